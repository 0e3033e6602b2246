"""EAGLE proposals in the model runner (``speculative_config={"method":
"eagle", "model": PATH}``; the draft layer: ``workers/model/eagle.py``).

After each step the runner hands over the target's hidden states of every row
it ran (``step_proposals``). Per sequence, the rows of its accepted path (a
prefill chunk's rows, a decode's row, or the fed token and the accepted drafts
of a verified step) are *caught up*: draft row i reads ``(h_i, t_{i+1})``,
``t_{i+1}`` the next input token, the sampled one after the last row::

    target rows     h_c   h_c+1 ... h_c+a          (a drafts accepted)
    draft rows      (h_c, t_c+1) ... (h_c+a, bonus) -> keys/values at positions c..c+a
                                                    -> f: lm_head(f) = d1
    rounds 2..k     (f, d1) at c+a+1 -> d2, (f', d2) at c+a+2 -> d3, ...

Draft keys and values live in a paged cache of their own with the target's
geometry of blocks: position p of a sequence is at the slot the target's
block table gives p (vLLM's way: the draft shares the block tables, not the
tensors). Catch-up rows always have their slots (the target just wrote the
same positions); the rounds' keys and values are kept beside the gathered
context for the step only (their slots may not be allocated yet), and
overwritten by the target's features once verified. So a prefix-cache hit
reads the draft keys its first writer left in those blocks; after a swap or
a KV transfer (blocks in new places, draft cache not carried) a sequence's
draft context is stale: proposals get worse, never wrong (the target
verifies every token). All sequences of a step run as one batch per round;
catch-up rows are batched too, a long prefill chunk alone.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from workers.engine.outputs import ScheduledRequest
from workers.model.eagle import EagleDraft

logger = logging.getLogger(__name__)

BATCH_QUERY_ROWS = 8  # a sequence with more catch-up rows (a prefill chunk) is attended alone


class EagleProposer:
    """Runs the draft after each target step; the runner's ``medusa`` slot
    holds it (``step_proposals`` marks a proposer that reads every row).

    Args:
        draft: The draft layer, on the runner's device and dtype.
        embed: The target's token embedding (ids -> [N, H]).
        lm_head: The target's LM head module (``[N, H]`` -> logits).
        num_blocks / block_size: The target's KV block geometry.
    """

    def __init__(self, draft: EagleDraft, embed: Callable[[torch.Tensor], torch.Tensor], lm_head: Any,
                 num_blocks: int, block_size: int) -> None:
        self.draft = draft
        self.embed = embed
        self.block_size = block_size
        param = draft.fc.weight
        self.device, self.dtype = param.device, param.dtype
        # [2, blocks * block_size, kv heads, head_dim]: keys, values by slot.
        self.kv = torch.zeros(2, num_blocks * block_size, draft.num_kv_heads, draft.head_dim,
                              dtype=self.dtype, device=self.device)
        self.lm_head: Callable[[torch.Tensor], torch.Tensor] = lm_head
        self.token_ids: Optional[torch.Tensor] = None  # the shortlist's ids, when scored on one
        if draft.shortlist is not None:
            self._bind_shortlist(lm_head, draft.shortlist.to(self.device))

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def _bind_shortlist(self, lm_head: Any, ids: torch.Tensor) -> None:
        packed = getattr(lm_head, "packed", None)
        rows = packed.rows(ids) if packed is not None else lm_head.weight.detach()[ids]
        rows = rows.to(self.dtype).contiguous()
        self.lm_head = lambda x: torch.nn.functional.linear(x, rows)
        self.token_ids = ids

    def _guess(self, features: torch.Tensor) -> torch.Tensor:
        best = self.lm_head(features).float().argmax(dim=-1)
        return best if self.token_ids is None else self.token_ids[best]

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def step_proposals(self, step: tuple, reqs: list[ScheduledRequest], paths: list[list[int]],
                       sampled: list[list[int]]) -> Optional[list[Optional[list[list[int]]]]]:
        """Catches the draft up on the step and proposes for the requests that
        ask (``num_proposals``).

        Args:
            step: ``(hidden, _, order, batch)`` of the runner's last ``_execute``:
                its hidden states, and its rows (``batch[j]`` is row ``order[j]``).
            reqs: The step's requests as scheduled.
            paths: Per request, the rows (of the last ``_execute``) whose
                tokens it keeps, in order (a plain step: its one row).
            sampled: Per request, the tokens it kept.

        Returns:
            Per request, None or ``[[d1, ..., dk]]``.
        """
        hidden, _, order, batch = step
        start_of: dict[int, tuple[int, ScheduledRequest]] = {}
        start = 0
        for row, req in zip(order, batch):
            start_of[row] = (start, req)
            start += len(req.input_token_ids)
        seqs = [s for s in (self._rows_of(i, req, paths[i], sampled[i], start_of) for i, req in enumerate(reqs))
                if s is not None]
        if not seqs:
            return None
        hrows = torch.tensor([r for s in seqs for r in s["hidden_rows"]], dtype=torch.long, device=self.device)
        next_ids = torch.tensor([t for s in seqs for t in s["next"]], dtype=torch.long, device=self.device)
        positions = torch.tensor([p for s in seqs for p in s["positions"]], dtype=torch.long, device=self.device)
        x, q, k, v = self.draft.qkv(self.embed(next_ids).to(self.dtype), hidden.index_select(0, hrows).to(self.dtype),
                                    positions)
        slots = torch.tensor([sl for s in seqs for sl in s["slots"]], dtype=torch.long, device=self.device)
        self.kv[0].index_copy_(0, slots, k)
        self.kv[1].index_copy_(0, slots, v)
        attn = torch.empty(len(hrows), q.shape[1] * q.shape[2], dtype=self.dtype, device=self.device)
        offsets, at = [], 0
        for s in seqs:
            offsets.append(at)
            at += len(s["positions"])
        small = [j for j, s in enumerate(seqs) if len(s["positions"]) <= BATCH_QUERY_ROWS]
        groups = ([small] if small else []) + [[j] for j, s in enumerate(seqs) if j not in set(small)]
        for group in groups:
            self._catch_up_attention(group, seqs, offsets, q, attn)
        features = self.draft.finish(x, attn)
        asking = [j for j, s in enumerate(seqs) if s["k"] > 0]
        out: list[Optional[list[list[int]]]] = [None] * len(reqs)
        if not asking:
            return out
        last = torch.tensor([offsets[j] + len(seqs[j]["positions"]) - 1 for j in asking], device=self.device)
        drafts = self._rounds([seqs[j] for j in asking], features.index_select(0, last))
        for j, guess in zip(asking, drafts):
            out[seqs[j]["index"]] = [guess]
        return out

    def _rows_of(self, i: int, req: ScheduledRequest, path: list[int], kept: list[int],
                 start_of: dict[int, tuple[int, ScheduledRequest]]) -> Optional[dict]:
        """One sequence's catch-up rows: hidden rows, positions, the token after each, slots."""
        hidden_rows: list[int] = []
        positions: list[int] = []
        tokens: list[int] = []
        for row in path:
            start, run = start_of[row]
            n = len(run.input_token_ids)
            hidden_rows.extend(range(start, start + n))
            positions.extend(range(run.num_computed_tokens, run.num_computed_tokens + n))
            tokens.extend(run.input_token_ids)
        if not positions:
            return None
        after = positions[-1] + 1
        full = list(req.prompt_token_ids) + list(req.output_token_ids)
        if kept:
            following = tokens[1:] + [kept[-1]]
        elif after < len(full):  # a prefill chunk that samples nothing: the next token is known
            following = tokens[1:] + [full[after]]
        else:  # nothing follows the last row yet: it waits for the next step
            hidden_rows, positions, following = hidden_rows[:-1], positions[:-1], tokens[1:]
            if not positions:
                return None
        bs, table = self.block_size, req.block_ids
        return {"index": i, "hidden_rows": hidden_rows, "positions": positions, "next": following,
                "slots": [table[p // bs] * bs + p % bs for p in positions], "table": table,
                "k": req.num_proposals if kept else 0}

    def _context(self, group: list[dict], extra: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values [B, L + extra, kv heads, d] of positions 0..last of each
        sequence (padded), and each one's length L_b."""
        bs = self.block_size
        lengths = [s["positions"][-1] + 1 for s in group]
        width = max(lengths)
        index = torch.zeros(len(group), width, dtype=torch.long)
        for b, (s, n) in enumerate(zip(group, lengths)):
            pos = torch.arange(n)
            table = torch.tensor(s["table"][: -(-n // bs)], dtype=torch.long)
            index[b, :n] = table[pos // bs] * bs + pos % bs
        flat = index.to(self.device).view(-1)
        keys = self.kv[0].index_select(0, flat).view(len(group), width, *self.kv.shape[2:])
        values = self.kv[1].index_select(0, flat).view(len(group), width, *self.kv.shape[2:])
        return keys, values, torch.tensor(lengths, device=self.device)

    def _catch_up_attention(self, group: list[int], seqs: list[dict], offsets: list[int], q: torch.Tensor,
                            attn: torch.Tensor) -> None:
        members = [seqs[j] for j in group]
        keys, values, _ = self._context(members)
        width_q = max(len(s["positions"]) for s in members)
        queries = q.new_zeros(len(members), width_q, *q.shape[1:])
        qpos = torch.full((len(members), width_q), -1, dtype=torch.long)
        for b, (j, s) in enumerate(zip(group, members)):
            n = len(s["positions"])
            queries[b, :n] = q[offsets[j]: offsets[j] + n]
            qpos[b, :n] = torch.tensor(s["positions"])
        kpos = torch.arange(keys.shape[1])
        mask = (kpos[None, None, :] <= qpos[:, :, None]).to(self.device)
        mask[:, :, 0] = True  # padding query rows attend something (their output is dropped)
        out = self.draft.attend(queries, keys, values, mask)
        for b, (j, s) in enumerate(zip(group, members)):
            n = len(s["positions"])
            attn[offsets[j]: offsets[j] + n] = out[b, :n]

    def _rounds(self, group: list[dict], features: torch.Tensor) -> list[list[int]]:
        """d1 from the caught-up features, then one batched draft row per round."""
        guesses = [self._guess(features)]
        k_max = max(s["k"] for s in group)
        if k_max > 1:
            keys, values, lengths = self._context(group, 0)
            width = keys.shape[1]
            base = torch.tensor([s["positions"][-1] for s in group], device=self.device)
            for r in range(1, k_max):
                x, q, k, v = self.draft.qkv(self.embed(guesses[-1]).to(self.dtype), features, base + r)
                keys = torch.cat([keys, k.unsqueeze(1)], dim=1)
                values = torch.cat([values, v.unsqueeze(1)], dim=1)
                span = torch.arange(keys.shape[1], device=self.device)
                mask = ((span[None, :] < lengths[:, None]) | (span[None, :] >= width)).unsqueeze(1)
                features = self.draft.finish(x, self.draft.attend(q.unsqueeze(1), keys, values, mask)[:, 0])
                guesses.append(self._guess(features))
        table = torch.stack(guesses, dim=1).tolist()
        return [row[: s["k"]] for row, s in zip(table, group)]


def attach_eagle(runner: Any, folder: Optional[str], arch: Any) -> Any:
    """Loads an EAGLE-1 draft onto a local runner, which then proposes after
    each step; returns the proposer that hands the proposals to the scheduler."""
    from pathlib import Path

    from workers.engine.proposers import RunnerProposer

    if arch.embed_scale != 1.0 or arch.final_logit_softcapping is not None:
        raise ValueError(f"speculative_config method 'eagle' supports Llama-family targets; {arch.family} "
                         "scales its embeddings or logits")
    draft = EagleDraft.load(Path(folder or ""), arch)
    model = runner.model
    dtype = next(model.parameters()).dtype
    draft = draft.to(device=runner.device, dtype=dtype)
    draft.inv_freq = draft.inv_freq.float()
    proposer = EagleProposer(draft, model.model.embed_tokens, model.lm_head, runner.num_kv_blocks, runner.block_size)
    runner.medusa = proposer
    logger.info("EAGLE draft from %s: one layer, its KV cache %.1f MiB%s", folder, proposer.kv_cache_bytes / 2**20,
                f", scored on a shortlist of {len(draft.shortlist)} tokens" if draft.shortlist is not None else "")
    return RunnerProposer()
