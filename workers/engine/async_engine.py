"""Async streaming over an ``LLMEngine`` for the replica.

The engine steps on a dedicated thread (torch releases the GIL while it
computes), so the caller's event loop never blocks. A serving replica builds
the engine on that same thread (``on_own_thread``): OpenMP keeps a pool of
worker threads per thread that ever ran a parallel region, and once a
process holds more of its threads than it has cores, libgomp stops
spin-waiting between regions (its "throttled" spin count), so the hundred-odd
regions of a decode step each pay a sleep and a wake-up. Loading on the main
thread and stepping on another made a batch-1 step 25-30% slower on 2 cores
(``cluster/bench/serve.py --engine-baseline``). Requests and aborts reach
the thread through a queue; outputs go back to per-request asyncio queues via
``call_soon_threadsafe`` (``run_direct``: to a ``DirectStream`` that sends
them to the router from the engine thread, ``workers/engine/direct_stream.py``)::

    generate() --add--> [inbox] --> engine thread: add / abort / step
         ^                                  |
         +---- asyncio.Queue per request <--+ outputs

Cancelling the consumer of ``generate()`` (client gone, deadline) aborts the
request in the engine, which frees its blocks.

Streaming: a stream yields each output as it comes, except that outputs already queued when the consumer comes
back for the next one (it was busy: a loaded event loop, a slow client) go out as one, merged
(``merge_outputs``), so a busy loop does less work per token instead of falling behind; nothing is held back
to wait for more. With ``stream_interval`` N > 1, tokens after the first are sent N at a time (the last chunk
may hold fewer); the first token and the finish leave at once.

Admission: with ``max_waiting_requests`` set, ``generate()`` rejects a request at once
(``ReplicaOverloadedError``, nothing queued) while the replica already holds ``max_num_seqs +
max_waiting_requests`` unfinished requests, i.e. when more than ``max_waiting_requests`` would wait beyond one
full batch. Counted here, on the caller's loop, so a burst is bounded exactly, not as of the last engine step.
The error's ``retry_after_s`` (the client's retry hint) is the mean gap between the replica's recent
completions (``retry_hint``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional, TypeVar

from cluster.shared.types import GenerationRequest, ReplicaOverloadedError, ReplicaStats
from workers.engine.engine import LLMEngine
from workers.engine.loop_stats import RETRY_HINT_WINDOW, LoopTiming, name_os_thread, retry_hint, settle_future
from workers.engine.outputs import RequestOutput, chunk_due, merge_outputs
from workers.engine.pool_gate import PoolGate
from workers.engine.structured import timeout_message

if TYPE_CHECKING:
    from workers.engine.direct_stream import DirectStream

logger = logging.getLogger(__name__)

_STOP = object()
T = TypeVar("T")


class _LoopQueue:
    """``generate``'s target: outputs into an asyncio queue on the consumer's loop."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: object) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """Thread-backed async front of an engine.

    Args:
        engine: The engine; after ``start()`` only the engine thread touches it.
        after_step: Runs on the engine thread after each step.
        before_step: Runs on the engine thread before each step.
        on_idle: Runs on the engine thread before it waits for work (no request left);
            with ``before_step`` it tells a ``CoreShare`` when this replica is busy.
        max_waiting_requests: Admission bound (see the module docstring);
            None admits everything.
        stream_interval: Tokens a stream sends per chunk after its first
            (vLLM's and SGLang's ``stream_interval``); the first token and
            the finish always leave at once.
    """

    def __init__(self, engine: LLMEngine, after_step: Optional[Callable[[], None]] = None,
                 max_waiting_requests: Optional[int] = None, stream_interval: int = 1,
                 before_step: Optional[Callable[[], None]] = None,
                 on_idle: Optional[Callable[[], None]] = None) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stream_interval = stream_interval
        self._after_step = after_step  # runs on the engine thread after each step
        self._before_step = before_step
        self._on_idle = on_idle
        self._inbox: "queue.Queue[tuple[str, object]]" = queue.Queue()
        self._streams: dict[str, "_LoopQueue | DirectStream"] = {}
        self._lock = threading.Lock()  # guards _streams
        self.pool_gate = PoolGate()  # the engine thread's, lent in a forward and while idle (pool_gate.py)
        self._finish_times: collections.deque[float] = collections.deque(maxlen=RETRY_HINT_WINDOW)
        self._thread: Optional[threading.Thread] = None
        self._stats = engine.stats()
        self.timing = LoopTiming()
        self.error: Optional[BaseException] = None

    @classmethod
    def on_own_thread(cls, factory: Callable[[], LLMEngine], **kwargs: object) -> "AsyncEngine":
        """Builds the engine with ``factory()`` on the thread that then steps
        it, and returns the running front (``kwargs`` as for the constructor).

        Raises:
            Whatever ``factory`` raised (no thread is left running).
        """
        ready = threading.Event()
        box: dict[str, object] = {}

        def main() -> None:
            name_os_thread("engine-loop")  # its OpenMP threads inherit it: a replica's forward in top -H
            try:
                front = cls(factory(), **kwargs)  # type: ignore[arg-type]
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                box["error"] = exc
                ready.set()
                return
            front._thread = threading.current_thread()
            box["front"] = front
            ready.set()
            front._run()

        threading.Thread(target=main, name="engine-loop", daemon=True).start()
        ready.wait()
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["front"]  # type: ignore[return-value]

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine thread; running requests end with ``abort``."""
        if self._thread is not None:
            self._inbox.put(("stop", _STOP))
            self._thread.join(timeout)
            self._thread = None

    @property
    def stats(self) -> ReplicaStats:
        """Load figures as of the last step (no lock needed: replaced whole)."""
        return self._stats

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs until it finishes.

        Raises:
            ValueError: The request is invalid (nothing was queued).
            ReplicaOverloadedError: The admission bound is reached (nothing was queued).
            RuntimeError: The engine loop died.
        """
        out_queue = (target := _LoopQueue(asyncio.get_running_loop())).queue
        await self._submit(request, target)
        finished = False
        held: Optional[RequestOutput] = None  # tokens not yet yielded (stream_interval)
        sent_first: set[int] = set()  # choices (RequestOutput.index) whose first token went out
        try:
            while True:
                item = await out_queue.get()
                while True:
                    if isinstance(item, BaseException):
                        finished = True
                        if held is not None:  # what was computed still reaches the client, then the error
                            yield held
                        raise item
                    if held is not None and held.index != item.index:  # outputs of one choice merge
                        out, held = held, None
                        if out.new_token_ids:
                            sent_first.add(out.index)
                        yield out
                    held = item if held is None else merge_outputs(held, item)
                    if held.finished or out_queue.empty():
                        break
                    item = out_queue.get_nowait()  # already computed: sent with the rest, never waited for
                if chunk_due(held, sent_first, self.stream_interval):
                    out, held = held, None
                    if out.new_token_ids:
                        sent_first.add(out.index)
                    yield out
                    if out.finished:
                        finished = True
                        self._finish_times.append(time.monotonic())
                        return
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            if not finished:
                self._inbox.put(("abort", request.request_id))

    async def run_direct(self, request: GenerationRequest, stream: "DirectStream") -> int:
        """Runs a request whose outputs ``stream`` turns into chunks on the engine
        thread (``workers/engine/direct_stream.py``); returns the number of chunks sent.

        Raises:
            As ``generate``; and the error that ended the stream.
        """
        await self._submit(request, stream)
        try:
            sent = await stream.done
            self._finish_times.append(time.monotonic())  # the overload retry hint, as generate() keeps it
            return sent
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            stream.detach()
            if not stream.finished:
                self._inbox.put(("abort", request.request_id))

    async def _submit(self, request: GenerationRequest, target: "_LoopQueue | DirectStream") -> None:
        """Checks, admits and queues ``request``; the engine thread puts its outputs to ``target``."""
        if self.error is not None:
            raise RuntimeError(f"engine loop stopped: {self.error!r}")
        self.engine.validate(request)  # read-only checks; fail fast in the caller
        self._admit()
        self.start()
        compiled = await self._compile_grammar(request)  # off the engine thread: other requests step on
        with self._lock:
            self._streams[request.request_id] = target
        self._inbox.put(("add", (request, compiled)))

    async def _compile_grammar(self, request: GenerationRequest) -> object:
        """The request's structured-output grammar, compiled on the backend's
        pool (None without a constraint).

        Raises:
            ValueError: It does not compile, or not within the backend's
                ``compile_timeout_s`` (this request alone fails).
        """
        params = request.sampling_params.structured_outputs
        backend = getattr(self.engine, "structured", None)
        if params is None or backend is None:
            return None
        future = asyncio.wrap_future(backend.prepare(params))
        # asyncio.wait, not wait_for: a timeout must not cancel a compile other requests may share.
        done, _ = await asyncio.wait({future}, timeout=backend.config.compile_timeout_s)
        if not done:
            backend.stats.num_failures += 1
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
            raise ValueError(timeout_message(params, backend.config.compile_timeout_s))
        if future.exception() is not None:
            backend.stats.num_failures += 1
        return future.result()

    @property
    def num_unfinished(self) -> int:
        """Requests admitted whose stream has not ended."""
        return len(self._streams)

    def _admit(self) -> None:
        """Raises ReplicaOverloadedError when one more request would pass the bound."""
        if self.max_waiting_requests is None:
            return
        max_num_seqs = self.engine.scheduler.max_num_seqs
        capacity = max_num_seqs + self.max_waiting_requests
        if len(self._streams) >= capacity:
            hint = retry_hint(list(self._finish_times), time.monotonic())
            raise ReplicaOverloadedError(
                f"the replica holds {len(self._streams)} unfinished requests, its bound is max_num_seqs "
                f"{max_num_seqs} + max_waiting_requests {self.max_waiting_requests}: retry in {hint:.2f}s",
                retry_after_s=hint,
            )

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))  # the engine thread aborts it (no-op if unknown)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between steps; returns its result.

        Anything that reads or changes engine state (block pool snapshots,
        prefix-cache resets) goes through here, never from another thread.
        """
        self.start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._inbox.put(("call", (fn, loop, future)))
        return await future

    # ------------------------------------------------------ engine thread
    def _run(self) -> None:
        name_os_thread("engine-loop")
        self.pool_gate.take(self.engine)
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if block and self._on_idle is not None:
                    self._on_idle()
                if not self._drain_inbox(block):
                    break
                if self.engine.has_unfinished_requests():
                    if self._before_step is not None:
                        self._before_step()
                    began = time.perf_counter()
                    outputs = self.engine.step()
                    stepped = time.perf_counter()
                    self._deliver(outputs)
                    if self._after_step is not None:
                        self._after_step()
                    self.timing.add(began, stepped, time.perf_counter())
                self._stats = self.engine.stats()
        except BaseException as exc:  # noqa: BLE001 - report to every waiting stream
            logger.exception("engine loop failed")
            self.error = exc
            self._fail_all(RuntimeError(f"engine loop failed: {exc!r}"))
        else:
            self._abort_all()
        finally:
            self.pool_gate.give_back(self.engine)

    def _drain_inbox(self, block: bool) -> bool:
        """Applies queued adds and aborts; returns False on stop."""
        while True:
            try:
                kind, payload = self.pool_gate.get(self._inbox, block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(payload)  # type: ignore[arg-type]
            elif kind == "abort":
                out = self.engine.abort_request(payload)  # type: ignore[arg-type]
                if out is not None:
                    self._deliver([out])
            elif kind == "call":
                self._call(*payload)  # type: ignore[misc]

    def _call(self, fn: Callable[[LLMEngine], object], loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        try:
            result, error = fn(self.engine), None
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
            result, error = None, exc

        try:
            loop.call_soon_threadsafe(settle_future, future, result, error)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _add(self, payload: tuple[GenerationRequest, object]) -> None:
        request, compiled = payload
        try:
            self.engine.add_request(request, compiled)
        except ValueError as exc:
            self._send(request.request_id, exc)
        except Exception as exc:  # noqa: BLE001 - bad input must never end the engine loop
            logger.exception("adding request %r failed", getattr(request, "request_id", None))
            self.engine.abort_request(request.request_id)  # drops whatever was half-added
            self._send(request.request_id, ValueError(f"the request could not be queued: {exc!r}"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._send(out.request_id, out)

    def _send(self, request_id: str, item: object) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is None:
            # The consumer left; make sure the engine lets go of it too.
            if isinstance(item, RequestOutput) and not item.finished:
                self.engine.abort_request(request_id)
            return
        try:
            target.put(item)
        except RuntimeError:  # the consumer's loop is closed
            self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - one stream's failure must never end the engine loop
            logger.exception("delivering to request %r failed", request_id)
            self.engine.abort_request(request_id)

    def _abort_all(self) -> None:
        with self._lock:
            ids = list(self._streams)
        for request_id, out in ((r, self.engine.abort_request(r)) for r in ids):
            if out is not None:
                self._send(request_id, out)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self._send(request_id, exc)
