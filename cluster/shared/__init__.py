"""The shared base: what every process of the cluster imports (the router,
the replicas and their tensor-parallel ranks, the entry points). It imports
nothing of ``workers``, ``router`` or the entry points, and no torch.

    config/        the frozen config tree (engine, cluster) and its strict loading
    types.py       SamplingParams, GenerationRequest, StreamChunk, ReplicaStats, ...
    hashing.py     the block-hash chain (router and engine compute the same)
    fingerprint.py the model fingerprint in the hash chain
    chat_template.py  chat templates rendered with jinja2, as transformers does
    detokenizer.py incremental detokenization and stop strings (replicas; the router
                   after a stream migrates)
    directory/     the Redis prefix directory and replica registry
    autoscaling.py the KV-aware Serve autoscaling policy
    metrics_format.py  Prometheus text of a registry (replicas and routers)
    ray_local.py   Ray on loopback for local clusters and TP groups
    sizes.py       block counts and byte units
"""
