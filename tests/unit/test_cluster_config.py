"""The cluster config file: one strict schema for `prefixserve up --config` and the RayService."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from cluster.shared.config import AutoscalingConfig, ClusterConfig, EngineConfig, RouterConfig

FULL = """
replicas: 2
replica_num_cpus: 0.25
redis_url: redis://redis:6379/0
namespace: smollm2
routing_policy: least_load
engine:
  dtype: float32
  max_model_len: 2048
  cache: {block_size: 32, kv_cache_memory: 0.5}
  max_num_seqs: 16            # flat vLLM-style knob of engine.scheduler
  parallel: {tensor_parallel_size: 1}
router: {host: 0.0.0.0, grpc_port: 50051, http_port: 8000, num_routers: 2}
autoscaling:
  min_replicas: 1
  max_replicas: 4
  target_kv_cache_usage: 0.8
  target_ttft_s: null
"""


def test_a_full_file_lands_in_every_section(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(FULL)
    cfg = ClusterConfig.from_yaml(path)
    assert cfg.replicas == 2 and cfg.replica_num_cpus == 0.25 and cfg.routing_policy == "least_load"
    assert cfg.engine.cache.block_size == 32 and cfg.engine.cache.kv_cache_memory == 0.5
    assert cfg.engine.scheduler.max_num_seqs == 16
    assert cfg.router == RouterConfig(host="0.0.0.0", grpc_port=50051, http_port=8000, num_routers=2)
    assert cfg.autoscaling == AutoscalingConfig(min_replicas=1, max_replicas=4, target_kv_cache_usage=0.8,
                                                target_ttft_s=None)
    # to_dict -> YAML -> from_dict is the identity.
    assert ClusterConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


def test_defaults_and_empty_file(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert ClusterConfig.from_yaml(path) == ClusterConfig()
    assert ClusterConfig.from_dict({}).autoscaling is None


@pytest.mark.parametrize(
    "mapping,message",
    [
        ({"replica": 2}, "unknown key 'replica'; did you mean 'replicas'"),
        ({"engine": {"cache": {"blok_size": 8}}}, "'engine.cache.blok_size'; did you mean 'engine.cache.block_size'"),
        ({"engine": {"max_num_seq": 8}}, "'engine.max_num_seq'; did you mean 'engine.max_num_seqs'"),
        ({"engine": {"schedular": {}}}, "'engine.schedular'; did you mean 'engine.scheduler'"),
        ({"router": {"grpc_prot": 1}}, "'router.grpc_prot'; did you mean 'router.grpc_port'"),
        # Ray's own AutoscalingConfig ignores this misspelling; ours names it.
        ({"autoscaling": {"max_replica": 3}}, "'autoscaling.max_replica'; did you mean 'autoscaling.max_replicas'"),
        ({"autoscaling": {"downscale_delay": 3}}, "did you mean 'autoscaling.downscale_delay_s'"),
    ],
)
def test_unknown_keys_are_named_with_their_path_and_closest_key(mapping, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        ClusterConfig.from_dict(mapping)


@pytest.mark.parametrize(
    "mapping,message",
    [
        ({"replicas": "2"}, "replicas must be an integer, got '2'"),
        ({"replicas": True}, "replicas must be an integer"),
        ({"engine": {"cache": {"enable_prefix_caching": "yes"}}},
         "engine.cache.enable_prefix_caching must be true or false"),
        ({"router": {"http_port": 80.5}}, "router.http_port must be an integer"),
        ({"engine": {"cache": [16]}}, "engine.cache must be a mapping"),
        ({"engine": {"cache": {"block_size": 12}}}, "engine.cache: block_size must be a power of two"),
        ({"engine": {"block_size": 16, "cache": {"block_size": 16}}}, "engine.block_size and engine.cache.block_size"),
        ({"autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "autoscaling: max_replicas"),
        ({"autoscaling": {"min_replicas": 2}}, r"replicas \(1\) is the initial replica count.*set replicas: 2"),
        ({"autoscaling": {"downscale_headroom": 1.0}}, "downscale_headroom must be in"),
        ({"routing_policy": "cache-aware"}, "did you mean 'cache_aware'"),
        ({"directory_lookup": "lua"}, r"directory_lookup must be one of \('index', 'redis'\)"),
        ({"router": {"replica_transport": "http"}}, "replica_transport must be one of direct, grpc, actor, got 'http'"),
        ({"router": {"tool_call_parser": "mistral"}},
         "tool_call_parser must be one of auto, hermes, llama3_json, got 'mistral'"),
        ({"max_replicas_per_node": 0}, r"max_replicas_per_node must be >= 1 \(or unset for no cap\), got 0"),
        ({"max_replicas_per_node": 1, "engine": {"tensor_parallel_size": 2}},
         "max_replicas_per_node applies to replicas without tensor parallelism"),
    ],
)
def test_bad_values_name_the_key_and_what_to_change(mapping, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(mapping)


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  cache:\n    blok_size: 8\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: unknown key 'engine\.cache\.blok_size'"):
        ClusterConfig.from_yaml(bad)
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        ClusterConfig.from_yaml(tmp_path / "list.yaml")
    with pytest.raises(ValueError, match="cannot read"):
        ClusterConfig.from_yaml(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        ClusterConfig.from_yaml(tmp_path / "broken.yaml")


def test_every_field_is_loadable():
    # A new config field must be reachable from the file (no silent holes).
    cfg = ClusterConfig(autoscaling=AutoscalingConfig())
    data = cfg.to_dict()
    for section, klass in (("engine", EngineConfig), ("router", RouterConfig), ("autoscaling", AutoscalingConfig)):
        assert set(data[section]) == {f.name for f in dataclasses.fields(klass)}
    assert ClusterConfig.from_dict(data) == cfg


def test_up_flags_override_the_config_file(tmp_path):
    from cluster.cli import build_parser, up_config

    path = tmp_path / "cluster.yaml"
    path.write_text(FULL)
    parser = build_parser()
    from_file = up_config(parser.parse_args(["up", "--config", str(path)]))
    assert from_file == ClusterConfig.from_yaml(path)
    args = parser.parse_args(["up", "--config", str(path), "--replicas", "3", "--block-size", "16",
                              "--http-port", "-1", "--grpc-host", "127.0.0.1", "--routing-policy", "round_robin"])
    cfg = up_config(args)
    assert cfg.replicas == 3 and cfg.routing_policy == "round_robin"
    assert cfg.router.replica_transport == "direct"
    assert up_config(parser.parse_args(["up", "--replica-transport", "actor"])).router.replica_transport == "actor"
    assert cfg.directory_lookup == "index"
    assert up_config(parser.parse_args(["up", "--directory-lookup", "redis"])).directory_lookup == "redis"
    assert cfg.engine.cache.block_size == 16 and cfg.engine.cache.kv_cache_memory == 0.5  # file value kept
    assert cfg.router.http_port is None and cfg.router.host == "127.0.0.1" and cfg.router.num_routers == 2
    assert cfg.autoscaling == from_file.autoscaling
    assert up_config(parser.parse_args(["up"])) == ClusterConfig()
    with pytest.raises(ValueError, match="initial replica count"):
        up_config(parser.parse_args(["up", "--config", str(path), "--replicas", "9"]))


def test_the_example_config_file_loads():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "deploy" / "cluster.example.yaml"
    cfg = ClusterConfig.from_yaml(example)
    assert cfg.autoscaling is not None


def test_redis_url_from_the_environment_of_the_process_that_connects(monkeypatch):
    """``env:NAME`` stays in the config (it travels to every pod as written);
    each process reads its own variable when it connects, so only the pods
    given the Secret's variable hold the password."""
    from cluster.shared.directory import Directory

    cfg = ClusterConfig.from_dict({"redis_url": "env:PREFIXSERVE_TEST_REDIS_URL",
                                   "router": {"redis_url": "env:PREFIXSERVE_TEST_ROUTER_URL"}})
    assert cfg.redis_url == "env:PREFIXSERVE_TEST_REDIS_URL"
    assert cfg.router_redis_url == "env:PREFIXSERVE_TEST_ROUTER_URL"
    assert ClusterConfig.from_dict({"redis_url": "redis://r:6379"}).router_redis_url == "redis://r:6379"
    monkeypatch.setenv("PREFIXSERVE_TEST_REDIS_URL", "redis://:secret@redis.example:6379/2")
    directory = Directory.from_url(cfg.redis_url, "ns")  # no I/O yet
    assert directory._client.connection_pool.connection_kwargs["host"] == "redis.example"
    monkeypatch.delenv("PREFIXSERVE_TEST_REDIS_URL")
    with pytest.raises(ValueError, match="'PREFIXSERVE_TEST_REDIS_URL' is not set"):
        Directory.from_url(cfg.redis_url, "ns")


def test_tool_call_parser_from_the_file_and_the_flag(tmp_path, capsys):
    from cluster.cli import build_parser, up_config
    from cluster.shared.config import TOOL_CALL_PARSERS
    from router.tools.plan import PARSERS

    assert TOOL_CALL_PARSERS == ("auto", *PARSERS)  # the router's formats, and auto
    assert RouterConfig().tool_call_parser == "auto"
    path = tmp_path / "cluster.yaml"
    path.write_text("router:\n  tool_call_parser: llama3_json\n")
    parser = build_parser()
    assert up_config(parser.parse_args(["up", "--config", str(path)])).router.tool_call_parser == "llama3_json"
    flagged = up_config(parser.parse_args(["up", "--config", str(path), "--tool-call-parser", "hermes"]))
    assert flagged.router.tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--tool-call-parser", "mistral"])
    assert "invalid choice: 'mistral' (choose from" in capsys.readouterr().err


def test_max_replicas_per_node_reaches_each_models_deployment(monkeypatch):
    from cluster.app import builder
    from cluster.cli import build_parser, up_config

    monkeypatch.setattr(builder, "request_router_config", lambda config: None)
    parser = build_parser()
    # Unset: no cap, Serve's own SPREAD scheduling places the replicas.
    assert "max_replicas_per_node" not in builder.replica_options(up_config(parser.parse_args(["up"])))
    one = up_config(parser.parse_args(["up", "--max-replicas-per-node", "1", "--replicas", "2"]))
    assert builder.replica_options(one)["max_replicas_per_node"] == 1
    two = up_config(parser.parse_args(["up", "--model", "a", "--model", "b", "--max-replicas-per-node", "2"]))
    assert [m.max_replicas_per_node for m in two.models] == [2, 2]
    assert [c.max_replicas_per_node for c in two.models_by_name().values()] == [2, 2]
