"""Flags generated from the config dataclasses, and the parser class of
every ``prefixserve`` command.

Engine flags come from ``EngineConfig`` and its sections and are named as
vLLM names them (``--block-size``, ``--max-num-seqs``,
``--enable-chunked-prefill`` / ``--no-enable-chunked-prefill``, ...); front-end
flags from ``router.limits.Limits`` and ``router.security``. Every flag
defaults to None, meaning "keep the config's value".
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from typing import Any, Optional, Sequence

from cluster.shared.config import CacheConfig, EngineConfig, LoRAConfig, ParallelConfig, SchedulerConfig

_ENGINE_SECTIONS = (EngineConfig, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig)
_SKIP = {"cache", "scheduler", "parallel", "lora"}


def add_engine_args(parser: argparse.ArgumentParser, exclude: Sequence[str] = ()) -> None:
    """Adds one flag per engine config field (defaults: None = config default),
    except the fields named in ``exclude`` (their flags mean something else there)."""
    group = parser.add_argument_group("engine")
    for klass in _ENGINE_SECTIONS:
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            if f.name in _SKIP or f.name in exclude:
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = _base_type(hints[f.name])
            if kind is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
            elif typing.get_origin(hints[f.name]) is tuple:  # a list of words (e.g. --lora-modules sql=/adapters/sql chat=/adapters/chat)
                group.add_argument(flag, dest=f.name, nargs="+", default=None, metavar="NAME=PATH")
            elif kind is dict:  # a mapping, given as JSON (e.g. --speculative-config '{"method": "ngram"}')
                group.add_argument(flag, dest=f.name, type=str, default=None, metavar="JSON",
                                   help=f"a JSON mapping; default: {f.default!r}")
            else:
                group.add_argument(flag, dest=f.name, type=kind, default=None, help=f"default: {f.default!r}")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user set (others keep the config defaults)."""
    names = {f.name for k in _ENGINE_SECTIONS for f in dataclasses.fields(k)} - _SKIP
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the front ends: input limits (from ``Limits``), TLS and API keys."""
    from router.limits import Limits

    limits = parser.add_argument_group("limits (router/limits.py)")
    hints = typing.get_type_hints(Limits)
    for f in dataclasses.fields(Limits):
        limits.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=_base_type(hints[f.name]),
                            default=None, help=f"default: {f.default!r}")
    sec = parser.add_argument_group("security (router/security.py)")
    sec.add_argument("--tls-cert", default=None, help="serve gRPC and HTTP over TLS with this certificate (PEM)")
    sec.add_argument("--tls-key", default=None, help="private key (PEM) of --tls-cert")
    sec.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA (mTLS)")
    sec.add_argument("--api-key", action="append", default=None,
                     help="require 'Authorization: Bearer <key>' with this key (repeatable)")
    sec.add_argument("--api-key-file", default=None, help="file of accepted keys, one per line")
    sec.add_argument("--tenants-file", default=None,
                     help="YAML binding keys to tenants: cache namespace, max_priority, requests_per_s, "
                          "max_concurrent_streams, max_tokens_per_request (router/tenants.py)")
    sec.add_argument("--auth-health", action="store_true", help="require a key for health checks too")
    sec.add_argument("--auth-metrics", action="store_true", help="require a key for /metrics too")


def limits_from_args(args: argparse.Namespace, base: Optional[dict] = None) -> Any:
    """The ``Limits`` of ``base`` (the config file's ``router.limits``) with the flags set on top."""
    from router.limits import Limits

    flags = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(Limits)}
    return Limits.from_kwargs(**{**(base or {}), **{k: v for k, v in flags.items() if v is not None}})


def security_from_args(args: argparse.Namespace, router: Any = None) -> Any:
    """The front ends' ``Security`` from the flags, falling back to the config
    file's ``router`` section (``RouterConfig``); None when nothing is set.

    Raises:
        ValueError: Only one of --tls-cert / --tls-key, a client CA without
            TLS, or an unreadable file / empty key file.
    """
    from router.security import Security

    def pick(flag: str, key: Optional[str] = None) -> Any:
        value = getattr(args, flag, None)
        return value if value not in (None, False) else getattr(router, key or flag, None)

    return Security.from_options(
        tls_cert=pick("tls_cert"), tls_key=pick("tls_key"), tls_client_ca=pick("tls_client_ca"),
        api_keys=getattr(args, "api_key", None) or (), api_key_file=pick("api_key_file"),
        tenants_file=pick("tenants_file"), auth_health=bool(pick("auth_health")), auth_metrics=bool(pick("auth_metrics")),
    )


def _base_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


class Parser(argparse.ArgumentParser):
    """No abbreviated flags (a typo must not silently pick another flag), and
    unknown flags get the closest known one suggested."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._argv = list(sys.argv[1:] if args is None else args)  # for error(): which subcommand was chosen
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            known = [opt for action in self._chosen()._actions for opt in action.option_strings]
            hints = []
            for arg in message.split(":", 1)[1].split():
                name = arg.split("=")[0]
                close = difflib.get_close_matches(name, known, n=1)
                if close and close[0] != name:
                    hints.append(f"{arg}: did you mean {close[0]}?")
                elif name.startswith("-") and name not in known:
                    others = [" ".join(words) for words, sub in self._commands() if name in sub._option_string_actions]
                    if others:
                        hints.append(f"{arg} is a flag of {', '.join(others[:3])}, not of this command")
            if hints:
                message += "\n" + "\n".join(hints)
        super().error(message)

    def _chosen(self) -> argparse.ArgumentParser:
        """The (sub)command parser the command line picked: its flags are the ones that apply."""
        parser: argparse.ArgumentParser = self
        for token in getattr(self, "_argv", []):
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if subs and token in subs[0].choices:
                parser = subs[0].choices[token]
        return parser

    def _commands(self, words: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
        """Every leaf command: its words and its parser."""
        subs = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [(words, self)]
        out = []
        for name, sub in subs[0].choices.items():
            out.extend(sub._commands((*words, name)) if isinstance(sub, Parser) else [((*words, name), sub)])
        return out
