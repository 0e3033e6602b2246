"""router/reasoning.py: recorded-style Qwen3 and DeepSeek-R1 outputs, whole and
streamed in chunks that split the tags at every position."""

import pytest

from router.reasoning import (ReasoningMode, ReasoningParser, effort_template_kwargs, resolve_reasoning_parser,
                              split_pieces, split_reasoning)

QWEN3_THINK = ("<think>\nOkay, the user asks what 2 + 2 is. That's simple arithmetic: 4.\n</think>\n\n"
               "2 + 2 = **4**.")
QWEN3_TOOL = ("<think>\nThe user wants the weather in Paris; I should call get_weather.\n</think>\n\n"
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
R1_OPENED = ("Okay, so I need to figure out 2 + 2. Adding two and two gives four.\n</think>\n\n"
             "The answer is **4**.")
R1_WRITES_TAG = "<think>\nHmm, 3 * 3 is 9.\n</think>\n\n9"

CASES = [
    # (parser, prompt tail, output, reasoning, content)
    ("qwen3", "<|im_start|>assistant\n", QWEN3_THINK,
     "Okay, the user asks what 2 + 2 is. That's simple arithmetic: 4.", "2 + 2 = **4**."),
    ("qwen3", "<|im_start|>assistant\n", QWEN3_TOOL,
     "The user wants the weather in Paris; I should call get_weather.",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("qwen3", "<|im_start|>assistant\n", "The answer is 4.", None, "The answer is 4."),
    ("qwen3", "<|im_start|>assistant\n", "Write <think> and </think> tags.", None, "Write <think> and </think> tags."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<think>x</think>y", None, "<think>x</think>y"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "I think.\n</think>\n\nDone.", "I think.", "Done."),
    ("qwen3", "<|im_start|>assistant\n", "<think>\nStill thinking when cut at max_tok",
     "Still thinking when cut at max_tok", ""),
    ("qwen3", "<|im_start|>assistant\n", "<think>\nabc </thi", "abc </thi", ""),
    ("qwen3", "<|im_start|>assistant\n", "<thi", None, "<thi"),
    ("deepseek_r1", "<｜Assistant｜><think>\n", R1_OPENED,
     "Okay, so I need to figure out 2 + 2. Adding two and two gives four.", "The answer is **4**."),
    ("deepseek_r1", "<｜Assistant｜>", R1_WRITES_TAG, "Hmm, 3 * 3 is 9.", "9"),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Cut before the end", "Cut before the end", ""),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "</think>\n\nNo thinking.", None, "No thinking."),
]


def _stream(mode, pieces):
    parser = mode.make()
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    reasoning.append(r)
    content.append(c)
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("parser, tail, output, reasoning, content", CASES)
def test_whole_output_splits(parser, tail, output, reasoning, content):
    mode = ReasoningMode.for_prompt(parser, tail)
    assert split_reasoning(mode, output) == (reasoning, content)


@pytest.mark.parametrize("parser, tail, output, reasoning, content", CASES)
def test_every_two_split_positions_give_the_same_split(parser, tail, output, reasoning, content):
    mode = ReasoningMode.for_prompt(parser, tail)
    want = (reasoning or "", content)
    for i in range(len(output) + 1):
        for j in range(i, min(len(output), i + 12) + 1):  # every cut of the tags, near each other too
            assert _stream(mode, [output[:i], output[i:j], output[j:]]) == want, (i, j)
    assert _stream(mode, list(output)) == want  # one character a chunk


def test_text_that_may_start_a_tag_is_held_back():
    parser = ReasoningParser()
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>\nab") == ("ab", "")
    assert parser.feed("c\n</") == ("c", "")
    assert parser.feed("think>\n\nAns") == ("", "Ans")
    assert parser.feed("wer") == ("", "wer")
    assert parser.finish() == ("", "")


def test_no_parser_means_all_content():
    assert ReasoningMode.for_prompt(None, "<think>\n") is None
    assert split_reasoning(None, QWEN3_THINK) == (None, QWEN3_THINK)


def test_auto_picks_from_the_chat_template():
    qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    r1 = "{{'<｜Assistant｜>'}}{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
    assert resolve_reasoning_parser("auto", qwen3) == "qwen3"
    assert resolve_reasoning_parser("auto", r1) == "deepseek_r1"
    first_r1 = "{% set content = message['content'].split('</think>')[-1] %}{{'<｜Assistant｜>' + content}}"
    assert resolve_reasoning_parser("auto", first_r1) == "deepseek_r1"
    assert resolve_reasoning_parser("auto", "{{ '<|im_start|>assistant\\n' }}") is None
    assert resolve_reasoning_parser("auto", None) is None
    assert resolve_reasoning_parser("none", qwen3) is None
    assert resolve_reasoning_parser("deepseek_r1", None) == "deepseek_r1"
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        resolve_reasoning_parser("granite", None)


# (parser, prompt tail, one token a piece, reasoning tokens): the tags count as reasoning.
TOKEN_CASES = [
    ("qwen3", "assistant\n", ["<", "think", ">", "\n", "Two", " plus", "\n", "</", "think", ">", "\n\n", "4"], 10),
    ("qwen3", "assistant\n", [" ", "\n", "<think>", "a", "</think>", "b"], 5),  # held whitespace follows the block
    ("qwen3", "assistant\n", [" ", "The", " answer"], 0),
    ("qwen3", "assistant\n", ["<", "thought"], 0),  # a tag that never completes is content
    ("qwen3", "assistant\n", ["<think>", "still", " going"], 3),
    ("qwen3", "assistant\n<think>\n\n</think>\n\n", ["<think>", "x", "</think>"], 0),
    ("deepseek_r1", "<｜Assistant｜><think>\n", ["Hm", "m", ".", "</think>", "\n\n", "4"], 4),
    ("deepseek_r1", "<｜Assistant｜><think>\n", ["\n"], 1),  # only held whitespace: still reasoning
    ("deepseek_r1", "<｜Assistant｜><think>\n", ["</think>", "No", " thinking."], 1),
]


@pytest.mark.parametrize("parser, tail, tokens, num_reasoning", TOKEN_CASES)
def test_reasoning_tokens_are_those_up_to_the_closing_tag(parser, tail, tokens, num_reasoning):
    mode = ReasoningMode.for_prompt(parser, tail)
    stream = mode.make()
    for token in tokens:
        stream.feed(token, 1)
    stream.finish()
    assert stream.num_reasoning_tokens == num_reasoning
    whole = split_pieces(mode, [(token, 1) for token in tokens])
    assert whole == (stream.reasoning or None, stream.content, num_reasoning)
    assert split_pieces(None, [(token, 1) for token in tokens]) == (None, "".join(tokens), 0)


def test_reasoning_effort_becomes_the_templates_variables():
    qwen3 = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}"
    assert effort_template_kwargs("none", qwen3) == effort_template_kwargs("minimal", qwen3) == {
        "enable_thinking": False}
    assert effort_template_kwargs("low", qwen3) == effort_template_kwargs("high", qwen3) == {"enable_thinking": True}
    levels = "{{ reasoning_effort }} {% if enable_thinking %}{% endif %}"
    assert effort_template_kwargs("medium", levels) == {"reasoning_effort": "medium", "enable_thinking": True}
    r1 = "{{'<｜Assistant｜>'}}{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
    assert effort_template_kwargs("high", r1) == {}  # it always thinks: honoured as it is
    with pytest.raises(ValueError, match="this model always thinks"):
        effort_template_kwargs("none", r1)
    plain = "{{ '<|im_start|>assistant\\n' }}"
    assert effort_template_kwargs("none", plain) == {}  # it never thinks
    with pytest.raises(ValueError, match="this model does not reason"):
        effort_template_kwargs("low", plain)
    with pytest.raises(ValueError, match="reasoning_effort must be one of none, minimal, low, medium, high"):
        effort_template_kwargs("max", qwen3)
