"""Connections of ``--url`` clients (``generate``, ``chat``, ``status``) to a
running cluster's gRPC router: plaintext, TLS or mTLS, and the API key.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from router.security import API_KEY_ENV


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """Flags of a ``--url`` client: TLS (mTLS) and the API key."""
    group = parser.add_argument_group("connection (with --url)")
    group.add_argument("--tls", action="store_true", help="connect with TLS, verified by the system's CAs")
    group.add_argument("--tls-ca", default=None, help="CA bundle (PEM) that verifies the router; implies TLS")
    group.add_argument("--tls-cert", default=None, help="client certificate (PEM) for mTLS; implies TLS")
    group.add_argument("--tls-key", default=None, help="private key of --tls-cert")
    group.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                       help=f"bearer token sent as 'authorization: Bearer ...' (default: ${API_KEY_ENV})")


def open_channel(args: argparse.Namespace) -> tuple[Any, tuple]:
    """The gRPC channel to ``args.url`` and the call metadata (API key).

    Raises:
        ValueError: A TLS file is unreadable, or a cert comes without its key.
    """
    from router.security import bearer_metadata, client_channel

    channel = client_channel(args.url, tls=getattr(args, "tls", False), ca_file=getattr(args, "tls_ca", None),
                             cert_file=getattr(args, "tls_cert", None), key_file=getattr(args, "tls_key", None))
    return channel, bearer_metadata(getattr(args, "api_key", None))
