"""The Ray Serve application: the replica deployment and, for Serve-managed
clusters (KubeRay), the router deployment in front of it (``builder.py``).

``cluster.app:app_builder`` is the import path of a RayService's
``serveConfigV2``; the local launcher (``cluster.launch``) runs ``build_app``.
"""

from cluster.app.builder import (
    APP_NAME,
    DEFAULT_MODEL_NAME,
    REPLICA_DEPLOYMENT,
    ROUTER_DEPLOYMENT,
    app_builder,
    app_names,
    build_app,
    model_info,
    replica_options,
    request_router_config,
    router_options,
)

__all__ = [
    "APP_NAME", "DEFAULT_MODEL_NAME", "REPLICA_DEPLOYMENT", "ROUTER_DEPLOYMENT", "app_builder", "app_names", "build_app",
    "model_info", "replica_options", "request_router_config", "router_options",
]
