"""The engine's LoRA knobs, named as vLLM names them (``--enable-lora``,
``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``, ``--lora-modules
name=path ...``); given flat to ``LLM(...)`` and the CLI like the other sections."""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional


_FOLDER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (``workers/lora/``, docs/LORA.md).

    Attributes:
        enable_lora: Serve PEFT LoRA adapters beside the base model; requests
            name one (``LoRARequest``, the OpenAI ``model`` field) or none.
        max_loras: Most distinct adapters in one step; a request whose
            adapter would be one more waits for a running one to finish.
        max_lora_rank: Largest rank accepted; a bigger adapter is refused.
        max_cpu_loras: Adapters kept loaded (least recently used dropped
            first, never one a request still uses); None: ``max_loras``.
        lora_modules: Adapters loaded at start, ``name=path`` each (vLLM's
            ``--lora-modules``; a mapping in a config file).
        dynamic_lora_loading_path: A folder whose sub-folders are adapters:
            a request naming ``<name>`` runs ``<folder>/<name>``, loaded on
            first use (Ray Serve LLM's knob; a local or mounted path that the
            replicas read).
        allow_runtime_lora_updating: Serve ``POST /v1/load_lora_adapter`` and
            ``/v1/unload_lora_adapter`` (vLLM's endpoints, off by default as
            there); with API keys on, only a tenant with ``lora_admin: true``
            may call them.
    """

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    lora_modules: tuple[str, ...] = ()
    dynamic_lora_loading_path: Optional[str] = None
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        modules = tuple(f"{n}={p}" for n, p in parse_lora_modules(self.lora_modules).items())
        object.__setattr__(self, "lora_modules", modules)
        if (modules or self.dynamic_lora_loading_path or self.allow_runtime_lora_updating) and not self.enable_lora:
            raise ValueError("lora_modules, dynamic_lora_loading_path and allow_runtime_lora_updating need "
                             "enable_lora: add --enable-lora (enable_lora=True)")

    @property
    def cpu_capacity(self) -> int:
        """Adapters kept loaded."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @functools.cached_property
    def modules(self) -> dict[str, str]:
        """``lora_modules`` as name -> path (parsed once: the routers read it per request)."""
        return parse_lora_modules(self.lora_modules)

    def dynamic_path(self, name: str) -> Optional[str]:
        """``<dynamic_lora_loading_path>/<name>``, or None (no folder, or a
        name that is not one plain folder name: no separators, no leading dot)."""
        if not self.dynamic_lora_loading_path or not _FOLDER_NAME.fullmatch(name):
            return None
        return os.path.join(self.dynamic_lora_loading_path, name)


def parse_lora_modules(value: Any) -> dict[str, str]:
    """Adapters as users give them: ``name=path`` strings (or vLLM's JSON
    ``{"name": ..., "path": ...}``), a list of them, or a name -> path mapping.

    Raises:
        ValueError: An entry is neither, or a name is given twice.
    """
    if isinstance(value, dict):
        items = [(str(k), str(v)) for k, v in value.items()]
    else:
        items = []
        for entry in [value] if isinstance(value, str) else list(value or ()):
            items.append(_parse_entry(entry))
    out: dict[str, str] = {}
    for name, path in items:
        if not name or not path:
            raise ValueError(f"lora_modules entry {name}={path!r} needs a name and a path")
        if name in out:
            raise ValueError(f"lora_modules names adapter {name!r} twice")
        out[name] = path
    return out


def _parse_entry(entry: Any) -> tuple[str, str]:
    if isinstance(entry, dict):
        return str(entry.get("name", "")), str(entry.get("path", ""))
    text = str(entry).strip()
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"lora_modules entry {text!r} is not JSON: {exc}") from None
        return _parse_entry(parsed)
    name, sep, path = text.partition("=")
    if not sep:
        raise ValueError(f"lora_modules entry {text!r} must be name=path (e.g. sql-lora=/adapters/sql)")
    return name.strip(), path.strip()
