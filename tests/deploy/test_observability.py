"""The Grafana dashboard and the Prometheus alert rules in ``deploy/``:
they parse, and every ``prefixserve:*`` series they query is one the replicas
(``workers/metrics.py``) or the routers (``router/metrics.py``) export."""

from __future__ import annotations

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
