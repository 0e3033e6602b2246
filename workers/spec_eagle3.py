"""EAGLE-3 proposals in the model runner (``speculative_config={"method":
"eagle3", "model": PATH}``; the draft layer: ``workers/model/eagle3.py``).

Everything but the features is EAGLE-1's proposer (``workers/spec_eagle.py``):
the catch-up of every kept row, the draft's own paged KV cache keyed by the
target's block tables, all sequences batched per draft position, the lazy
catch-up backlog, EAGLE-2's dynamic trees (``spec_eagle_tree.py``). What
differs:

- the rows a draft row reads are the residual stream entering three target
  layers (``Eagle3Draft.aux_layer_ids``), concatenated [T, 3H], not the final
  hidden state. ``AuxHiddenCapture`` takes them with forward pre-hooks on
  those layers of the module path, so the target's code is unchanged and the
  hooks exist only while EAGLE-3 is on; the native one-call decoder, the
  compiled stack and CUDA graphs run no Python per layer, so the runner
  steps the module path instead (the same kernels and bits: the exactness
  tests compare with the fast path off);
- guesses come from the draft's own LM head over its draft vocabulary,
  mapped to target ids by ``d2t``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from workers.engine.outputs import ScheduledRequest
from workers.model.eagle3 import Eagle3Draft
from workers.spec_eagle import EagleProposer

logger = logging.getLogger(__name__)


class AuxHiddenCapture:
    """Keeps, for the last forward pass, the residual stream entering each of
    ``layer_ids`` (the layer's ``x + residual``; the embedding for layer 0)."""

    def __init__(self, layers: torch.nn.ModuleList, layer_ids: tuple[int, ...]) -> None:
        self.layer_ids = tuple(layer_ids)
        self._parts: list[Optional[torch.Tensor]] = [None] * len(self.layer_ids)
        self._handles = [layers[i].register_forward_pre_hook(self._hook(j)) for j, i in enumerate(self.layer_ids)]

    def _hook(self, j: int) -> Callable:
        def hook(module: Any, args: tuple) -> None:
            x, residual = args[0], args[1]
            self._parts[j] = x if residual is None else x + residual
        return hook

    def take(self) -> torch.Tensor:
        """The last pass's features [T, 3H] (low, middle, high); held until the next pass overwrites them."""
        assert all(p is not None for p in self._parts), "no forward pass ran through the captured layers"
        return torch.cat(self._parts, dim=-1)  # type: ignore[arg-type]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class Eagle3Proposer(EagleProposer):
    """``EagleProposer`` over the captured features and the draft's own head."""

    def __init__(self, draft: Eagle3Draft, embed: Callable[[torch.Tensor], torch.Tensor],
                 capture: AuxHiddenCapture, num_blocks: int, block_size: int) -> None:
        super().__init__(draft, embed, draft.logits, num_blocks, block_size)
        self.capture = capture
        self.token_ids = draft.token_ids  # draft vocabulary id -> target id (d2t)

    @torch.inference_mode()
    def step_proposals(self, step: tuple, reqs: list[ScheduledRequest], paths: list[list[int]],
                       sampled: list[list[int]]) -> Optional[list[Optional[list[list[int]]]]]:
        """``EagleProposer.step_proposals`` with the step's fused features for its hidden states."""
        return super().step_proposals((self.capture.take(), *step[1:]), reqs, paths, sampled)


def attach_eagle3(runner: Any, folder: Optional[str], arch: Any) -> Any:
    """Loads an EAGLE-3 draft onto a local runner, hooks the target layers it
    reads and switches the target to its module path (module doc); returns
    the proposer that hands the proposals to the scheduler."""
    from workers.engine.proposers import RunnerProposer

    if arch.embed_scale != 1.0 or arch.final_logit_softcapping is not None or arch.sandwich_norms:
        raise ValueError(f"speculative_config method 'eagle3' supports Llama-family targets; {arch.family} "
                         "scales its embeddings or logits or norms its sublayers' outputs")
    draft = Eagle3Draft.load(Path(folder or ""), arch)
    model = runner.model
    dtype = next(model.parameters()).dtype
    own_embed = draft.embed
    draft = draft.to(device=runner.device, dtype=dtype)
    draft.inv_freq = draft.inv_freq.float()
    if own_embed is not None:
        weight = own_embed.to(device=runner.device, dtype=dtype)
        def embed(ids: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.embedding(ids, weight)
    else:
        embed = model.model.embed_tokens  # type: ignore[assignment]
    fast = [name for name, on in (("compiled stack", model.compiled is not None),
                                  ("native decoder", model.native_decoder is not None),
                                  ("CUDA graphs", runner.graphs is not None)) if on]
    model.compiled, model.native_decoder, runner.graphs = None, None, None
    capture = AuxHiddenCapture(model.model.layers, draft.aux_layer_ids)
    proposer = Eagle3Proposer(draft, embed, capture, runner.num_kv_blocks, runner.block_size)
    runner.medusa = proposer
    logger.info("EAGLE-3 draft from %s: features of target layers %s, a draft vocabulary of %d tokens, its KV "
                "cache %.1f MiB%s", folder, list(draft.aux_layer_ids), len(draft.d2t), proposer.kv_cache_bytes / 2**20,
                f"; the target steps its module path ({', '.join(fast)} off: they run no Python per layer)"
                if fast else "")
    return RunnerProposer()
