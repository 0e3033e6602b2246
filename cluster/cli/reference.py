"""The configuration reference (``docs/CONFIG.md``), generated from the config
dataclasses and the ``prefixserve`` parser so it cannot drift from them.

Every config key is a field of a dataclass in ``cluster/shared/config`` (or
``router.limits.Limits``), documented in its class's ``Attributes:``
section; every flag is an argparse action of ``cluster.cli.main``. The test
``tests/unit/test_docs.py`` regenerates the page and compares it with the
committed one; ``scripts/gen_reference.py`` writes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing
from typing import Any, Iterator, Optional

from cluster.shared.config import (AutoscalingConfig, CacheConfig, ClusterConfig, EngineConfig, LoRAConfig,
                                   ParallelConfig, SchedulerConfig, SpeculativeConfig, StructuredOutputsConfig)
from cluster.shared.config.cluster import RouterConfig

SECTIONS = {ClusterConfig: ("engine", "router", "autoscaling"), EngineConfig: ("cache", "scheduler", "parallel", "lora")}
HEADER = """# Configuration reference

Generated from the config dataclasses (`cluster/shared/config/`,
`router/limits.py`) and the `prefixserve` parser by
`scripts/gen_reference.py`; `tests/unit/test_docs.py` fails when this page
and the code disagree. Do not edit it by hand.

A cluster config file (`prefixserve up --config cluster.yaml`, or the
RayService's `serveConfigV2 -> applications[0].args.config`) has the keys of
the first table at its top level and the sections below it; an unknown or
misspelled key at any level is an error that names it. `LLM(...)` takes the
`engine` keys (sections included) as flat keyword arguments. On the command
line every engine key is a flag of the commands that run an engine, named
as vLLM names it; a flag given overrides the file.
"""


def attribute_docs(klass: type) -> dict[str, str]:
    """``{field: description}`` from the ``Attributes:`` section of a dataclass's
    docstring (``a / b: text`` documents both fields)."""
    doc = inspect.cleandoc(klass.__doc__ or "")
    out: dict[str, str] = {}
    inside, current = False, None
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            inside = True
            continue
        if not inside:
            continue
        if line and not line.startswith(" "):
            break  # the next section
        match = re.match(r"^    ([a-z_][a-z0-9_ /]*):\s*(.*)$", line)
        if match:
            current = [name.strip() for name in match.group(1).split("/")]
            for name in current:
                out[name] = match.group(2)
        elif current and line.strip():
            for name in current:
                out[name] += " " + line.strip()
    return out


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{}" if not value else repr(value)
    return str(value)


def _default(f: dataclasses.Field) -> Optional[Any]:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text).replace("|", "\\|").strip()


def _up_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``{dest: flag}`` of ``prefixserve up`` (the flags that override config keys)."""
    up, _ = _subparsers(parser)["up"]
    flags = {a.dest: a.option_strings[0] for a in up._actions if a.option_strings}
    return {**flags, "host": flags["grpc_host"]}  # the router's host is --grpc-host


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Every command's parser and help by its words (``up``, ``bench serve``, ...), in order."""
    out: dict[str, tuple[argparse.ArgumentParser, str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                words = f"{prefix} {name}".strip()
                nested = _subparsers(sub, words)
                if nested:
                    out.update(nested)
                else:
                    out[words] = (sub, helps.get(name, ""))
    return out


def _section(title: str, klass: type, flags: dict[str, str], engine: bool, json_flag: Optional[str] = None,
             intro: str = "") -> Iterator[str]:
    docs = attribute_docs(klass)
    hints = typing.get_type_hints(klass)
    yield f"## `{title}`" if title else "## Top level"
    yield ""
    if intro:
        yield intro
        yield ""
    yield "| key | default | flag | what it does |"
    yield "|---|---|---|---|"
    for f in dataclasses.fields(klass):
        if f.name in SECTIONS.get(klass, ()):
            yield f"| `{f.name}` | section | | see `{(title + '.' if title else '') + f.name}` below |"
            continue
        if engine:
            flag = "--" + f.name.replace("_", "-")
            if hints[f.name] is bool or hints[f.name] == Optional[bool]:
                flag += f" / --no-{f.name.replace('_', '-')}"
        elif json_flag:
            flag = f"in {json_flag} JSON"
        else:
            flag = flags.get(f.name, "")
        text = docs.get(f.name, "")
        if not text:
            raise ValueError(f"{klass.__name__}.{f.name} has no entry in its docstring's Attributes section")
        yield f"| `{f.name}` | `{_yaml(_default(f))}` | {f'`{flag}`' if flag else ''} | {_cell(text)} |"
    yield ""


def _commands(parser: argparse.ArgumentParser) -> Iterator[str]:
    yield "## Commands and their flags"
    yield ""
    yield ("Flags that every engine command takes are the `engine` keys above (`--block-size`, "
           "`--max-num-seqs`, ...); each command below says whether it takes them. `--log-level` "
           "comes before the command.")
    yield ""
    for words, (sub, helptext) in _subparsers(parser).items():
        groups = {id(a): g.title for g in sub._action_groups for a in g._group_actions}
        engine = any(groups.get(id(a)) == "engine" for a in sub._actions)
        yield f"### `prefixserve {words}`"
        yield ""
        yield (_cell(helptext) or "(no summary)") + ("; takes the engine flags." if engine else ".")
        yield ""
        formatter = sub._get_formatter()
        rows = []
        for action in sub._actions:
            if action.dest == "help" or groups.get(id(action)) == "engine":
                continue
            name = ", ".join(action.option_strings) or f"{action.dest} (positional)"
            text = formatter._expand_help(action) if action.help else ""
            default = "" if action.default in (None, argparse.SUPPRESS, False) or action.nargs == 0 \
                else f"`{_yaml(action.default)}`"
            rows.append(f"| `{name}` | {_cell(default)} | {_cell(text)} |")
        if rows:
            yield "| flag | default | what it does |"
            yield "|---|---|---|"
            yield from rows
            yield ""


def config_reference() -> str:
    """The whole ``docs/CONFIG.md``."""
    from cluster.cli.main import build_parser
    from router.limits import Limits

    parser = build_parser()
    flags = _up_flags(parser)
    lines = [HEADER]
    lines += _section("", ClusterConfig, flags, engine=False)
    lines += _section("engine", EngineConfig, flags, engine=True)
    lines += _section("engine.cache", CacheConfig, flags, engine=True)
    lines += _section("engine.scheduler", SchedulerConfig, flags, engine=True)
    lines += _section("engine.parallel", ParallelConfig, flags, engine=True)
    lines += _section("engine.lora", LoRAConfig, flags, engine=True, intro="docs/LORA.md has the adapters' format.")
    lines += _section("engine.speculative_config", SpeculativeConfig, flags, engine=False,
                      json_flag="--speculative-config", intro="docs/SPECULATIVE.md has the methods.")
    lines += _section("engine.structured_outputs_config", StructuredOutputsConfig, flags, engine=False,
                      json_flag="--structured-outputs-config")
    lines += _section("router", RouterConfig, flags, engine=False)
    lines += _section("router.limits", Limits, flags, engine=False)
    lines += _section("autoscaling", AutoscalingConfig, flags, engine=False,
                      intro="Present: Serve scales the replicas on these signals (`cluster/shared/autoscaling.py`).")
    lines += list(_commands(parser))
    return "\n".join(lines).rstrip() + "\n"
