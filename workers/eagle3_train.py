"""``prefixserve train-heads --method eagle3``: fits an EAGLE-3 draft layer
(``workers/model/eagle3.py``) on the model's own greedy answers, on CPU, and
writes it in vLLM's layout.

Data: EAGLE-1's recipe (``workers/eagle_train.py``: the same prompts and
greedy answers, one prefill per sequence), keeping the residual stream
entering the three feature layers (vLLM's choice, (2, L // 2, L - 3)) of
every position instead of the final hidden state.

Draft vocabulary: the ``draft_vocab_size`` target tokens the training
answers use most, in id order; ``d2t[i]`` = id_i - i, ``t2d`` their mask.
Answer tokens outside it are left out of the loss (the draft cannot say them).

Training follows EAGLE-3: no feature regression, a token loss only, and
"training-time test": the draft is unrolled one step on its own features,
so it learns from what it will read from the second guess on::

    step 1   row p: (fc(a_p), t_{p+1}) at position p, causal over step-1 keys 0..p
             -> f_p, cross-entropy of lm_head(norm(f_p)) against t_{p+2}
    step 2   row p: (f_p, t_{p+2}) at position p + 1, over step-1 keys 0..p and its own
             -> cross-entropy against t_{p+3}, weight STEP2_WEIGHT (EAGLE-3's 0.8 decay)

both over the answer's positions (the prompt's rows are context). Start: the
LM head is the target's rows of the draft vocabulary and ``norm`` its final
norm, ``fc`` passes the high feature through and the residual branches start
at zero, so the untrained draft guesses from the input of layer L - 3 (an
early exit). A tenth of the sequences is held out; its top-1 accuracy of the
first guess (step 1, EAGLE-1's measure) is reported and stored in config.json.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from workers.eagle_train import run_fit
from workers.medusa_train import final_hidden_states, greedy_answers, head_and_embedding
from workers.model.eagle3 import Eagle3Draft, default_aux_layer_ids
from workers.spec_eagle3 import AuxHiddenCapture

logger = logging.getLogger(__name__)

STEP2_WEIGHT = 0.8  # weight of the unrolled second step's loss (EAGLE-3 decays each step by 0.8)
MIN_STEPS = 400  # optimizer steps of the default schedule (epochs raised until there are this many)


def collect_eagle3_data(llm: Any, num_prompts: int, prompt_len: int, gen_len: int, seed: int = 0,
                        layer_ids: Optional[tuple[int, ...]] = None
                        ) -> tuple[list[tuple[torch.Tensor, list[int], int]], tuple[int, ...]]:
    """The training rows: per answered prompt ``(features [n, 3H], tokens,
    first answer row)``, and the feature layers' ids."""
    prompts, outs = greedy_answers(llm, num_prompts, prompt_len, gen_len, seed)
    model = llm.runner.model
    ids = tuple(layer_ids or default_aux_layer_ids(len(model.model.layers)))
    compiled, model.compiled = model.compiled, None  # it runs no Python per layer (spec_eagle3.py)
    capture = AuxHiddenCapture(model, ids)
    data: list[tuple[torch.Tensor, list[int], int]] = []
    try:
        for prompt, out in zip(prompts, outs):
            if len(out.token_ids) >= 4:
                seq = prompt + out.token_ids
                final_hidden_states(llm, seq)
                data.append((capture.take().float().clone(), seq, len(prompt) - 1))
    finally:
        capture.remove()
        model.compiled = compiled
    llm.engine.scheduler.kv_manager.reset_prefix_cache()  # its blocks were written outside the engine
    return data, ids


def train_eagle3(llm: Any, output: Path, *, num_prompts: int = 512, prompt_len: int = 64, gen_len: int = 128,
                 epochs: Optional[int] = None, lr: float = 1e-3, batch_size: int = 16, seed: int = 0,
                 draft_vocab_size: int = 8192, min_steps: int = MIN_STEPS) -> dict[str, Any]:
    """Generates, extracts features, fits the draft and writes it to ``output``.

    Returns:
        What was done: sizes, seconds per phase, held-out first-guess top-1 accuracy.
    """
    from cluster.shared.fingerprint import model_fingerprint
    from workers.model.loader import read_arch

    started = time.perf_counter()
    data, layer_ids = collect_eagle3_data(llm, num_prompts, prompt_len, gen_len, seed)
    collected_s = time.perf_counter() - started
    head_weight, embedding = head_and_embedding(llm.model_dir)
    norm = llm.runner.model.model.norm.weight.detach().float().cpu()
    draft, summary = fit_eagle3(data, read_arch(llm.model_dir), layer_ids, head_weight, embedding, norm,
                                epochs=epochs, lr=lr, batch_size=batch_size, seed=seed,
                                draft_vocab_size=draft_vocab_size, min_steps=min_steps)
    summary = {"base_model": str(llm.model_dir), "base_model_fingerprint": model_fingerprint(llm.model_dir),
               **summary, "data_seconds": round(collected_s, 1)}
    draft.save(Path(output), extra_config=summary)
    logger.info("wrote %s: held-out top-1 accuracy of the first guess %s", output, summary["held_out_top1_accuracy"])
    return summary


def _init(draft: Eagle3Draft, head_rows: torch.Tensor, norm: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    h = draft.arch.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, 2 * h:] = torch.eye(h)  # the high feature passes through
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            w = draft.w(name)
            w.copy_(torch.randn(w.shape, generator=g) * w.shape[1] ** -0.5)
        draft.w("self_attn.o_proj").zero_()
        draft.w("mlp.down_proj").zero_()
        draft.lm_head.copy_(head_rows)
        draft.norms["norm"].copy_(norm)


def _unrolled(draft: Eagle3Draft, embeds: torch.Tensor, feats: torch.Tensor, lengths: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-1 and step-2 features [B, T, H] (module doc) of padded rows:
    ``embeds`` [2, B, T, H] (t_{p+1} and t_{p+2}), ``feats`` [B, T, 3H]."""
    _, b, t, h = embeds.shape
    positions = torch.arange(t).repeat(b)
    span = torch.arange(t)
    valid = span[None, None, :] < lengths[:, None, None]
    causal = (span[None, :] <= span[:, None])[None] & valid  # [B, T, T]
    x1, q1, k1, v1 = draft.qkv(embeds[0].reshape(b * t, h), feats.reshape(b * t, -1), positions)
    shape = lambda z: z.view(b, t, *z.shape[1:])  # noqa: E731
    f1 = draft.finish(x1, draft.attend(shape(q1), shape(k1), shape(v1), causal).reshape(b * t, -1))
    x2, q2, k2, v2 = draft.qkv(embeds[1].reshape(b * t, h), f1, positions + 1)
    own = torch.eye(t, dtype=torch.bool)[None] & valid
    keys, values = torch.cat([shape(k1), shape(k2)], dim=1), torch.cat([shape(v1), shape(v2)], dim=1)
    f2 = draft.finish(x2, draft.attend(shape(q2), keys, values, torch.cat([causal, own], dim=-1)).reshape(b * t, -1))
    return f1.view(b, t, h), f2.view(b, t, h)


def fit_eagle3(data: list[tuple[torch.Tensor, list[int], int]], arch: Any, layer_ids: tuple[int, ...],
               head_weight: torch.Tensor, embedding: torch.Tensor, norm: torch.Tensor, *,
               epochs: Optional[int] = None, lr: float = 1e-3, batch_size: int = 16, seed: int = 0,
               draft_vocab_size: int = 8192, min_steps: int = MIN_STEPS) -> tuple[Eagle3Draft, dict[str, Any]]:
    """Fits a draft on ``collect_eagle3_data``'s rows, a tenth held out
    (``fit_eagle``'s schedule: one cycle, ``min_steps`` steps without ``epochs``)."""
    torch.manual_seed(seed)
    started = time.perf_counter()
    data = list(data)
    random.Random(seed).shuffle(data)
    held, train = data[: max(1, len(data) // 10)], data[max(1, len(data) // 10):]
    vocab = embedding.shape[0]
    counts = torch.zeros(vocab, dtype=torch.long)
    for _, seq, first in train:
        counts += torch.bincount(torch.tensor(seq[first + 1:]), minlength=vocab)
    kept = counts.topk(min(draft_vocab_size, vocab)).indices.sort().values
    draft = Eagle3Draft(arch, arch.hidden_size, len(kept), layer_ids)
    draft.d2t.copy_(kept - torch.arange(len(kept)))
    _init(draft, head_weight[kept], norm, seed)
    column = torch.full((vocab,), -100, dtype=torch.long)  # target id -> draft id (-100: not in the draft's)
    column[kept] = torch.arange(len(kept))

    def batch_loss(items) -> tuple[torch.Tensor, int, int]:
        n = max(len(seq) - 1 for _, seq, _ in items)
        feats = torch.zeros(len(items), n, len(layer_ids) * arch.hidden_size)
        ids = torch.zeros(2, len(items), n, dtype=torch.long)
        targets = torch.full((2, len(items), n), -100, dtype=torch.long)
        for b, (a, seq, first) in enumerate(items):
            m = len(seq) - 1  # rows (a_p, t_{p+1}) for p < m
            feats[b, :m], ids[0, b, :m], ids[1, b, : m - 1] = a[:m], torch.tensor(seq[1:]), torch.tensor(seq[2:])
            targets[0, b, first: m - 1] = column[torch.tensor(seq[first + 2:])]
            targets[1, b, first: m - 2] = column[torch.tensor(seq[first + 3:])]
        lengths = torch.tensor([len(seq) - 1 for _, seq, _ in items])
        f1, f2 = _unrolled(draft, embedding[ids], feats, lengths)
        logits1 = draft.logits(f1)
        ce1 = F.cross_entropy(logits1.flatten(0, 1), targets[0].flatten(), ignore_index=-100)
        ce2 = F.cross_entropy(draft.logits(f2).flatten(0, 1), targets[1].flatten(), ignore_index=-100)
        answer = targets[0] != -100
        hits = int((logits1.argmax(-1)[answer] == targets[0][answer]).sum())
        # Accuracy over every answer position, those the draft vocabulary misses counted as misses.
        total = sum(max(0, len(seq) - 2 - first) for _, seq, first in items)
        return ce1 + STEP2_WEIGHT * ce2, hits, total

    return run_fit(draft, data, train, held, lambda items, training: batch_loss(items), batch_size=batch_size,
                   epochs=epochs, min_steps=min_steps, lr=lr, seed=seed, started=started,
                   what=f"the EAGLE-3 draft (a draft vocabulary of {len(kept)} tokens)")
