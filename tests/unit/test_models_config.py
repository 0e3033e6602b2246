"""Several models in one cluster config: `models:` entries, their names, namespaces and errors."""

from __future__ import annotations

import pytest

from cluster.shared.config import ClusterConfig, ModelConfig

TWO = {
    "namespace": "prod",
    "redis_url": "redis://redis:6379/0",
    "models": [
        {"name": "smollm", "replicas": 2, "engine": {"max_num_seqs": 8}},
        {"name": "tiny", "engine": {"model": "/models/tiny-llama"}, "routing_policy": "least_load",
         "autoscaling": {"min_replicas": 1, "max_replicas": 3}},
    ],
}


def test_each_entry_becomes_a_single_model_config_of_its_own():
    cfg = ClusterConfig.from_dict(TWO)
    assert cfg.multi_model
    by_name = cfg.models_by_name()
    assert list(by_name) == ["smollm", "tiny"]  # the order given: the first is the default
    smollm, tiny = by_name["smollm"], by_name["tiny"]
    assert smollm.replicas == 2 and smollm.engine.scheduler.max_num_seqs == 8
    assert tiny.routing_policy == "least_load" and tiny.engine.model == "/models/tiny-llama"
    assert (smollm.namespace, tiny.namespace) == ("prod.smollm", "prod.tiny")
    assert smollm.redis_url == tiny.redis_url == "redis://redis:6379/0"
    assert not smollm.multi_model and not tiny.multi_model
    assert cfg.max_num_replicas == 2 + 3  # for sizing local Ray: every model at its most


def test_a_single_model_config_is_its_own_only_model():
    cfg = ClusterConfig.from_dict({"replicas": 2})
    assert not cfg.multi_model
    assert list(cfg.models_by_name().values()) == [cfg]
    assert cfg.max_num_replicas == 2


def test_the_name_defaults_to_the_model_folder():
    model = ModelConfig(engine=ClusterConfig.from_dict({"engine": {"model": "/m/Qwen3-0.6B"}}).engine)
    assert model.served_name == "Qwen3-0.6B"
    assert ModelConfig().served_name == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("mapping, message", [
    ({"replicas": 2, "models": [{"name": "a"}]}, "replicas is set at the top level but models: is set too"),
    ({"models": [{"name": "a"}, {"name": "a"}]}, "two models are named 'a'"),
    ({"models": [{"name": "a.b"}, {"name": "a/b"}]}, "map to one deployment name"),
    ({"models": [{"name": "a", "namespace": "x"}, {"name": "b", "namespace": "x"}]},
     "share the directory namespace 'x'"),
    ({"models": [{"name": "a", "replicas": 0}]}, "replicas must be >= 1"),
    ({"models": [{"name": "a", "routing_policy": "cache_awre"}]}, "did you mean 'cache_aware'"),
    ({"models": [{"name": "a", "replica": 2}]}, "models[0]"),
    ({"models": [{"name": "bad name"}]}, "name must be 1-128 letters"),
    ({"models": {"name": "a"}}, "models must be a list"),
])
def test_bad_model_lists_name_what_to_change(mapping, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ClusterConfig.from_dict(mapping)
