"""The KV-transfer methods of ``ReplicaServer`` (mixed in: the replica's
module stays about serving), and how a replica reaches the holder the
request router named (issue 33, docs/KV_TRANSFER.md).

Under Ray Serve a replica cannot call another by id through Serve's public
API: a handle lets the request router pick the replica. So a receiver calls
``export_kv`` through its own handle to its deployment, naming the holder
(``holder_id``), and the deployment's request router
(``router/serve_router.py``) routes that call to the holder alone (to the
least loaded replica when the holder has left: it answers with what it
holds, and the receiver checks every hash). The export's array comes back as
the call's result through Ray's object store, as with an actor handle::

    router:   choose_replicas -> request.kv_fetch_from = {receiver: holder}
    receiver: generate / generate_direct -> _start_request -> fetch_hinted
                handle.options(method_name="export_kv").remote(hashes, holder_id=holder)
    router (in the receiver's process): call_method export_kv -> [[holder]]
    holder:   export_kv -> KVExport (pinned, copied, released)
    receiver: import, commit, events out -> the request's admission hits
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Optional

from workers.kv_transfer import KVExport, KVTransfer
from workers.kv_warm_start import WarmResult, WarmStartMetrics, warm_start
from workers.kv_transfer_metrics import TransferMetrics

logger = logging.getLogger(__name__)

HolderOf = Callable[[str], Optional[Any]]  # holder replica id -> a handle with export_kv.remote, or None


class ServeHolder:
    """A holder replica of this deployment reached through a Serve handle:
    ``export_kv.remote(hashes)`` is the handle's call naming ``holder_id``."""

    def __init__(self, handle: Any, holder_id: str) -> None:
        self.export_kv = _NamedExport(handle.options(method_name="export_kv"), holder_id)


class _NamedExport:
    def __init__(self, handle: Any, holder_id: str) -> None:
        self._handle = handle
        self._holder_id = holder_id

    def remote(self, block_hashes: list[bytes], warm_blocks: int = 0) -> Any:
        if warm_blocks:
            return self._handle.remote(block_hashes, holder_id=self._holder_id, warm_blocks=warm_blocks)
        return self._handle.remote(block_hashes, holder_id=self._holder_id)


def serve_holder_of() -> Optional[HolderOf]:
    """Inside a Serve replica: resolves a holder id to a ``ServeHolder`` through a
    handle to this replica's own deployment (made once); None outside Serve."""
    try:
        from ray import serve

        context = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return None
    handles: list[Any] = []

    def holder_of(holder_id: str) -> Any:
        if not handles:
            handles.append(serve.get_deployment_handle(context.deployment, context.app_name))
        return ServeHolder(handles[0], holder_id)

    return holder_of


class KVTransferEndpoints:
    """The transfer methods of ``ReplicaServer``. The class sets
    ``kv_transfer``, ``replica_id`` and, optionally, ``holder_of``."""

    kv_transfer: KVTransfer
    replica_id: str
    holder_of: Optional[HolderOf] = None

    def _start_kv_transfer(self, front: Any, runner: Any, metrics: Any, after_commit: Callable[[], None],
                           cache: Any) -> None:
        """``cache``: the engine config's ``CacheConfig`` (the limit and the timeout)."""
        labels = dict(getattr(metrics, "_labels", {"replica": "", "model": ""}))
        self.kv_transfer = KVTransfer(front, runner, TransferMetrics(metrics.registry, labels),
                                      after_commit=after_commit,
                                      max_concurrent_transfers=cache.kv_transfer_max_concurrent,
                                      timeout_s=cache.kv_transfer_timeout_s)
        if self.holder_of is None:
            self.holder_of = serve_holder_of()
        self._kv_cache_config = cache
        self.warm_metrics = WarmStartMetrics(metrics.registry, labels)
        self.warm_result: Optional[WarmResult] = None

    def _run_warm_start(self, redis_url: Optional[str], namespace: str, contract: str) -> WarmResult:
        """Blocks until the warm start is over (``workers/kv_warm_start.py``): called by the
        constructor after the replica registered, before Serve routes it a request. Runs on
        a thread of its own with its own event loop (the constructor's loop stays free)."""
        cache = self._kv_cache_config
        if redis_url is None or cache.kv_warm_start_bytes <= 0:
            result = WarmResult("off")
        else:
            box: list[WarmResult] = []

            async def main() -> None:
                from cluster.shared.directory import Directory

                directory = Directory.from_url(redis_url, namespace)
                try:
                    box.append(await warm_start(self.kv_transfer, directory, self.holder_of, self.replica_id,
                                                contract, cache.kv_warm_start_bytes, cache.kv_transfer_timeout_s))
                finally:
                    await directory.aclose()

            thread = threading.Thread(target=lambda: asyncio.run(main()), name="kv-warm-start", daemon=True)
            thread.start()
            thread.join(cache.kv_transfer_timeout_s + 30)  # its own bound is kv_transfer_timeout_s
            result = box[0] if box else WarmResult("timeout")
        self.warm_metrics.record(result)
        self.warm_result = result
        return result

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token, every layer and rank (the routers price a fetch with it); 0: none."""
        block_size = self.kv_transfer.ledger.pool.block_size
        return self.kv_transfer.block_bytes // block_size if block_size else 0

    async def export_kv(self, block_hashes: list[bytes], holder_id: str = "", warm_blocks: int = 0) -> KVExport:
        """The leading blocks of ``block_hashes`` cached here (another replica fetches them).
        ``holder_id``: the replica the caller meant (the request router routes on it); a
        call that reached another one (the holder left) is answered all the same.
        ``warm_blocks`` > 0: a joining replica's warm start (``workers/kv_warm_start.py``)."""
        return await self.kv_transfer.export(block_hashes, warm_blocks)

    async def fetch_prefix(self, holder: Any, prompt_token_ids: list[int], cache_salt: str = "") -> int:
        """Imports the prompt's cached prefix blocks this replica lacks from
        ``holder`` (a handle with ``export_kv``); returns the tokens imported
        (0: the request will prefill them)."""
        return await self.kv_transfer.fetch(holder, prompt_token_ids, cache_salt)

    async def fetch_hinted(self, request: Any) -> int:
        """Fetches the request's prefix from the holder the request router named for
        this replica (``request.kv_fetch_from``); returns the tokens imported (0: no hint,
        no way to reach the holder, an adapter, or any fallback: the request prefills)."""
        hints = getattr(request, "kv_fetch_from", None)
        holder_id = hints.get(self.replica_id, "") if hints else ""
        if not holder_id or holder_id == self.replica_id or request.lora_request is not None:
            return 0
        holder = self.holder_of(holder_id) if self.holder_of is not None else None
        if holder is None:
            logger.warning("KV fetch from %s asked, but this replica cannot reach other replicas (not "
                           "under Serve); the request prefills", holder_id)
            self.kv_transfer.metrics.fallback("unreachable")
            return 0
        return await self.kv_transfer.fetch(holder, request.prompt_token_ids, request.cache_salt)

    async def fetch_and_generate(self, request: Any, holder: Any) -> Any:
        """``generate(request)`` after fetching its prefix from ``holder``
        (a failed fetch only means a longer prefill)."""
        if request.lora_request is None:  # an adapter's blocks hash on its content: not fetched yet
            await self.kv_transfer.fetch(holder, request.prompt_token_ids, request.cache_salt)
        async for chunk in self.generate(request):  # type: ignore[attr-defined]
            yield chunk
