"""Request rate per prefix, as one router sees it: an exponentially decaying
count per prefix key (the request's first block hash), bounded in memory.

After each observation at time t the estimate is

    rate = rate * exp(-(t - t_last) / window_s) + 1 / window_s

which converges to λ for steady arrivals at λ/s and decays to 0 within a
few windows once a prefix goes quiet. The least recently seen keys are
dropped beyond ``max_keys`` (a dropped key restarts from 0: at worst a hot
prefix is replicated a window later).
"""

from __future__ import annotations

import math
from collections import OrderedDict


class PrefixRates:
    """Decaying per-key request rates (see module doc).

    Args:
        window_s: Time constant of the decay, seconds (> 0).
        max_keys: Keys kept (>= 1).
    """

    def __init__(self, window_s: float = 10.0, max_keys: int = 4096) -> None:
        if not window_s > 0 or max_keys < 1:
            raise ValueError(f"window_s must be > 0 and max_keys >= 1, got {window_s!r}, {max_keys!r}")
        self.window_s = float(window_s)
        self.max_keys = max_keys
        self._rates: "OrderedDict[bytes, tuple[float, float]]" = OrderedDict()

    def observe(self, key: bytes, now: float) -> float:
        """Counts one request for ``key`` at ``now`` and returns its rate (1/s)."""
        rate, last = self._rates.pop(key, (0.0, now))
        rate = rate * math.exp(-max(0.0, now - last) / self.window_s) + 1.0 / self.window_s
        self._rates[key] = (rate, now)
        while len(self._rates) > self.max_keys:
            self._rates.popitem(last=False)
        return rate

    def __len__(self) -> int:
        return len(self._rates)
