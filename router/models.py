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
    backends.pick("sql-lora")   # the backend of the model serving that LoRA adapter (also "smollm:sql-lora")
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
        self._backends = dict(backends)
        self.default_name = next(iter(self._backends), None)
        self.response_store: Any = None  # /v1/responses (router/openai/response_store.py); set by its builder

    @classmethod
    def of(cls, backend: Any) -> "ModelBackends":
        """``backend`` as it is when already a ``ModelBackends``, else the only
        model of one (None: no model, e.g. a server of ``/metrics`` only)."""
        if isinstance(backend, ModelBackends):
            return backend
        return cls({backend.model.name: backend} if backend is not None else {})

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
        if self.default_name is None:
            raise ModelNotFoundError("this server serves no model")
        if name is None or name == "":
            return self._backends[self.default_name]
        if not isinstance(name, str):
            raise ValueError(f"model must be a string, got {name!r}")
        backend = self._backends.get(name)
        if backend is None:  # a LoRA adapter's name, or <model>:<adapter>
            backend = next((b for b in self if b.model.adapter_of(name) is not None), None)
        if backend is None:
            served = ", ".join([repr(n) for n in self._backends]
                               + [repr(a) for b in self for a in b.model.adapters])
            raise ModelNotFoundError(f"the model {name!r} does not exist: this server serves {served}; "
                                     "pass one of them as model")
        return backend

    async def refresh_adapters(self) -> None:
        """Brings each model's run-time LoRA adapters up to date when due
        (``router/lora_registry.py``; a time check otherwise)."""
        for backend in self:
            runtime = getattr(backend.model, "runtime", None)
            if runtime is not None:
                await runtime.maybe_refresh()

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


class ModelDirectories:
    """The prefix directories of several models (one namespace each), as
    ``ListReplicas`` and the router's shutdown use one.

    Args:
        directories: ``{model name: Directory}`` (None entries are skipped).
    """

    def __init__(self, directories: Mapping[str, Any]) -> None:
        self.directories = {name: d for name, d in directories.items() if d is not None}

    async def replica_stats(self) -> dict[str, dict]:
        """Every model's live replicas, each with its ``model`` name among its stats."""
        merged: dict[str, dict] = {}
        names = list(self.directories)
        for name, stats in zip(names, await asyncio.gather(*(self.directories[n].replica_stats() for n in names))):
            merged.update({rid: {**figures, "model": name} for rid, figures in stats.items()})
        return merged

    async def aclose(self) -> None:
        await asyncio.gather(*(d.aclose() for d in self.directories.values()), return_exceptions=True)


class ModelMetrics:
    """``GET /metrics`` of several models: each model's ``ClusterMetrics``
    (its router series and its replicas'), merged family by family, every
    series labelled with its ``model`` (the replicas' carry it already).

    Args:
        metrics: ``{model name: router.metrics.ClusterMetrics}``.
    """

    def __init__(self, metrics: Mapping[str, Any]) -> None:
        self.metrics = dict(metrics)

    @property
    def router(self) -> Any:
        """The first model's router metrics (where the per-tenant series are counted)."""
        return next(iter(self.metrics.values())).router

    async def render(self) -> bytes:
        from prometheus_client.parser import text_string_to_metric_families

        from cluster.shared.metrics_format import render_families

        texts = await asyncio.gather(*(m.render() for m in self.metrics.values()))
        families: dict[str, Any] = {}
        for name, text in zip(self.metrics, texts):
            for family in text_string_to_metric_families(text.decode()):
                family.samples = [s if "model" in s.labels else s._replace(labels={**s.labels, "model": name})
                                  for s in family.samples]
                merged = families.get(family.name)
                if merged is None:
                    families[family.name] = family
                elif merged.type == family.type:
                    merged.samples.extend(family.samples)
        return render_families(families.values())

    async def release(self) -> None:
        await asyncio.gather(*(m.release() for m in self.metrics.values() if hasattr(m, "release")))
