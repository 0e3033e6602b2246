"""Chat templates (Jinja, as in ``tokenizer_config.json``), without torch.

Shared by the router (which renders chat requests) and the offline CLI.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.sandbox

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplate:
    """A compiled chat template with the model's special tokens.

    Args:
        source: The Jinja source.
        bos_token / eos_token: Strings the template may reference.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Optional["ChatTemplate"]:
        """Reads ``tokenizer_config.json``; None when the model has no template."""
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.is_file():
            return None
        cfg = json.loads(path.read_text())
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: take the default
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        return cls(source, _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token")))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """Renders messages into the prompt text.

        Raises:
            ValueError: A message lacks a known role or string content.
        """
        if not messages:
            raise ValueError("messages is empty: send at least one message")
        for i, msg in enumerate(messages):
            if msg.get("role") not in ROLES:
                raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {msg.get('role')!r}")
            if not isinstance(msg.get("content"), str):
                raise ValueError(f"messages[{i}].content must be a string")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _token_str(token: Any) -> str:
    if isinstance(token, dict):  # AddedToken serialized form
        return str(token.get("content", ""))
    return token or ""
