"""One replica: an engine behind an async streaming API, for Ray Serve.

``ReplicaServer`` is a plain class (the engine is injected or built from an
``EngineConfig``), so tests can drive it without Serve; ``cluster/app/builder.py``
wraps it with ``serve.deployment``. It:

- streams ``StreamChunk``s from ``generate()``; when the caller goes away
  (Serve cancels the generator), the sequence is aborted and its blocks
  return to the pool; ``generate_direct()`` has the engine thread send them
  to the router instead (``workers/engine/direct_stream.py``);
- after every engine step, drains the block pool's KV events (on the engine
  thread) and publishes them to the Redis prefix directory from a publisher
  thread with its own event loop (heartbeats start with the replica); a gap
  or a directory restart triggers a full resync from a snapshot taken on the
  engine thread;
- answers ``record_routing_stats()`` (Serve's request router) and
  ``record_autoscaling_stats()`` (custom autoscaling metrics);
- keeps its Prometheus series (``workers/metrics.py``) and publishes their
  text with every directory heartbeat, for the router's ``GET /metrics``.

The engine never runs on the event loop: ``AsyncEngine`` steps it on its own
thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import uuid
from dataclasses import asdict
from typing import Any, AsyncIterator, Optional

from cluster.shared import autoscaling
from cluster.shared.config import EngineConfig
from cluster.shared.contract import contract_for
from cluster.shared.fingerprint import served_model_name
from cluster.shared.ray_local import node_ip as ray_node_ip
from cluster.shared.types import GenerationRequest, LoRARequest, StreamChunk
from workers.core_share import core_share_for, forward_threads, torch_threads
from workers.direct_endpoint import DirectStreamEndpoint
from workers.disagg import DisaggregationEndpoints
from workers.engine.async_engine import AsyncEngine
from workers.engine.block_pool import KVEventBatch
from workers.engine.engine import LLMEngine
from workers.engine.direct_stream import SinkConnections, chunk_of
from workers.engine.lora_slots import slots_in_use
from workers.kv_transfer_endpoints import KVTransferEndpoints
from workers.metrics import ReplicaMetrics

logger = logging.getLogger(__name__)


def default_replica_id() -> str:
    """Serve's replica id when running in Serve, else a random one."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return f"local-{uuid.uuid4().hex[:8]}"


class ReplicaServer(DisaggregationEndpoints, KVTransferEndpoints, DirectStreamEndpoint):
    """An engine replica with streaming, stats and KV-event publishing.

    Args:
        engine_config: Flat engine arguments or an ``EngineConfig`` (used
            when ``engine`` is not given).
        redis_url: The prefix directory; None disables publishing.
        namespace: Directory namespace (one per model / cluster).
        replica_id: Defaults to Serve's replica id.
        engine: A ready engine (tests inject one).
        model_name: The ``model`` label of the metrics; defaults to the
            served name of the configured model.
        freeze_heap: After building the engine, take the objects alive
            then out of the cyclic collector's reach (``builder.freeze_heap``);
            the Serve deployment sets it, its process holds this one engine.
        packed_replicas: Most replicas of the deployment that may share one
            machine (its replica count, or autoscaling's maximum); a
            replica reserving a fraction of a CPU splits the machine's cores
            over them for its forward (``forward_threads``), and each step
            by how many of them are busy (``workers/core_share.py``).
    """

    def __init__(
        self,
        engine_config: Any = None,
        redis_url: Optional[str] = None,
        namespace: str = "default",
        replica_id: Optional[str] = None,
        engine: Optional[LLMEngine] = None,
        model_name: Optional[str] = None,
        freeze_heap: bool = False,
        packed_replicas: int = 1,
    ) -> None:
        self._parts = None
        config_model = None
        self._contract = ""  # declared to the directory when the engine was built here
        # The defaults when none is given (an injected engine): the admission bound and stream interval.
        config = engine_config if isinstance(engine_config, EngineConfig) else EngineConfig.from_kwargs(
            **(engine_config or {}))
        front_args: dict[str, Any] = {"after_step": self._after_step,
                                      "max_waiting_requests": config.scheduler.max_waiting_requests,
                                      "stream_interval": config.scheduler.stream_interval}
        self._cores = None
        if engine is None:
            threads = forward_threads(config, packed_replicas)
            self._cores = core_share_for(config, packed_replicas)
            if self._cores is not None:
                front_args.update(before_step=self._cores.before_step, on_idle=self._cores.idle)
            # Built on the thread that steps it: one OpenMP pool in the process (async_engine.py).
            self._front = AsyncEngine.on_own_thread(lambda: self._build(config, threads, freeze_heap), **front_args)
            engine = self._front.engine
            config_model = config.model
            self._contract = contract_for(engine.scheduler.kv_manager.block_size, engine.model_fingerprint,
                                          config.tokenizer or self._parts.model_dir)
        else:
            self._front = AsyncEngine(engine, **front_args)
        self.engine = engine
        if getattr(engine, "structured", None) is not None:
            engine.structured.warm_up()  # the grammar backend's tables, off the request path
        self.replica_id = replica_id or default_replica_id()
        self.metrics = ReplicaMetrics(self.replica_id, model_name or served_model_name(config_model))
        runner = getattr(engine, "runner", None)  # test engines may run without one
        self.metrics.set_model_info(getattr(runner, "quantization", None), getattr(runner, "kv_cache_dtype", "auto"),
                                    int(getattr(runner, "weight_bytes", 0)), int(getattr(runner, "kv_cache_bytes", 0)))
        self._pending: "queue.SimpleQueue[KVEventBatch]" = queue.SimpleQueue()  # engine thread -> publisher
        self._start_kv_transfer(self._front, runner, self.metrics, self._collect_events, config.cache)  # kv_transfer.py
        self._sinks = SinkConnections()  # routers' direct-stream sinks (generate_direct)
        self._ttft = autoscaling.TTFTTracker()
        self._front.start()
        self._publisher = None
        self._publish_wakeup: Optional[asyncio.Event] = None
        self._publish_loop_obj: Optional[asyncio.AbstractEventLoop] = None
        self._closing = False
        self._redis_url = redis_url
        self._namespace = namespace
        if redis_url is not None:
            self._start_publisher()
        self._run_warm_start(redis_url, namespace, self._contract)  # before Serve routes it a request
        logger.info("replica %s ready (pid %d)", self.replica_id, os.getpid())

    def _build(self, config: EngineConfig, threads: Optional[int], freeze_heap: bool) -> LLMEngine:
        """Engine thread: the forward's threads, then the engine (``build_engine``)."""
        from workers.builder import build_engine, freeze_heap as freeze_process_heap

        if threads is not None:
            from workers.placement import set_cpu_threads

            set_cpu_threads(threads)
            logger.info("forward on %d CPU threads", threads)
        self._parts = build_engine(config)
        if freeze_heap:  # a Serve replica process: this one engine for its life
            freeze_process_heap()
        return self._parts.engine

    # ---------------------------------------------------------- requests
    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Streams the request's output as chunks; the last has a finish reason.

        Raises:
            ValueError: The request is invalid (says what to change).
        """
        timer = await self._start_request(request)
        async for out in self._tracked(request):
            timer.on_output(out)
            yield chunk_of(out, self.replica_id)

    async def _start_request(self, request: GenerationRequest) -> Any:
        """Reads the request's adapter if it is new (here, not on the engine thread),
        starts its metrics timer, then fetches its prefix's KV from the holder the
        request router named (``kv_transfer_endpoints.py``; inside the TTFT)."""
        lora = request.lora_request
        if lora is not None and self.engine.lora is not None:
            await asyncio.to_thread(self.engine.lora.prefetch, lora)
        timer = self.metrics.start_request(lora_name=lora.lora_name if lora is not None else None)
        await self.fetch_hinted(request)
        return timer

    async def _tracked(self, request: GenerationRequest) -> AsyncIterator[Any]:
        """The engine's outputs, with arrival and first token noted for ``ttft_s``."""
        self._ttft.start(request.request_id)
        try:
            async for out in self._front.generate(request):
                if out.new_token_ids:
                    self._ttft.first_token(request.request_id)
                yield out
        finally:
            self._ttft.discard(request.request_id)

    async def abort(self, request_id: str) -> None:
        self._front.abort(request_id)

    # ------------------------------------------------------------- stats
    def record_routing_stats(self) -> dict[str, Any]:
        """Load figures for Serve's request router (no engine-thread access)."""
        stats = self._front.stats
        # Replicas splitting one machine's cores: those on one core-share board (one per Ray node).
        group = os.path.basename(self._cores.path) if self._cores is not None else ""
        return {**asdict(stats), "replica_id": self.replica_id, "core_group": group,
                "kv_bytes_per_token": self.kv_bytes_per_token}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics (``cluster/shared/autoscaling.py`` reads them):
        KV use, queue and time to first token, not request counts alone."""
        stats = self._front.stats
        return {
            autoscaling.KV_CACHE_USAGE: float(stats.kv_cache_usage),
            autoscaling.NUM_WAITING: float(stats.num_waiting),
            autoscaling.NUM_RUNNING: float(stats.num_running),
            "num_swapped": float(stats.num_swapped),
            autoscaling.TTFT_S: self._ttft.value(),
        }

    async def stats(self) -> dict[str, Any]:
        """Detailed stats, read on the engine thread (consistent)."""

        def read(engine: LLMEngine) -> dict[str, Any]:
            kv = engine.scheduler.kv_manager
            return {
                **asdict(engine.stats(self.replica_id)),
                "num_free_blocks": kv.num_free_blocks,
                "num_device_blocks": kv.num_device_blocks,
                "num_used_blocks": kv.device_pool.num_used_blocks,
                "num_preemptions": engine.scheduler.num_preemptions_total,
                "prefix_cache_hit_rate": kv.prefix_cache_hit_rate,
                "pid": os.getpid(), "torch_threads": torch_threads(),
                "directory_resyncs": getattr(self._publisher, "num_resyncs", 0),  # a plain int: any thread
                "loop": self._front.timing.as_dict(),
            }

        return await self._front.call(read)

    async def load_lora_adapter(self, lora: LoRARequest) -> str:
        """Loads an adapter now (a run-time load's check, ``router/openai/lora_admin.py``);
        returns its content hash. Raises ValueError with the reason it cannot load."""
        if self.engine.lora is not None:  # read off the engine thread: running streams wait for the install only
            await asyncio.to_thread(self.engine.lora.prefetch, lora)

        def load(engine: LLMEngine) -> str:
            if engine.lora is None:
                raise ValueError("this replica serves no LoRA adapters: start it with --enable-lora")
            return engine.lora.load(lora, slots_in_use(engine.scheduler.queue))[0].content_hash

        return await self._front.call(load)

    async def reset_prefix_cache(self) -> bool:
        """Drops the prefix cache when no request holds blocks (publishes the clear)."""
        done = await self._front.call(lambda engine: engine.scheduler.kv_manager.reset_prefix_cache())
        await self._front.call(lambda engine: self._collect_events())
        self._wake_publisher()
        return done

    def metrics_text(self) -> bytes:
        """This replica's series in Prometheus text format (gauges as of the last step)."""
        self.metrics.set_load(self._front.stats)
        return self.metrics.render()

    async def check_health(self) -> None:
        """Serve health check: fails when the engine loop died."""
        if self._front.error is not None:
            raise RuntimeError(f"engine loop failed: {self._front.error!r}")

    def shutdown(self) -> None:
        """Hands the cache over to a survivor (``kv_transfer_endpoints.py``), then stops the
        engine thread, the publisher (unregisters) and TP ranks."""
        self._hand_over_cache(getattr(self, "_redis_url", None), getattr(self, "_namespace", ""),
                              getattr(self, "_contract", ""))
        self._closing = True
        self._wake_publisher()
        if getattr(self, "_publisher_thread", None) is not None:
            self._publisher_thread.join(timeout=5)
        self._front.shutdown()
        if getattr(self, "_sinks", None) is not None:
            self._sinks.close()
        if getattr(self, "_cores", None) is not None:
            self._cores.close()
        parts, self._parts = self._parts, None
        if parts is not None and hasattr(parts.runner, "shutdown"):
            parts.runner.shutdown()

    def __del__(self) -> None:
        # Serve calls __del__ when it stops a replica (scale-down, delete).
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass

    # ------------------------------------------------------- KV events
    def _after_step(self) -> None:
        """Engine thread, after each step: direct-stream chunks and KV events out,
        engine counters into the metrics."""
        self._sinks.flush()
        self._collect_events()
        self.metrics.record_engine(self.engine, self._parts.runner if self._parts else None)

    def _collect_events(self) -> None:
        """Engine thread: drain this step's KV events for the publisher."""
        batch = self.engine.scheduler.kv_manager.take_events()
        if batch is not None:
            self._pending.put(batch)
            self._wake_publisher()

    def _wake_publisher(self) -> None:
        wakeup, loop = self._publish_wakeup, self._publish_loop_obj
        if wakeup is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wakeup.set)

    def _start_publisher(self) -> None:
        """Runs the directory publisher on its own thread and event loop, so
        heartbeats start with the replica and never wait on Serve's loop."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._publish_loop_obj = loop
            self._publish_wakeup = asyncio.Event()
            loop.run_until_complete(self._publisher_main(ready))

        self._publisher_error: Optional[BaseException] = None
        self._publisher_thread = threading.Thread(target=run, name="kv-publisher", daemon=True)
        self._publisher_thread.start()
        ready.wait(timeout=30)
        if self._publisher_error is not None:  # wrong Redis credentials / ACL: refuse to start, say why
            self._closing = True
            self._front.shutdown()
            raise RuntimeError(str(self._publisher_error)) from None

    async def _publisher_main(self, ready: threading.Event) -> None:
        from cluster.shared.directory import Directory
        from cluster.shared.directory.publisher import DirectoryPublisher

        directory = Directory.from_url(self._redis_url, self._namespace)
        self._publisher = DirectoryPublisher(
            directory, self.replica_id, self._snapshot, stats_fn=self._directory_stats,
            metrics_fn=self.metrics_text, contract=self._contract,
        )
        from cluster.shared.directory import DirectoryAuthError

        try:
            await self._publisher.start()
        except DirectoryAuthError as exc:
            self._publisher_error = exc
            await directory.aclose()
            return
        finally:
            ready.set()
        assert self._publish_wakeup is not None
        lora_sync = None
        if getattr(self.engine, "lora", None) is not None:  # run-time unloads free the adapters' weights here too
            from workers.lora.registry_sync import follow_unloads

            lora_sync = asyncio.create_task(follow_unloads(self._redis_url, self._namespace, self.engine,
                                                           self._front, lambda: self._closing))
        try:
            while not self._closing:
                await self._publish_wakeup.wait()
                self._publish_wakeup.clear()
                await self._publish_pending()
        finally:
            if lora_sync is not None:
                lora_sync.cancel()
            await self._publisher.stop()

    async def _publish_pending(self) -> None:
        assert self._publisher is not None
        while True:
            try:
                batch = self._pending.get_nowait()
            except queue.Empty:
                return
            # Batches already covered by a resync's snapshot are skipped there.
            await self._publisher.publish_events(batch)

    def _directory_stats(self) -> dict[str, float]:
        """Load figures sent with each directory heartbeat (``ListReplicas``)."""
        stats = self._front.stats
        return {
            "num_running": int(stats.num_running),
            "num_waiting": int(stats.num_waiting),
            "kv_cache_usage": float(stats.kv_cache_usage),
            "num_cached_blocks": int(stats.num_cached_blocks), "num_swapped": int(stats.num_swapped),
            "node": ray_node_ip(),  # where it runs (prefixserve status), text among the numbers
            "lora_adapters": ",".join(name for name, _ in stats.lora_adapters),  # text too
            # Read without the engine thread: a float written by it, stale by at most a step.
            "prefix_cache_hit_rate": float(self.engine.scheduler.kv_manager.prefix_cache_hit_rate),
        }

    async def _snapshot(self) -> tuple[int, list[bytes]]:
        """A full snapshot, taken on the engine thread (for a resync)."""
        snap = await self._front.call(lambda engine: engine.scheduler.kv_manager.take_snapshot())
        return snap.seq_no, list(snap.block_hashes)
