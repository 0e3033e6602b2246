"""Prometheus metrics of one replica, named as vLLM names them with the
prefix ``prefixserve:`` (so vLLM dashboards and alerts port over by renaming).

Every series carries the labels ``replica`` (Serve's replica id) and
``model`` (the served model name). Each ``ReplicaMetrics`` owns its own
``CollectorRegistry`` (never the process-global one), so several replicas in
one process -- tests -- never collide.

Where the figures come from::

    gauges      num_requests_{running,waiting,swapped}, kv_cache_usage_perc
                <- ReplicaStats of the last engine step   (set_load, before render)
    gauges      model_info{quantization, kv_cache_dtype} (1), model_weight_bytes,
                kv_cache_bytes <- the runner, once at start (set_model_info)
    counters    num_preemptions_total, prefix_cache_{queries,hits}_total (tokens),
                model_compilations_total (torch.compile graphs, enforce_eager False)
                <- the engine's cumulative counters       (record_engine_counters,
                   after every step on the engine thread)
    counters    spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total,
                spec_decode_num_accepted_tokens_per_pos_total{position}
                <- the speculator's stats                 (record_spec_decode, ditto)
    counters    structured_output_{requests,grammar_cache_hits,grammar_failures,
                jump_forward_tokens}_total; histogram structured_output_compile_seconds
                <- the grammar backend's stats            (record_structured, ditto)
    gauges      lora_loaded_adapters, lora_active_adapters; counters lora_loads_total,
                lora_evictions_total; histogram lora_load_seconds
                <- the engine's LoRA manager              (record_lora, ditto)
    counters    lora_requests_total{lora_name}, lora_generation_tokens_total{lora_name}
                (at most MAX_LORA_NAMES names, the rest as "_other")
    counters    prompt_tokens_total, generation_tokens_total
    histograms  time_to_first_token_seconds, inter_token_latency_seconds,
                e2e_request_latency_seconds, request_queue_time_seconds
                <- each request's outputs, timed where the replica receives
                   them                                   (RequestTimer)

The replica publishes ``render()``'s text to the prefix directory with its
heartbeats; the router's ``GET /metrics`` merges the live replicas' texts
(``router/metrics.py``). No torch here: this module only needs
``prometheus_client``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cluster.shared.metrics_format import METRIC_PREFIX as PREFIX
from cluster.shared.metrics_format import render_registry
from cluster.shared.types import ReplicaStats
from workers.engine.outputs import RequestOutput

LABELS = ("replica", "model")
MAX_LORA_NAMES = 64  # lora_name label values per replica; later adapters count as "_other"
LORA_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# vLLM's buckets (vllm/v1/metrics/loggers.py), so quantiles compare.
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ReplicaMetrics:
    """The ``prefixserve:*`` series of one replica.

    Args:
        replica_id: Value of the ``replica`` label.
        model_name: Value of the ``model`` label.
        registry: Where the metrics live; a fresh ``CollectorRegistry`` by default.
    """

    def __init__(self, replica_id: str, model_name: str, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"replica": replica_id, "model": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, LABELS, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            # prometheus_client appends _total to a counter's samples.
            return Counter(PREFIX + name.removesuffix("_total"), doc, LABELS, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=self.registry).labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Requests swapped out to CPU memory.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Used device KV blocks / total (1 = 100%).")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache (at each admission).")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits_total", "Prompt tokens served from the prefix cache.")
        self.num_preemptions = counter("num_preemptions_total", "Sequences preempted (swapped or recomputed).")
        self.model_compilations = counter(
            "model_compilations_total", "Graphs torch.compile built for the model (enforce_eager False).")
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts_total", "Steps of a sequence that verified speculated tokens.")
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens_total", "Speculated tokens verified.")
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens_total", "Speculated tokens accepted.")
        self._accepted_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Speculated tokens accepted, by position in the draft.",
            (*LABELS, "position"), registry=self.registry)
        self._spec_counts: dict[str, int] = {}
        self._structured = {
            "requests": counter("structured_output_requests_total", "Requests with a structured-output constraint."),
            "cache_hits": counter("structured_output_grammar_cache_hits_total",
                                  "Constraints whose compiled grammar was cached (or being compiled)."),
            "failures": counter("structured_output_grammar_failures_total",
                                "Constraints that did not compile, or not within compile_timeout_s."),
            "jump_forward_tokens": counter("structured_output_jump_forward_tokens_total",
                                           "Forced tokens proposed by jump-forward decoding."),
        }
        self._structured_counts: dict[str, int] = {}
        self.structured_compile_seconds = histogram(
            "structured_output_compile_seconds", "Time to compile a constraint's grammar (cache misses).",
            COMPILE_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of requests that produced output.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "From the replica receiving a request to its first token.",
            TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Between consecutive outputs of a request.", ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "From the replica receiving a request to its last output.",
            REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "From entering the engine to first being scheduled.",
            REQUEST_LATENCY_BUCKETS)
        self.model_weight_bytes = gauge("model_weight_bytes", "Bytes of the model's weights (as packed or quantized).")
        self.kv_cache_bytes = gauge("kv_cache_bytes", "Bytes of the device KV cache.")
        self._info = Gauge(PREFIX + "model_info", "How the model runs: quantization and KV cache dtype (value 1).",
                           (*LABELS, "quantization", "kv_cache_dtype"), registry=self.registry)
        self.lora_loaded = gauge("lora_loaded_adapters", "LoRA adapters loaded (max_cpu_loras bounds them).")
        self.lora_active = gauge("lora_active_adapters",
                                 "LoRA adapters of the running requests (max_loras bounds them).")
        self.lora_loads = counter("lora_loads_total", "LoRA adapters loaded from their folders.")
        self.lora_evictions = counter("lora_evictions_total", "LoRA adapters evicted to make room (LRU).")
        self.lora_load_seconds = histogram("lora_load_seconds", "Time to read and install a LoRA adapter.",
                                           LORA_LOAD_BUCKETS)
        self._lora_requests = Counter(PREFIX + "lora_requests", "Requests that ran with a LoRA adapter.",
                                      (*LABELS, "lora_name"), registry=self.registry)
        self._lora_tokens = Counter(PREFIX + "lora_generation_tokens", "Tokens generated with a LoRA adapter.",
                                    (*LABELS, "lora_name"), registry=self.registry)
        self._lora_names: set[str] = set()
        self._lora_counts = {"loads": 0, "evictions": 0}
        self._labels = labels
        self._engine_counts = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                               "model_compilations": 0}

    # ----------------------------------------------------------- recording
    def set_load(self, stats: ReplicaStats) -> None:
        """Sets the gauges from the last step's load figures."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_swapped.set(stats.num_swapped)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)

    def set_model_info(self, quantization: Optional[str], kv_cache_dtype: str, weight_bytes: int,
                       kv_cache_bytes: int) -> None:
        """The model's quantization (``none`` without), KV cache dtype and sizes."""
        self._info.clear()
        self._info.labels(**self._labels, quantization=quantization or "none", kv_cache_dtype=kv_cache_dtype).set(1)
        self.model_weight_bytes.set(weight_bytes)
        self.kv_cache_bytes.set(kv_cache_bytes)

    def record_engine_counters(self, *, num_preemptions: int, prefix_cache_queries: int,
                               prefix_cache_hits: int, model_compilations: int = 0) -> None:
        """Advances the counters to the engine's cumulative values (never backwards)."""
        targets = {
            "num_preemptions": (num_preemptions, self.num_preemptions),
            "prefix_cache_queries": (prefix_cache_queries, self.prefix_cache_queries),
            "prefix_cache_hits": (prefix_cache_hits, self.prefix_cache_hits),
            "model_compilations": (model_compilations, self.model_compilations),
        }
        for name, (value, counter) in targets.items():
            delta = value - self._engine_counts[name]
            if delta > 0:
                counter.inc(delta)
                self._engine_counts[name] = value

    def record_spec_decode(self, *, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                           accepted_per_position: list[int]) -> None:
        """Advances the speculative-decoding counters to the engine's cumulative values."""
        targets = {
            "drafts": (num_drafts, self.spec_decode_num_drafts),
            "draft_tokens": (num_draft_tokens, self.spec_decode_num_draft_tokens),
            "accepted_tokens": (num_accepted_tokens, self.spec_decode_num_accepted_tokens),
        }
        for position, value in enumerate(accepted_per_position):
            targets[f"pos{position}"] = (value, self._accepted_per_pos.labels(**self._labels, position=str(position)))
        for name, (value, counter) in targets.items():
            delta = value - self._spec_counts.get(name, 0)
            if delta > 0:
                counter.inc(delta)
                self._spec_counts[name] = value

    def record_structured(self, *, num_requests: int, num_cache_hits: int, num_failures: int,
                          num_jump_forward_tokens: int, compile_seconds: list[float]) -> None:
        """Advances the structured-output counters to the backend's cumulative
        values and observes the compile times taken since the last call."""
        values = {"requests": num_requests, "cache_hits": num_cache_hits, "failures": num_failures,
                  "jump_forward_tokens": num_jump_forward_tokens}
        for name, value in values.items():
            delta = value - self._structured_counts.get(name, 0)
            if delta > 0:
                self._structured[name].inc(delta)
                self._structured_counts[name] = value
        for seconds in compile_seconds:
            self.structured_compile_seconds.observe(seconds)

    def record_lora(self, *, num_loaded: int, num_active: int, num_loads: int, num_evictions: int,
                    load_seconds: Sequence[float] = ()) -> None:
        """Sets the adapter gauges and advances the counters to the manager's
        cumulative values; observes each load's seconds (``load_seconds``: those since the last call)."""
        self.lora_loaded.set(num_loaded)
        self.lora_active.set(num_active)
        for name, value, counter in (("loads", num_loads, self.lora_loads),
                                     ("evictions", num_evictions, self.lora_evictions)):
            delta = value - self._lora_counts[name]
            if delta > 0:
                counter.inc(delta)
                self._lora_counts[name] = value
        for seconds in load_seconds:
            self.lora_load_seconds.observe(seconds)

    def lora_label(self, name: str) -> str:
        """``name`` as a ``lora_name`` label value (bounded: ``_other`` past ``MAX_LORA_NAMES``)."""
        if name not in self._lora_names and len(self._lora_names) >= MAX_LORA_NAMES:
            return "_other"
        self._lora_names.add(name)
        return name

    def start_request(self, clock: Callable[[], float] = time.monotonic,
                      lora_name: Optional[str] = None) -> "RequestTimer":
        """A timer for one request, started now (``lora_name``: its adapter)."""
        return RequestTimer(self, clock, lora_name)

    # ----------------------------------------------------------- exposition
    def record_engine(self, engine: Any, runner: Any) -> None:
        """Every cumulative figure of ``engine`` (an ``LLMEngine``) into the
        metrics: its counters, speculation's, structured outputs', LoRA's.
        Engine thread, after each step."""
        scheduler = engine.scheduler
        self.record_engine_counters(
            num_preemptions=scheduler.num_preemptions_total,
            prefix_cache_queries=scheduler.kv_manager.prefix_cache_queries,
            prefix_cache_hits=scheduler.kv_manager.prefix_cache_hits,
            model_compilations=getattr(runner, "num_compilations", 0) if runner is not None else 0,
        )
        if scheduler.speculator is not None:
            stats = scheduler.speculator.stats
            self.record_spec_decode(num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
                                    num_accepted_tokens=stats.num_accepted_tokens,
                                    accepted_per_position=stats.accepted_per_position)
        structured = getattr(engine, "structured", None)
        if structured is not None:
            grammar = structured.stats
            proposer = getattr(scheduler.speculator, "proposer", None)
            self.record_structured(
                num_requests=grammar.num_constrained_requests, num_cache_hits=grammar.num_cache_hits,
                num_failures=grammar.num_failures, compile_seconds=grammar.take_compile_seconds(),
                num_jump_forward_tokens=getattr(proposer, "num_proposed_tokens", 0))
        lora = getattr(engine, "lora", None)
        if lora is not None:
            active = {s.lora.slot for s in scheduler.queue.running if s.lora is not None}
            self.record_lora(num_loaded=len(lora.published), num_active=len(active), num_loads=lora.num_loads,
                             num_evictions=lora.num_evictions, load_seconds=lora.cost.take_load_seconds())

    def render(self) -> bytes:
        """The registry in Prometheus text format (without ``*_created`` series)."""
        return render_registry(self.registry)


class RequestTimer:
    """Times one request's outputs into its replica's metrics.

    Call ``on_output`` with every ``RequestOutput`` as it arrives.
    """

    def __init__(self, metrics: ReplicaMetrics, clock: Callable[[], float] = time.monotonic,
                 lora_name: Optional[str] = None) -> None:
        self._metrics = metrics
        self._clock = clock
        self._lora = None
        if lora_name is not None:
            label = metrics.lora_label(lora_name)
            metrics._lora_requests.labels(**metrics._labels, lora_name=label).inc()
            self._lora = metrics._lora_tokens.labels(**metrics._labels, lora_name=label)
        self._start = clock()
        self._last_token: Optional[float] = None
        self._queue_time_seen = False

    def on_output(self, out: RequestOutput) -> None:
        """Records one output (mutates the metrics)."""
        m, now = self._metrics, self._clock()
        if out.new_token_ids:
            if self._last_token is None:
                m.time_to_first_token.observe(now - self._start)
                m.prompt_tokens.inc(out.num_prompt_tokens)
                for _ in out.new_token_ids[1:]:  # came with the first: no gap (one per token after the first)
                    m.inter_token_latency.observe(0.0)
            else:  # a chunk of k tokens (stream_interval, or outputs that queued up): k gaps of 1/k
                share = (now - self._last_token) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    m.inter_token_latency.observe(share)
            self._last_token = now
            m.generation_tokens.inc(len(out.new_token_ids))
            if self._lora is not None:
                self._lora.inc(len(out.new_token_ids))
        if out.queue_time is not None and not self._queue_time_seen:
            m.request_queue_time.observe(out.queue_time)
            self._queue_time_seen = True
        if out.finished:
            m.e2e_request_latency.observe(now - self._start)
