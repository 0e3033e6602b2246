"""The grammar backend of structured outputs: xgrammar, compiled off the
engine thread and cached.

    request --prepare()--> pool (num_compile_threads) --> CompiledGrammar
                              |  cached by (kind, spec, whitespace), LRU
                              '- compile_timeout_s: that request fails alone
    engine  --new_state()--> XGrammarState (a GrammarMatcher) per sequence

What each kind compiles to (``cluster/shared/structured.py``):

    json            compile_json_schema(strict_mode=True: properties a schema
                    does not list are not generated, as in vLLM); compact
                    separators (", " and ": ") unless whitespace_limit N, then
                    any whitespace, at most N characters at a time
    json_object     the schema {"type": "object"}, same whitespace
    regex           compile_regex
    choice          an EBNF alternation of the strings, exactly
    grammar         EBNF / GBNF (root rule ``root``)
    structural_tag  vLLM's format ({"type": "structural_tag", "structures":
                    [{begin, schema, end}], "triggers": [...]}) or xgrammar's
                    own ({"type": "structural_tag", "format": {...}})

With ``reasoning`` set (a reasoning model's think block first), the
constraint above is compiled as a ``Grammar`` and concatenated after the
block, as xgrammar's own reasoning structural tags build it: a ``tag``
(begin ``<think>``, or nothing when the prompt opened the block; any text; end
``</think>``), ``optional`` for "optional", then at most ``REASONING_GAP``
whitespace characters. An xgrammar structural tag keeps its own format and
gets the block as the first element of a ``sequence``.

A schema keyword xgrammar does not enforce is refused before compiling
(``cluster/shared/schema_check.py``), never dropped silently.

A compile that exceeds its timeout keeps its pool thread until it ends (a
C++ call cannot be interrupted); its result is still cached. New compiles
queue behind it, each with its own timeout.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from cluster.shared.config import StructuredOutputsConfig
from cluster.shared.schema_check import unsupported_schema_features
from cluster.shared.structured import REASONING_GAP, THINK_TAGS, StructuredOutputsParams
from workers.engine.structured import timeout_message

logger = logging.getLogger(__name__)



@dataclass
class GrammarStats:
    """Cumulative figures for the replica's metrics."""

    num_constrained_requests: int = 0
    num_compiled: int = 0
    num_cache_hits: int = 0
    num_failures: int = 0  # compile errors and timeouts
    compile_seconds: list[float] = field(default_factory=list)  # drained by take_compile_seconds

    def take_compile_seconds(self) -> list[float]:
        taken, self.compile_seconds = self.compile_seconds, []
        return taken


def _json_kwargs(params: StructuredOutputsParams) -> dict[str, Any]:
    limit = None if params.disable_any_whitespace else params.whitespace_limit
    if limit is None:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": limit}


# Formats xgrammar approximates loosely (any month has 31 days; ipv4 octets may have leading zeros),
# compiled as patterns that accept only what a strict checker (jsonschema's) accepts: the 29th of
# February is left out, so these are stricter than the format, never looser.
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
EXACT_FORMAT_PATTERNS = {
    "date": ("^[1-9][0-9]{3}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
             "|02-(0[1-9]|1[0-9]|2[0-8]))$"),
    "ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$",
}


_VALUE_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # JSON values, not schemas


def exact_formats(schema: Any) -> Any:
    """``schema`` with each ``format`` of ``EXACT_FORMAT_PATTERNS`` (on a
    string schema without its own pattern) replaced by its pattern."""
    if isinstance(schema, list):
        return [exact_formats(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _VALUE_KEYWORDS else exact_formats(value) for key, value in schema.items()}
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in EXACT_FORMAT_PATTERNS and "pattern" not in schema:
        del out["format"]
        out["pattern"] = EXACT_FORMAT_PATTERNS[fmt]
    return out


def _choice_grammar(choices: Sequence[str]) -> str:
    # JSON string escapes are EBNF string escapes in xgrammar.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarState:
    """A sequence's ``GrammarMatcher`` (``workers/engine/structured.py``'s protocol)."""

    __slots__ = ("_matcher", "_encode")

    def __init__(self, matcher: Any, encode: Any) -> None:
        self._matcher = matcher
        self._encode = encode

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def fill_mask(self, masks: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(masks, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def jump_forward(self, limit: int) -> list[int]:
        text = self._matcher.find_jump_forward_string()
        if not text or limit <= 0:
            return []
        tokens = self._encode(text)[:limit]
        kept = 0
        for token in tokens:
            if not self._matcher.accept_token(token):
                break
            kept += 1
        self.rollback(kept)
        return tokens[:kept]


class XGrammarBackend:
    """Compiles constraints for one model's vocabulary and makes grammar states.

    Args:
        tokenizer_file: The model's ``tokenizer.json``.
        vocab_size: Columns of the model's logits (the masks' width).
        eos_token_ids: Tokens that end a grammar (and the sequence).
        config: Timeouts, threads, cache size.
    """

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: Sequence[int],
                 config: Optional[StructuredOutputsConfig] = None) -> None:
        self.config = config or StructuredOutputsConfig()
        self.tokenizer_file = Path(tokenizer_file)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.stats = GrammarStats()
        self._pool = concurrent.futures.ThreadPoolExecutor(self.config.num_compile_threads,
                                                           thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # guards _cache, _pending and the lazy compiler
        self._cache: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self._compiler: Any = None
        self._encode: Any = None

    # ------------------------------------------------------------ compiling
    def _ensure_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar
                from tokenizers import Tokenizer
                from transformers import PreTrainedTokenizerFast

                started = time.perf_counter()
                hf = PreTrainedTokenizerFast(tokenizer_file=str(self.tokenizer_file))
                info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.eos_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self.config.num_compile_threads,
                                                          cache_enabled=False)
                tokenizer = Tokenizer.from_file(str(self.tokenizer_file))
                self._encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
                logger.info("grammar backend xgrammar ready in %.2f s (vocabulary %d)",
                            time.perf_counter() - started, self.vocab_size)
            return self._compiler

    def _compile_now(self, params: StructuredOutputsParams) -> Any:
        compiler = self._ensure_compiler()
        kind = params.kind
        started = time.perf_counter()
        try:
            if params.reasoning is not None:
                compiled = _compile_after_reasoning(compiler, params)
            elif kind == "json":
                schema = params.schema()
                _check_schema_features(schema)
                compiled = compiler.compile_json_schema(json.dumps(exact_formats(schema)), strict_mode=True,
                                                        **_json_kwargs(params))
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', strict_mode=True,
                                                        **_json_kwargs(params))
            elif kind == "regex":
                compiled = compiler.compile_regex(params.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(_choice_grammar(params.choice or ()))
            elif kind == "grammar":
                compiled = compiler.compile_grammar(params.grammar)
            else:
                compiled = self._compile_structural_tag(compiler, json.loads(params.structural_tag))
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / its own errors
            raise ValueError(f"structured_outputs.{kind} does not compile: {library_message(exc)}") from None
        self.stats.compile_seconds.append(time.perf_counter() - started)
        self.stats.num_compiled += 1
        return compiled

    @staticmethod
    def _compile_structural_tag(compiler: Any, tag: dict) -> Any:
        import xgrammar

        if "structures" in tag:  # vLLM's (and OpenAI-harmony's) legacy layout
            items = []
            for s in tag["structures"]:
                schema = s.get("schema", {})
                _check_schema_features(schema, "structured_outputs.structural_tag")  # as strictly as json's
                items.append(xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(exact_formats(schema)),
                                                        end=s["end"]))
            return compiler.compile_structural_tag(items, list(tag.get("triggers", ())))
        return compiler.compile_structural_tag(tag)

    def prepare(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar of ``params``, as a future (done at once when
        cached); compiles on the pool. Never blocks."""
        key = params.cache_key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.stats.num_cache_hits += 1
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(self._cache[key])
                return done
            pending = self._pending.get(key)
            if pending is not None:
                self.stats.num_cache_hits += 1
                return pending
            future = self._pool.submit(self._compile_now, params)
            self._pending[key] = future
        future.add_done_callback(lambda f, key=key: self._store(key, f))
        return future

    def _store(self, key: tuple, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.pop(key, None)
            if not future.cancelled() and future.exception() is None:
                self._cache[key] = future.result()
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """Waits for ``prepare(params)`` up to ``compile_timeout_s``.

        Raises:
            ValueError: It does not compile, or not within the timeout.
        """
        future = self.prepare(params)
        try:
            return future.result(timeout=self.config.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            self.stats.num_failures += 1
            raise ValueError(timeout_message(params, self.config.compile_timeout_s)) from None
        except ValueError:
            self.stats.num_failures += 1
            raise

    # -------------------------------------------------------------- states
    def new_state(self, params: StructuredOutputsParams, compiled: Any = None) -> XGrammarState:
        import xgrammar

        if compiled is None:
            compiled = self.compile(params)
        self._ensure_compiler()
        self.stats.num_constrained_requests += 1
        matcher = xgrammar.GrammarMatcher(compiled)  # rollback is unbounded in xgrammar 0.2
        return XGrammarState(matcher, self._encode)

    def allocate_masks(self, num_rows: int) -> torch.Tensor:
        return torch.empty(num_rows, (self.vocab_size + 31) // 32, dtype=torch.int32)

    def warm_up(self) -> None:
        """Builds the tokenizer tables on the pool now (a serving replica at
        start), so the first constrained request does not wait for them."""
        self._pool.submit(self._ensure_compiler)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")  # xgrammar's "[12:58:42] /project/cpp/x.cc:83: "


def library_message(exc: BaseException) -> str:
    """The first line of a grammar library's error, without its log prefix
    (a clock time and an internal source path mean nothing to a client)."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return _LOG_PREFIX.sub("", text.splitlines()[0])[:500]


def _check_schema_features(schema: Any, field: str = "structured_outputs.json") -> None:
    """Refuses a schema with keywords xgrammar would not enforce (``cluster/shared/schema_check.py``)."""
    problems = unsupported_schema_features(schema)
    if problems:
        raise ValueError(f"{field} uses {', '.join(problems)}, which structured outputs cannot enforce: remove it "
                         "from the schema")


def reasoning_format(mode: str) -> dict:
    """xgrammar's structural-tag format of the think block before a constraint
    (``StructuredOutputsParams.reasoning``: "optional" or "open")."""
    begin, end = THINK_TAGS
    block = {"type": "sequence", "elements": [
        {"type": "tag", "begin": begin if mode == "optional" else "", "content": {"type": "any_text"}, "end": end},
        {"type": "regex", "pattern": f"[ \\t\\r\\n]{{0,{REASONING_GAP}}}"},
    ]}
    return {"type": "optional", "content": block} if mode == "optional" else block


def _compile_after_reasoning(compiler: Any, params: StructuredOutputsParams) -> Any:
    """The compiled grammar of ``params`` after its think block."""
    import xgrammar

    prefix = reasoning_format(params.reasoning or "")
    kind = params.kind
    if kind == "structural_tag":
        tag = json.loads(params.structural_tag)
        if "structures" not in tag:  # xgrammar's own: one format, the block first
            return compiler.compile_structural_tag(
                {**tag, "format": {"type": "sequence", "elements": [prefix, tag["format"]]}})
        items = []
        for s in tag["structures"]:
            schema = s.get("schema", {})
            _check_schema_features(schema, "structured_outputs.structural_tag")
            items.append(xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(exact_formats(schema)),
                                                    end=s["end"]))
        content = xgrammar.Grammar.from_structural_tag(items, list(tag.get("triggers", ())))
    elif kind in ("json", "json_object"):
        schema = params.schema() if kind == "json" else {"type": "object"}
        _check_schema_features(schema)
        content = xgrammar.Grammar.from_json_schema(json.dumps(exact_formats(schema)), strict_mode=True,
                                                    **_json_kwargs(params))
    elif kind == "regex":
        content = xgrammar.Grammar.from_regex(params.regex)
    else:
        content = xgrammar.Grammar.from_ebnf(_choice_grammar(params.choice or ()) if kind == "choice"
                                            else params.grammar)
    block = xgrammar.Grammar.from_structural_tag({"type": "structural_tag", "format": prefix})
    return compiler.compile_grammar(xgrammar.Grammar.concat(block, content))
