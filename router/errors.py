"""The errors a request can end with besides bad input (``ValueError``), as the
front ends map them (``router/backend.py`` has the table):

    OverloadedError   queues are full      RESOURCE_EXHAUSTED / HTTP 429 (+ retry hint)
    NoReplicaError    no live replica      UNAVAILABLE / HTTP 503
"""

from __future__ import annotations

DEFAULT_RETRY_AFTER_S = 1.0


class OverloadedError(RuntimeError):
    """The cluster cannot take the request now; the client should retry later.

    Args:
        message: Which bound was hit.
        retry_after_s: The retry hint sent to the client.
    """

    def __init__(self, message: str, retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoReplicaError(RuntimeError):
    """No replica is running (or all are restarting)."""
