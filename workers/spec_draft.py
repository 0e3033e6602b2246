"""The draft-model proposer of speculative decoding
(``speculative_config={"method": "draft_model", ...}``).

A smaller model with the target's vocabulary runs in the same process as the
engine, on its own ``ModelRunner`` and paged KV cache (a private block pool),
and proposes greedily. One ``propose_many`` call serves all sequences of a
step as batches::

    round 1     each sequence's tokens the draft cache lacks (its prefix that
                still matches what the cache saw is kept), as one prefill
                chunk per sequence, sampling d1
    rounds 2..k one decode row per sequence still drafting, sampling d2..dk

The draft cache then holds the sequence's tokens and ``d1..d(k-1)``; on the
next call only what the target accepted is kept (longest common prefix), the
rest is recomputed. Any draft is safe: the target verifies every token
(``workers/engine/spec_decode.py``), so a poor draft costs speed, never
correctness. ``draft_num_layers`` cuts a copy of a model to its first N
decoder layers (self-speculation), written once into the cache folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from cluster.shared.cache import cache_root
from cluster.shared.types import SamplingParams
from workers.engine.block_pool import BlockPool
from workers.engine.outputs import ScheduledRequest, SchedulerOutput
from workers.runner import ModelRunner

if TYPE_CHECKING:
    from cluster.shared.config import EngineConfig

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class _DraftState:
    seen: list[int] = field(default_factory=list)  # tokens whose KV is in the draft cache, in order
    blocks: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy proposals of a draft model (see the module doc).

    Args:
        runner: The draft model's runner (its KV cache: ``runner.num_kv_blocks``
            blocks of ``runner.block_size`` tokens).
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.pool = BlockPool(runner.num_kv_blocks, runner.block_size, enable_caching=False)
        self._states: dict[str, _DraftState] = {}

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        return self.propose_many([(request_id, token_ids, k)])[0]

    def propose_many(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        live: list[tuple[int, _DraftState, list[int], int]] = []  # (index, state, tokens, k)
        for i, (rid, tokens, k) in enumerate(requests):
            state = self._states.setdefault(rid, _DraftState())
            keep = _common_prefix(state.seen, tokens, len(tokens) - 1)  # the last token is always fed
            del state.seen[keep:]
            if not self._reserve(state, len(tokens) + k - 1):
                continue  # the draft cache is full: no proposal for this one now
            live.append((i, state, list(tokens), k))
        if not live:
            return out
        # Round 1: catch up and sample d1; then one decode row per drafting sequence.
        feeds = [(state, tokens[len(state.seen):], tokens) for _, state, tokens, _ in live]
        for round_index in range(max(k for *_, k in live)):
            batch = [(pos, state, new, tokens) for pos, (state, new, tokens) in enumerate(feeds)
                     if new and round_index < live[pos][3]]
            if not batch:
                break
            sched = SchedulerOutput(scheduled=[
                ScheduledRequest(request_id=str(pos), input_token_ids=new, num_computed_tokens=len(state.seen),
                                 block_ids=state.blocks, num_sample_tokens=1, sampling_params=_GREEDY,
                                 prompt_token_ids=tokens, output_token_ids=())
                for pos, state, new, tokens in batch])
            sampled = self.runner.execute(sched).sampled_token_ids
            for (pos, state, new, tokens), token in zip(batch, sampled):
                state.seen.extend(new)
                out[live[pos][0]].append(token[0])
                feeds[pos] = (state, [token[0]], tokens)
        return out

    def drop(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None and state.blocks:
            self.pool.free(reversed(state.blocks))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _reserve(self, state: _DraftState, num_tokens: int) -> bool:
        """Grows ``state``'s block table to hold ``num_tokens`` positions."""
        missing = -(-num_tokens // self.block_size) - len(state.blocks)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return False
        state.blocks.extend(blocks)
        return True


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def truncated_copy(model_dir: Path, num_layers: int) -> Path:
    """A copy of ``model_dir`` with only its first ``num_layers`` decoder
    layers (config, weights, tokenizer), written once under the cache folder."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from workers.model.loader import weight_files

    config = json.loads((model_dir / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if num_layers >= total:
        raise ValueError(f"speculative_config draft_num_layers must be below the model's {total} layers, "
                         f"got {num_layers}")
    from cluster.shared.fingerprint import model_fingerprint

    # Named by the weights, not the folder: two models in folders of one name never share a copy.
    dest = cache_root() / "draft" / f"{model_dir.name}-{model_fingerprint(model_dir)[:16]}-layers{num_layers}"
    if (dest / "config.json").is_file():
        return dest
    logger.info("writing %s: the first %d of %d layers of %s", dest, num_layers, total, model_dir)
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                layer = _layer_index(name)
                if layer is None or layer < num_layers:
                    tensors[name] = f.get_tensor(name).contiguous()
    save_file(tensors, str(tmp / "model.safetensors"))
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / extra).is_file():
            shutil.copy(model_dir / extra, tmp / extra)
    try:
        tmp.rename(dest)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / "config.json").is_file():
            raise
    return dest


def _layer_index(name: str) -> Optional[int]:
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def build_draft_proposer(config: "EngineConfig", target_dir: Path, target_vocab_size: int,
                         num_kv_blocks: int) -> DraftModelProposer:
    """Loads the draft model of ``config.speculative`` (float weights, eager,
    the target's dtype, device and kernels) with a KV cache of as many tokens
    as the target's.

    Raises:
        ValueError: The draft's vocabulary differs from the target's, or
            ``draft_num_layers`` is not below its layer count.
    """
    import dataclasses

    from workers.model.loader import read_arch, resolve_model
    from workers.provision import load_model_for, pick_device

    spec = config.speculative
    assert spec is not None and spec.method == "draft_model"
    draft_dir = resolve_model(spec.model) if spec.model else target_dir
    if spec.draft_num_layers is not None:
        draft_dir = truncated_copy(draft_dir, spec.draft_num_layers)
    arch = read_arch(draft_dir)
    if arch.vocab_size != target_vocab_size:
        raise ValueError(f"the draft model {draft_dir} has a vocabulary of {arch.vocab_size} tokens, the target "
                         f"{target_vocab_size}: a draft model must share the target's tokenizer")
    draft_config = dataclasses.replace(
        config, model=str(draft_dir), quantization=None, quantization_group_size=None, enforce_eager=True,
        speculative_config=None, cache=dataclasses.replace(config.cache, kv_cache_dtype="auto"))
    device = pick_device(config)
    model, arch, dtype = load_model_for(draft_config, draft_dir, device)
    runner = ModelRunner(model, num_layers=arch.num_hidden_layers, num_kv_heads=arch.num_key_value_heads,
                         head_dim=arch.head_dim, block_size=config.cache.block_size, num_kv_blocks=num_kv_blocks,
                         num_cpu_blocks=0, dtype=dtype, device=device, seed=config.seed)
    logger.info("draft model %s: %d layers, %d KV blocks (%.2f GiB)", draft_dir.name, arch.num_hidden_layers,
                num_kv_blocks, runner.kv_cache_bytes / 2**30)
    return DraftModelProposer(runner)
