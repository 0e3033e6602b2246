"""Workloads of ``prefixserve bench serve``: seeded synthetic datasets.

Every dataset is a list of ``Conversation``s; a single-turn dataset is one
conversation per request. Prompts are token ids (no tokenizer round trip, so
lengths are exact on both backends); outputs are generated with
``ignore_eos`` so each request produces exactly its ``output_len`` tokens.

    random          --random-input-len / --random-output-len, each drawn
                    uniformly from [len * (1 - r), len * (1 + r)] with
                    r = --random-range-ratio (as ``vllm bench serve``)
    shared-prefix   --gsp-num-groups groups, each with its own system prompt
                    of --gsp-system-prompt-len tokens, and
                    --gsp-prompts-per-group questions of --gsp-question-len
                    tokens per group (SGLang's generated-shared-prefix);
                    requests are shuffled so groups interleave
    multi-turn      conversations of --multi-turn-turns turns: the first
                    prompt has --multi-turn-input-len tokens, each later turn
                    sends the previous prompt + the model's answer + a new
                    question of --multi-turn-question-len tokens
    json, json-unique, regex, choice
                    vLLM's structured-output datasets
                    (``cluster/bench/schemas.py``): chat questions, each with
                    its constraint and the validator of its answer;
                    ``json-unique`` gives every request its own schema, so the
                    grammar cache cannot help. A seeded --structured-output-ratio
                    share of them carry the constraint (vLLM's
                    ``random.sample`` of ``int(n * ratio)`` requests), the rest
                    go unconstrained; answers end where the model ends them
                    (no ``ignore_eos``), at most --structured-output-len tokens

A conversation's later turns are built at run time from the answers
(``next_prompt``), so the dataset holds only each turn's new tokens.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

STRUCTURED_DATASETS = ("json", "json-unique", "regex", "choice")
DATASETS = ("random", "shared-prefix", "multi-turn", *STRUCTURED_DATASETS)
# Ids below this are left out of generated prompts: BOS/EOS/padding in the
# models we serve (the default model's chat markers sit there too).
FIRST_USABLE_ID = 3
MAX_USABLE_ID = 32000


@dataclass(frozen=True)
class Turn:
    """One request of a conversation.

    Attributes:
        new_token_ids: Tokens this turn appends to the conversation (the
            whole prompt of a first turn); empty for a chat question.
        output_len: Tokens to generate (EOS ignored), at most for a question.
        question: A chat question, sent as one user message instead of
            token ids; its answer ends at EOS (or ``output_len``).
        structured_outputs: vLLM's ``structured_outputs`` object the answer
            must match (a question's only); None for no constraint.
        validator: Whether an answer text meets ``structured_outputs``
            (set with it).
    """

    new_token_ids: tuple[int, ...]
    output_len: int
    question: str = ""
    structured_outputs: Optional[dict[str, Any]] = None
    validator: Optional[Callable[[str], bool]] = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Conversation:
    """Requests that must be sent one after the other.

    Attributes:
        turns: At least one turn.
        group: The shared-prefix group (tenant) of the conversation; -1 if none.
        shared_prefix_len: Leading prompt tokens shared with the rest of the
            group (the system prompt); 0 if none.
    """

    turns: tuple[Turn, ...]
    group: int = -1
    shared_prefix_len: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.turns)


def next_prompt(previous_prompt: Sequence[int], answer_ids: Sequence[int], turn: Turn) -> list[int]:
    """The prompt of a later turn: the previous prompt, its answer, the new question."""
    return [*previous_prompt, *answer_ids, *turn.new_token_ids]


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """Adds ``--dataset-name`` and each dataset's flags (names as vLLM / SGLang)."""
    parser.add_argument("--dataset-name", default="random", choices=DATASETS)
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests to send (default: 64; shared-prefix: groups x prompts per group)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrival times")
    group = parser.add_argument_group("random dataset")
    group.add_argument("--random-input-len", type=int, default=256)
    group.add_argument("--random-output-len", type=int, default=64)
    group.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="lengths drawn from [len * (1 - r), len * (1 + r)], r in [0, 1)")
    group = parser.add_argument_group("shared-prefix dataset (SGLang generated-shared-prefix)")
    group.add_argument("--gsp-num-groups", type=int, default=8)
    group.add_argument("--gsp-prompts-per-group", type=int, default=8)
    group.add_argument("--gsp-system-prompt-len", type=int, default=512)
    group.add_argument("--gsp-question-len", type=int, default=32)
    group.add_argument("--gsp-output-len", type=int, default=32)
    group = parser.add_argument_group("multi-turn dataset")
    group.add_argument("--multi-turn-turns", type=int, default=4, help="turns per conversation")
    group.add_argument("--multi-turn-input-len", type=int, default=128, help="tokens of the first prompt")
    group.add_argument("--multi-turn-question-len", type=int, default=32, help="new tokens of each later turn")
    group.add_argument("--multi-turn-output-len", type=int, default=32)
    group = parser.add_argument_group("structured-output datasets (json, json-unique, regex, choice; as vLLM)")
    group.add_argument("--structured-output-ratio", type=float, default=1.0,
                       help="share of the requests that carry their constraint, in [0, 1] (the rest go unconstrained)")
    group.add_argument("--structured-output-len", type=int, default=256,
                       help="most tokens of an answer (room for the json datasets' ten-field profile)")


def make_dataset(args: argparse.Namespace, vocab_size: int) -> list[Conversation]:
    """Builds the dataset the flags name (see the module doc).

    Raises:
        ValueError: A flag is out of range (the message names it).
    """
    seed = args.seed
    if args.dataset_name == "random":
        return random_dataset(args.num_prompts or 64, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, vocab_size, seed)
    if args.dataset_name == "shared-prefix":
        total = args.gsp_num_groups * args.gsp_prompts_per_group
        if args.num_prompts is not None and args.num_prompts != total:
            raise ValueError(
                f"--num-prompts {args.num_prompts} does not match the shared-prefix dataset, which sends "
                f"--gsp-num-groups x --gsp-prompts-per-group = {total} prompts: drop --num-prompts or change those"
            )
        return shared_prefix_dataset(args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len,
                                     args.gsp_question_len, args.gsp_output_len, vocab_size, seed)
    if args.dataset_name == "multi-turn":
        return multi_turn_dataset(args.num_prompts or 64, args.multi_turn_turns, args.multi_turn_input_len,
                                  args.multi_turn_question_len, args.multi_turn_output_len, vocab_size, seed)
    if args.dataset_name in STRUCTURED_DATASETS:
        return structured_output_dataset(args.dataset_name, args.num_prompts or 64, args.structured_output_ratio,
                                         args.structured_output_len, seed)
    raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}, got {args.dataset_name!r}")


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                   seed: int) -> list[Conversation]:
    """``num_prompts`` single-turn requests of random tokens (lengths as the module doc says)."""
    _positive(num_prompts=num_prompts, random_input_len=input_len, random_output_len=output_len)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    tokens = _token_sampler(rng, vocab_size)
    out = []
    for _ in range(num_prompts):
        n_in = rng.randint(*_length_range(input_len, range_ratio))
        n_out = rng.randint(*_length_range(output_len, range_ratio))
        out.append(Conversation((Turn(tokens(n_in), n_out),)))
    return out


def shared_prefix_dataset(num_groups: int, prompts_per_group: int, system_prompt_len: int, question_len: int,
                          output_len: int, vocab_size: int, seed: int) -> list[Conversation]:
    """Groups of single-turn requests sharing their group's system prompt, shuffled."""
    _positive(gsp_num_groups=num_groups, gsp_prompts_per_group=prompts_per_group,
              gsp_system_prompt_len=system_prompt_len, gsp_question_len=question_len, gsp_output_len=output_len)
    rng = random.Random(seed)
    tokens = _token_sampler(rng, vocab_size)
    system_prompts = [tokens(system_prompt_len) for _ in range(num_groups)]
    out = [
        Conversation((Turn(system_prompts[g] + tokens(question_len), output_len),), group=g,
                     shared_prefix_len=system_prompt_len)
        for g in range(num_groups)
        for _ in range(prompts_per_group)
    ]
    rng.shuffle(out)
    return out


def multi_turn_dataset(num_prompts: int, turns: int, input_len: int, question_len: int, output_len: int,
                       vocab_size: int, seed: int) -> list[Conversation]:
    """``num_prompts`` requests as conversations of ``turns`` turns (the last one may be shorter)."""
    _positive(num_prompts=num_prompts, multi_turn_turns=turns, multi_turn_input_len=input_len,
              multi_turn_question_len=question_len, multi_turn_output_len=output_len)
    rng = random.Random(seed)
    tokens = _token_sampler(rng, vocab_size)
    out = []
    for start in range(0, num_prompts, turns):
        n = min(turns, num_prompts - start)
        first = Turn(tokens(input_len), output_len)
        out.append(Conversation((first, *(Turn(tokens(question_len), output_len) for _ in range(n - 1)))))
    return out


def structured_output_dataset(name: str, num_prompts: int, ratio: float, output_len: int,
                              seed: int) -> list[Conversation]:
    """``num_prompts`` chat questions of vLLM's structured-output dataset
    ``name``; ``constrained_indices`` picks those that carry their constraint."""
    from cluster.bench.schemas import structured_dataset  # jsonschema: only for these datasets

    _positive(num_prompts=num_prompts, structured_output_len=output_len)
    if name not in STRUCTURED_DATASETS:
        raise ValueError(f"--dataset-name must be one of {', '.join(STRUCTURED_DATASETS)} here, got {name!r}")
    constrained = constrained_indices(num_prompts, ratio, seed)
    out = []
    for i, (question, constraint, validator) in enumerate(structured_dataset(name, num_prompts, seed)):
        if i in constrained:
            turn = Turn((), output_len, question, constraint, validator)
        else:
            turn = Turn((), output_len, question)
        out.append(Conversation((turn,)))
    return out


def constrained_indices(num_prompts: int, ratio: float, seed: int) -> frozenset[int]:
    """The requests that carry their constraint: vLLM's ``random.sample`` of
    ``int(num_prompts * ratio)`` of them, seeded.

    Raises:
        ValueError: ``ratio`` is not in [0, 1].
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--structured-output-ratio must be in [0, 1], got {ratio}")
    # The epsilon keeps 0.29 * 100 (28.999...) at 29; seed + 1 draws the arrivals.
    count = int(num_prompts * ratio + 1e-9)
    return frozenset(random.Random(seed + 2).sample(range(num_prompts), count))


def max_prompt_len(conversation: Conversation) -> int:
    """Tokens of the conversation's longest (last) prompt, answers included."""
    turns = conversation.turns
    return sum(len(t.new_token_ids) for t in turns) + sum(t.output_len for t in turns[:-1])


def _token_sampler(rng: random.Random, vocab_size: int):
    high = min(vocab_size, MAX_USABLE_ID)
    if high <= FIRST_USABLE_ID:
        raise ValueError(f"vocab_size {vocab_size} is too small for generated prompts (need > {FIRST_USABLE_ID})")

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_USABLE_ID, high) for _ in range(n))

    return tokens


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    low = max(1, int(length * (1 - range_ratio)))
    return low, max(low, int(length * (1 + range_ratio)))


def _positive(**values: Optional[int]) -> None:
    for name, value in values.items():
        if value is None or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
