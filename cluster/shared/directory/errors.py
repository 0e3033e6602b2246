"""How directory calls fail, and what a publish, resync or heartbeat did.

Routers treat any ``DirectoryError`` as "no cache information" and route on
load alone (a ``DirectoryAuthError`` at start-up stops them instead); replicas treat ``PublishStatus`` values other than ``OK`` as
instructions (resync, re-register, stop).
"""

from __future__ import annotations

import enum

from redis import exceptions as rex

from cluster.shared.directory import lua

# Errors that mean "Redis cannot serve us now", as opposed to a bug.
UNAVAILABLE_ERRORS = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.BusyLoadingError,
    rex.ReadOnlyError,
    rex.OutOfMemoryError,
    OSError,
)


class DirectoryError(Exception):
    """A directory call failed; routers treat it as "no cache information"."""


class DirectoryAuthError(DirectoryError):
    """Redis refused the credentials of the URL, or its ACL user may not run a
    call: a configuration error, not an outage (replicas and routers refuse
    to start with it; ``cluster/shared/directory/acl.py`` has the ACL)."""


def is_acl_denial(exc: Exception) -> bool:
    """Whether Redis refused a command for the ACL (NOPERM, or a command that
    a script ran, which Redis reports as a plain error)."""
    return isinstance(exc, rex.NoPermissionError) or (
        isinstance(exc, rex.ResponseError) and "user executing the script can't" in str(exc))


def auth_error_message(what: str, exc: Exception) -> str:
    """What to change when Redis refuses ``what`` for lack of credentials or permission."""
    if is_acl_denial(exc):
        return (f"directory {what}: the Redis user of this URL may not do it ({exc}): replicas need the "
                "'replica' ACL and routers the 'router' ACL (`prefixserve redis-acl`, "
                "cluster/shared/directory/acl.py)")
    return (f"directory {what}: Redis refused the credentials ({exc}): put the right user and password in the "
            "URL, redis://USER:PASSWORD@host:port/0 (`env:NAME` reads the URL from a variable filled from a Secret)")


class DirectoryUnavailable(DirectoryError):
    """Redis is unreachable or cannot serve writes right now."""


class PublishStatus(str, enum.Enum):
    """What the directory did with a publish, resync or heartbeat."""

    OK = lua.OK
    GAP = lua.GAP  # seq_no was not last + 1: set dropped, resync needed
    NEEDS_RESYNC = lua.NEEDS_RESYNC  # registered or gapped, no resync yet
    UNKNOWN = lua.UNKNOWN  # registry entry expired or Redis restarted: re-register
    SUPERSEDED = lua.SUPERSEDED  # a newer epoch of this replica id exists
