"""What a verified draft token costs: the step-time model adaptive
speculation prices proposals with (``Speculator.depth_limit``)."""

from __future__ import annotations

from collections import deque
from typing import Optional


class StepCostModel:
    """Step time as ``base + a * tokens + b * draft_tokens``: ``tokens`` the
    step's own (prefill chunks, one per decode), ``draft_tokens`` the
    speculated ones it verifies. Least squares over the last ``window`` steps,
    each coefficient pulled towards a prior by a ridge of ``RIDGE`` (tokens²),
    so a direction the steps have not varied in stays at its prior: ``a`` at
    0 (every step the same size: ``base`` is the step), ``b`` at
    ``prior_draft_fraction`` of the mean step (cheap drafts, as on a
    memory-bound decode) until drafts have been tried and measured. ``b``
    never falls below ``min_draft_fraction`` of the mean step: over the first
    few steps (prefill chunks and drafts both varying) the fit can put a
    draft's whole cost on ``a`` and solve ``b`` to zero or below, which would
    read as "drafts are free" and have every sequence ask for its longest
    draft (seen with EAGLE at batch 8: the guesses asked, then dropped).
    """

    RIDGE = 1.0

    def __init__(self, window: int = 256, prior_draft_fraction: float = 0.02,
                 min_draft_fraction: float = 0.005) -> None:
        self._steps: deque[tuple[int, int, float]] = deque()
        self.window = window
        self.prior_draft_fraction = prior_draft_fraction
        self.min_draft_fraction = min_draft_fraction
        # Running sums of the normal equations of [1, x1, x2] -> y over the window.
        self._s = [[0.0] * 3 for _ in range(3)]
        self._r = [0.0] * 3
        self._fit: Optional[tuple[float, float, float]] = None  # solved lazily, once per new step

    def observe(self, num_tokens: int, num_draft_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        self._steps.append((num_tokens, num_draft_tokens, seconds))
        self._add(num_tokens, num_draft_tokens, seconds, 1.0)
        if len(self._steps) > self.window:
            self._add(*self._steps.popleft(), -1.0)
        self._fit = None

    def _add(self, x1: float, x2: float, y: float, sign: float) -> None:
        row = (1.0, float(x1), float(x2))
        for i in range(3):
            self._r[i] += sign * row[i] * y
            for j in range(3):
                self._s[i][j] += sign * row[i] * row[j]

    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def fit(self) -> Optional[tuple[float, float, float]]:
        """``(base, a, b)`` in seconds (per step, per token, per draft token);
        None before any step."""
        if not self._steps:
            return None
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float, float]:
        n = len(self._steps)
        mean_y = self._r[0] / n
        prior = (0.0, 0.0, self.prior_draft_fraction * mean_y)
        s = [row[:] for row in self._s]
        r = self._r[:]
        for i in (1, 2):  # the ridge on a and b, towards their priors
            s[i][i] += self.RIDGE
            r[i] += self.RIDGE * prior[i]
        solved = _solve3(s, r)
        if solved is None:
            return mean_y, 0.0, prior[2]
        base, a, b = solved
        return max(base, 0.0), max(a, 0.0), max(b, self.min_draft_fraction * mean_y)


def _solve3(m: list[list[float]], v: list[float]) -> Optional[tuple[float, float, float]]:
    """Solves the 3x3 system ``m x = v`` (Cramer's rule); None if singular."""
    def det(a: list[list[float]]) -> float:
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
                - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))

    d = det(m)
    if abs(d) < 1e-12 * max(1.0, abs(m[0][0] * m[1][1] * m[2][2])):
        return None
    out = []
    for col in range(3):
        swapped = [[v[i] if j == col else m[i][j] for j in range(3)] for i in range(3)]
        out.append(det(swapped) / d)
    return out[0], out[1], out[2]
