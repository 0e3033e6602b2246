"""The Grafana dashboard and the Prometheus alert rules in ``deploy/``:
they parse, and every ``prefixserve:*`` series they query is one the replicas
(``workers/metrics.py``) or the routers (``router/metrics.py``) export."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from cluster.shared.metrics_format import sample_names
from router.metrics import RouterMetrics
from workers.metrics import ReplicaMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "prefixserve-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
NAME = re.compile(r"prefixserve:[A-Za-z0-9_:]+")


@pytest.fixture(scope="module")
def exported() -> set[str]:
    router = RouterMetrics("p")
    router.record_tenant_request("t", "admitted")  # per-tenant series exist once a tenant calls
    router.record_tenant_tokens("t", 1, 1, 0)
    return sample_names(ReplicaMetrics("r", "m").registry) | sample_names(router.registry)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    assert doc["kind"] == "PrometheusRule" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    return [rule for group in doc["spec"]["groups"] for rule in group["rules"]]


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def check_expr(expr: str, exported: set[str]) -> set[str]:
    """Balanced brackets, histogram_quantile over buckets; returns the series named."""
    for left, right in ("()", "{}", "[]"):
        assert expr.count(left) == expr.count(right), f"unbalanced {left}{right} in {expr}"
    if "histogram_quantile(" in expr:
        assert "_bucket" in expr and re.search(r"by \([^)]*\ble\b", expr), f"quantile needs le buckets: {expr}"
    names = set(NAME.findall(expr))
    assert names, f"{expr} queries no prefixserve series"
    unknown = names - exported
    assert not unknown, f"{expr} queries series nobody exports: {sorted(unknown)}"
    return names


def test_exported_names_are_the_ones_the_issue_lists(exported):
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "router_requests_total", "router_decision_seconds_bucket",
                 "router_prefix_match_ratio_bucket", "router_directory_errors_total"):
        assert "prefixserve:" + name in exported


def test_dashboard_queries_only_exported_series_and_covers_the_essentials(dashboard, exported):
    used: set[str] = set()
    for expr in dashboard_exprs(dashboard):
        used |= check_expr(expr, exported)
    for essential in ("kv_cache_usage_perc", "num_requests_waiting", "generation_tokens_total",
                      "time_to_first_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
                      "prefix_cache_hits_total", "num_preemptions_total", "router_requests_total",
                      "router_decision_seconds_bucket"):
        assert "prefixserve:" + essential in used, essential
    quantiles = {m for e in dashboard_exprs(dashboard) for m in re.findall(r"histogram_quantile\((0\.\d+)", e)}
    assert {"0.5", "0.95", "0.99"} <= quantiles


def test_dashboard_layout_is_importable(dashboard):
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 30
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["w"] > 0 and grid["h"] > 0, panel["title"]
        if panel["type"] != "row":
            refs = [t["refId"] for t in panel["targets"]]
            assert refs and len(refs) == len(set(refs)), panel["title"]
    kv = next(p for p in panels(dashboard) if "prefixserve:kv_cache_usage_perc{" in str(p.get("targets"))
              and p["type"] == "timeseries")
    steps = [s["value"] for s in kv["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert 0.8 in steps and 0.9 in steps  # the 80-90 % target band


def test_alert_rules_are_complete_and_query_exported_series(rules, exported):
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    used: set[str] = set()
    for rule in rules:
        used |= check_expr(rule["expr"], exported)
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
    for needed in ("kv_cache_usage_perc", "num_requests_waiting", "time_to_first_token_seconds_bucket",
                   "router_directory_errors_total"):
        assert "prefixserve:" + needed in used, needed
    assert any(r["expr"].startswith("absent(") for r in rules), "an alert for 'no replica reports'"


# ------------------------------------------------- schemas and PromQL
def validate_monitoring(obj: dict[str, Any]) -> list[str]:
    import jsonschema

    from tests.deploy.monitoring_schemas import SCHEMAS

    validator = jsonschema.Draft7Validator(SCHEMAS[obj["kind"]])
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def test_pod_monitors_and_the_prometheus_rule_match_their_schemas():
    from tests.deploy.kustomize import render

    objects = [o for t in ("base", "overlays/cpu", "overlays/gpu")
               for o in render(ROOT / "deploy" / "kuberay" / t) if o["kind"] == "PodMonitor"]
    objects.append(yaml.safe_load(ALERTS.read_text()))
    assert len(objects) == 7
    for obj in objects:
        errors = validate_monitoring(obj)
        assert not errors, f"{obj['kind']} {obj['metadata']['name']}: " + "\n".join(errors)
    # The schemas catch what the API server would silently drop or refuse.
    monitor = objects[0]
    bad = {**monitor, "spec": {**monitor["spec"], "podMetricsEndpoints": [
        {**monitor["spec"]["podMetricsEndpoints"][0], "intervall": "15s"}]}}
    assert any("'intervall' was unexpected" in e for e in validate_monitoring(bad))
    rule_doc = copy.deepcopy(objects[-1])
    rule_doc["spec"]["groups"][0]["rules"][0]["for"] = "10 minutes"
    assert any("does not match" in e for e in validate_monitoring(rule_doc))


def promql(expr: str) -> Any:
    """The parsed expression (Grafana's variables replaced by what they expand to)."""
    import promql_parser

    for variable, value in (("$__rate_interval", "5m"), ("$__interval", "1m"), ("$model", ".*")):
        expr = expr.replace(variable, value)
    return promql_parser.parse(expr)


def test_every_expression_parses_as_promql(dashboard, rules):
    pytest.importorskip("promql_parser", reason="pip install promql-parser (the dev extra)")
    exprs = [r["expr"] for r in rules] + dashboard_exprs(dashboard)
    for expr in exprs:
        if expr.startswith("label_values("):  # a Grafana templating function, not PromQL
            expr = expr[len("label_values("):].rsplit(",", 1)[0]
        promql(expr)  # raises on a syntax error
    with pytest.raises(Exception):
        promql("sum(rate(prefixserve:generation_tokens_total[5m])")
    with pytest.raises(Exception):
        promql("sum by (le) rate(x[5m])")
