"""How directory calls fail, and what a publish, resync or heartbeat did.

Routers treat any ``DirectoryError`` as "no cache information" and route on
load alone; replicas treat ``PublishStatus`` values other than ``OK`` as
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


class DirectoryUnavailable(DirectoryError):
    """Redis is unreachable or cannot serve writes right now."""


class PublishStatus(str, enum.Enum):
    """What the directory did with a publish, resync or heartbeat."""

    OK = lua.OK
    GAP = lua.GAP  # seq_no was not last + 1: set dropped, resync needed
    NEEDS_RESYNC = lua.NEEDS_RESYNC  # registered or gapped, no resync yet
    UNKNOWN = lua.UNKNOWN  # registry entry expired or Redis restarted: re-register
    SUPERSEDED = lua.SUPERSEDED  # a newer epoch of this replica id exists
