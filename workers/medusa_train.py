"""``prefixserve train-heads``: fits Medusa heads (``workers/model/medusa.py``)
on the model's own greedy outputs, on CPU, in minutes.

1. Chat requests in the model's template: about everyday subjects (a list
   here) and about sentences of text shipped with Python
   (``cluster/shared/text_corpus.py``, the calibration part); raw text
   windows to continue when the model has no chat template.
2. The engine answers them greedily: the heads learn what *this* model says.
3. One prefill per sequence gives the final hidden state h_p of every
   position p (the runner's own kernels); head i learns to predict token
   p + 2 + i from h_p (and, token-conditioned, the default, from token
   p + 1 too: the one the model samples from h_p), for the positions of the
   model's answer.
4. Each head is one residual block ``h + SiLU(W h + b)`` (``W [h; e(t)]``
   when token-conditioned; zero-initialized, so it starts as the LM head
   itself) read through the model's frozen LM head, trained by AdamW (one
   cycle of its learning rate) on cross-entropy over the vocabulary
   shortlist the heads will be scored on (every token without one); a
   tenth of the positions is held out and its top-1 accuracy per head
   reported (and stored in the heads' config.json).

Data is what helps the heads most on requests unlike their training: on the
default model, 512 prompts instead of 256 raised head 0's top-1 accuracy on
bench spec's chat questions from 0.21 to 0.25.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from cluster.shared.types import SamplingParams
from workers.engine.outputs import ScheduledRequest
from workers.model.medusa import MedusaHeads

logger = logging.getLogger(__name__)


# Everyday subjects and request shapes: with the questions about Python's documentation they make
# the heads see chat beyond one domain (heads fitted on one domain guess badly outside it). None is a
# question of bench spec's chat workload, which measures the heads on requests they never saw.
TOPICS = [
    "cooking pasta", "the moon", "saving money", "learning a language", "dogs", "rainforests",
    "sleep", "coffee", "volcanoes", "friendship", "time management", "bicycles", "the history of paper",
    "gardening", "electric cars", "chess", "public speaking", "the human heart", "music",
    "recycling", "mountains", "honey bees", "a job interview", "the internet", "painting", "a rainy day",
    "running a marathon", "the solar system", "bread", "winter", "cats", "a birthday party", "trains", "bridges",
    "earthquakes", "writing a letter", "vitamins", "the desert", "kindness", "football", "libraries",
    "clouds", "a small town", "tea", "dinosaurs", "the river", "teamwork", "a lighthouse",
]
ASKS = [
    "Tell me about {}.", "Write a short poem about {}.", "Give me three tips about {}.",
    "Explain {} to a child.", "Write a short story about {}.", "What are the pros and cons of {}?",
    "Describe {} in a few sentences.", "Why do people care about {}?",
]


def training_prompts(llm: Any, num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Chat requests when the model has a chat template, half about everyday
    subjects, half questions about the calibration text's sentences (greedy
    continuations of raw text soon loop and teach the heads little); raw
    windows of that text otherwise. Shuffled with ``seed``."""
    from cluster.shared.chat_template import ChatTemplate
    from cluster.shared.text_corpus import calibration_text

    text = calibration_text()
    ids = llm.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    windows = [ids[i : i + prompt_len] for i in range(0, len(ids) - prompt_len, prompt_len)]
    rng.shuffle(windows)
    prompts: list[list[int]] = []
    try:
        template: Optional[ChatTemplate] = ChatTemplate.from_model_dir(llm.model_dir)
    except (ValueError, OSError):
        template = None
    if template is not None:
        sentences = [p.split(". ")[0].strip() for p in text.split("\n\n") if 40 < len(p.split(". ")[0]) < 300]
        rng.shuffle(sentences)
        asks = ["Explain this in simple words: {}", "What does this mean? {}", "Write a short answer about: {}",
                "Give an example of the following. {}"]
        everyday = [ask.format(topic) for topic in TOPICS for ask in ASKS]
        rng.shuffle(everyday)
        questions = [asks[i % len(asks)].format(sentence) for i, sentence in enumerate(sentences)]
        mixed = [q for pair in zip(everyday, questions) for q in pair]  # one of each, alternately
        for question in mixed[:num_prompts]:
            chat = template.render([{"role": "user", "content": question}])
            prompts.append(llm.encode(chat, add_special_tokens=False))
    prompts += windows[: num_prompts - len(prompts)]
    rng.shuffle(prompts)
    return prompts[:num_prompts]


@torch.inference_mode()

def greedy_answers(llm: Any, num_prompts: int, prompt_len: int, gen_len: int, seed: int = 0) -> tuple[list, list]:
    """``(prompts, outputs)``: ``training_prompts`` and the model's greedy answers to
    them, ``gen_len`` tokens at most (the data of Medusa heads and EAGLE drafts)."""
    prompts = training_prompts(llm, num_prompts, prompt_len, seed)
    logger.info("generating %d greedy answers of %d tokens", len(prompts), gen_len)
    return prompts, llm.generate(prompts, SamplingParams(max_tokens=gen_len, temperature=0.0))

def final_hidden_states(llm: Any, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), hidden]``: the model's normed last hidden state of
    every position, in one prefill over the engine's (idle) KV cache."""
    runner = llm.runner
    bs = runner.block_size
    num_blocks = -(-len(token_ids) // bs)
    if num_blocks > runner.num_kv_blocks:
        raise ValueError(f"a training sequence of {len(token_ids)} tokens does not fit the KV cache")
    req = ScheduledRequest(request_id="train-heads", input_token_ids=list(token_ids), num_computed_tokens=0,
                           block_ids=list(range(num_blocks)), num_sample_tokens=0,
                           sampling_params=SamplingParams(max_tokens=1), prompt_token_ids=token_ids,
                           output_token_ids=())
    input_ids, positions, meta = runner._prepare([req])
    return runner.model(input_ids, positions, runner.kv_caches, meta).float().clone()


def head_and_embedding(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's LM head and input embedding matrices ``[vocab, hidden]``
    (the same one when it has no ``lm_head.weight``), read from the checkpoint."""
    from workers.model.loader import iter_weights

    head = embed = None
    for name, tensor in iter_weights(model_dir):
        if name == "lm_head.weight":
            head = tensor.float().clone()
        elif name.endswith("embed_tokens.weight"):
            embed = tensor.float().clone()
    if embed is None:
        raise ValueError(f"{model_dir} has no embed_tokens.weight")
    return (head if head is not None else embed), embed


def train_heads(llm: Any, output: Path, *, num_heads: int = 4, num_prompts: int = 512, prompt_len: int = 64,
                gen_len: int = 128, epochs: int = 2, lr: float = 2e-3, batch_size: int = 256,
                seed: int = 0, shortlist: int = 8192, token_conditioned: bool = True) -> dict[str, Any]:
    """Generates, extracts hidden states, fits ``num_heads`` heads and writes
    them to ``output`` (Medusa's layout, no per-head vocabulary projection;
    with ``shortlist`` > 0, the ids of the ``shortlist`` tokens the answers use
    most as ``vocab_shortlist``, which the heads are trained and scored on;
    ``token_conditioned``: heads that also read the sampled token, module doc).

    Returns:
        What was done: sizes, seconds per phase, held-out top-1 accuracy per head.
    """
    torch.manual_seed(seed)
    started = time.perf_counter()
    prompts, outs = greedy_answers(llm, num_prompts, prompt_len, gen_len, seed)
    generated_s = time.perf_counter() - started
    feats, targets = [], []
    for n, (prompt, out) in enumerate(zip(prompts, outs)):
        seq = prompt + out.token_ids
        if len(out.token_ids) < 3:
            continue
        hidden = final_hidden_states(llm, seq)
        first = len(prompt) - 1  # h of the last prompt token predicts the first answer token
        rows = range(first, len(seq) - 2)
        feats.append(hidden[first : len(seq) - 2])
        # Column 0: the token sampled from h_p (p + 1); column 1 + i: head i's target (p + 2 + i).
        targets.append(torch.tensor([[seq[p + 1 + i] if p + 1 + i < len(seq) else -100 for i in range(num_heads + 1)]
                                     for p in rows]))
        if (n + 1) % 32 == 0:
            logger.info("hidden states: %d of %d sequences", n + 1, len(prompts))
    llm.engine.scheduler.kv_manager.reset_prefix_cache()  # its blocks were written outside the engine
    x, y = torch.cat(feats), torch.cat(targets)
    sampled, y = y[:, 0], y[:, 1:]
    hidden_s = time.perf_counter() - started - generated_s
    order = torch.randperm(len(x))
    held = order[: max(1, len(x) // 10)]
    train = order[len(held):]
    head_weight, embedding = head_and_embedding(llm.model_dir)
    arch = llm.engine.vocab_size, x.shape[1]
    heads = MedusaHeads(hidden_size=arch[1], vocab_size=arch[0], num_heads=num_heads, num_layers=1,
                        token_conditioned=token_conditioned)
    embeds = embedding[sampled] if token_conditioned else None
    coverage = None
    column = torch.arange(arch[0])  # target token -> logit column (-100: outside the shortlist)
    if shortlist > 0:
        seen = y[train]  # the held-out positions measure the coverage
        counts = torch.bincount(seen[seen != -100].flatten(), minlength=arch[0])
        heads.shortlist = counts.topk(min(shortlist, arch[0])).indices.sort().values
        held_targets = y[held][y[held] != -100]
        coverage = round(float(torch.isin(held_targets, heads.shortlist).float().mean()), 4)
        logger.info("vocab shortlist of %d tokens covers %.1f%% of held-out targets", len(heads.shortlist),
                    100 * coverage)
        head_weight = head_weight[heads.shortlist].contiguous()
        column = torch.full((arch[0],), -100, dtype=torch.long)
        column[heads.shortlist] = torch.arange(len(heads.shortlist))
    answered = y != -100  # a target outside the shortlist is a miss in the held-out accuracy
    y = torch.where(answered, column[y.clamp(min=0)], y)

    def head_logits(idx: torch.Tensor, i: int) -> torch.Tensor:
        return F.linear(heads.transform(x[idx], i, None if embeds is None else embeds[idx]), head_weight)

    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.01)
    steps = epochs * -(-len(train) // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=max(1, steps))
    logger.info("training %d heads on %d positions (%d held out), %d epoch(s)", num_heads, len(train), len(held),
                epochs)
    for epoch in range(epochs):
        perm = train[torch.randperm(len(train))]
        for start in range(0, len(perm), batch_size):
            idx = perm[start : start + batch_size]
            loss = sum(F.cross_entropy(head_logits(idx, i), y[idx, i], ignore_index=-100) for i in range(num_heads))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            if (start // batch_size) % 20 == 0:
                logger.info("epoch %d: %d of %d positions, loss %.3f", epoch + 1, start + len(idx), len(perm),
                            loss.item() / num_heads)
    accuracy = []
    with torch.no_grad():
        for i in range(num_heads):
            valid = answered[held, i]
            guess = head_logits(held, i).argmax(dim=-1)
            accuracy.append(round(float((guess == y[held, i])[valid].float().mean()), 4))
    from cluster.shared.fingerprint import model_fingerprint

    summary = {"base_model": str(llm.model_dir), "base_model_fingerprint": model_fingerprint(llm.model_dir),
               "num_sequences": len(feats), "num_positions": int(len(x)), "epochs": epochs,
               "held_out_top1_accuracy": accuracy, "shortlist_held_out_coverage": coverage,
               "generate_seconds": round(generated_s, 1),
               "hidden_seconds": round(hidden_s, 1),
               "train_seconds": round(time.perf_counter() - started - generated_s - hidden_s, 1)}
    heads.save(Path(output), extra_config=summary)
    logger.info("wrote %s: held-out top-1 accuracy per head %s", output, accuracy)
    return summary
