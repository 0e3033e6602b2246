"""JSON schemas of the Prometheus Operator objects the manifests use
(``monitoring.coreos.com/v1`` PodMonitor and PrometheusRule), written here
from the operator's published v1 CRDs (field names, types and duration
patterns), for the fields prefixserve sets: no package ships them, and the
tests cannot download them.

They are stricter than the CRDs on purpose: every object that lists its
properties refuses any other key, so a misspelled field (``intervall``,
``tlsconfig``) fails here instead of being dropped by the API server.
"""

from __future__ import annotations

from typing import Any

DURATION = {"type": "string",
            "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


SECRET_KEY = strict({"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}},
                    ("key",))
LABEL_SELECTOR = strict({
    "matchLabels": STRING_MAP,
    "matchExpressions": {"type": "array", "items": strict({
        "key": {"type": "string"},
        "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
        "values": {"type": "array", "items": {"type": "string"}},
    }, ("key", "operator"))},
})
METADATA = strict({"name": {"type": "string", "minLength": 1}, "namespace": {"type": "string"},
                   "labels": STRING_MAP, "annotations": STRING_MAP}, ("name",))
TLS_CONFIG = strict({
    "ca": strict({"secret": SECRET_KEY, "configMap": SECRET_KEY}),
    "cert": strict({"secret": SECRET_KEY, "configMap": SECRET_KEY}),
    "keySecret": SECRET_KEY,
    "serverName": {"type": "string"},
    "insecureSkipVerify": {"type": "boolean"},
})
RELABELING = strict({
    "action": {"type": "string"}, "regex": {"type": "string"}, "replacement": {"type": "string"},
    "separator": {"type": "string"}, "sourceLabels": {"type": "array", "items": {"type": "string"}},
    "targetLabel": {"type": "string"}, "modulus": {"type": "integer"},
})

POD_MONITOR = strict({
    "apiVersion": {"const": "monitoring.coreos.com/v1"},
    "kind": {"const": "PodMonitor"},
    "metadata": METADATA,
    "spec": strict({
        "selector": LABEL_SELECTOR,
        "namespaceSelector": strict({"any": {"type": "boolean"},
                                     "matchNames": {"type": "array", "items": {"type": "string"}}}),
        "jobLabel": {"type": "string"},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": strict({
            "port": {"type": "string"},
            "path": {"type": "string"},
            "interval": DURATION,
            "scrapeTimeout": DURATION,
            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
            "tlsConfig": TLS_CONFIG,
            "authorization": strict({"type": {"type": "string"}, "credentials": SECRET_KEY}),
            "honorLabels": {"type": "boolean"},
            "relabelings": {"type": "array", "items": RELABELING},
            "metricRelabelings": {"type": "array", "items": RELABELING},
        })},
    }, ("selector", "podMetricsEndpoints")),
}, ("apiVersion", "kind", "metadata", "spec"))

RULE = strict({
    "alert": {"type": "string", "minLength": 1},
    "record": {"type": "string", "minLength": 1},
    "expr": {"type": ["string", "integer"]},
    "for": DURATION,
    "keep_firing_for": DURATION,
    "labels": STRING_MAP,
    "annotations": STRING_MAP,
}, ("expr",))
RULE["oneOf"] = [{"required": ["alert"]}, {"required": ["record"]}]

PROMETHEUS_RULE = strict({
    "apiVersion": {"const": "monitoring.coreos.com/v1"},
    "kind": {"const": "PrometheusRule"},
    "metadata": METADATA,
    "spec": strict({
        "groups": {"type": "array", "items": strict({
            "name": {"type": "string", "minLength": 1},
            "interval": DURATION,
            "limit": {"type": "integer"},
            "labels": STRING_MAP,
            "rules": {"type": "array", "items": RULE},
        }, ("name",))},
    }),
}, ("apiVersion", "kind", "metadata", "spec"))

SCHEMAS = {"PodMonitor": POD_MONITOR, "PrometheusRule": PROMETHEUS_RULE}
