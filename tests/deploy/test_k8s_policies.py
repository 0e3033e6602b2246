"""Policy checks of the rendered KubeRay manifests (base and both overlays):
what a platform team's admission policies would refuse, checked offline.

- every pod meets Pod Security "restricted"; every container has requests
  and limits, readiness and liveness probes and a security context;
- no Service or container port exposes the Ray dashboard or Ray client;
- the NetworkPolicies admit exactly the intended flows (evaluated here as
  the API server would: a pod selected by some policy admits only what one
  of them allows);
- Secrets: every Secret the manifests read is made by
  ``create-secrets.sh``, with the keys read; each pod gets only the Redis
  URL of its own role; the router's TLS and tenants files are mounted where
  its config reads them;
- the router pods' drain hook agrees with the config and the grace period.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import yaml

from tests.deploy.kustomize import render
from tests.deploy.test_kuberay import KUBERAY, TARGETS, cluster_config, group, one

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PORT, CLIENT_PORT = 8265, 10001


@pytest.fixture(scope="module", params=TARGETS)
def rendered(request) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(KUBERAY / request.param)


def pods(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(name, pod template)`` of every pod the manifests make."""
    for obj in objects:
        if obj["kind"] == "StatefulSet":
            yield obj["metadata"]["name"], obj["spec"]["template"]
        elif obj["kind"] == "RayService":
            for name in ("head", "routers", "replicas"):
                yield name, group(obj, name)["template"]


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    return template["spec"]["containers"] + template["spec"].get("initContainers", [])


# ------------------------------------------------------------ pod security
def test_every_pod_meets_pod_security_restricted(rendered):
    name, objects = rendered
    for pod_name, template in pods(objects):
        spec, where = template["spec"], f"{name}: {pod_name}"
        security = spec.get("securityContext", {})
        assert security.get("runAsNonRoot") is True, where
        assert security.get("runAsUser", 1) != 0, where
        assert security.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost"), where
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(host), f"{where}: {host}"
        assert not any("hostPath" in v for v in spec.get("volumes", [])), f"{where}: hostPath volume"
        for container in containers(template):
            c = container.get("securityContext", {})
            assert c.get("allowPrivilegeEscalation") is False, f"{where}/{container['name']}"
            assert c.get("capabilities", {}).get("drop") == ["ALL"], f"{where}/{container['name']}"
            assert not c.get("capabilities", {}).get("add"), f"{where}/{container['name']}"
            assert not c.get("privileged"), f"{where}/{container['name']}"
            assert c.get("runAsUser", 1) != 0, f"{where}/{container['name']}"
            assert not any("hostPort" in p for p in container.get("ports", [])), f"{where}: hostPort"


def test_every_container_has_resources_and_probes(rendered):
    name, objects = rendered
    for pod_name, template in pods(objects):
        for container in template["spec"]["containers"]:
            where = f"{name}: {pod_name}/{container['name']}"
            resources = container.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{where}: {kind}"
            assert "readinessProbe" in container and "livenessProbe" in container, f"{where}: probes"


def test_no_service_or_port_exposes_the_ray_dashboard_or_client(rendered):
    name, objects = rendered
    rayservice = one(objects, "RayService")
    for service in (o for o in objects if o["kind"] == "Service"):
        for port in service["spec"]["ports"]:
            assert port["port"] not in (DASHBOARD_PORT, CLIENT_PORT), service["metadata"]["name"]
            assert port.get("targetPort") not in ("dashboard", "client", DASHBOARD_PORT, CLIENT_PORT)
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP", f"{name}: no Service leaves the cluster"
    for pod_name, template in pods(objects):
        for container in containers(template):
            ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
            assert "client" not in ports and CLIENT_PORT not in ports.values(), f"{pod_name}: Ray client port"
            if pod_name != "head":
                assert DASHBOARD_PORT not in ports.values(), pod_name
    head_params = group(rayservice, "head")["rayStartParams"]
    assert "ray-client-server-port" not in head_params
    # The dashboard stays on the head only for the KubeRay operator: its policy says so.
    admitted = admitted_by(objects, pod_labels("head", objects), port=("dashboard", DASHBOARD_PORT),
                           namespace="kuberay")
    assert admitted and not admitted_by(objects, pod_labels("head", objects), port=("dashboard", DASHBOARD_PORT),
                                        namespace="ingress-nginx")


# ------------------------------------------------------------- NetworkPolicy
def pod_labels(pod_name: str, objects: list[dict[str, Any]]) -> dict[str, str]:
    return dict(dict(pods(objects))[pod_name]["metadata"]["labels"])


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        if e["operator"] == "In" and value not in e["values"]:
            return False
        if e["operator"] == "NotIn" and value in e["values"]:
            return False
        if e["operator"] == "Exists" and value is None:
            return False
    return True


def admitted_by(objects: list[dict[str, Any]], target: dict[str, str], port: tuple[str, int],
                source: Optional[dict[str, str]] = None, namespace: Optional[str] = None) -> bool:
    """Whether traffic to ``port`` (name, number) of a pod with ``target`` labels is
    admitted from a pod with ``source`` labels in the same namespace, or from any
    pod of ``namespace`` (matched by its automatic name label)."""
    policies = [o for o in objects if o["kind"] == "NetworkPolicy" and selects(o["spec"]["podSelector"], target)
                and "Ingress" in o["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True  # not isolated
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p.get("port") in port for p in ports):
                continue
            for peer in rule.get("from", [{}]):
                if not peer:
                    return True
                if "namespaceSelector" in peer:
                    if namespace is not None and selects(peer["namespaceSelector"],
                                                         {"kubernetes.io/metadata.name": namespace}) \
                            and selects(peer.get("podSelector", {}), {}):
                        return True
                elif "podSelector" in peer and source is not None and selects(peer["podSelector"], source):
                    return True
    return False


def test_network_policies_admit_exactly_the_intended_flows(rendered):
    name, objects = rendered
    head, router, replica = (pod_labels(p, objects) for p in ("head", "routers", "replicas"))
    redis = pod_labels("prefixserve-redis", objects)
    gcs = pod_labels("prefixserve-gcs-redis", objects)
    stranger = {"app": "some-other-app"}
    every_pod = [head, router, replica, redis, gcs]
    isolated = [p for p in every_pod if any(o["kind"] == "NetworkPolicy" and selects(o["spec"]["podSelector"], p)
                                            for o in objects)]
    assert isolated == every_pod, f"{name}: every pod is isolated by a policy"
    grpc, http, redis_port, gcs_port = ("grpc", 50051), ("http", 8000), ("redis", 6379), ("gcs-server", 6379)
    expect = [
        # (what, admitted?)
        (admitted_by(objects, router, grpc, namespace="ingress-nginx"), True),
        (admitted_by(objects, router, http, namespace="ingress-nginx"), True),
        (admitted_by(objects, router, http, namespace="monitoring"), True),  # /metrics
        (admitted_by(objects, router, grpc, namespace="default"), False),
        (admitted_by(objects, router, grpc, source=stranger), False),
        (admitted_by(objects, replica, ("serve", 8001), source=stranger), False),
        (admitted_by(objects, replica, ("serve", 8001), namespace="ingress-nginx"), False),
        (admitted_by(objects, replica, ("any", 12345), source=router), True),  # Ray's ports, from Ray pods
        (admitted_by(objects, replica, ("any", 12345), source=head), True),
        (admitted_by(objects, head, gcs_port, source=replica), True),
        (admitted_by(objects, head, gcs_port, source=stranger), False),
        (admitted_by(objects, redis, redis_port, source=router), True),
        (admitted_by(objects, redis, redis_port, source=replica), True),
        (admitted_by(objects, redis, redis_port, source=head), False),
        (admitted_by(objects, redis, redis_port, source=stranger), False),
        (admitted_by(objects, redis, redis_port, namespace="monitoring"), False),
        (admitted_by(objects, gcs, redis_port, source=head), True),
        (admitted_by(objects, gcs, redis_port, source=router), False),
        (admitted_by(objects, gcs, redis_port, source=replica), False),
    ]
    wrong = [i for i, (got, want) in enumerate(expect) if got != want]
    assert not wrong, f"{name}: flows {wrong} are not as intended"


def test_named_ports_of_policies_exist_on_the_pods_they_select(rendered):
    name, objects = rendered
    pod_list = list(pods(objects))
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if not isinstance(port["port"], str):
                    continue
                holders = [p for p, t in pod_list if selects(policy["spec"]["podSelector"], t["metadata"]["labels"])
                           and any(cp.get("name") == port["port"] for c in containers(t) for cp in c.get("ports", []))]
                assert holders, f"{name}: {policy['metadata']['name']} names port {port['port']} no pod has"


def test_disruption_budgets_and_spread_select_their_own_pods(rendered):
    name, objects = rendered
    for pdb in (o for o in objects if o["kind"] == "PodDisruptionBudget"):
        selected = [p for p, t in pods(objects) if selects(pdb["spec"]["selector"], t["metadata"]["labels"])]
        assert len(selected) == 1, f"{name}: {pdb['metadata']['name']} selects {selected}"
    for pod_name in ("routers", "replicas"):
        template = dict(pods(objects))[pod_name]
        constraints = template["spec"]["topologySpreadConstraints"]
        assert {c["topologyKey"] for c in constraints} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
        for c in constraints:
            assert selects(c["labelSelector"], template["metadata"]["labels"]), pod_name


# --------------------------------------------------------------- Secrets
def secret_refs(objects: list[dict[str, Any]]) -> dict[str, set[str]]:
    """``{Secret name: keys read}`` over the whole rendered tree (volumes read every key: empty set)."""
    refs: dict[str, set[str]] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "secretKeyRef" in node:
                refs.setdefault(node["secretKeyRef"]["name"], set()).add(node["secretKeyRef"]["key"])
            if "secretName" in node:
                refs.setdefault(node["secretName"], set())
            if "secret" in node and isinstance(node["secret"], dict) and "key" in node["secret"]:
                refs.setdefault(node["secret"]["name"], set()).add(node["secret"]["key"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(objects)
    return refs


@pytest.fixture(scope="module")
def printed_secrets() -> dict[str, dict[str, str]]:
    """The Secrets ``create-secrets.sh --print`` makes: ``{name: {key: value}}``."""
    if shutil.which("kubectl") is None or shutil.which("openssl") is None or shutil.which("prefixserve") is None:
        pytest.skip("create-secrets.sh needs kubectl, openssl and prefixserve on PATH")
    env = {**os.environ, "TENANTS_FILE": ""}
    out = subprocess.run([str(KUBERAY / "create-secrets.sh"), "--print"], capture_output=True, text=True,
                         timeout=120, env=env, check=True).stdout
    secrets = {}
    for doc in yaml.safe_load_all(out):
        if doc:
            secrets[doc["metadata"]["name"]] = {k: base64.b64decode(v).decode() for k, v in doc["data"].items()}
    return secrets


def test_create_secrets_makes_every_secret_the_manifests_read(rendered, printed_secrets, tmp_path):
    from cluster.shared.directory.acl import acl_file
    from router.tenants import load_tenants

    name, objects = rendered
    for secret, keys in secret_refs(objects).items():
        assert secret in printed_secrets, f"{name}: Secret {secret} is read but create-secrets.sh does not make it"
        assert keys <= set(printed_secrets[secret]), f"{name}: {secret} lacks {keys - set(printed_secrets[secret])}"
    urls = printed_secrets["prefixserve-redis-urls"]
    service = one(objects, "Service", "prefixserve-redis")
    acl = printed_secrets["prefixserve-redis-acl"]["users.acl"]
    passwords = {}
    for role in ("replica", "router"):
        url = urls[f"{role}-url"]
        assert url.endswith(f"@{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0"), url
        user, password = url.removeprefix("redis://").split("@")[0].split(":")
        assert user == f"prefixserve-{role}"
        passwords[role] = password
    assert acl == acl_file(passwords)  # the ACL's users are the URLs' users, with the rules of acl.py
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(printed_secrets["prefixserve-tenants"]["tenants.yaml"])
    assert load_tenants(str(tenants))
    tls = printed_secrets["prefixserve-router-tls"]
    for key in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / key).write_text(tls[key])
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", str(tmp_path / "tls.crt")],
                          capture_output=True, text=True, check=True).stdout
    for dns in ("prefixserve-grpc", "prefixserve-http"):
        assert f"DNS:{dns}" in text  # the names the Services and the PodMonitor use


def env_names(template: dict[str, Any]) -> set[str]:
    return {e["name"] for c in template["spec"]["containers"] for e in c.get("env", [])}


def test_each_pod_gets_only_its_own_credentials_and_the_router_its_files(rendered):
    name, objects = rendered
    rayservice = one(objects, "RayService")
    config = cluster_config(rayservice)
    replica_var = config.redis_url.removeprefix("env:")
    router_var = config.router.redis_url.removeprefix("env:")
    head, routers, replicas = (group(rayservice, g)["template"] for g in ("head", "routers", "replicas"))
    assert replica_var in env_names(replicas) and router_var not in env_names(replicas)
    assert router_var in env_names(routers) and replica_var not in env_names(routers)
    assert not {replica_var, router_var} & env_names(head), "the head needs no directory credentials"
    (container,) = routers["spec"]["containers"]
    volumes = {v["name"]: v for v in routers["spec"]["volumes"]}

    def secret_of(path: str) -> str:
        for mount in container["volumeMounts"]:
            if path.startswith(mount["mountPath"].rstrip("/") + "/"):
                return volumes[mount["name"]]["secret"]["secretName"]
        raise AssertionError(f"{name}: {path} is not under any mount of the router container")

    router = config.router
    assert secret_of(router.tls_cert) == secret_of(router.tls_key) == "prefixserve-router-tls"
    assert Path(router.tls_cert).name == "tls.crt" and Path(router.tls_key).name == "tls.key"
    assert secret_of(router.tenants_file) == "prefixserve-tenants" and Path(router.tenants_file).name == "tenants.yaml"
    monitor = one(objects, "PodMonitor", "prefixserve-routers")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]["ca"]["secret"]["name"] == "prefixserve-router-tls"


def test_router_drain_hook_agrees_with_the_config(rendered):
    name, objects = rendered
    rayservice = one(objects, "RayService")
    router = cluster_config(rayservice).router
    template = group(rayservice, "routers")["template"]
    (container,) = template["spec"]["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["prefixserve", "router-drain"]
    assert command[command.index("--socket") + 1] == router.admin_socket
    timeout = float(command[command.index("--timeout") + 1])
    assert timeout >= router.drain_timeout_s
    assert template["spec"]["terminationGracePeriodSeconds"] > timeout + 10


def test_gcs_fault_tolerance_uses_its_own_redis(rendered):
    name, objects = rendered
    options = one(objects, "RayService")["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    service = one(objects, "Service", "prefixserve-gcs-redis")
    assert options["redisAddress"] == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert options["redisPassword"]["valueFrom"]["secretKeyRef"]["name"] == "prefixserve-gcs-redis"
    statefulset = one(objects, "StatefulSet", "prefixserve-gcs-redis")
    assert statefulset["spec"]["volumeClaimTemplates"], "the GCS state must survive its pod"
