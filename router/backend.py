"""What the gRPC and HTTP front ends share: turning a validated request into
a stream of chunks from the replicas through Ray Serve.

``RouterBackend`` owns the Serve handle of the replica deployment (whose
request router applies the routing policy) and the router tokenizer. Front
ends convert their wire format into a ``GenerationRequest`` (tokenizing and
rendering chat templates here, never in a replica), call ``stream()``, and
map errors to their status codes:

    ValueError             bad input            INVALID_ARGUMENT / HTTP 400
    OverloadedError        queues are full      RESOURCE_EXHAUSTED / HTTP 429
    NoReplicaError         no live replica      UNAVAILABLE / HTTP 503

Cancelling the consumer of ``stream()`` cancels the Serve response, and the
replica aborts the sequence and frees its blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Protocol

from cluster.types import GenerationRequest, StreamChunk
from router.tokenizer import RouterTokenizer

logger = logging.getLogger(__name__)


class OverloadedError(RuntimeError):
    """Every replica's queue is full; the client should retry later."""


class NoReplicaError(RuntimeError):
    """No replica is running (or all are restarting)."""


@dataclass(frozen=True)
class ModelInfo:
    """What front ends report about the served model."""

    name: str
    max_model_len: int


class Backend(Protocol):
    """The interface front ends use (tests may pass a fake)."""

    tokenizer: RouterTokenizer
    model: ModelInfo

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]: ...


class RouterBackend:
    """Streams requests to replicas through a Serve deployment handle.

    Args:
        handle: ``DeploymentHandle`` of the replica deployment.
        tokenizer: The model's router tokenizer.
        model: Name and limits of the served model.
    """

    def __init__(self, handle: Any, tokenizer: RouterTokenizer, model: ModelInfo) -> None:
        self.handle = handle
        self.tokenizer = tokenizer
        self.model = model

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Yields the request's chunks; the last one has a finish reason.

        Raises:
            ValueError: The replica rejected the request as invalid.
            OverloadedError: Serve could not queue it anywhere.
            NoReplicaError: No replica is available.
        """
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        response = self.handle.options(stream=True, method_name="generate").remote(request)
        try:
            async for chunk in response:
                yield chunk
        except BackPressureError as exc:
            raise OverloadedError(f"all replicas are at capacity, retry later: {exc}") from exc
        except DeploymentUnavailableError as exc:
            raise NoReplicaError(f"no replica is available: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - unwrap user errors raised in the replica
            cause = _user_error(exc)
            if cause is not None:
                raise cause from exc
            raise
        finally:
            response.cancel()  # no-op when finished; aborts the sequence otherwise


def _user_error(exc: BaseException) -> Optional[ValueError]:
    """The replica's ValueError inside Ray's task-error wrapper, if any."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ValueError):
        return exc
    if isinstance(cause, ValueError):
        return cause
    return None
