"""Tensor parallelism across processes: one Ray actor per rank, joined by
``torch.distributed`` (gloo on CPU, NCCL on GPU).

::

    engine thread (the replica, or the offline LLM)
      TensorParallelRunner.execute(SchedulerOutput)
        |  one actor call per rank, then a blocking ray.get (never on an event loop)
        v
      rank 0 .. rank N-1 (RankWorker actors)
        each: its model shard (workers/model/tp.py), its KV shard and its CPU
        swap copies in a ModelRunner; swap maps and block tables are the same
        on every rank (one scheduler, in the driver)
        |  all-reduce: embedding, o_proj, down_proj; gather: logits -> rank 0
        v
      rank 0 samples over the full vocabulary -> ModelOutput; the others None

Start-up: the driver plans every rank's shard (a ValueError before any actor
starts), creates the actors, rank 0 picks a free loopback port, and every rank
joins ``tcp://127.0.0.1:<port>``, loads its own slice from the model folder
(weights never cross the object store) and reports how many KV blocks it can
hold. The driver takes the minimum, so a block id means the same slots on
every rank, and the ranks allocate their KV and swap tensors.

Placement and threads: ``workers/placement.py``.

LoRA: the driver's ``LoRAManager`` decides which adapter is in which slot;
every rank installs its own shard of it in that slot (``call_ranks``,
``workers/lora/side_paths.py``), so the ranks hold the same adapters.

Sampling happens on rank 0 only, over the gathered full logits, with the
engine seed: outputs and seeded draws do not depend on the TP size.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

import ray
import torch
import torch.distributed as dist

from cluster.shared.config import EngineConfig
from cluster.shared.ray_local import LOOPBACK, init_local_ray
from workers.engine.outputs import ModelOutput, SchedulerOutput
from workers.lora.side_paths import AdapterSlots, RankAdapterSlots
from workers.model.config import ModelArchConfig
from workers.model.linear import weight_bytes
from workers.model.loader import read_arch
from workers.model.tp import TPContext, TPShard, plan_shards
from workers.provision import activation_bytes_for, load_model_for, num_cpu_blocks_for, num_kv_blocks_for
from workers.kv_copy import RankKVCopies
from workers.runner import ModelRunner
from workers.kv_memory import kv_block_bytes
from workers.placement import RankPlacement, rank_placements, set_cpu_threads, threads_per_rank

logger = logging.getLogger(__name__)

DEFAULT_RANK_NUM_CPUS = 0.5
STARTUP_TIMEOUT_S = 300.0
# A collective waits this long for a peer; ranks move in lockstep, so only a dead peer trips it.
COLLECTIVE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RankInfo:
    """What a rank reports after loading its shard."""

    max_kv_blocks: int
    block_bytes: int
    device: str
    dtype: str
    pid: int
    weight_bytes: int = 0
    quantization: Optional[str] = None
    kv_cache_dtype: str = "auto"


class RankWorker(RankKVCopies):
    """One tensor-parallel rank; created as a Ray actor by ``TensorParallelRunner``.

    Args:
        config: The engine configuration.
        model_dir: The model folder (each rank reads its slice itself).
        shard: This rank's slice (``plan_shards``).
        device: ``cpu`` or ``cuda`` (the actor's GPU).
        num_threads: Torch (and OpenMP) threads.
    """

    def __init__(self, config: EngineConfig, model_dir: str, shard: TPShard, device: str, num_threads: int) -> None:
        # Before the native decode kernel loads its OpenMP runtime.
        set_cpu_threads(num_threads)
        self.config = config
        self.model_dir = Path(model_dir)
        self.shard = shard
        self.device = torch.device(device)
        self.tp: Optional[TPContext] = None
        self.model: Optional[torch.nn.Module] = None
        self.arch: Optional[ModelArchConfig] = None
        self.runner: Optional[ModelRunner] = None
        self.dtype: Optional[torch.dtype] = None
        self._execute_seconds = 0.0
        self._num_steps = 0
        self.lora: Optional[AdapterSlots] = None  # this rank's LoRA side paths, with enable_lora

    def pick_port(self) -> int:
        """A free TCP port on loopback for the group's rendezvous (rank 0)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOOPBACK, 0))
            return sock.getsockname()[1]

    def setup(self, port: int, max_model_len: int) -> RankInfo:
        """Joins the process group and loads this rank's shard."""
        # Rendezvous and gloo pairs on loopback: the ranks share one node (STRICT_PACK).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{LOOPBACK}:{port}",
            rank=self.shard.rank,
            world_size=self.shard.world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        self.tp = TPContext(self.shard)
        self.model, arch, self.dtype = load_model_for(self.config, self.model_dir, self.device, self.tp)
        self.arch = arch
        block_bytes = kv_block_bytes(
            arch.num_hidden_layers, self.config.cache.block_size, self.shard.num_kv_heads, arch.head_dim, self.dtype,
            self.config.cache.kv_cache_dtype,
        )
        # Every rank profiles (the forward's all-reduces need them all), each for its own device.
        activations = activation_bytes_for(self.model, self.config, self.shard.num_kv_heads, arch.head_dim,
                                           self.dtype, self.device, max_model_len)
        return RankInfo(
            max_kv_blocks=num_kv_blocks_for(self.config, block_bytes, self.device, max_model_len, activations),
            block_bytes=block_bytes,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            pid=os.getpid(),
            weight_bytes=weight_bytes(self.model),
            quantization=getattr(self.model, "quantization", None),
            kv_cache_dtype=self.config.cache.kv_cache_dtype,
        )

    def init_cache(self, num_kv_blocks: int, num_cpu_blocks: int) -> None:
        """Allocates this rank's KV shard and swap copies (the same block counts on every rank)."""
        assert self.model is not None and self.arch is not None and self.dtype is not None, "setup() first"
        self.runner = ModelRunner(
            self.model,
            num_layers=self.arch.num_hidden_layers,
            num_kv_heads=self.shard.num_kv_heads,
            head_dim=self.arch.head_dim,
            block_size=self.config.cache.block_size,
            num_kv_blocks=num_kv_blocks,
            num_cpu_blocks=num_cpu_blocks,
            dtype=self.dtype,
            device=self.device,
            seed=self.config.seed,
            kv_cache_dtype=self.config.cache.kv_cache_dtype,
            prefault_kv=self.config.cache.kv_cache_prefault,
        )

    def attach_lora(self, max_lora_rank: int) -> None:
        """Gives this rank's layers LoRA side paths (``workers/lora/side_paths.py``)."""
        assert self.runner is not None and self.model is not None, "init_cache() first"
        native = any(getattr(m, "backend", "") == "native" for m in self.model.modules())
        self.lora = self.runner.lora = AdapterSlots(self.model, max_lora_rank, native)

    def call_lora(self, method: str, *args: Any) -> Any:
        """``AdapterSlots.<method>(*args)`` on this rank (stage, commit, drop): the driver's manager decides."""
        assert self.lora is not None, "attach_lora() first"
        return getattr(self.lora, method)(*args)

    def execute(self, sched: SchedulerOutput) -> Optional[ModelOutput]:
        """Runs one step; rank 0 returns the sampled tokens, the others None."""
        assert self.runner is not None, "init_cache() first"
        start = time.perf_counter()
        out = self.runner.execute(sched)
        self._execute_seconds += time.perf_counter() - start
        self._num_steps += 1
        return out if self.shard.rank == 0 else None

    def take_timings(self) -> dict[str, float]:
        """Seconds in ``execute`` and in collectives, steps and collectives since the last call."""
        assert self.tp is not None
        out = {"execute_s": self._execute_seconds, "comm_s": self.tp.comm_seconds, "steps": self._num_steps,
               "collectives": self.tp.num_collectives}
        self._execute_seconds = self.tp.comm_seconds = 0.0
        self._num_steps = self.tp.num_collectives = 0
        return out


class TensorParallelRunner:
    """Drives the rank actors; the engine's runner when ``tensor_parallel_size > 1``.

    Build it with ``create``. ``execute`` blocks on ``ray.get`` and must run on
    the engine thread, never in an event loop.
    """

    def __init__(self, ranks: Sequence[Any], infos: Sequence[RankInfo], num_kv_blocks: int, num_cpu_blocks: int):
        self._ranks: Optional[list[Any]] = list(ranks)
        self.rank_pids = [info.pid for info in infos]
        self.num_kv_blocks = num_kv_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.kv_cache_bytes = num_kv_blocks * sum(info.block_bytes for info in infos)
        self.description = f"{infos[0].dtype} on {len(infos)} x {infos[0].device} ranks"
        self.weight_bytes = sum(info.weight_bytes for info in infos)
        self.kv_cache_dtype = infos[0].kv_cache_dtype
        self.quantization = infos[0].quantization
        self.execute_seconds = 0.0  # wall time of execute(), for the breakdown in bench scripts

    @property
    def world_size(self) -> int:
        return len(self.rank_pids)

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        model_dir: Path,
        max_model_len: int,
        *,
        num_cpus_per_rank: float = DEFAULT_RANK_NUM_CPUS,
        num_gpus_per_rank: Optional[float] = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> "TensorParallelRunner":
        """Starts the ranks (in the current placement group, if any) and sizes the KV cache.

        Args:
            config: The engine configuration (``parallel.tensor_parallel_size`` ranks).
            model_dir: The resolved model folder.
            max_model_len: Caps the KV blocks (see ``num_kv_blocks_for``).
            num_cpus_per_rank / num_gpus_per_rank: Resources of a rank outside a
                placement group; GPUs default to 1 when ``config.device`` is
                cuda, or unset and the cluster has a GPU per rank.
            startup_timeout_s: How long the ranks may take to be scheduled and load.

        Raises:
            ValueError: The model cannot be split that way, or the placement
                group has no room; says what to change.
            RuntimeError: The ranks could not start in time.
        """
        world_size = config.parallel.tensor_parallel_size
        arch = read_arch(model_dir)
        shards = plan_shards(
            arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size, arch.vocab_size, world_size,
            arch.moe_intermediate_size, arch.shared_expert_intermediate_size,
        )
        init_local_ray()  # no-op when this process is already connected (a Serve replica)
        pg = ray.util.get_current_placement_group()
        if num_gpus_per_rank is None:
            num_gpus_per_rank = 1.0 if _wants_gpu(config, world_size) else 0.0
        placements = rank_placements(world_size, num_cpus_per_rank, num_gpus_per_rank, pg)
        actor_cls = ray.remote(RankWorker)
        ranks = [
            _start_rank(actor_cls, config, model_dir, shard, place, pg) for shard, place in zip(shards, placements)
        ]
        try:
            return cls._start(ranks, config, max_model_len, startup_timeout_s, placements)
        except BaseException:
            _kill(ranks)
            raise

    @classmethod
    def _start(
        cls, ranks: list[Any], config: EngineConfig, max_model_len: int, timeout: float,
        placements: list[RankPlacement],
    ) -> "TensorParallelRunner":
        started = time.monotonic()
        try:
            port = ray.get(ranks[0].pick_port.remote(), timeout=timeout)
            infos: list[RankInfo] = _get_all([r.setup.remote(port, max_model_len) for r in ranks], timeout)
        except ray.exceptions.GetTimeoutError:
            need = ", ".join(f"{p.num_cpus} CPU/{p.num_gpus} GPU" for p in placements)
            raise RuntimeError(
                f"tensor-parallel ranks did not start within {timeout:.0f}s (they need {need}; Ray has "
                f"{ray.available_resources()} free): give Ray more CPUs or lower the ranks' num_cpus"
            ) from None
        num_kv_blocks = min(info.max_kv_blocks for info in infos)
        num_cpu_blocks = num_cpu_blocks_for(config, max(info.block_bytes for info in infos), num_kv_blocks)
        _get_all([r.init_cache.remote(num_kv_blocks, num_cpu_blocks) for r in ranks], timeout)
        logger.info("%d tensor-parallel ranks ready in %.1fs (pids %s)", len(ranks), time.monotonic() - started,
                    [info.pid for info in infos])
        return cls(ranks, infos, num_kv_blocks, num_cpu_blocks)

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Sends the step to every rank and returns rank 0's sampled tokens.

        Raises:
            RuntimeError: A rank failed; the group is stopped (it cannot
                continue: the ranks' collectives no longer line up).
        """
        if self._ranks is None:
            raise RuntimeError("the tensor-parallel runner is shut down")
        if sched.is_empty:  # nothing to swap or compute: spare the ranks a round trip
            return ModelOutput(sampled_token_ids=[], logprobs=[])
        start = time.perf_counter()
        light = _without_sampling_inputs(sched)
        refs = [rank.execute.remote(sched if i == 0 else light) for i, rank in enumerate(self._ranks)]
        try:
            out = _get_all(refs)[0]
        except Exception as exc:
            self.shutdown()
            raise RuntimeError(f"a tensor-parallel rank failed; the ranks are stopped: {exc}") from exc
        self.execute_seconds += time.perf_counter() - start
        return out

    def attach_lora(self, max_lora_rank: int) -> RankAdapterSlots:
        """Gives every rank's layers LoRA side paths; the handle that drives them as one."""
        self.call_ranks("attach_lora", max_lora_rank)
        return RankAdapterSlots(self)

    def call_ranks(self, method: str, *args: Any) -> list[Any]:
        """``RankWorker.<method>(*args)`` on every rank, their results in rank order.

        Raises:
            ValueError: A rank refused (its message, e.g. a bad LoRA adapter).
        """
        assert self._ranks is not None, "shut down"
        try:
            return _get_all([getattr(rank, method).remote(*args) for rank in self._ranks])
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, ValueError):
                raise ValueError(str(exc.cause)) from None
            raise

    def take_timings(self) -> list[dict[str, float]]:
        """Per rank: seconds in ``execute`` and in collectives, steps and collectives since the last call."""
        assert self._ranks is not None, "shut down"
        return ray.get([rank.take_timings.remote() for rank in self._ranks])

    def shutdown(self) -> None:
        """Kills the rank actors (their processes exit); idempotent."""
        ranks, self._ranks = self._ranks, None
        if ranks:
            _kill(ranks)
            logger.info("stopped %d tensor-parallel ranks", len(ranks))


def _wants_gpu(config: EngineConfig, world_size: int) -> bool:
    if config.device is not None:
        return config.device.startswith("cuda")
    return ray.cluster_resources().get("GPU", 0) >= world_size


def _start_rank(
    actor_cls: Any, config: EngineConfig, model_dir: Path, shard: TPShard, place: RankPlacement, pg: Any
) -> Any:
    """Creates one rank actor (it starts loading only when ``setup`` is called)."""
    options: dict[str, Any] = {"num_cpus": place.num_cpus, "num_gpus": place.num_gpus}
    if place.bundle_index is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=place.bundle_index
        )
    device = "cuda" if place.num_gpus > 0 else "cpu"
    threads = config.parallel.cpu_threads or threads_per_rank(place.num_cpus, shard.world_size)
    return actor_cls.options(**options).remote(config, str(model_dir), shard, device, threads)


def _get_all(refs: list[Any], timeout: Optional[float] = None) -> list[Any]:
    """``ray.get`` of every ref, raising as soon as any fails (the others may
    wait forever on a collective with the failed rank)."""
    pending = list(refs)
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise ray.exceptions.GetTimeoutError(f"ranks did not answer within {timeout}s")
        ray.get(ready[0])  # raises the rank's error
    return ray.get(refs)


def _without_sampling_inputs(sched: SchedulerOutput) -> SchedulerOutput:
    """The step as ranks other than 0 need it: no prompt / output token lists
    (only rank 0 samples, and penalties and seeds need them) and no grammar masks."""
    light = [dataclasses.replace(r, prompt_token_ids=(), output_token_ids=(), grammar_bitmask=None)
             for r in sched.scheduled]
    return dataclasses.replace(sched, scheduled=light)


def _kill(ranks: Sequence[Any]) -> None:
    for rank in ranks:
        try:
            ray.kill(rank, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead, or Ray is shutting down
            logger.debug("could not kill a rank actor", exc_info=True)
