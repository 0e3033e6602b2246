"""What loading an adapter costs this replica, in the routers' unit: prefill
tokens (``router/policies/prefix_cost.py``).

A request whose adapter a replica does not hold waits for its load; the
router weighs that wait against queueing on a holder. Both sides of the
price are measured here rather than configured, because both vary by
orders of magnitude between fleets (a rank-16 adapter reads in 5-50 ms on a
CPU node's disk, a GPU node prefills hundreds of times faster than 2 CPU
cores)::

    load_tokens = mean load seconds  x  prefill tokens per second

    mean load seconds   EWMA (weight LOAD_WEIGHT) of each load's read +
                        install time (LoRAManager.load)
    prefill tokens/s    EWMA (weight RATE_WEIGHT) of the engine's steps of
                        at least MIN_PREFILL_TOKENS batched tokens (prefill
                        chunks; decode steps would price a token at a decode
                        row's cost, several times a prefill token's)

``load_tokens`` is 0 until both are measured; the router then uses its
configured ``adapter_load_tokens``. The replica publishes it in its routing
stats (``ReplicaStats.lora_load_tokens``).
"""

from __future__ import annotations

LOAD_WEIGHT = 0.3  # weight of the newest load in the mean: a few loads settle it
RATE_WEIGHT = 0.1  # weight of the newest prefill step in the rate
MIN_PREFILL_TOKENS = 64  # batched tokens of a step that counts as a prefill step
MAX_PENDING = 1024  # load times kept for the metrics (an engine without metrics never takes them)


class LoadCost:
    """The measured load time and prefill rate (module doc). Engine thread writes;
    any thread may read ``load_tokens`` (floats replaced whole)."""

    def __init__(self) -> None:
        self.mean_load_s = 0.0
        self.prefill_tokens_per_s = 0.0
        self._pending: list[float] = []  # load seconds not yet taken by the metrics

    def observe_load(self, seconds: float) -> None:
        """One adapter load took ``seconds`` (read and install)."""
        self.mean_load_s = seconds if not self.mean_load_s else (
            (1 - LOAD_WEIGHT) * self.mean_load_s + LOAD_WEIGHT * seconds)
        self._pending.append(seconds)
        del self._pending[:-MAX_PENDING]

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """An engine step computed ``num_tokens`` batched tokens in ``seconds``."""
        if num_tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        rate = num_tokens / seconds
        self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else (
            (1 - RATE_WEIGHT) * self.prefill_tokens_per_s + RATE_WEIGHT * rate)

    @property
    def load_tokens(self) -> float:
        """A load's wait in prefill tokens (0: not measured yet)."""
        return self.mean_load_s * self.prefill_tokens_per_s

    def take_load_seconds(self) -> list[float]:
        """Each load's seconds since the last call (drains; every load is observed once)."""
        taken, self._pending = self._pending, []
        return taken
