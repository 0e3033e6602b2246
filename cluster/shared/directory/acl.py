"""Redis ACL users of the prefix directory: replicas write, routers only read.

    user prefixserve-replica on >PASSWORD <REPLICA_RULES>
    user prefixserve-router  on >PASSWORD <ROUTER_RULES>
    user default off

Both users reach only the directory's keys (``ps:*``) and no pub/sub
channel. Replicas run every directory script (register, publish, resync,
heartbeat, GC) and nothing administrative. Routers read: the lookup and
stats scripts (read-only Lua: Redis checks each command a script runs
against the caller's ACL, so a router's script cannot write), the events
stream (``XREAD``) and the registry; any write is refused with NOPERM, but
to the one key of the metrics-exporter lease, the stored ``/v1/responses``
(``ps:responses:*``, set and delete only) and the run-time LoRA adapters
(``ps:lora:*``, hash set and delete only: ``router/lora_registry.py``).

``prefixserve redis-acl`` prints an ACL file for ``redis-server --aclfile``
(``deploy/kuberay/base/redis.yaml`` mounts one from a Secret); the
directory's tests run both roles against a real ``redis-server`` with it.
"""

from __future__ import annotations

import re
from typing import Mapping

KEYS = "~ps:*"
# No @dangerous (KEYS, FLUSHALL, CONFIG, DEBUG, ...), no pub/sub.
REPLICA_RULES = f"{KEYS} resetchannels -@all +@connection +@read +@write +@scripting +time -@dangerous"
# Routers read every directory key and write one: the lease of exporting the
# replicas' series (router/metrics.py), so dashboards count each series once.
# (A Redis 7 selector: SET / PEXPIRE / DEL on that key only. Read-only key
# patterns (%R~) would refuse EVALSHA itself, whose declared keys count as written.)
# And the stored /v1/responses (router/openai/response_store.py): set and delete on their keys only;
# the run-time LoRA adapters (router/lora_registry.py): HSET and HDEL on theirs.
ROUTER_RULES = (f"{KEYS} resetchannels -@all +@connection +@read +evalsha +eval +script|load +script|exists +time "
                "-@dangerous (~ps:*:metrics-exporter resetchannels -@all +set +pexpire +del) "
                "(~ps:responses:* resetchannels -@all +set +del) (~ps:lora:* resetchannels -@all +hset +hdel)")
ROLES: Mapping[str, str] = {"replica": REPLICA_RULES, "router": ROUTER_RULES}
DEFAULT_USERS = {"replica": "prefixserve-replica", "router": "prefixserve-router"}
_USER = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def acl_line(role: str, user: str, password: str) -> str:
    """One ``user ...`` line of an ACL file for ``role`` (``replica`` or ``router``).

    Raises:
        ValueError: An unknown role, a bad user name, or a password with
            whitespace or shorter than 16 characters.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    if not _USER.match(user):
        raise ValueError(f"a Redis user name is 1-64 characters of [A-Za-z0-9_.-], got {user!r}")
    if len(password) < 16 or any(c.isspace() for c in password):
        raise ValueError("a Redis password needs at least 16 characters and no whitespace "
                         "(e.g. `openssl rand -hex 24`)")
    return f"user {user} on >{password} {ROLES[role]}"


def acl_file(passwords: Mapping[str, str], users: Mapping[str, str] = DEFAULT_USERS) -> str:
    """An ACL file with one user per role and the default user off."""
    lines = [acl_line(role, users[role], passwords[role]) for role in sorted(passwords)]
    return "\n".join(lines + ["user default off", ""])
