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
verifies every token). All sequences of a step run as one batch per round.

Lazy catch-up: only keys and values of the caught-up rows are needed, and the
layer's attention and MLP only for each asking sequence's last row (its f).
A sequence that asks for nothing this step (adaptive speculation turned its
proposals off) has its rows' hidden states held (``CatchUpBacklog``) and
written when it asks again, or once more than ``MAX_BACKLOG_ROWS`` wait, so
a draft that proposes nothing costs a copy of a row per step. Rows still
held when a request ends are dropped unwritten (a later prefix-cache hit on
those blocks reads a stale draft context, as after a swap).
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, Optional

import torch

from workers.engine.outputs import ScheduledRequest
from workers.model.eagle import EagleDraft
from workers.spec_eagle_tree import expand_trees

logger = logging.getLogger(__name__)

MAX_BACKLOG_ROWS = 64  # a sequence that proposes nothing has its rows written once it has more waiting
PRUNE_AFTER_STEPS = 256  # a backlog untouched this many steps (its request ended or waits) is dropped


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
        self._backlog = CatchUpBacklog()
        self._num_steps = 0
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
        """Catches the draft up on the step (now for the requests that ask,
        later for the others) and proposes for the requests that ask
        (``num_proposals``).

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
        self._num_steps += 1
        if self._num_steps % PRUNE_AFTER_STEPS == 0:
            self._backlog.prune(self._num_steps - PRUNE_AFTER_STEPS)
        start_of: dict[int, tuple[int, ScheduledRequest]] = {}
        start = 0
        for row, req in zip(order, batch):
            start_of[row] = (start, req)
            start += len(req.input_token_ids)
        seqs = [s for s in (self._rows_of(i, req, paths[i], sampled[i], start_of) for i, req in enumerate(reqs))
                if s is not None]
        if not seqs:
            return None
        # Two gathers, the asking sequences' rows and the held ones: a held row's view then keeps alive only
        # rows that are themselves held (not a prefill's written now), with no copy per sequence.
        for asking in (True, False):
            part = [s for s in seqs if (s["k"] > 0) == asking]
            if not part:
                continue
            rows = hidden.index_select(0, torch.tensor([r for s in part for r in s["hidden_rows"]],
                                                       dtype=torch.long, device=hidden.device))
            at = 0
            for s in part:
                n = len(s["positions"])
                s["h"], at = rows[at: at + n], at + n
        writes: list[dict] = []  # the rows written now: the asking sequences' and the backlogs flushed
        for s in seqs:
            rid = reqs[s["index"]].request_id
            if self._backlog.add(rid, s, self._num_steps) > MAX_BACKLOG_ROWS or s["k"] > 0:
                writes.append(self._backlog.take(rid, s))
        out: list[Optional[list[list[int]]]] = [None] * len(reqs)
        if not writes:
            return out
        x, q = self._write(writes)
        asking = [(j, s) for j, s in enumerate(writes) if s["k"] > 0]
        if not asking:
            return out
        ends, at = [], 0
        for s in writes:
            at += len(s["positions"])
            ends.append(at - 1)
        last = torch.tensor([ends[j] for j, _ in asking], device=self.device)
        group = [s for _, s in asking]
        context = self._context(group)
        keys, values, lengths = context
        span = torch.arange(keys.shape[1], device=self.device)
        mask = (span[None, :] < lengths[:, None]).unsqueeze(1)
        attn = self.draft.attend(q.index_select(0, last).unsqueeze(1), keys, values, mask)[:, 0]
        features = self.draft.finish(x.index_select(0, last), attn)
        for s, candidates in zip(group, self._propose(group, features, context)):
            out[s["index"]] = candidates
        return out

    def _propose(self, group: list[dict], features: torch.Tensor,
                 context: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> list[list[list[int]]]:
        """Per sequence, its candidates: one chain (``_rounds``), or with
        ``num_candidates`` > 1 an EAGLE-2 dynamic tree's (``spec_eagle_tree``)."""
        out: list[list[list[int]]] = [[] for _ in group]
        for tree in (False, True):
            part = [j for j, s in enumerate(group) if (s["m"] > 1) == tree]
            if not part:
                continue
            members = [group[j] for j in part]
            if len(part) < len(group):
                rows = torch.tensor(part, device=self.device)
                feats = features.index_select(0, rows)
                ctx = (context[0].index_select(0, rows), context[1].index_select(0, rows), context[2][rows])
            else:
                feats, ctx = features, context
            if tree:
                found = expand_trees(self, members, feats, ctx, max(s["m"] for s in members),
                                     max(s["k"] for s in members))
                made = [[c[: s["k"]] for c in cands[: s["m"]]] for s, cands in zip(members, found)]
            else:
                made = [[guess] for guess in self._rounds(members, feats, ctx)]
            for j, cands in zip(part, made):
                out[j] = cands
        return out

    def _write(self, writes: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the draft keys and values of every row of ``writes`` to its
        slot (the block table the sequence has now); returns the rows' layer
        inputs and queries."""
        hid = torch.cat([s["h"] for s in writes]).to(self.dtype)
        next_ids = torch.tensor([t for s in writes for t in s["next"]], dtype=torch.long, device=self.device)
        positions = torch.tensor([p for s in writes for p in s["positions"]], dtype=torch.long, device=self.device)
        x, q, k, v = self.draft.qkv(self.embed(next_ids).to(self.dtype), hid, positions)
        bs = self.block_size
        slots = torch.tensor([s["table"][p // bs] * bs + p % bs for s in writes for p in s["positions"]],
                             dtype=torch.long, device=self.device)
        self.kv[0].index_copy_(0, slots, k)
        self.kv[1].index_copy_(0, slots, v)
        return x, q

    def _rows_of(self, i: int, req: ScheduledRequest, path: list[int], kept: list[int],
                 start_of: dict[int, tuple[int, ScheduledRequest]]) -> Optional[dict]:
        """One sequence's catch-up rows: hidden rows, positions, the token after each."""
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
        num_prompt = len(req.prompt_token_ids)
        if kept:
            following = tokens[1:] + [kept[-1]]
        elif after < num_prompt + len(req.output_token_ids):  # a prefill chunk that samples nothing: known next
            following = tokens[1:] + [req.prompt_token_ids[after] if after < num_prompt
                                      else req.output_token_ids[after - num_prompt]]
        else:  # nothing follows the last row yet: it waits for the next step
            hidden_rows, positions, following = hidden_rows[:-1], positions[:-1], tokens[1:]
            if not positions:
                return None
        return {"index": i, "hidden_rows": hidden_rows, "positions": positions, "next": following,
                "table": req.block_ids, "k": req.num_proposals if kept else 0,
                "m": req.num_proposal_candidates}

    def _context(self, group: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values [B, L, kv heads, d] of positions 0..last of each
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

    def _rounds(self, group: list[dict], features: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> list[list[int]]:
        """d1 from the caught-up features, then one batched draft row per round
        over ``context`` (``_context(group)``)."""
        guesses = [self._guess(features)]
        k_max = max(s["k"] for s in group)
        if k_max > 1:
            keys, values, lengths = context
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


class CatchUpBacklog:
    """Per request, the kept rows not yet written to the draft's cache (its
    target hidden states, positions and next tokens), in position order."""

    def __init__(self) -> None:
        self._rows: dict[str, dict] = {}

    def add(self, request_id: str, s: dict, step: int) -> int:
        """Appends the rows of ``s`` (``_rows_of`` with ``h``), first dropping
        waiting rows at or after its first position (the sequence was
        recomputed from there); returns how many rows wait."""
        entry = self._rows.get(request_id)
        if entry is None:
            entry = self._rows[request_id] = {"h": [], "positions": [], "next": []}
        cut = bisect.bisect_left(entry["positions"], s["positions"][0])
        if cut < len(entry["positions"]):
            entry["h"] = [torch.cat(entry["h"])[:cut]]
            del entry["positions"][cut:], entry["next"][cut:]
        entry["h"].append(s["h"])
        entry["positions"] += s["positions"]
        entry["next"] += s["next"]
        entry["touched"] = step
        return len(entry["positions"])

    def take(self, request_id: str, s: dict) -> dict:
        """``s`` with every waiting row of its request (its own last), which no longer wait."""
        entry = self._rows.pop(request_id)
        h = entry["h"][0] if len(entry["h"]) == 1 else torch.cat(entry["h"])
        return {**s, "h": h, "positions": entry["positions"], "next": entry["next"]}

    def prune(self, before: int) -> None:
        """Drops the rows of requests untouched since step ``before``."""
        for rid in [rid for rid, e in self._rows.items() if e["touched"] < before]:
            del self._rows[rid]

    @property
    def num_rows(self) -> int:
        return sum(len(e["positions"]) for e in self._rows.values())


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
