"""Tokenization, chat templates and block hashes on the router (no torch).

The router must turn a request into exactly the token ids the engine would
see, and hash them exactly as the engine does, or the prefix directory never
matches. Both sides therefore share their pieces:

    text prompt  ──tokenizer.json, add_special_tokens=True──▶ ids
    chat messages ──chat_template.ChatTemplate.render──▶ text
                  ──tokenizer.json, add_special_tokens=False──▶ ids
                    (the template already wrote BOS / role markers;
                     same as ``prefixserve generate --chat``)
    ids ──cluster.shared.hashing (root = fingerprint + cache_salt)──▶ block hashes

and the fingerprint comes from ``cluster.shared.fingerprint``, which the engine's
loader re-exports.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from tokenizers import Tokenizer

from cluster.shared.chat_template import ChatTemplate
from cluster.shared.fingerprint import model_fingerprint as compute_fingerprint
from cluster.shared.hashing import hash_block_chain, root_hash
from router.reasoning import ReasoningMode, resolve_reasoning_parser
from router.token_cache import MIN_CACHED_CHARS, SegmentTokenCache

logger = logging.getLogger(__name__)


class RouterTokenizer:
    """Tokenizer, chat template and fingerprint of one model, for the router.

    Build it with :meth:`from_model_dir` in production; the constructor takes
    the parts so tests can inject them.

    Args:
        tokenizer: The model's ``tokenizers.Tokenizer``.
        chat_template: The model's chat template, or None when it has none.
        model_fingerprint: Identifies the weights in block hashes (see
            ``cluster.shared.fingerprint``).
        vocab_size: Largest token id + 1 the model accepts; defaults to the
            tokenizer's vocabulary with added tokens.
        segment_cache: Tokenize long prompts from cached segments where that
            is exact for this tokenizer (``router/token_cache.py``).
        tool_call_parser: How to read tool calls out of this model's output:
            ``auto`` (from the chat template), ``hermes`` or ``llama3_json``
            (``router/tools``).
        reasoning_parser: How to split reasoning from content: ``none``,
            ``auto`` (from the chat template), ``qwen3`` or ``deepseek_r1``
            (``router/reasoning.py``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: Optional[ChatTemplate],
        model_fingerprint: str,
        vocab_size: Optional[int] = None,
        segment_cache: bool = True,
        tool_call_parser: str = "auto",
        reasoning_parser: str = "none",
    ) -> None:
        self.tokenizer = tokenizer
        self.segment_cache = SegmentTokenCache.for_tokenizer(tokenizer) if segment_cache else None
        self.chat_template = chat_template
        self.model_fingerprint = model_fingerprint
        self.vocab_size = vocab_size if vocab_size is not None else tokenizer.get_vocab_size(with_added_tokens=True)
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    @classmethod
    def from_model_dir(cls, path: Union[str, os.PathLike], tool_call_parser: str = "auto",
                       reasoning_parser: str = "none") -> "RouterTokenizer":
        """Loads ``tokenizer.json``, the chat template and the fingerprint of a model folder.

        Args:
            path: A model folder as ``workers.model.loader.resolve_model``
                returns it (config.json, safetensors, tokenizer files).
            tool_call_parser, reasoning_parser: See the class (router flags' values).

        Raises:
            ValueError: The folder has no ``tokenizer.json`` (the router needs
                one to tokenize), or its weights cannot be fingerprinted.
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{folder} has no tokenizer.json: the router needs the model's tokenizer")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        template = ChatTemplate.from_model_dir(folder)
        if template is None:
            logger.warning("%s has no chat template: chat requests will be rejected", folder)
        vocab_size = None
        config_file = folder / "config.json"
        if config_file.is_file():
            # The model's embedding may be larger than the tokenizer's vocabulary (padding).
            vocab_size = json.loads(config_file.read_text()).get("vocab_size")
        return cls(tokenizer, template, compute_fingerprint(folder), vocab_size, tool_call_parser=tool_call_parser,
                   reasoning_parser=reasoning_parser)

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``prompt``, as the engine's ``LLM.encode`` computes them.

        Args:
            prompt: The text.
            add_special_tokens: Add BOS etc. as the tokenizer's post-processor
                does (like HF ``tokenizer(text)``); False for chat-rendered text.
        """
        if self.segment_cache is not None and len(prompt) >= MIN_CACHED_CHARS:
            return self.segment_cache.encode(prompt, add_special_tokens)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Optional[Sequence[Mapping[str, Any]]] = None,
                    template_kwargs: Optional[Mapping[str, Any]] = None) -> list[int]:
        """Token ids of a conversation, rendered with the chat template.

        The generation prompt is appended, and the rendered text is encoded
        without special tokens (the template writes them), exactly like the
        offline CLI's ``--chat``.

        Args:
            messages: ``{"role": ..., "content": ...}`` mappings (assistant
                ones may carry ``tool_calls``, tool ones ``tool_call_id``).
            tools: OpenAI tool objects offered to the model: passed to a
                template that takes ``tools``, else written in the built-in
                format (``cluster/shared/chat_template.py``).
            template_kwargs: More template variables (``chat_template_kwargs``).

        Raises:
            ValueError: The model has no chat template, or a message is invalid.
        """
        return self.encode(self.render_chat_text(messages, tools, template_kwargs), add_special_tokens=False)

    def render_chat_text(self, messages: Sequence[Mapping[str, Any]],
                         tools: Optional[Sequence[Mapping[str, Any]]] = None,
                         template_kwargs: Optional[Mapping[str, Any]] = None) -> str:
        """The prompt text :meth:`render_chat` encodes (same arguments and errors)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template: send prompt or prompt_token_ids instead of messages")
        return self.chat_template.render(messages, tools=tools, template_kwargs=template_kwargs)

    def reasoning_mode(self, prompt_text: str) -> Optional[ReasoningMode]:
        """How the output of a chat prompt (its rendered text) splits into reasoning
        and content; None without a reasoning parser (``router/reasoning.py``)."""
        template = self.chat_template.source if self.chat_template is not None else None
        parser = resolve_reasoning_parser(getattr(self, "reasoning_parser", "none"), template)
        return ReasoningMode.for_prompt(parser, prompt_text[-64:])

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (whole sequences; streaming uses the replica's deltas)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def check_token_ids(self, token_ids: Sequence[int], field: str = "prompt_token_ids") -> None:
        """Rejects ids the model cannot embed.

        Raises:
            ValueError: Naming the first out-of-range id and the vocabulary size.
        """
        for i, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"{field}[{i}] = {token_id} is out of range: token ids must be in [0, {self.vocab_size})"
                )

    def block_hashes(
        self,
        token_ids: Sequence[int],
        model_fingerprint: Optional[str],
        cache_salt: str,
        block_size: int,
    ) -> list[bytes]:
        """The block-hash chain of ``token_ids`` (full blocks only), as the engine computes it.

        Args:
            token_ids: The prompt's ids.
            model_fingerprint: Fingerprint of the weights; None uses this
                tokenizer's model (the usual case).
            cache_salt: The request's tenant salt ("" for none).
            block_size: The replicas' KV block size.

        Raises:
            ValueError: ``block_size`` < 1.
        """
        fingerprint = self.model_fingerprint if model_fingerprint is None else model_fingerprint
        return hash_block_chain(token_ids, block_size, root_hash(fingerprint, cache_salt))
