"""``prefixserve router-drain``: drain the router replica of this pod (its
preStop hook; ``router/drain.py``). Exit 0 once no stream runs, 1 when some
still ran at the timeout, 2 when no router answered."""

from __future__ import annotations

import argparse
import asyncio
import logging

from router.drain import DEFAULT_SOCKET, request_drain

logger = logging.getLogger(__name__)


def add_drain_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=DEFAULT_SOCKET,
                        help=f"the router's admin socket, router.admin_socket (default {DEFAULT_SOCKET})")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds running streams get to finish (default 30; keep it below the pod's "
                             "terminationGracePeriodSeconds)")


def run_drain(args: argparse.Namespace) -> int:
    if args.timeout < 0:
        logger.error("--timeout must be >= 0, got %s", args.timeout)
        return 2
    try:
        left = asyncio.run(request_drain(args.socket, args.timeout))
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 2
    if left:
        logger.warning("router drained with %d streams still running after %.0f s", left, args.timeout)
        return 1
    logger.info("router drained: no stream left")
    return 0
