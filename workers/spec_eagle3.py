"""EAGLE-3 proposals in the model runner (``speculative_config={"method":
"eagle3", "model": PATH}``; the draft layer: ``workers/model/eagle3.py``).

Everything but the features is EAGLE-1's proposer (``workers/spec_eagle.py``):
the catch-up of every kept row, the draft's own paged KV cache keyed by the
target's block tables, all sequences batched per draft position, the lazy
catch-up backlog, EAGLE-2's dynamic trees (``spec_eagle_tree.py``). What
differs:

- the rows a draft row reads are the residual stream entering three target
  layers (``Eagle3Draft.aux_layer_ids``), concatenated [T, 3H], not the final
  hidden state. ``AuxHiddenCapture`` takes them, only while EAGLE-3 is on,
  with forward pre-hooks on those layers of the module path and, where the
  native decoder runs (the CPU float32 default), its ``aux_capture``: the
  one-call decode step copies the three streams in C (``decoder_step.c``),
  the per-layer loop (prefill, mixed steps) hands each to
  ``native_layer``. The compiled stack and CUDA graphs
  run no Python per layer, so they are turned off (module path instead);
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
    """Keeps, for the last forward pass of ``model`` (a ``LlamaForCausalLM``),
    the residual stream entering each of ``layer_ids`` (the layer's ``x +
    residual``; the embedding for layer 0), on the module path and the native
    decoder's per-layer loop alike."""

    def __init__(self, model: Any, layer_ids: tuple[int, ...], active: Callable[[], bool] = lambda: True) -> None:
        self.layer_ids = tuple(layer_ids)
        self.active = active  # False: the passes run as without EAGLE-3 (bench spec's other modes)
        self._parts: list[Optional[torch.Tensor]] = [None] * len(self.layer_ids)
        layers = model.model.layers
        self._handles = [layers[i].register_forward_pre_hook(self._hook(j)) for j, i in enumerate(self.layer_ids)]
        self._native = model.native_decoder
        if self._native is not None:
            self._native.aux_capture = lambda: self if self.active() else None

    def _hook(self, j: int) -> Callable:
        def hook(module: Any, args: tuple) -> None:
            if not self.active():
                return
            x, residual = args[0], args[1]
            # Layer 0's input is the embedding, which becomes the stream that later layers add to in place.
            self._parts[j] = x.clone() if residual is None else x + residual
        return hook

    def native_layer(self, i: int, stream: torch.Tensor) -> None:
        """The native decoder's per-layer loop: ``stream`` enters layer ``i``."""
        for j, layer in enumerate(self.layer_ids):
            if layer == i:
                self._parts[j] = stream.clone()  # the decoder adds to it in place

    def native_step(self, features: torch.Tensor) -> None:
        """The native one-call decode step copied the streams into ``features`` [len(layer_ids), T, H]."""
        self._parts = list(features.unbind(0))

    def take(self) -> torch.Tensor:
        """The last pass's features [T, 3H] (low, middle, high); held until the next pass overwrites them."""
        assert all(p is not None for p in self._parts), "no forward pass ran through the captured layers"
        return torch.cat(self._parts, dim=-1)  # type: ignore[arg-type]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self._native is not None:
            self._native.aux_capture = None


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
                                  ("CUDA graphs", runner.graphs is not None)) if on]
    model.compiled, runner.graphs = None, None
    capture = AuxHiddenCapture(model, draft.aux_layer_ids, active=lambda: runner.medusa is proposer)
    proposer = Eagle3Proposer(draft, embed, capture, runner.num_kv_blocks, runner.block_size)
    runner.medusa = proposer
    logger.info("EAGLE-3 draft from %s: features of target layers %s, a draft vocabulary of %d tokens, its KV "
                "cache %.1f MiB%s", folder, list(draft.aux_layer_ids), len(draft.d2t), proposer.kv_cache_bytes / 2**20,
                f"; {' and '.join(fast)} off (they run no Python per layer)" if fast else "")
    return RunnerProposer()
