"""``prefixserve redis-acl``: the Redis ACL file of the prefix directory
(``cluster/shared/directory/acl.py``) on stdout, for ``redis-server --aclfile``
or a Kubernetes Secret. Passwords come from variables (never the command
line, which other users can read); unset ones are generated and reported
with the URLs to give replicas and routers, on stderr."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys

from cluster.shared.directory.acl import DEFAULT_USERS, acl_file

logger = logging.getLogger(__name__)


def add_redis_acl_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replica-password-env", default="PREFIXSERVE_REDIS_REPLICA_PASSWORD",
                        help="variable holding the replicas' password (generated when unset)")
    parser.add_argument("--router-password-env", default="PREFIXSERVE_REDIS_ROUTER_PASSWORD",
                        help="variable holding the routers' password (generated when unset)")
    parser.add_argument("--host", default="prefixserve-redis:6379",
                        help="host:port of Redis, for the URLs printed on stderr")


def run_redis_acl(args: argparse.Namespace) -> int:
    passwords = {}
    for role, env in (("replica", args.replica_password_env), ("router", args.router_password_env)):
        passwords[role] = os.environ.get(env) or secrets.token_hex(24)
    try:
        text = acl_file(passwords)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    sys.stdout.write(text)
    for role in sorted(passwords):
        sys.stderr.write(f"# {role}s: redis://{DEFAULT_USERS[role]}:{passwords[role]}@{args.host}/0\n")
    return 0
