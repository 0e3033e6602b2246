"""Token-level stops: when a sequence ends after a token, and which tokens
``min_tokens`` bans from the sampler until then.

Stop strings are the engine's (they need text); everything that a token id
alone decides is here: EOS (unless ``ignore_eos``), ``stop_token_ids``,
``max_tokens``, ``max_model_len``, and a grammar that rejects the token.
"""

from __future__ import annotations

from typing import Iterable, Optional

from cluster.shared.types import FinishReason
from workers.engine.sequence import Sequence


class TokenStops:
    """The stop rule of one engine.

    Args:
        eos_token_ids: Tokens that end a sequence unless ``ignore_eos``.
        max_model_len: Longest prompt + output; reaching it ends a sequence.
    """

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._sorted_eos = tuple(sorted(self.eos_token_ids))
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, token_id: int) -> Optional[FinishReason]:
        """Why ``seq`` ends after appending ``token_id`` (None: it goes on);
        a sequence with a grammar advances it by the token first (mutates it)."""
        params = seq.sampling_params
        if seq.grammar is not None and not seq.grammar.accept(token_id):
            # The masks make this unreachable; a sequence is never continued outside its grammar.
            seq.finish_message = (f"request {seq.request_id!r}: token {token_id} is outside its "
                                  "structured-output grammar; the output so far is returned")
            return FinishReason.ABORT
        if seq.num_output_tokens > params.min_tokens:  # min_tokens: the sampler banned them before
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def min_tokens_banned(self, seq: Sequence) -> tuple[int, ...]:
        """The tokens the sampler must not pick for ``seq``'s next token: EOS
        and ``stop_token_ids`` while fewer than ``min_tokens`` are out."""
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else self._sorted_eos
        return eos + params.stop_token_ids
