"""Several served models behind one pair of front ends: the request's
``model`` picks the backend.

A cluster serves one model (one ``RouterBackend``) or several (``models:`` in
the cluster config, Ray Serve LLM's list of ``LLMConfig`` in one OpenAI
app). Each model has its own replica deployment, tokenizer, limits, routing
policy and prefix-directory namespace, so each has its own backend; the
front ends hold a ``ModelBackends`` and ask it for the request's::

    backends = ModelBackends({"smollm": backend_a, "tiny": backend_b})
    backends.pick("tiny")       # backend_b
    backends.pick(None)         # backend_a: a request that names no model gets the first
    backends.pick("gpt-4")      # ModelNotFoundError: 404 model_not_found / NOT_FOUND,
                                # the message names the served models

Draining (a router stopping) drains every model's backend: each refuses new
requests and the running streams of all of them get the same grace.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterator, Mapping, Optional


class ModelNotFoundError(LookupError):
    """The request names a model this cluster does not serve (HTTP 404, gRPC NOT_FOUND)."""


class ModelBackends:
    """The backends of the served models, by the name clients pass as ``model``.

    Args:
        backends: ``{served name: Backend}`` in the order the config lists
            them; the first serves requests that name no model.
    """

    def __init__(self, backends: Mapping[str, Any]) -> None:
        if not backends:
            raise ValueError("ModelBackends needs at least one model")
        self._backends = dict(backends)
        self.default_name = next(iter(self._backends))

    @classmethod
    def of(cls, backend: Any) -> "ModelBackends":
        """``backend`` as it is when already a ``ModelBackends``, else the only model of one."""
        if isinstance(backend, ModelBackends):
            return backend
        return cls({backend.model.name: backend})

    @property
    def names(self) -> list[str]:
        """The served names, the default first."""
        return list(self._backends)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._backends.values())

    def __len__(self) -> int:
        return len(self._backends)

    def pick(self, name: Optional[str]) -> Any:
        """The backend of the model ``name`` (None or empty: the default model).

        Raises:
            ValueError: ``name`` is not a string.
            ModelNotFoundError: No served model has that name; the message lists them.
        """
        if name is None or name == "":
            return self._backends[self.default_name]
        if not isinstance(name, str):
            raise ValueError(f"model must be a string, got {name!r}")
        backend = self._backends.get(name)
        if backend is None:
            served = ", ".join(repr(n) for n in self._backends)
            raise ModelNotFoundError(f"the model {name!r} does not exist: this server serves {served}; "
                                     "pass one of them as model")
        return backend

    @property
    def draining(self) -> bool:
        """Whether this router drains (every backend refuses new requests)."""
        return any(getattr(b, "draining", False) for b in self)

    @property
    def num_inflight(self) -> int:
        """Streams running over every model."""
        return sum(getattr(b, "num_inflight", 0) for b in self)

    async def drain(self, timeout_s: float) -> int:
        """Drains every backend at once; returns the streams still running."""
        left = await asyncio.gather(*(b.drain(timeout_s) for b in self if hasattr(b, "drain")))
        return sum(left)
