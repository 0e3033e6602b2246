"""A runner's KV cache committed at start, or not (``kv_cache_prefault``)."""

from cluster.shared.config import EngineConfig
from tests.factories import make_tiny_model_dir, resident_bytes


def test_the_runner_commits_its_kv_cache_unless_told_not_to(tmp_path, monkeypatch):
    import workers.runner as runner_module
    from workers.builder import build_engine

    model_dir = make_tiny_model_dir("llama", tmp_path / "m")
    calls = []
    real = runner_module.prefault
    monkeypatch.setattr(runner_module, "prefault", lambda caches: (calls.append(len(caches)), real(caches)))
    for flag in (True, False):
        config = EngineConfig.from_kwargs(model=str(model_dir), num_kv_blocks=2048, block_size=16,
                                          kv_cache_prefault=flag)
        runner = build_engine(config).engine.runner
        if flag:
            assert calls == [len(runner.kv_caches)]
            assert sum(resident_bytes(c) for c in runner.kv_caches) >= sum(
                c.numel() * c.element_size() for c in runner.kv_caches)
    assert calls == [2]  # the second engine (off) committed nothing up front
