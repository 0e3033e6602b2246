"""The Redis prefix directory: which replica caches which KV blocks, and
which replicas are alive (docs/DIRECTORY.md).

    client.py     Directory: the async client routers and replicas use
                  (registry, heartbeats, publish / resync / lookup, metrics texts)
    connection.py DirectoryConnection: its Redis connection (URLs, Sentinel,
                  timeouts) and the unavailable / fail-fast convention
    publisher.py  DirectoryPublisher: a replica's side (numbered KV-event
                  batches, resync on a gap, heartbeats)
    lua.py        the key schema and the server-side scripts
    errors.py     DirectoryError / DirectoryUnavailable, PublishStatus
"""

from cluster.shared.directory.client import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_TTL_S,
    Directory,
    check_block_hashes,
    pairs_to_dict,
)
from cluster.shared.directory.errors import DirectoryAuthError, DirectoryError, DirectoryUnavailable, PublishStatus

__all__ = [
    "DEFAULT_HEARTBEAT_S", "DEFAULT_TTL_S", "Directory", "DirectoryAuthError", "DirectoryError",
    "DirectoryUnavailable",
    "PublishStatus", "check_block_hashes", "pairs_to_dict",
]
