"""``prefixserve train-heads --method eagle``: fits an EAGLE-1 draft layer
(``workers/model/eagle.py``) on the model's own greedy answers, on CPU, in
minutes, and writes it in vLLM's layout.

The data recipe is Medusa's (``workers/medusa_train.py``): chat requests
about everyday subjects and about text shipped with Python, answered
greedily by the engine, and one prefill per sequence for the final hidden
state h_p of every position. The draft is trained with teacher forcing, as
EAGLE is: row p reads ``(h_p, t_{p+1})`` with causal attention over the rows
before it, and its feature f_p is pulled towards h_{p+1} (smooth L1, EAGLE's
regression loss) while ``lm_head(f_p)`` learns t_{p+2} (cross-entropy, weight
0.1 as EAGLE's, over the vocabulary shortlist the draft is scored on), for
the positions of the answer (the prompt's rows are context). Uniform noise
on the input features (EAGLE's data augmentation) prepares the draft for its
own, imperfect features from the second guess on. ``fc`` starts as
``[0, I]`` and the residual branches' outputs at zero, so the untrained draft
guesses from h_p alone. A tenth of the sequences is held out; its top-1
accuracy of the first guess is reported and stored in config.json.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from workers.medusa_train import final_hidden_states, greedy_answers, head_and_embedding
from workers.model.eagle import EagleDraft

logger = logging.getLogger(__name__)

NOISE = 0.2  # half-width of the uniform noise added to input features, in units of their RMS
CE_WEIGHT = 0.1  # EAGLE's weight of the token loss beside the feature regression


def _init(draft: EagleDraft, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    h = draft.arch.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, h:] = torch.eye(h)
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            w = draft.w(name)
            w.copy_(torch.randn(w.shape, generator=g) * w.shape[1] ** -0.5)
        draft.w("self_attn.o_proj").zero_()
        draft.w("mlp.down_proj").zero_()


def _forward(draft: EagleDraft, embeds: torch.Tensor, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Features [B, T, H] of padded sequences (causal, padding masked)."""
    b, t, h = hidden.shape
    positions = torch.arange(t).repeat(b)
    x, q, k, v = draft.qkv(embeds.reshape(b * t, h), hidden.reshape(b * t, h), positions)
    span = torch.arange(t)
    mask = (span[None, :] <= span[:, None])[None] & (span[None, None, :] < lengths[:, None, None])
    attn = draft.attend(q.view(b, t, *q.shape[1:]), k.view(b, t, *k.shape[1:]), v.view(b, t, *v.shape[1:]), mask)
    return draft.finish(x, attn.reshape(b * t, -1)).view(b, t, h)


MIN_STEPS = 400  # optimizer steps of the default schedule (epochs raised until there are this many)


def collect_eagle_data(llm: Any, num_prompts: int, prompt_len: int, gen_len: int, seed: int = 0
                       ) -> list[tuple[torch.Tensor, list[int], int]]:
    """The training rows: per answered prompt ``(hidden [n, H], tokens, first
    answer row)``, the target's final hidden state of every position."""
    prompts, outs = greedy_answers(llm, num_prompts, prompt_len, gen_len, seed)
    data: list[tuple[torch.Tensor, list[int], int]] = []
    for prompt, out in zip(prompts, outs):
        if len(out.token_ids) >= 3:
            seq = prompt + out.token_ids
            data.append((final_hidden_states(llm, seq), seq, len(prompt) - 1))
    llm.engine.scheduler.kv_manager.reset_prefix_cache()  # its blocks were written outside the engine
    return data


def train_eagle(llm: Any, output: Path, *, num_prompts: int = 512, prompt_len: int = 64, gen_len: int = 128,
                epochs: Optional[int] = None, lr: float = 1e-3, batch_size: int = 16, seed: int = 0,
                shortlist: int = 8192, min_steps: int = MIN_STEPS) -> dict[str, Any]:
    """Generates, extracts hidden states, fits the draft and writes it to
    ``output`` (module doc; ``fit_eagle`` for the fitting's arguments).

    Returns:
        What was done: sizes, seconds per phase, held-out first-guess top-1 accuracy.
    """
    from workers.model.loader import read_arch

    started = time.perf_counter()
    data = collect_eagle_data(llm, num_prompts, prompt_len, gen_len, seed)
    collected_s = time.perf_counter() - started
    head_weight, embedding = head_and_embedding(llm.model_dir)
    draft, summary = fit_eagle(data, read_arch(llm.model_dir), head_weight, embedding, epochs=epochs, lr=lr,
                               batch_size=batch_size, seed=seed, shortlist=shortlist, min_steps=min_steps)
    from cluster.shared.fingerprint import model_fingerprint

    summary = {"base_model": str(llm.model_dir), "base_model_fingerprint": model_fingerprint(llm.model_dir),
               **summary, "data_seconds": round(collected_s, 1)}
    draft.save(Path(output), extra_config=summary)
    logger.info("wrote %s: held-out top-1 accuracy of the first guess %s", output, summary["held_out_top1_accuracy"])
    return summary


def fit_eagle(data: list[tuple[torch.Tensor, list[int], int]], arch: Any, head_weight: torch.Tensor,
              embedding: torch.Tensor, *, epochs: Optional[int] = None, lr: float = 1e-3, batch_size: int = 16,
              seed: int = 0, shortlist: int = 8192, min_steps: int = MIN_STEPS) -> tuple[EagleDraft, dict[str, Any]]:
    """Fits a draft on ``collect_eagle_data``'s rows, a tenth held out.

    Args:
        epochs: Passes over the training rows; None: as many as make
            ``min_steps`` optimizer steps (one pass at least).
        shortlist: > 0: the ``shortlist`` tokens the answers use most, stored
            as ``vocab_shortlist``.

    Returns:
        The draft, and a summary: sizes, steps, seconds, the held-out top-1
        accuracy of the first guess before training (the untrained draft
        guesses from h_p alone, as Medusa's first head) and after.
    """
    torch.manual_seed(seed)
    started = time.perf_counter()
    data = list(data)
    random.Random(seed).shuffle(data)
    held, train = data[: max(1, len(data) // 10)], data[max(1, len(data) // 10):]
    vocab = embedding.shape[0]
    draft = EagleDraft(arch)
    _init(draft, seed)
    column = torch.arange(vocab)
    if shortlist > 0:
        counts = torch.zeros(vocab, dtype=torch.long)
        for _, seq, first in train:
            counts += torch.bincount(torch.tensor(seq[first + 1:]), minlength=vocab)
        draft.shortlist = counts.topk(min(shortlist, vocab)).indices.sort().values
        head_weight = head_weight[draft.shortlist].contiguous()
        column = torch.full((vocab,), -100, dtype=torch.long)
        column[draft.shortlist] = torch.arange(len(draft.shortlist))
    rms = torch.cat([h for h, _, _ in train]).pow(2).mean().sqrt()
    def batch_loss(items, noise: float) -> tuple[torch.Tensor, int, int]:
        n = max(len(seq) - 1 for _, seq, _ in items)
        hid = torch.zeros(len(items), n, draft.arch.hidden_size)
        ids = torch.zeros(len(items), n, dtype=torch.long)
        feat_target = torch.zeros_like(hid)
        tok_target = torch.full((len(items), n), -100, dtype=torch.long)
        for b, (h, seq, first) in enumerate(items):
            m = len(seq) - 1  # rows (h_p, t_{p+1}) for p < m
            hid[b, :m], ids[b, :m] = h[:m], torch.tensor(seq[1:])
            feat_target[b, : m - 1] = h[1:m]
            tok_target[b, first: m - 1] = column[torch.tensor(seq[first + 2:])]
        if noise:
            hid = hid + (torch.rand_like(hid) * 2 - 1) * noise * rms
        lengths = torch.tensor([len(seq) - 1 for _, seq, _ in items])
        feats = _forward(draft, embedding[ids], hid, lengths)
        answer = torch.zeros(tok_target.shape, dtype=torch.bool)
        for b, (_, seq, first) in enumerate(items):
            answer[b, first: len(seq) - 2] = True
        reg = F.smooth_l1_loss(feats[answer], feat_target[answer])
        logits = F.linear(feats[answer], head_weight)
        ce = F.cross_entropy(logits, tok_target[answer], ignore_index=-100)
        hits = int((logits.argmax(-1) == tok_target[answer]).sum())
        return reg + CE_WEIGHT * ce, hits, int(answer.sum())

    return run_fit(draft, data, train, held, lambda items, training: batch_loss(items, NOISE if training else 0.0),
                   batch_size=batch_size, epochs=epochs, min_steps=min_steps, lr=lr, seed=seed, started=started,
                   what="the EAGLE draft")


def run_fit(draft: torch.nn.Module, data: list, train: list, held: list,
            batch_loss: Callable[[list, bool], tuple[torch.Tensor, int, int]], *, batch_size: int,
            epochs: Optional[int], min_steps: int, lr: float, seed: int, started: float, what: str
            ) -> tuple[torch.nn.Module, dict]:
    """The schedule an EAGLE draft (EAGLE-1 and EAGLE-3) is fitted with: held-out
    accuracy before and after, AdamW over one cycle of ``epochs`` passes (without
    ``epochs``, as many as give ``min_steps`` steps). ``batch_loss(items, training)``
    returns (loss, hits, positions). Returns the draft in eval mode and the summary."""
    def held_out_accuracy() -> float:
        hits = total = 0
        with torch.no_grad():
            for start in range(0, len(held), batch_size):
                _, h, t = batch_loss(held[start: start + batch_size], False)
                hits, total = hits + h, total + t
        return round(hits / max(1, total), 4)

    before = held_out_accuracy()
    batches = -(-len(train) // batch_size)
    epochs = epochs if epochs is not None else max(1, -(-min_steps // batches))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    steps = max(1, epochs * batches)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    logger.info("training %s on %d sequences (%d held out): %d epoch(s), %d steps", what, len(train), len(held),
                epochs, steps)
    for epoch in range(epochs):
        random.Random(seed + epoch).shuffle(train)
        for start in range(0, len(train), batch_size):
            loss, _, _ = batch_loss(train[start: start + batch_size], True)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
        logger.info("epoch %d of %d: last batch's loss %.4f", epoch + 1, epochs, loss.item())
    after = held_out_accuracy()
    summary = {"num_sequences": len(data), "num_positions": sum(len(s) - 2 - f for _, s, f in data),
               "epochs": epochs, "optimizer_steps": steps, "held_out_top1_accuracy": [after],
               "held_out_top1_accuracy_untrained": [before], "train_seconds": round(time.perf_counter() - started, 1)}
    return draft.eval(), summary
