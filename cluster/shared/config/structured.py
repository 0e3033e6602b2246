"""The engine's structured-output knobs, vLLM's ``structured_outputs_config``
(a mapping, or its JSON on the command line)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster.shared.config.mapping import check_keys, read_mapping

STRUCTURED_BACKENDS = ("xgrammar", "auto")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """How an engine compiles and enforces output constraints.

    Attributes:
        backend: The grammar library: ``xgrammar`` (``auto`` is the same; a
            request with a constraint fails with a clear error where it is
            not installed).
        compile_timeout_s: A request whose grammar takes longer to compile
            fails alone, with a message saying so; others never wait for it.
        num_compile_threads: Threads that compile grammars, off the engine
            thread.
        cache_size: Compiled grammars kept, by (kind, spec), least recently
            used dropped first.
        jump_forward: Where the grammar forces the next characters
            (``{"name": "``), propose their tokens as drafts the same step
            verifies (exact: the output is what masked decoding gives),
            sized adaptively like speculation's drafts.
        max_jump_forward_tokens: Most forced tokens proposed per step.
    """

    backend: str = "auto"
    compile_timeout_s: float = 10.0
    num_compile_threads: int = 2
    cache_size: int = 256
    jump_forward: bool = True
    max_jump_forward_tokens: int = 8

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_BACKENDS:
            raise ValueError(f"structured_outputs_config backend must be one of {STRUCTURED_BACKENDS}, "
                             f"got {self.backend!r}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"structured_outputs_config compile_timeout_s must be > 0, got {self.compile_timeout_s}")
        if not 1 <= self.num_compile_threads <= 64:
            raise ValueError("structured_outputs_config num_compile_threads must be in 1..64, got "
                             f"{self.num_compile_threads}")
        if self.cache_size < 1:
            raise ValueError(f"structured_outputs_config cache_size must be >= 1, got {self.cache_size}")
        if not 1 <= self.max_jump_forward_tokens <= 16:
            raise ValueError("structured_outputs_config max_jump_forward_tokens must be in 1..16, got "
                             f"{self.max_jump_forward_tokens}")

    @classmethod
    def from_mapping(cls, mapping: Any) -> "StructuredOutputsConfig":
        """From ``structured_outputs_config`` as users give it (a dict, or its JSON).

        Raises:
            ValueError: Not a mapping, an unknown key (named), or a bad value.
        """
        mapping = read_mapping(mapping, "structured_outputs_config", '{"compile_timeout_s": 5, "jump_forward": false}')
        check_keys(mapping, cls, "structured_outputs_config")
        return cls(**mapping)
