"""Tenants bound to API keys: who a caller is decides its cache namespace, the
most urgent priority it may ask for, and its limits, not what the request says.

A tenants file (``--tenants-file``, the config's ``router.tenants_file``; in
Kubernetes a mounted Secret) maps keys to tenants::

    tenants:
      - name: search                  # [A-Za-z0-9_.-], at most 64 characters: a metric label
        keys: [sk-search-1]           # bearer tokens, or instead (so the file holds no secret):
        # key_sha256: [9f86d0...]     #   their SHA-256 digests, hex
        cache_namespace: search       # default: the name; tenants sharing one share cached prefixes
        max_priority: 0               # the most urgent priority allowed (lower is served first,
                                      # as in vLLM): a request asking for less is clamped up to it
        requests_per_s: 20            # token bucket per router (burst: its size, default
        burst: 40                     #   max(1, requests_per_s))
        max_concurrent_streams: 16    # per router, both front ends together
        max_tokens_per_request: 1024  # cap on max_tokens (below the server's max_output_tokens)
        lora_adapters: [sql-lora]     # the LoRA adapters its keys may use (default: every one);
                                      # another is 404 model_not_found / NOT_FOUND. [] : base model only
        lora_admin: true              # may POST /v1/load_lora_adapter and /v1/unload_lora_adapter

What a tenant's request becomes (``Tenant.apply``):

    cache_salt   "tenant:<cache_namespace>" + (":" + the client's salt, if any): a
                 client salt only narrows the tenant's namespace, so tenant B
                 sending A's salt still hashes into B's namespace and never
                 sees A's cached tokens (``cached_tokens`` cannot probe them)
    priority     max(requested, max_priority)

Limits are checked before the body is parsed or tokenized (``TenantGate.admit``):
over ``requests_per_s`` or ``max_concurrent_streams`` the router answers
RESOURCE_EXHAUSTED / HTTP 429 with a retry-after; ``max_tokens_per_request``
joins the input limits (``router.limits``), INVALID_ARGUMENT / 400.

Keys given without a tenants file (``--api-key``, ``--api-key-file``) belong
to the tenant ``default``, which changes nothing in the request (today's
behaviour). Metrics carry the tenant's name as a label; names come only from
the file, so the label's cardinality is bounded by it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

from cluster.shared.types import GenerationRequest, StreamChunk
from router.errors import OverloadedError
from router.limits import Limits
from router.models import ModelNotFoundError

TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_TENANT_NAME = "default"
SALT_PREFIX = "tenant:"
_FIELDS = ("name", "keys", "key_sha256", "cache_namespace", "max_priority", "requests_per_s", "burst",
           "max_concurrent_streams", "max_tokens_per_request", "lora_adapters", "lora_admin")


@dataclass(frozen=True)
class Tenant:
    """Who a key belongs to and what it may do.

    Attributes:
        name: The tenant (a metric label).
        cache_namespace: Prefix-cache namespace (derives the request's
            ``cache_salt``); None leaves the salt as the client sent it
            (the ``default`` tenant of keys without a tenants file).
        max_priority: The most urgent priority allowed; None allows any.
        requests_per_s: Requests admitted per second per router; None: unlimited.
        burst: Size of the request token bucket (default ``max(1, requests_per_s)``).
        max_concurrent_streams: Streams at once per router; None: unlimited.
        max_tokens_per_request: Cap on ``max_tokens``; None: the server's limits only.
        lora_adapters: The LoRA adapters its requests may run; None: any.
        lora_admin: Its keys may load and unload LoRA adapters at run time.
    """

    name: str
    cache_namespace: Optional[str] = None
    max_priority: Optional[int] = None
    requests_per_s: Optional[float] = None
    burst: Optional[int] = None
    max_concurrent_streams: Optional[int] = None
    max_tokens_per_request: Optional[int] = None
    lora_adapters: Optional[frozenset[str]] = None
    lora_admin: bool = False

    def cache_salt(self, client_salt: str) -> str:
        """The salt a request of this tenant runs with (see the module doc)."""
        if self.cache_namespace is None:
            return client_salt
        salt = SALT_PREFIX + self.cache_namespace
        return f"{salt}:{client_salt}" if client_salt else salt

    def priority(self, requested: int) -> int:
        """``requested``, clamped so it is not more urgent than ``max_priority``."""
        return requested if self.max_priority is None else max(requested, self.max_priority)

    def limits_over(self, limits: Limits) -> Limits:
        """The input limits of this tenant's requests: ``limits`` with its token cap."""
        cap = self.max_tokens_per_request
        if cap is None or (limits.max_output_tokens is not None and limits.max_output_tokens <= cap):
            return limits
        return dataclasses.replace(limits, max_output_tokens=cap)

    def apply(self, request: GenerationRequest) -> GenerationRequest:
        """The request as this tenant may run it (salt and priority; see the module doc).

        Raises:
            ModelNotFoundError: The request's LoRA adapter is not one this tenant may use.
        """
        lora = request.lora_request
        if lora is not None and self.lora_adapters is not None and lora.lora_name not in self.lora_adapters:
            allowed = ", ".join(repr(a) for a in sorted(self.lora_adapters)) or "none"
            raise ModelNotFoundError(f"the model {lora.lora_name!r} does not exist for this API key (its tenant "
                                     f"{self.name!r} may use the LoRA adapters {allowed} and the base model)")
        salt, priority = self.cache_salt(request.cache_salt), self.priority(request.priority)
        if salt == request.cache_salt and priority == request.priority:
            return request
        return dataclasses.replace(request, cache_salt=salt, priority=priority)


DEFAULT_TENANT = Tenant(DEFAULT_TENANT_NAME)


def load_tenants(path: str) -> list[tuple[bytes, Tenant]]:
    """``(SHA-256 digest of a key, its tenant)`` for every key of a tenants file.

    Raises:
        ValueError: The file is unreadable or not YAML, or an entry is invalid
            (the message names the tenant and field, and what to write).
    """
    import yaml

    flag = f"--tenants-file {path}"
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{flag} is not valid YAML: {exc}") from None
    entries = doc.get("tenants") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{flag}: expected 'tenants:' with a list of tenants, each with a name and keys")
    pairs: list[tuple[bytes, Tenant]] = []
    seen_names: set[str] = set()
    seen_digests: dict[bytes, str] = {}
    for i, entry in enumerate(entries):
        where = f"{flag}: tenants[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a mapping with name, keys and optional limits")
        unknown = sorted(set(entry) - set(_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown}; known: {', '.join(_FIELDS)}")
        name = entry.get("name")
        if not isinstance(name, str) or not TENANT_NAME.match(name):
            raise ValueError(f"{where}: name must be 1-64 characters of [A-Za-z0-9_.-], got {name!r}")
        if name in seen_names:
            raise ValueError(f"{where}: tenant {name!r} appears twice: merge its keys into one entry")
        seen_names.add(name)
        where = f"{flag}: tenant {name!r}"
        tenant = _tenant_from(entry, name, where)
        digests = [hashlib.sha256(k.encode()).digest() for k in _strings(entry, "keys", where)]
        for hex_digest in _strings(entry, "key_sha256", where):
            try:
                digest = bytes.fromhex(hex_digest)
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise ValueError(f"{where}: key_sha256 entry {hex_digest[:12]!r}... is not 64 hex digits "
                                 "(write `printf %s KEY | sha256sum`)")
            digests.append(digest)
        if not digests:
            raise ValueError(f"{where} has no key: give keys or key_sha256")
        for digest in digests:
            if digest in seen_digests:
                raise ValueError(f"{where}: a key is also one of tenant {seen_digests[digest]!r}'s: "
                                 "a key must identify one tenant")
            seen_digests[digest] = name
            pairs.append((digest, tenant))
    return pairs


def _strings(entry: dict, field: str, where: str) -> list[str]:
    values = entry.get(field) or []
    if not isinstance(values, list) or not all(isinstance(v, str) and v and not any(c.isspace() for c in v)
                                               for v in values):
        raise ValueError(f"{where}: {field} must be a list of non-empty strings without whitespace")
    return values


def _tenant_from(entry: dict, name: str, where: str) -> Tenant:
    def number(field: str, kind: type, minimum: Optional[float]) -> Any:
        value = entry.get(field)
        if value is None:
            return None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok and kind is int:
            ok = float(value).is_integer()
        if not ok or (minimum is not None and value < minimum):
            bound = "" if minimum is None else f" >= {minimum}"
            raise ValueError(f"{where}: {field} must be {'an integer' if kind is int else 'a number'}{bound}, "
                             f"got {value!r}")
        return kind(value)

    namespace = entry.get("cache_namespace", name)
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"{where}: cache_namespace must be a non-empty string")
    rate = number("requests_per_s", float, None)
    if rate is not None and rate <= 0:
        raise ValueError(f"{where}: requests_per_s must be > 0 (leave it out for no limit), got {rate}")
    max_priority = number("max_priority", int, None)
    if max_priority is not None and not -2**31 <= max_priority < 2**31:
        raise ValueError(f"{where}: max_priority must fit an int32, got {max_priority}")
    adapters = entry.get("lora_adapters")
    if adapters is not None:
        adapters = frozenset(_strings(entry, "lora_adapters", where)) if adapters else frozenset()
    admin = entry.get("lora_admin", False)
    if not isinstance(admin, bool):
        raise ValueError(f"{where}: lora_admin must be true or false, got {admin!r}")
    return Tenant(name=name, cache_namespace=namespace, max_priority=max_priority, requests_per_s=rate,
                  lora_admin=admin, burst=number("burst", int, 1), max_concurrent_streams=number("max_concurrent_streams", int, 1),
                  max_tokens_per_request=number("max_tokens_per_request", int, 1), lora_adapters=adapters)


class _Account:
    """One tenant's request bucket and open streams in this router."""

    __slots__ = ("tokens", "stamp", "streams")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens, self.stamp, self.streams = tokens, stamp, 0


class Admission:
    """A request admitted for a tenant; ``release()`` (idempotent) frees its stream slot."""

    def __init__(self, gate: "TenantGate", tenant: Tenant) -> None:
        self.gate, self.tenant = gate, tenant
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.gate._accounts[self.tenant.name].streams -= 1

    async def meter(self, stream: AsyncIterator[StreamChunk]) -> AsyncIterator[StreamChunk]:
        """Passes ``stream`` through, counts the tenant's tokens on its last chunk,
        and releases the admission when it ends (closing this closes ``stream``)."""
        done: dict[int, int] = {}  # completion tokens of each choice that finished
        try:
            async for chunk in stream:
                if chunk.finish_reason is not None:
                    done[chunk.index] = chunk.completion_tokens
                if chunk.finished:
                    self.gate.record_tokens(self.tenant, dataclasses.replace(
                        chunk, completion_tokens=sum(done.values())))
                yield chunk
        finally:
            self.release()
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


class TenantGate:
    """Admits requests per tenant (request rate and open streams) in one router.

    Args:
        metrics: ``router.metrics.RouterMetrics`` (``router_tenant_*`` series); None counts nothing.
        clock: Monotonic seconds (tests pass a fake).
    """

    def __init__(self, metrics: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self._accounts: dict[str, _Account] = {}

    def admit(self, tenant: Tenant) -> Admission:
        """Takes one request token and one stream slot of ``tenant``.

        Raises:
            OverloadedError: Over ``requests_per_s`` or ``max_concurrent_streams``
                (``retry_after_s``: when a token or slot is likely free).
        """
        now = self.clock()
        capacity = float(tenant.burst if tenant.burst is not None else max(1.0, tenant.requests_per_s or 1.0))
        account = self._accounts.get(tenant.name)
        if account is None:
            account = self._accounts[tenant.name] = _Account(capacity, now)
        if tenant.requests_per_s is not None:
            account.tokens = min(capacity, account.tokens + (now - account.stamp) * tenant.requests_per_s)
        account.stamp = now
        if tenant.max_concurrent_streams is not None and account.streams >= tenant.max_concurrent_streams:
            self._record(tenant, "concurrency_limited")
            raise OverloadedError(f"tenant {tenant.name!r} already streams {account.streams} requests, its "
                                  f"max_concurrent_streams: wait for one to finish", retry_after_s=1.0)
        if tenant.requests_per_s is not None:
            if account.tokens < 1.0:
                self._record(tenant, "rate_limited")
                wait = (1.0 - account.tokens) / tenant.requests_per_s
                raise OverloadedError(f"tenant {tenant.name!r} is over its requests_per_s of "
                                      f"{tenant.requests_per_s:g}: retry in {wait:.2f} s", retry_after_s=wait)
            account.tokens -= 1.0
        account.streams += 1
        self._record(tenant, "admitted")
        return Admission(self, tenant)

    def open_streams(self, tenant: Tenant) -> int:
        """Streams of ``tenant`` this router has admitted and not yet released."""
        account = self._accounts.get(tenant.name)
        return account.streams if account is not None else 0

    def _record(self, tenant: Tenant, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.record_tenant_request(tenant.name, outcome)

    def record_tokens(self, tenant: Tenant, last: StreamChunk) -> None:
        if self.metrics is not None:
            self.metrics.record_tenant_tokens(tenant.name, last.prompt_tokens, last.completion_tokens,
                                              last.cached_prompt_tokens)
