"""The model runner: executes one ``SchedulerOutput`` and returns a ``ModelOutput``.

It owns the device KV tensors (one per layer, layout in
``workers/model/attention/base.py``) and the CPU swap copies, builds the
per-step ``AttentionMetadata``, runs the model and samples. It never mutates
the scheduler's sequences.

Batch order inside a step: requests with one input token (decodes) first,
longest context first, so attention backends batch them with little padding,
then prefill chunks.
Outputs are mapped back to the scheduler's order.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from cluster.shared.sizes import cdiv
from workers.cuda_graphs import DecodeGraphs
from workers.engine.outputs import ModelOutput, ScheduledRequest, SchedulerOutput
from workers.engine.spec_trees import tree_paths
from workers.model.attention.base import AttentionMetadata, host_to_device
from workers.model.linear import weight_bytes
from workers.model.sampler import Sampler, token_logprobs
from workers.swap import BlockSwapper
from workers.kv_memory import kv_block_bytes, kv_layout, lazy_zeros, prefault

logger = logging.getLogger(__name__)

PROMPT_LOGPROB_ROWS = 64  # rows of logits computed at once for prompt logprobs


class ModelRunner:
    """Runs the model over the paged KV cache.

    Args:
        model: A model with ``forward(input_ids, positions, kv_caches, meta)``
            and ``compute_logits(hidden)`` (None on tensor-parallel ranks
            other than 0, which then return an empty ``ModelOutput``).
        num_layers / num_kv_heads / head_dim: KV geometry of this rank.
        block_size: Tokens per block.
        num_kv_blocks: Device blocks.
        num_cpu_blocks: CPU swap blocks (0 disables swap).
        dtype: KV dtype (the model's compute dtype).
        device: Where the model and the KV cache live.
        seed: Seed of the sampler's generator for requests without a seed.
        cuda_graph_sizes: Decode batch sizes to capture as CUDA graphs
            (``workers/cuda_graphs.py``); None runs every step eagerly. The
            cache then holds one block past ``num_kv_blocks`` for padding rows.
        max_blocks_per_seq: Block-table width of the graphs' buffers.
        graph_api: The graph calls (tests pass a fake; default CUDA's).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_kv_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        cuda_graph_sizes: Optional[list[int]] = None,
        max_blocks_per_seq: int = 0,
        graph_api: Any = None,
        prefault_kv: bool = False,
    ) -> None:
        self.model = model
        self.long_rope_rows = getattr(model, "long_rope_rows", 0)  # longrope: rows of the long factors
        self.device = device
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.kv_cache_bytes = num_kv_blocks * kv_block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype,
                                                             kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.description = f"{str(dtype).removeprefix('torch.')} on {device}"
        self.quantization: Optional[str] = getattr(model, "quantization", None)
        self.weight_bytes = weight_bytes(model) if isinstance(model, torch.nn.Module) else 0
        cache_dtype, row = kv_layout(head_dim, dtype, kv_cache_dtype)
        pad_blocks = 1 if cuda_graph_sizes else 0  # where a graph's padding rows write (never a request's)
        shape = (2, num_kv_blocks + pad_blocks, block_size, num_kv_heads, row)
        # Zeros, not empty: padded decode gathers read unused slots (NaN there poisons masked softmax sums).
        self.kv_caches = [lazy_zeros(shape, cache_dtype, device) for _ in range(num_layers)]
        if prefault_kv:  # kv_cache_prefault: no page fault inside a request's forward
            prefault(self.kv_caches)
        cpu_shape = (2, num_cpu_blocks, block_size, num_kv_heads, row)
        pin = device.type == "cuda"
        self.cpu_caches = [
            torch.zeros(cpu_shape, dtype=cache_dtype, pin_memory=True) if pin
            else lazy_zeros(cpu_shape, cache_dtype, device)
            for _ in range(num_layers)
        ] if num_cpu_blocks else []
        self.swapper = BlockSwapper(self.kv_caches, self.cpu_caches, device)
        self.sampler = Sampler(seed)
        self.lora: Any = None  # workers.lora.manager.LoRAManager with enable_lora
        self.medusa = None  # MedusaHeads (workers/model/medusa.py) when speculating with them
        self._sample_hidden: tuple = (torch.empty(0), {}, [], [])  # hidden, sample rows, order, batch
        self.graphs: Optional[DecodeGraphs] = None
        if cuda_graph_sizes:
            self.graphs = DecodeGraphs(model, self.kv_caches, block_size=block_size, pad_block=num_kv_blocks,
                                       max_blocks_per_seq=max_blocks_per_seq, sizes=cuda_graph_sizes, device=device,
                                       graphs=graph_api)
            with torch.inference_mode():
                self.graphs.capture()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Swaps blocks, runs the forward pass and samples (see SchedulerOutput)."""
        if sched.kv_moves:
            self._move_kv(sched.kv_moves)
        self.swapper.flush()  # last step's swap-outs, now on the host (a no-op on CPU)
        if sched.swap_out:
            self.swapper.swap_out(sched.swap_out)
        if sched.swap_in:
            self.swapper.swap_in(sched.swap_in)
        reqs = sched.scheduled
        if not reqs:
            return ModelOutput(sampled_token_ids=[], logprobs=[])
        if any(r.spec_token_ids for r in reqs):
            return self._execute_speculative(reqs)
        return self._execute(reqs)

    def _execute_speculative(self, reqs: list[ScheduledRequest]) -> ModelOutput:
        """A step with speculated tokens: each such request runs as 1 + k decodes,
        one per proposed token and the fed one (the kernels of an ordinary
        decode, so each row's logits are those its position would get without
        speculation), each sampled as if the proposals on its path were
        already output; then the request keeps, from the fed token on, every
        proposal equal to its parent row's own sample, and the first sample no
        proposal matches (``workers/engine/spec_decode.py``).

        A chain of k proposals lies at positions ``c+1 .. c+k`` after the fed
        token at ``c``. A tree (``spec_parents``: several candidate
        continuations) puts proposal i's KV at slot position ``c+1+i`` and its
        row at position ``c + depth(i)``; the row attends its own path through
        the tree (``AttentionMetadata.tree_tails``), which is what a plain
        decode of that path would read, in the same order.
        """
        rows: list[ScheduledRequest] = []
        owner: list[int] = []
        # Per request: the row of the fed token and of each proposal, and the proposals' children by token.
        row_of: list[list[int]] = []
        children: list[list[dict[int, int]]] = []
        # Rows of a tree (id of the row -> its KV slot, first tail position, the slots of its path).
        tree_rows: dict[int, tuple[int, int, list[int]]] = {}
        bs = self.block_size
        for i, req in enumerate(reqs):
            if not req.spec_token_ids:
                row_of.append([len(rows)])
                children.append([{}])
                rows.append(req)
                owner.append(i)
                continue
            drafts = list(req.spec_token_ids)
            k = len(drafts)
            assert req.num_input_tokens == 1 + k and req.num_sample_tokens == 1 + k, req
            is_chain = not req.spec_parents
            c = req.num_computed_tokens
            paths = tree_paths(req.spec_parents, k)  # proposal indices from depth 1 down to the proposal
            kids: list[dict[int, int]] = [{} for _ in range(k + 1)]  # index 0: the fed token; j + 1: proposal j
            for j, path in enumerate(paths):
                parent = path[-2] if len(path) > 1 else -1
                assert drafts[j] not in kids[parent + 1], ("sibling proposals repeat a token", req.request_id)
                kids[parent + 1][drafts[j]] = j + 1
            rows_here = [len(rows)]
            masks = req.grammar_bitmask  # row 0: the fed token's; row 1 + j: proposal j's
            rows.append(dataclasses.replace(req, input_token_ids=[req.input_token_ids[0]], num_sample_tokens=1,
                                            spec_token_ids=(), spec_parents=(),
                                            grammar_bitmask=None if masks is None else masks[0:1]))
            owner.append(i)
            table = req.block_ids
            for j, path in enumerate(paths):
                row = dataclasses.replace(
                    req, input_token_ids=[drafts[j]], num_computed_tokens=c + len(path), num_sample_tokens=1,
                    output_token_ids=[*req.output_token_ids, *(drafts[a] for a in path)], spec_token_ids=(),
                    spec_parents=(), grammar_bitmask=None if masks is None else masks[j + 1:j + 2])
                if not is_chain:
                    slot_of = [table[(c + 1 + a) // bs] * bs + (c + 1 + a) % bs for a in path]
                    tree_rows[id(row)] = (slot_of[-1], c + 1, slot_of)
                rows_here.append(len(rows))
                rows.append(row)
                owner.append(i)
            row_of.append(rows_here)
            children.append(kids)
        out = self._execute(rows, with_proposals=False, tree_rows=tree_rows)
        if not out.sampled_token_ids:  # a tensor-parallel rank other than 0
            return out
        sampled: list[list[int]] = []
        logprobs: list[Optional[list]] = []
        last_rows: list[int] = []
        paths: list[list[int]] = []  # per request, the rows of its kept tokens (EAGLE reads them all)
        for i in range(len(reqs)):
            node, kept, lps, path = 0, [], None, []
            while True:
                row = row_of[i][node]
                path.append(row)
                tokens = out.sampled_token_ids[row]
                if not tokens:  # a prompt chunk that samples nothing
                    break
                kept.extend(tokens)
                if out.logprobs[row] is not None:
                    lps = (lps or []) + out.logprobs[row]
                nxt = children[i][node].get(tokens[0])
                if nxt is None:
                    break
                node = nxt
            sampled.append(kept)
            logprobs.append(lps)
            last_rows.append(row_of[i][node] if kept else -1)
            paths.append(path)
        prompt_logprobs = None
        if out.prompt_logprobs is not None:  # rows of prompt chunks are never expanded
            prompt_logprobs = [None] * len(reqs)
            for row, entry in zip(owner, out.prompt_logprobs):
                if entry is not None:
                    prompt_logprobs[row] = entry
        result = ModelOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if out.fork_samples is not None:  # forks sample where a prompt ends: never an expanded row
            result.fork_samples = [out.fork_samples[row_of[i][0]] for i in range(len(reqs))]
        # Heads read the row that sampled each request's last kept token.
        result.spec_proposals = self._head_proposals(reqs, last_rows, sampled, paths)
        return result

    def _execute(self, reqs: list[ScheduledRequest], with_proposals: bool = True,
                 tree_rows: Optional[dict[int, tuple[int, int, list[int]]]] = None) -> ModelOutput:
        # Decodes first, longest context first (attention pads per group of
        # similar lengths), then prefill chunks.
        order = sorted(range(len(reqs)), key=lambda i: (len(reqs[i].input_token_ids) != 1, -reqs[i].seq_len))
        batch = [reqs[i] for i in order]
        input_ids, positions, meta = self._prepare(batch, tree_rows)
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)

        sample_rows, sample_reqs, owners = [], [], []
        forks: list[tuple[int, ScheduledRequest]] = []  # (owner, request as the fork samples)
        end = 0
        for pos_in_batch, req in zip(order, batch):
            end += len(req.input_token_ids)
            if req.num_sample_tokens:
                assert req.num_sample_tokens == 1, "several tokens per step need a verifier"
                sample_rows.append(end - 1)
                sample_reqs.append(req)
                owners.append(pos_in_batch)
                for params in req.fork_params:
                    forks.append((pos_in_batch, dataclasses.replace(req, sampling_params=params, fork_params=())))
        num_main = len(sample_rows)
        if forks:  # parallel sampling: each fork samples from its parent's last row
            row_of = dict(zip(owners, sample_rows))
            sample_rows = sample_rows + [row_of[owner] for owner, _ in forks]
            sample_reqs = sample_reqs + [fork for _, fork in forks]
        sampled: list[list[int]] = [[] for _ in reqs]
        logprobs: list[Optional[list]] = [None for _ in reqs]
        fork_samples: Optional[list] = None
        prompt_logprobs = self._prompt_logprobs(hidden, order, batch)
        if sample_rows:
            rows = host_to_device(sample_rows, torch.long, self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
                return ModelOutput(sampled_token_ids=[], logprobs=[])
            token_ids, sampled_logprobs = self.sampler(logits, sample_reqs)
            for owner, tok, lp in zip(owners, token_ids[:num_main], sampled_logprobs[:num_main]):
                sampled[owner] = [tok]
                logprobs[owner] = lp
            if forks:
                fork_samples = [None] * len(reqs)
                for (owner, _), tok, lp in zip(forks, token_ids[num_main:], sampled_logprobs[num_main:]):
                    fork_samples[owner] = (fork_samples[owner] or []) + [(tok, lp)]
        if self.medusa is not None:  # the heads read these rows after sampling (EAGLE: every row)
            self._sample_hidden = (hidden, dict(zip(owners, sample_rows[:num_main])), order, batch)
        out = ModelOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                          fork_samples=fork_samples)
        if with_proposals and self.medusa is not None:
            out.spec_proposals = self._head_proposals(reqs, list(range(len(reqs))), sampled)
        return out

    def _head_proposals(self, reqs: list[ScheduledRequest], rows: list[int], sampled: list[list[int]],
                        paths: Optional[list[list[int]]] = None) -> Optional[list[Optional[list[int]]]]:
        """Medusa heads' guesses for the next step of each request asking for
        them (``num_proposals``), from the hidden state of ``rows[i]``, the row
        (of the last ``_execute``) that sampled request i's last token,
        ``sampled[i][-1]`` (token-conditioned heads read it too). EAGLE
        (``workers/spec_eagle.py``) reads every row of ``paths[i]``."""
        if self.medusa is None:
            return None
        if hasattr(self.medusa, "step_proposals"):
            return self.medusa.step_proposals(self._sample_hidden, reqs, paths or [[r] for r in rows], sampled)
        hidden, row_of = self._sample_hidden[:2]
        wanted = [i for i, req in enumerate(reqs) if req.num_proposals > 0 and rows[i] in row_of]
        if not wanted:
            return None
        index = torch.tensor([row_of[rows[i]] for i in wanted], device=self.device)
        k = max(reqs[i].num_proposals for i in wanted)
        m = max(reqs[i].num_proposal_candidates for i in wanted)
        tokens = (torch.tensor([sampled[i][-1] for i in wanted], device=self.device)
                  if self.medusa.token_conditioned else None)
        candidates = self.medusa.propose_candidates(hidden.index_select(0, index), k, m, self.model.lm_head, tokens)
        out: list[Optional[list[list[int]]]] = [None] * len(reqs)
        for i, guesses in zip(wanted, candidates):
            out[i] = [guess[: reqs[i].num_proposals] for guess in guesses[: reqs[i].num_proposal_candidates]]
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, order: list[int], batch: list[ScheduledRequest]
                         ) -> Optional[list[Optional[tuple[int, list]]]]:
        """For requests with ``prompt_logprobs``: the logprobs of the prompt tokens
        their chunk's rows predict (row of position p -> prompt token p + 1), in
        slices of rows so the logits stay small."""
        out: Optional[list[Optional[tuple[int, list]]]] = None
        end = 0
        for pos_in_batch, req in zip(order, batch):
            start_row, end = end, end + len(req.input_token_ids)
            top = req.sampling_params.prompt_logprobs
            prompt = req.prompt_token_ids
            first, last = req.num_computed_tokens, min(req.seq_len, len(prompt) - 1)  # positions p predicting p + 1
            if top is None or first >= last:
                continue
            entries: list = []
            for lo in range(first, last, PROMPT_LOGPROB_ROWS):
                hi = min(lo + PROMPT_LOGPROB_ROWS, last)
                rows = torch.arange(start_row + lo - first, start_row + hi - first, device=self.device)
                logits = self.model.compute_logits(hidden.index_select(0, rows))
                if logits is None:  # a tensor-parallel rank other than 0
                    return None
                targets = torch.tensor(prompt[lo + 1 : hi + 1], device=self.device)
                entries.extend(token_logprobs(logits, targets, [top] * (hi - lo)))
            if out is None:
                out = [None] * len(batch)
            out[pos_in_batch] = (first + 1, entries)
        return out

    @property
    def num_compilations(self) -> int:
        """Graphs ``torch.compile`` built for the model so far (0 when eager)."""
        compiled = getattr(self.model, "compiled", None)
        return compiled.num_compilations if compiled is not None else 0

    def shutdown(self) -> None:
        """Nothing to stop in one process (the tensor-parallel runner stops its ranks)."""

    def _prepare(self, batch: list[ScheduledRequest], tree: Optional[dict[int, tuple[int, int, list[int]]]] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Host lists -> tensors and metadata; ``tree`` gives tree rows (by id)
        their own KV slot and path (``_execute_speculative``)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tails: list[tuple[int, list[int]]] = []
        for req in batch:
            start = req.num_computed_tokens
            n = len(req.input_token_ids)
            input_ids.extend(req.input_token_ids)
            pos = range(start, start + n)
            offset = self.long_rope_rows * req.rope_long  # a longrope sequence past its original length
            positions.extend(range(start + offset, start + n + offset))
            table = req.block_ids
            in_tree = tree.get(id(req)) if tree else None
            if in_tree is not None:  # a proposal of a tree: its own slot, its own path from tail_lo on
                slots.append(in_tree[0])
                tails.append(in_tree[1:])
            else:
                slots.extend(table[p // bs] * bs + p % bs for p in pos)
                tails.append((-1, []))
            query_lens.append(n)
            seq_lens.append(start + n)
        # Tables cut to the blocks this step can touch (a table may hold more).
        tables = [req.block_ids[: cdiv(s, bs)] for req, s in zip(batch, seq_lens)]
        dev = self.device
        meta = AttentionMetadata.build(slots, query_lens, seq_lens, tables, dev)
        if tree:
            width = max(len(t) for _, t in tails)
            meta.tree_tails = (torch.tensor([lo for lo, _ in tails], dtype=torch.int32, device=dev),
                               torch.tensor([t + [0] * (width - len(t)) for _, t in tails], dtype=torch.int64,
                                            device=dev))
        if self.lora is not None:  # which rows run which adapter
            self.lora.batch.set([(r.lora_slot, len(r.input_token_ids)) for r in batch], len(input_ids), dev)
        ids = host_to_device(input_ids, torch.long, dev)
        pos_t = host_to_device(positions, torch.long, dev)
        return ids, pos_t, meta

    def _move_kv(self, moves: list[tuple[int, int]]) -> None:
        """Copies KV rows between slots, every layer (all sources read before any write)."""
        src = torch.tensor([a for a, _ in moves], dtype=torch.long, device=self.device)
        dst = torch.tensor([b for _, b in moves], dtype=torch.long, device=self.device)
        for cache in self.kv_caches:
            flat = cache.view(2, cache.shape[1] * cache.shape[2], *cache.shape[3:])
            flat[:, dst] = flat[:, src]
