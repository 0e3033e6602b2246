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

The other way round, a replica that Serve stops (scale-down) pushes its
hottest blocks to a survivor in ``shutdown`` (``_hand_over_cache``,
``workers/kv_handover.py``): the same handle, method ``import_kv``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Optional

from workers.kv_handover import HandoverMetrics, HandoverResult, hand_over, import_pushed
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


class ServeReceiver:
    """A surviving replica of this deployment reached through a Serve handle (a
    hand-over, ``workers/kv_handover.py``): ``import_kv.remote(export, sender_id)``.
    The call names the receiver (``holder_id``), but the request router routes
    by name only ``export_kv``; ``import_kv`` goes to the least loaded live
    replica, which imports what fits all the same (Serve no longer routes to the
    stopping replica)."""

    def __init__(self, handle: Any, receiver_id: str) -> None:
        import_kv = handle.options(method_name="import_kv")

        class _Call:
            @staticmethod
            def remote(export: KVExport, sender_id: str) -> Any:
                return import_kv.remote(export, holder_id=receiver_id, sender_id=sender_id)

        self.import_kv = _Call


def serve_holder_of(wrap: Callable[[Any, str], Any] = ServeHolder) -> Optional[HolderOf]:
    """Inside a Serve replica: resolves a replica id to ``wrap(handle, id)`` (a
    ``ServeHolder``, or a ``ServeReceiver``) through a handle to this replica's
    own deployment (made once); None outside Serve."""
    try:
        from ray import serve

        context = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return None
    handles: list[Any] = []

    def holder_of(holder_id: str) -> Any:
        if not handles:
            handles.append(serve.get_deployment_handle(context.deployment, context.app_name))
        return wrap(handles[0], holder_id)

    return holder_of


def serve_app_deleted() -> bool:
    """Inside a Serve replica: whether its whole application is being deleted (or
    Serve is gone): then no replica survives to take a hand-over. Blocks (asks
    Serve's controller): call it off any event loop."""
    try:
        from ray import serve

        app_name = serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - not inside a Serve replica (a test's receivers)
        return False
    try:
        app = serve.status().applications.get(app_name)
        return app is None or app.status == "DELETING"
    except Exception:  # noqa: BLE001 - no controller (serve.shutdown)
        return True


def _run_with_directory(redis_url: str, namespace: str, main: Callable[[Any], Any], join_s: float,
                        name: str) -> list[Any]:
    """``await main(directory)`` on a thread of its own with its own event loop (the
    caller's loop, Serve's, stays free); returns ``[its result]``, or ``[]`` when it
    did not end within ``join_s`` (the thread is left to end on its own bound)."""
    box: list[Any] = []

    async def run() -> None:
        from cluster.shared.directory import Directory

        directory = Directory.from_url(redis_url, namespace)
        try:
            box.append(await main(directory))
        finally:
            await directory.aclose()

    thread = threading.Thread(target=lambda: asyncio.run(run()), name=name, daemon=True)
    thread.start()
    thread.join(join_s)
    return box


class KVTransferEndpoints:
    """The transfer methods of ``ReplicaServer``. The class sets
    ``kv_transfer``, ``replica_id`` and, optionally, ``holder_of``."""

    kv_transfer: KVTransfer
    replica_id: str
    holder_of: Optional[HolderOf] = None
    receiver_of: Optional[HolderOf] = None  # a hand-over's receiver id -> a handle with import_kv.remote
    handover_result: Optional[HandoverResult] = None

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
        if self.receiver_of is None:
            self.receiver_of = serve_holder_of(ServeReceiver)
        self._kv_cache_config = cache
        self.warm_metrics = WarmStartMetrics(metrics.registry, labels)
        self.warm_result: Optional[WarmResult] = None
        self.handover_metrics = HandoverMetrics(metrics.registry, labels)

    def _run_warm_start(self, redis_url: Optional[str], namespace: str, contract: str) -> WarmResult:
        """Blocks until the warm start is over (``workers/kv_warm_start.py``): called by the
        constructor after the replica registered, before Serve routes it a request. Runs on
        a thread of its own with its own event loop (the constructor's loop stays free)."""
        cache = self._kv_cache_config
        if redis_url is None or cache.kv_warm_start_bytes <= 0:
            result = WarmResult("off")
        else:
            box = _run_with_directory(redis_url, namespace, lambda directory: warm_start(
                self.kv_transfer, directory, self.holder_of, self.replica_id, contract, cache.kv_warm_start_bytes,
                cache.kv_transfer_timeout_s), cache.kv_transfer_timeout_s + 30, "kv-warm-start")  # its own bound
            result = box[0] if box else WarmResult("timeout")
        self.warm_metrics.record(result)
        self.warm_result = result
        return result

    def _hand_over_cache(self, redis_url: Optional[str], namespace: str, contract: str) -> None:
        """Pushes this replica's hottest cached blocks to a survivor (``workers/kv_handover.py``)
        and blocks until that is over, at most ``kv_transfer_timeout_s`` (and a margin): called
        once by ``shutdown`` (Serve's graceful stop, after its drain) while the engine and the
        directory publisher still run. Off outside Serve, with no directory or a budget of 0;
        skipped when the whole application is being deleted. Never raises."""
        if self.handover_result is not None or getattr(self, "handover_metrics", None) is None:
            return  # handed over already, or the constructor did not get this far
        cache = self._kv_cache_config
        result = HandoverResult("off")
        try:
            if (redis_url is not None and cache.kv_handover_bytes > 0 and self.receiver_of is not None
                    and self.kv_transfer.front.error is None and self.kv_transfer.layout is not None):
                async def main(directory: Any) -> HandoverResult:
                    if await asyncio.to_thread(serve_app_deleted):
                        return HandoverResult("skipped")
                    return await hand_over(self.kv_transfer, directory, self.receiver_of,  # type: ignore[arg-type]
                                           self.replica_id, contract, cache.kv_handover_bytes,
                                           cache.kv_transfer_timeout_s)

                box = _run_with_directory(redis_url, namespace, main, cache.kv_transfer_timeout_s + 5, "kv-handover")
                result = box[0] if box else HandoverResult("timeout")
        except Exception as exc:  # noqa: BLE001 - the stop must go on
            logger.warning("cache hand-over failed (%r)", exc)
            result = HandoverResult("error")
        self.handover_metrics.record(result)
        self.handover_result = result

    async def import_kv(self, export: KVExport, holder_id: str = "", sender_id: str = "") -> tuple[str, int]:
        """A stopping replica's hand-over (``workers/kv_handover.py``): imports the blocks of
        ``export`` not cached here, hottest first, at most half of the free blocks. Returns
        ``(failure reason or "", blocks imported)``. ``holder_id``: the receiver the sender
        meant (any live replica that gets the call imports what fits)."""
        if sender_id and sender_id == self.replica_id:
            return "error", 0  # routed back to the stopping replica: nothing survives here
        reason, num = await import_pushed(self.kv_transfer, export)
        self.handover_metrics.received_blocks.inc(num)
        self.handover_metrics.received_bytes.inc(num * self.kv_transfer.block_bytes)
        return reason, num

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
        no way to reach the holder, or any fallback: the request prefills). A LoRA request's
        blocks hash on its adapter's content, read ahead by then (``_start_request``)."""
        hints = getattr(request, "kv_fetch_from", None)
        holder_id = hints.get(self.replica_id, "") if hints else ""
        if not holder_id or holder_id == self.replica_id:
            return 0
        holder = self.holder_of(holder_id) if self.holder_of is not None else None
        if holder is None:
            logger.warning("KV fetch from %s asked, but this replica cannot reach other replicas (not "
                           "under Serve); the request prefills", holder_id)
            self.kv_transfer.metrics.fallback("unreachable")
            return 0
        return await self.kv_transfer.fetch(holder, request.prompt_token_ids, request.cache_salt,
                                            request.lora_request)

    async def fetch_and_generate(self, request: Any, holder: Any) -> Any:
        """``generate(request)`` after fetching its prefix from ``holder``
        (a failed fetch only means a longer prefill)."""
        if request.lora_request is not None and self.engine.lora is not None:  # hashes on its content
            await asyncio.to_thread(self.engine.lora.prefetch, request.lora_request)
        await self.kv_transfer.fetch(holder, request.prompt_token_ids, request.cache_salt, request.lora_request)
        async for chunk in self.generate(request):  # type: ignore[attr-defined]
            yield chunk
