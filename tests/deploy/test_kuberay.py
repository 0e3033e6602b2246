"""The KubeRay manifests in ``deploy/kuberay``, validated offline.

Each of base, overlays/cpu and overlays/gpu is rendered (``tests/deploy/
kustomize.py``) and checked:

- the RayService against the OpenAPI schema of KubeRay's CRD
  (``../shared/kuberay/ray.io_rayservices.yaml``), made strict: an object
  schema that lists ``properties`` rejects any other key, as the API server's
  strict field validation does;
- core objects (Services, StatefulSet, and each worker group's pod template
  as a Pod) against the Kubernetes schemas of ``kubernetes-validate``, strict;
- ``serveConfigV2`` by Ray's ``ServeDeploySchema`` with unknown keys refused,
  every ``import_path`` importable, its ``args.config`` by
  ``ClusterConfig.from_dict``, and the Serve options the app builds from it
  accepted by Serve;
- what ties them together: ports, the router's custom resource, a replica
  fitting its pod (CPUs, GPUs for the TP group) and not a router pod, the
  Services and PodMonitors selecting the right pods, the image's Ray version.
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from cluster.shared.config import ClusterConfig
from tests.deploy.kustomize import render

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deploy" / "kuberay"
CRD = ROOT.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"
TARGETS = ["base", "overlays/cpu", "overlays/gpu", "overlays/two-models", "overlays/lora"]
ROUTER_RESOURCE = "prefixserve_router"


@pytest.fixture(scope="module", params=TARGETS)
def rendered(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(KUBERAY / request.param)


def one(objects: list[dict[str, Any]], kind: str, name: str = "") -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (not name or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def cluster_config(rayservice: dict[str, Any]) -> ClusterConfig:
    (app,) = serve_config(rayservice)["applications"]
    return ClusterConfig.from_dict(app["args"]["config"])


def group(rayservice: dict[str, Any], name: str) -> dict[str, Any]:
    spec = rayservice["spec"]["rayClusterConfig"]
    if name == "head":
        return spec["headGroupSpec"]
    (found,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == name]
    return found


def container_ports(pod_group: dict[str, Any]) -> dict[str, int]:
    (container,) = pod_group["template"]["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


# ------------------------------------------------------------ CRD schema
def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused wherever it lists properties."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def rayservice_validator() -> Any:
    if not CRD.is_file():
        pytest.skip(f"KubeRay's RayService CRD is not at {CRD}: put ray.io_rayservices.yaml "
                    "(KubeRay v1.x, config/crd/bases) there to validate the RayService")
    import jsonschema

    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def test_rayservice_matches_the_crd_schema(rendered, rayservice_validator):
    name, objects = rendered
    rayservice = one(objects, "RayService")
    assert rayservice["apiVersion"] == "ray.io/v1"
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in rayservice_validator.iter_errors(rayservice)]
    assert not errors, f"{name}: " + "\n".join(errors)


def test_the_strict_schema_refuses_unknown_fields(rayservice_validator):
    rayservice = copy.deepcopy(one(render(KUBERAY / "base"), "RayService"))
    rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    rayservice["spec"]["serveConfigv2"] = "typo"
    messages = " ".join(e.message for e in rayservice_validator.iter_errors(rayservice))
    assert "'maxReplica' was unexpected" in messages and "'serveConfigv2' was unexpected" in messages


# --------------------------------------------------------- core objects
def core_objects(objects: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for obj in objects:
        if obj["kind"] in ("Service", "StatefulSet", "Secret", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget"):
            yield obj
        elif obj["kind"] == "RayService":
            # Each group's pod template, checked as the Pod KubeRay makes of it.
            spec = obj["spec"]["rayClusterConfig"]
            for pod_group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
                template = pod_group["template"]
                yield {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": pod_group.get("groupName", "head"), **template.get("metadata", {})},
                       "spec": template["spec"]}


def test_core_objects_match_the_kubernetes_schemas(rendered):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (the dev extra) to validate core objects")
    name, objects = rendered
    version = kubernetes_validate.latest_version()
    checked = 0
    for obj in core_objects(objects):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {obj['kind']} {obj['metadata']['name']}: {exc}")
        checked += 1
    assert checked >= 18  # 4 Services, 2 StatefulSets, 7 NetworkPolicies, 2 PDBs, 3 pod templates


def test_every_object_is_known(rendered):
    name, objects = rendered
    kinds = sorted(o["kind"] for o in objects)
    adapters = ["PersistentVolumeClaim"] if name == "overlays/lora" else []  # the adapters' volume
    assert kinds == ["NetworkPolicy"] * 7 + adapters + ["PodDisruptionBudget"] * 2 + ["PodMonitor"] * 2 + \
        ["RayService"] + ["Service"] * 4 + ["StatefulSet"] * 2, name


def test_kubectl_kustomize_and_the_subset_renderer_agree(rendered):
    """Where kubectl is installed the tests render with it; the subset renderer
    (used where it is not) must print the same objects."""
    from tests.deploy.kustomize import kubectl, render_subset

    if kubectl() is None:
        pytest.skip("kubectl (with kustomize 5) is not installed: the overlays were rendered by the subset")
    name, objects = rendered

    def key(obj: dict[str, Any]) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    ours = render_subset(KUBERAY / name)
    assert sorted(map(key, ours)) == sorted(map(key, objects))
    by_key = {key(o): o for o in objects}
    for obj in ours:
        assert obj == by_key[key(obj)], f"{name}: {key(obj)} differs between kubectl kustomize and the subset"


# ---------------------------------------------------------- serveConfigV2
def assert_known_keys(data: dict[str, Any], model: Any, where: str) -> None:
    fields = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    unknown = set(data) - fields
    assert not unknown, f"{where}: unknown keys {sorted(unknown)} (Serve would ignore them)"


def test_serve_config_is_valid_and_strict(rendered):
    from ray.serve.schema import (
        DeploymentSchema,
        HTTPOptionsSchema,
        RayActorOptionsSchema,
        ServeApplicationSchema,
        ServeDeploySchema,
    )

    name, objects = rendered
    raw = serve_config(one(objects, "RayService"))
    ServeDeploySchema.model_validate(raw)
    assert_known_keys(raw, ServeDeploySchema, "serveConfigV2")
    assert_known_keys(raw.get("http_options", {}), HTTPOptionsSchema, "http_options")
    for app in raw["applications"]:
        assert_known_keys(app, ServeApplicationSchema, f"applications.{app['name']}")
        for deployment in app.get("deployments", []):
            assert_known_keys(deployment, DeploymentSchema, f"deployments.{deployment['name']}")
            assert_known_keys(deployment.get("ray_actor_options", {}), RayActorOptionsSchema, "ray_actor_options")
        module, _, attr = app["import_path"].partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), app["import_path"]
    assert [a["import_path"] for a in raw["applications"]] == ["cluster.app:app_builder"], name


def test_the_config_builds_serve_options_serve_accepts(rendered, monkeypatch):
    from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

    from cluster import app

    name, objects = rendered
    rayservice = one(objects, "RayService")
    config = cluster_config(rayservice)
    # Each pod reads its own URL from its own variable (filled from a Secret).
    assert config.redis_url == "env:PREFIXSERVE_REDIS_URL"
    assert config.router_redis_url == "env:PREFIXSERVE_ROUTER_REDIS_URL"
    # The request router needs the model's fingerprint (a model conversion): not what is tested here.
    monkeypatch.setattr(app, "request_router_config", lambda cfg: None)
    router = app.router_options(config)
    names = {router["name"]}
    for model_name, model in config.models_by_name().items():
        deployment = f"replica-{model_name}" if config.multi_model else "replica"
        replica = app.replica_options(model, deployment)
        assert model.autoscaling is not None, f"{name}: the RayService should autoscale ({model_name})"
        scaling = ServeAutoscalingConfig(**replica["autoscaling_config"])
        assert scaling.policy.policy_function == "cluster.shared.autoscaling:KVAwareAutoscalingPolicy"
        names.add(replica["name"])
    # Overrides in serveConfigV2 name deployments that exist.
    (serve_app,) = serve_config(rayservice)["applications"]
    assert {d["name"] for d in serve_app.get("deployments", [])} <= names


# ----------------------------------------------------------- consistency
def test_ports_agree(rendered):
    name, objects = rendered
    rayservice = one(objects, "RayService")
    config = cluster_config(rayservice)
    serve_port = serve_config(rayservice)["http_options"]["port"]
    assert serve_port not in (config.router.grpc_port, config.router.http_port), "Serve's proxy port must differ"
    for pod_group in ["head", "routers", "replicas"]:
        assert container_ports(group(rayservice, pod_group))["serve"] == serve_port, pod_group
    router_ports = container_ports(group(rayservice, "routers"))
    assert router_ports["grpc"] == config.router.grpc_port and router_ports["http"] == config.router.http_port
    assert config.router.host == "0.0.0.0"
    (container,) = group(rayservice, "routers")["template"]["spec"]["containers"]
    # grpc.health.v1 on the plaintext health port: the gRPC port speaks TLS, which probes cannot.
    assert config.router.tls_cert is not None and config.router.health_port is not None
    assert router_ports["grpc-health"] == config.router.health_port == container["readinessProbe"]["grpc"]["port"]
    for service_name, port_name in (("prefixserve-grpc", "grpc"), ("prefixserve-http", "http")):
        service = one(objects, "Service", service_name)
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] == port_name
        labels = group(rayservice, "routers")["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), f"{service_name} must select the router pods"
        for other in ("head", "replicas"):
            other_labels = group(rayservice, other)["template"]["metadata"]["labels"]
            assert not service["spec"]["selector"].items() <= other_labels.items(), f"{service_name} selects {other}"


def test_routers_and_replicas_land_on_their_own_pods(rendered):
    name, objects = rendered
    rayservice = one(objects, "RayService")
    config = cluster_config(rayservice)
    (serve_app,) = serve_config(rayservice)["applications"]
    assert not serve_app.get("deployments"), "placement comes from the config (router_resources), not an override"
    from cluster.app import router_options

    actor = router_options(config)["ray_actor_options"]
    assert actor == {"num_cpus": config.router.router_num_cpus, "resources": {ROUTER_RESOURCE: 1}}
    routers, replicas, head = (group(rayservice, g) for g in ("routers", "replicas", "head"))
    assert routers["resources"] == {ROUTER_RESOURCE: "1"}, "one router per router pod"
    assert ROUTER_RESOURCE not in replicas.get("resources", {}) and ROUTER_RESOURCE not in head.get("resources", {})
    assert routers["replicas"] >= config.router.num_routers
    assert head["rayStartParams"]["num-cpus"] == "0", "the head runs no replicas"

    models = list(config.models_by_name().values())
    for model in models:
        tp = model.engine.parallel.tensor_parallel_size
        replica_cpus = model.replica_num_cpus + (model.rank_num_cpus * tp if tp > 1 else 0)
        assert replica_cpus <= float(replicas["rayStartParams"]["num-cpus"]), f"{name}: a replica must fit its pod"
        left_on_router_pod = float(routers["rayStartParams"]["num-cpus"]) - config.router.router_num_cpus
        assert replica_cpus > left_on_router_pod, f"{name}: a replica would fit on a router pod"
    assert replicas["maxReplicas"] >= sum(m.autoscaling.max_replicas for m in models), \
        f"{name}: every model at its most replicas must fit the replica pods"
    config = models[0]  # device, TP and attention: the first model's (the overlays serve one kind)
    tp = config.engine.parallel.tensor_parallel_size
    (container,) = replicas["template"]["spec"]["containers"]
    gpus = int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
    if config.engine.device == "cuda":
        assert gpus == tp, f"{name}: a replica's TP group needs {tp} GPUs in one pod (STRICT_PACK)"
        backend, block_size = config.engine.attention_backend, config.engine.cache.block_size
        assert backend in ("auto", "triton") or (backend == "flash_attn" and block_size % 256 == 0), \
            f"{name}: attention_backend {backend} cannot page block_size {block_size} on a GPU"
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("NCCL_DEBUG") and env.get("NCCL_CUMEM_ENABLE") == "0"
        volumes = {v["name"]: v for v in replicas["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory" and int(shm["sizeLimit"].removesuffix("Gi")) >= 8, \
            f"{name}: NCCL's intra-node buffers need a large /dev/shm"
        assert container["image"].endswith("-cuda")
    else:
        assert gpus == 0 and container["image"].endswith("-cpu")


def test_pods_run_as_non_root_with_the_pinned_ray(rendered):
    import ray

    name, objects = rendered
    rayservice = one(objects, "RayService")
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
    images = set()
    for pod_group in ("head", "routers", "replicas"):
        template = group(rayservice, pod_group)["template"]
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        images |= {c["image"] for c in template["spec"]["containers"]}
    assert len(images) == 1, f"{name}: one image for every pod, got {images}"


def test_pod_monitors_select_pods_with_their_ports(rendered):
    name, objects = rendered
    rayservice = one(objects, "RayService")
    monitors = [o for o in objects if o["kind"] == "PodMonitor"]
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        selector = monitor["spec"]["selector"]
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        selected = []
        for pod_group in ("head", "routers", "replicas"):
            labels = group(rayservice, pod_group)["template"]["metadata"]["labels"]
            if selector["matchLabels"].items() <= labels.items() and all(
                labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
            ):
                selected.append(pod_group)
                assert endpoint["port"] in container_ports(group(rayservice, pod_group)), (monitor, pod_group)
        assert selected, f"{monitor['metadata']['name']} selects no pod"
    router_monitor = one(objects, "PodMonitor", "prefixserve-routers")
    assert router_monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"


def test_the_renderer_refuses_what_it_cannot_render(tmp_path):
    from tests.deploy.kustomize import render_subset as render

    (tmp_path / "kustomization.yaml").write_text("kind: Kustomization\nresources: [x.yaml]\nconfigMapGenerator: []\n")
    with pytest.raises(AssertionError, match="configMapGenerator"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "kind: Kustomization\nresources: [x.yaml]\npatches: [{path: p.yaml, target: {kind: Service, name: nope}}]\n")
    (tmp_path / "x.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: a}\n")
    (tmp_path / "p.yaml").write_text("- {op: replace, path: /spec, value: {}}\n")
    with pytest.raises(AssertionError, match="matches no object"):
        render(tmp_path)


def test_the_lora_overlay_mounts_its_adapters_where_the_engine_reads_them():
    objects = render(KUBERAY / "overlays/lora")
    rayservice = one(objects, "RayService")
    lora = cluster_config(rayservice).engine.lora
    assert lora.enable_lora and lora.modules and lora.dynamic_lora_loading_path == "/adapters"
    replicas = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]
    assert replicas["groupName"] == "replicas"
    pod = replicas["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["adapters"]["mountPath"] == "/adapters" and mounts["adapters"]["readOnly"]
    claim = volumes["adapters"]["persistentVolumeClaim"]["claimName"]
    assert one(objects, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert all(path.startswith("/adapters/") for path in lora.modules.values())
