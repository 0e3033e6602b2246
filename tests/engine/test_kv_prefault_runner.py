"""A runner's KV cache committed at start, or not (``kv_cache_prefault``)."""

from cluster.shared.config import EngineConfig
from tests.factories import make_tiny_model_dir, resident_bytes


def test_the_runner_commits_its_kv_cache_unless_told_not_to(tmp_path):
    from workers.builder import build_engine

    model_dir = make_tiny_model_dir("llama", tmp_path / "m")
    for flag in (True, False):  # 39 MiB a layer: fresh pages, above glibc's largest mmap threshold
        config = EngineConfig.from_kwargs(model=str(model_dir), num_kv_blocks=10000, block_size=16,
                                          kv_cache_prefault=flag)
        runner = build_engine(config).engine.runner
        resident = sum(resident_bytes(c) for c in runner.kv_caches)
        total = sum(c.numel() * c.element_size() for c in runner.kv_caches)
        assert (resident >= total) if flag else (resident < total / 2), (flag, resident, total)
