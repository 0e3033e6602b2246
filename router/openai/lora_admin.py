"""vLLM's run-time adapter endpoints, with ``allow_runtime_lora_updating``::

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql", "model": "<base>"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

A load is checked by one replica first (it reads the folder: a missing or
corrupt adapter, a rank above ``max_lora_rank``, shapes that do not fit are
400 with its reason, and nothing is registered), then registered for every
router (``router/lora_registry.py``); requests may name it at once. An
unload refuses new requests naming it at once; replicas drop its weights
within seconds (``workers/lora/registry_sync.py``). Adapters of ``lora_modules`` are fixed: neither replaced
nor unloaded here. With API keys on, only a tenant with ``lora_admin: true``
may call these (403 otherwise). Answers as vLLM's: plain text on success.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from cluster.shared.types import LoRARequest
from router.errors import NoReplicaError
from router.models import ModelNotFoundError
from router.openai.protocol import APIError, backend_error, bad_request, error_response


class LoRAAdmin:
    """The two endpoints over an ``OpenAIServer`` (its backends, security and body reader)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    async def load(self, request: Request) -> Response:
        try:
            backend, name, body = await self._prepare(request)
            path = body.get("lora_path")
            if not isinstance(path, str) or not path:
                raise bad_request("lora_path must be the adapter's folder (a string)", "lora_path")
            runtime = backend.model.runtime
            if name in backend.model.lora.modules:
                raise bad_request(f"the LoRA adapter {name!r} comes from lora_modules and cannot be replaced at "
                                  "run time", "lora_name")
            if name in self.server.backends.names:
                raise bad_request(f"{name!r} is the name of a served model: choose another lora_name", "lora_name")
            await runtime.maybe_refresh()
            generation = runtime.next_generation()
            check = getattr(backend, "check_adapter", None)
            if check is not None:  # one replica reads it now: a bad adapter is never registered
                await check(LoRARequest(name, generation, path))
            await runtime.add(name, path, generation)
        except Exception as exc:  # noqa: BLE001 - mapped below; anything else is a 500
            return self._error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        try:
            backend, name, _ = await self._prepare(request)
            if name in backend.model.lora.modules:
                raise bad_request(f"the LoRA adapter {name!r} comes from lora_modules and cannot be unloaded at "
                                  "run time", "lora_name")
            if not await backend.model.runtime.remove(name):
                raise APIError(404, f"the LoRA adapter {name!r} was not loaded at run time", "lora_name",
                               code="model_not_found")
        except Exception as exc:  # noqa: BLE001
            return self._error(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _prepare(self, request: Request) -> tuple[Any, str, dict]:
        security = self.server.security
        if security is not None:
            tenant = security.tenant_of(request.headers.get("authorization"))
            if tenant is not None and not tenant.lora_admin:
                raise APIError(403, f"tenant {tenant.name!r} may not load or unload LoRA adapters: use a key of a "
                               "tenant with lora_admin: true", type_="permission_error", code="forbidden")
        body = await self.server._json(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name or ":" in name or "/" in name:
            raise bad_request("lora_name must be a non-empty string without ':' or '/'", "lora_name")
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or model not in self.server.backends.names):
            raise APIError(404, f"the model {model!r} does not exist: this server serves "
                           f"{', '.join(repr(n) for n in self.server.backends.names)}", "model",
                           code="model_not_found")
        backend = self.server.backends.pick(model)
        info = backend.model
        if info.lora is None or info.runtime is None:
            raise APIError(404, f"run-time LoRA loading is off for the model {info.name!r}: start it with "
                           "--enable-lora --allow-runtime-lora-updating", code="not_found")
        return backend, name, body

    @staticmethod
    def _error(exc: Exception) -> Response:
        if isinstance(exc, APIError):
            return error_response(exc)
        if isinstance(exc, PermissionError):
            return error_response(APIError(401, str(exc), code="invalid_api_key"))
        from router.lora_registry import RegistryUnavailable

        if isinstance(exc, (RegistryUnavailable, NoReplicaError)):
            return error_response(APIError(503, str(exc), type_="service_unavailable", code="unavailable"))
        if isinstance(exc, ValueError):  # the replica's reason the adapter cannot load
            return error_response(APIError(400, str(exc), "lora_path"))
        mapped = backend_error(exc) if isinstance(exc, ModelNotFoundError) else None
        if mapped is None:
            raise exc
        return error_response(mapped)
