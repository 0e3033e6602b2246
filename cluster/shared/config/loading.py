"""Strict reading of the config tree from nested mappings (parsed YAML).

Every level is checked: an unknown or misspelled key, or a value of the
wrong type, is an error naming its full key path (``engine.cache.blok_size``)
and the closest known key. Under ``engine:`` the knobs of its sections may
be given nested (``cache: {block_size: 16}``) or flat as vLLM names them
(``block_size: 16``), not both for one knob.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Any, Mapping, Union

from cluster.shared.config.engine import ENGINE_SECTIONS, EngineConfig

_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def build_strict(cls: type, mapping: Any, path: str = "") -> Any:
    """Builds dataclass ``cls`` from ``mapping``, checking every level.

    Args:
        cls: A config dataclass (nested dataclass fields recurse).
        mapping: Its keys and values (a parsed YAML mapping).
        path: Key path of ``mapping`` in the whole tree, prefixed to errors.

    Raises:
        ValueError: Names the key to change (full path) and how.
    """
    return _build(cls, mapping, path)


def read_yaml_mapping(path: Union[str, "os.PathLike[str]"]) -> Any:
    """The parsed content of a YAML file (an empty file is ``{}``).

    Raises:
        ValueError: The file is unreadable or not valid YAML (names the file).
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"cannot read the cluster config {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from exc
    return {} if data is None else data


def _build(cls: type, mapping: Any, path: str) -> Any:
    """Builds dataclass ``cls`` from ``mapping``; ``path`` prefixes error keys."""
    where = path or "the cluster config"
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{where} must be a mapping of keys to values, got {type(mapping).__name__}")
    if cls is EngineConfig:
        mapping = _nest_engine_keys(mapping, path)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    for key, value in mapping.items():
        if key not in names:
            raise ValueError(_unknown_key(key, names, path))
        values[key] = _convert(value, hints[key], _join(path, key))
    try:
        return cls(**values)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}" if path else str(exc)) from exc


def _nest_engine_keys(mapping: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Moves flat vLLM-style section knobs (``block_size``) into their section."""
    owner = {f.name: section for section, klass in ENGINE_SECTIONS.items() for f in dataclasses.fields(klass)}
    nested: dict[str, Any] = {}
    flat: dict[str, dict[str, Any]] = {}
    for key, value in mapping.items():
        if key in owner and key not in ENGINE_SECTIONS:
            flat.setdefault(owner[key], {})[key] = value
        else:
            nested[key] = value
    engine_names = [f.name for f in dataclasses.fields(EngineConfig)]
    for key in nested:
        if key not in engine_names:
            raise ValueError(_unknown_key(key, engine_names + sorted(owner), path))
    for section, knobs in flat.items():
        given = nested.get(section) or {}
        if not isinstance(given, Mapping):
            continue  # _build reports the wrong type with its path
        both = sorted(set(knobs) & set(given))
        if both:
            raise ValueError(
                f"{_join(path, both[0])} and {_join(path, section + '.' + both[0])} are both set; keep one"
            )
        nested[section] = {**given, **knobs}
    return nested


def _convert(value: Any, hint: Any, path: str) -> Any:
    """Checks ``value`` against a field's type hint; nested dataclasses recurse."""
    if typing.get_origin(hint) is Union:
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        hint = options[0]
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise ValueError(f"{path} must be a list, got {value!r} ({type(value).__name__})")
        item = (typing.get_args(hint) or (Any,))[0]
        return [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    else:
        ok = True
    if not ok:
        kind = _KIND_NAMES.get(hint, getattr(hint, "__name__", str(hint)))
        raise ValueError(f"{path} must be {kind}, got {value!r} ({type(value).__name__})")
    return value


def from_env(value: str, path: str) -> str:
    """``env:NAME`` -> the value of environment variable NAME; other values as they are.

    Raises:
        ValueError: NAME is not set (the message names ``path`` and NAME).
    """
    if not value.startswith("env:"):
        return value
    name = value[len("env:"):]
    if not name or name not in os.environ:
        raise ValueError(f"{path} is {value!r} but environment variable {name!r} is not set; "
                         "set it (e.g. from a Secret) or give the URL itself")
    return os.environ[name]


def _unknown_key(key: Any, known: list[str], path: str) -> str:
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"; did you mean {_join(path, close[0])!r}?" if close else f"; known keys: {', '.join(known)}"
    return f"unknown key {_join(path, str(key))!r}{hint}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
