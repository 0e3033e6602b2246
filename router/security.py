"""TLS and bearer-token authentication of both front ends, and of their clients.

Server side, one ``Security`` for the gRPC and the HTTP front end::

    security = Security(
        tls=TLSFiles("server.crt", "server.key", client_ca_file="clients.crt"),  # mTLS if a CA is given
        api_keys=ApiKeys.load(["key-1"], key_file="/etc/prefixserve/keys"),
    )
    RouterServer(backend, security=security)     # ssl_server_credentials + BearerAuthInterceptor
    await serve_openai(backend, security=security)  # uvicorn TLS + BearerAuthMiddleware

With API keys set, a gRPC call needs the metadata ``authorization: Bearer
<key>`` (else ``UNAUTHENTICATED``) and an HTTP request the header
``Authorization: Bearer <key>`` (else 401 with an OpenAI error body and
``WWW-Authenticate: Bearer``). Health (``grpc.health.v1.Health``, HTTP
``/health``) and ``/metrics`` stay open unless ``auth_health`` /
``auth_metrics`` say otherwise, so probes and Prometheus need no key.
With a tenants file (``router.tenants``) each key names its tenant, which
sets the request's cache namespace, priority cap and limits.

Keys are kept only as SHA-256 digests and compared with
``hmac.compare_digest`` against every configured key (no early exit), so the
time taken says nothing about how much of a key matched.

Client side: ``client_channel`` opens a plaintext or TLS (optionally mTLS)
``grpc.aio`` channel; ``bearer_metadata`` is the call metadata for a key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Optional, Sequence

import grpc

from router.tenants import DEFAULT_TENANT, Tenant, TenantGate, load_tenants

logger = logging.getLogger(__name__)

API_KEY_ENV = "PREFIXSERVE_API_KEY"
HEALTH_SERVICE_PREFIX = "/grpc.health.v1.Health/"
UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send the header 'authorization: Bearer <key>'"


def _read_file(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a TLS server.

    Attributes:
        cert_file: Certificate chain (``--tls-cert``).
        key_file: Private key (``--tls-key``).
        client_ca_file: CA bundle that client certificates must chain to
            (``--tls-client-ca``); set, clients without one are refused (mTLS).
    """

    cert_file: str
    key_file: str
    client_ca_file: Optional[str] = None

    def __post_init__(self) -> None:
        for flag, path in (("--tls-cert", self.cert_file), ("--tls-key", self.key_file),
                           ("--tls-client-ca", self.client_ca_file)):
            if path is not None:
                _read_file(path, flag)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Server credentials for ``add_secure_port``."""
        pair = (_read_file(self.key_file, "--tls-key"), _read_file(self.cert_file, "--tls-cert"))
        client_ca = _read_file(self.client_ca_file, "--tls-client-ca") if self.client_ca_file else None
        return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                           require_client_auth=client_ca is not None)

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.Config`` keyword arguments serving HTTPS (and requiring client certs with a CA)."""
        options: dict[str, Any] = {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}
        if self.client_ca_file:
            options.update(ssl_ca_certs=self.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options


class ApiKeys:
    """The accepted bearer tokens, as SHA-256 digests, each with its tenant.

    Args:
        keys: The tokens (non-empty, no whitespace); they belong to the
            ``default`` tenant (``router.tenants``), which changes nothing.
        tenant_keys: ``(SHA-256 digest, Tenant)`` pairs of a tenants file.

    Raises:
        ValueError: No key at all, or an empty / whitespace-containing one.
    """

    def __init__(self, keys: Iterable[str] = (), tenant_keys: Iterable[tuple[bytes, Tenant]] = ()) -> None:
        entries = []
        for i, key in enumerate(keys):
            if not isinstance(key, str) or not key or any(c.isspace() for c in key):
                raise ValueError(f"API key #{i + 1} is empty or contains whitespace: use a non-empty token")
            entries.append((hashlib.sha256(key.encode()).digest(), DEFAULT_TENANT))
        entries += list(tenant_keys)
        if not entries:
            raise ValueError("no API key given: pass --api-key, a non-empty --api-key-file or --tenants-file")
        self._entries = tuple(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} keys)"

    @property
    def tenants(self) -> list[Tenant]:
        """Every tenant a key belongs to (each once)."""
        return list({id(t): t for _, t in self._entries}.values())

    @classmethod
    def load(cls, keys: Sequence[str] = (), key_file: Optional[str] = None,
             tenants_file: Optional[str] = None) -> Optional["ApiKeys"]:
        """Keys from the command line, a file (one per line; blank lines and
        ``#`` comments skipped) and a tenants file (``router.tenants``).

        Returns:
            None when none of them is given (authentication off).

        Raises:
            ValueError: A file is unreadable, holds no key, or is invalid.
        """
        if not keys and key_file is None and tenants_file is None:
            return None
        all_keys = list(keys)
        if key_file is not None:
            text = _read_file(key_file, "--api-key-file").decode("utf-8", errors="replace")
            from_file = [line.strip() for line in text.splitlines()]
            from_file = [k for k in from_file if k and not k.startswith("#")]
            if not from_file:
                raise ValueError(f"--api-key-file {key_file} holds no key: put one key per line")
            all_keys += from_file
        tenant_keys = load_tenants(tenants_file) if tenants_file is not None else []
        known = {digest for digest, _ in tenant_keys}
        if any(hashlib.sha256(k.encode()).digest() in known for k in all_keys if isinstance(k, str)):
            raise ValueError("a key of --api-key / --api-key-file is also in --tenants-file: "
                             "list it once, under its tenant")
        return cls(all_keys, tenant_keys)

    def identify(self, authorization: Any) -> Optional[Tenant]:
        """The tenant of an ``Authorization`` value (``Bearer <key>``, str or
        bytes); None when it carries no valid key."""
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        if not isinstance(authorization, str):
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode("utf-8", errors="replace")).digest()
        found = None
        for known, tenant in self._entries:  # all of them: no early exit
            if hmac.compare_digest(known, digest):
                found = tenant
        return found

    def allows(self, authorization: Any) -> bool:
        """Whether an ``Authorization`` value carries a valid key."""
        return self.identify(authorization) is not None


@dataclass(frozen=True)
class Security:
    """TLS and authentication of a router's front ends.

    Attributes:
        tls: Serve TLS (HTTPS) with these files; None serves plaintext.
        api_keys: Require one of these bearer tokens; None requires none.
        auth_health: Require a key for health checks too.
        auth_metrics: Require a key for ``/metrics`` too.
        tenant_gate: Admits each tenant's requests (rate, open streams) in
            this router, shared by both front ends.
    """

    tls: Optional[TLSFiles] = None
    api_keys: Optional[ApiKeys] = None
    auth_health: bool = False
    auth_metrics: bool = False
    tenant_gate: TenantGate = field(default_factory=TenantGate, compare=False)

    def tenant_of(self, authorization: Any) -> Optional[Tenant]:
        """The caller's tenant (None without API keys: requests run as sent).

        Raises:
            PermissionError: Keys are required and ``authorization`` carries none
                (the interceptor / middleware refuse such calls first).
        """
        if self.api_keys is None:
            return None
        tenant = self.api_keys.identify(authorization)
        if tenant is None:
            raise PermissionError(UNAUTHENTICATED_MESSAGE)
        return tenant

    def admit(self, authorization: Any) -> tuple[Optional[Tenant], Any]:
        """The caller's tenant and its admission (``TenantGate.admit``), for
        both front ends; ``(None, None)`` without API keys.

        Raises:
            PermissionError: No valid key (see ``tenant_of``).
            OverloadedError: The tenant is over its rate or stream limit.
        """
        tenant = self.tenant_of(authorization)
        return (None, None) if tenant is None else (tenant, self.tenant_gate.admit(tenant))

    @classmethod
    def from_options(
        cls,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
        tls_client_ca: Optional[str] = None,
        api_keys: Sequence[str] = (),
        api_key_file: Optional[str] = None,
        auth_health: bool = False,
        auth_metrics: bool = False,
        tenants_file: Optional[str] = None,
    ) -> Optional["Security"]:
        """The front ends' security from plain settings (flags or the config's
        ``router`` section); None when nothing is set.

        Raises:
            ValueError: Only one of cert / key, a client CA without TLS, auth
                options without keys, or an unreadable file / empty key file /
                invalid tenants file.
        """
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key (tls_cert and tls_key)")
        if tls_client_ca is not None and tls_cert is None:
            raise ValueError("--tls-client-ca (tls_client_ca) needs TLS: set --tls-cert and --tls-key too")
        tls = TLSFiles(tls_cert, tls_key, tls_client_ca) if tls_cert else None
        keys = ApiKeys.load(api_keys or (), api_key_file, tenants_file)
        if tls is None and keys is None:
            if auth_health or auth_metrics:
                raise ValueError("--auth-health / --auth-metrics need API keys: set --api-key, --api-key-file "
                                 "or --tenants-file")
            return None
        if keys is not None and tls is None:
            logger.warning("API keys without TLS travel in plaintext: set --tls-cert and --tls-key")
        return cls(tls=tls, api_keys=keys, auth_health=auth_health, auth_metrics=auth_metrics)

    def open_http_paths(self) -> frozenset[str]:
        """HTTP paths served without a key."""
        paths = set()
        if not self.auth_health:
            paths.add("/health")
        if not self.auth_metrics:
            paths.add("/metrics")
        return frozenset(paths)

    def grpc_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The server interceptors (authentication when keys are set)."""
        if self.api_keys is None:
            return []
        return [BearerAuthInterceptor(self.api_keys, open_health=not self.auth_health)]


# ----------------------------------------------------------------- gRPC server
class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid ``authorization: Bearer <key>`` with UNAUTHENTICATED.

    Args:
        api_keys: The accepted keys.
        open_health: Let ``grpc.health.v1.Health`` through without a key.
    """

    def __init__(self, api_keys: ApiKeys, open_health: bool = True) -> None:
        self.api_keys = api_keys
        self.open_health = open_health

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if self.open_health and method.startswith(HEALTH_SERVICE_PREFIX):
            return await continuation(handler_call_details)
        authorization = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                authorization = value
                break
        handler = await continuation(handler_call_details)
        if self.api_keys.allows(authorization):
            return handler
        logger.info("refused %s: %s API key", method, "invalid" if authorization else "no")
        return _refusing(handler)


def _refusing(handler: Optional[grpc.RpcMethodHandler]) -> Optional[grpc.RpcMethodHandler]:
    """A handler of the same shape as ``handler`` that aborts with UNAUTHENTICATED."""
    if handler is None:
        return None  # unknown method: gRPC answers UNIMPLEMENTED

    async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **codec)
    return grpc.stream_stream_rpc_method_handler(refuse, **codec)


# ----------------------------------------------------------------- HTTP server
class BearerAuthMiddleware:
    """ASGI middleware: 401 (OpenAI error body) without a valid ``Authorization: Bearer <key>``.

    Args:
        app: The wrapped ASGI app.
        api_keys: The accepted keys.
        open_paths: Paths served without a key (``/health``, ``/metrics``).
    """

    def __init__(self, app: Any, api_keys: ApiKeys, open_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.api_keys = api_keys
        self.open_paths = open_paths

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        authorization = None
        for key, value in scope.get("headers", ()):
            if key.lower() == b"authorization":
                authorization = value
                break
        if self.api_keys.allows(authorization):
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        body = {"error": {"message": "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                          "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


# ---------------------------------------------------------------------- clients
def client_channel(
    target: str,
    *,
    tls: bool = False,
    ca_file: Optional[str] = None,
    cert_file: Optional[str] = None,
    key_file: Optional[str] = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target``: TLS when ``tls`` or any file is given.

    Args:
        target: ``host:port``.
        tls: Use TLS with the system's roots (unless ``ca_file``).
        ca_file: CA bundle that verifies the server (``--tls-ca``).
        cert_file: Client certificate for mTLS (``--tls-cert``).
        key_file: Its private key (``--tls-key``).
        options: Extra channel options.

    Raises:
        ValueError: A file is unreadable, or only one of cert / key is given.
    """
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both --tls-cert and --tls-key")
    if not (tls or ca_file or cert_file):
        return grpc.aio.insecure_channel(target, options=list(options))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read_file(ca_file, "--tls-ca") if ca_file else None,
        private_key=_read_file(key_file, "--tls-key") if key_file else None,
        certificate_chain=_read_file(cert_file, "--tls-cert") if cert_file else None,
    )
    return grpc.aio.secure_channel(target, credentials, options=list(options))


def bearer_metadata(api_key: Optional[str]) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``api_key`` (empty without one)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()
