"""llama.cpp as the CPU peer of ``prefixserve bench latency --compare llama.cpp``.

llama.cpp runs the same weights as our engine, in the same run: the default
model's GGUF file itself (Q4_1), an F32 file made from it (every tensor
dequantized with ``gguf.quants.dequantize``, the metadata kept), and a Q8_0
file quantized from the F32 one by llama.cpp. Timing goes through the
low-level API (``llama_batch`` / ``llama_decode``), as a CPU user tuning
llama.cpp would: no sampling chain, no Python object per token.

llama-cpp-python is *not* a project dependency (CI never installs it): it is
imported lazily, and its absence raises :class:`LlamaCppMissing` with the pip
command that installs the prebuilt wheel. This module takes and returns token
ids; llama.cpp reads the vocabulary of the same GGUF file as our tokenizer, so
the ids are the same (checked when the peer was written).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from cluster.bench.peer_weights import _llama_cpp

logger = logging.getLogger(__name__)


class LlamaCppPeer:
    """One llama.cpp model and context on the CPU, driven through the low-level API.

    Args:
        gguf_path: The GGUF file.
        n_threads: Threads for both decode and batch (prompt) processing.
        n_ctx: KV cells of *each* sequence: the context keeps ``n_seq_max``
            separate KV streams (``kv_unified=False``, so a sequence attends only
            to its own cells), ``n_ctx * n_seq_max`` cells in all.
        n_seq_max: Sequence ids available (0 .. n_seq_max-1).
        n_batch: Tokens one ``llama_decode`` call takes (logical and physical
            batch): a prompt up to this long is prefilled in one call.
    """

    def __init__(
        self,
        gguf_path: Path,
        n_threads: int = 2,
        n_ctx: int = 1024,
        n_seq_max: int = 32,
        n_batch: int = 512,
    ) -> None:
        llama = _llama_cpp()
        self._llama = llama
        self._model = self._ctx = self._batch = None
        self.path = Path(gguf_path)
        if not self.path.is_file():
            raise FileNotFoundError(self.path)
        if n_seq_max > llama.llama_max_parallel_sequences():
            raise ValueError(f"n_seq_max={n_seq_max} is over llama.cpp's {llama.llama_max_parallel_sequences()}")
        self.n_threads = n_threads
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.n_batch = max(n_batch, n_seq_max)

        mparams = llama.llama_model_default_params()
        mparams.n_gpu_layers = 0
        model = llama.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {self.path}")
        self._model = model
        self._vocab = llama.llama_model_get_vocab(model)
        self.n_vocab = llama.llama_vocab_n_tokens(self._vocab)

        cparams = llama.llama_context_default_params()
        cparams.n_ctx = n_ctx * n_seq_max
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = n_seq_max
        cparams.kv_unified = False
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        cparams.no_perf = True
        ctx = llama.llama_init_from_model(model, cparams)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {self.path} (n_ctx={cparams.n_ctx})")
        self._ctx = ctx
        self._memory = llama.llama_get_memory(ctx)
        self._batch = llama.llama_batch_init(self.n_batch, 0, 1)
        self.last_decoded: list[list[int]] = []

    # -- plumbing -------------------------------------------------------------

    def __enter__(self) -> "LlamaCppPeer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        llama = self._llama
        if self._batch is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            llama.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _check_open(self) -> None:
        if self._ctx is None:
            raise RuntimeError("the llama.cpp peer is closed")

    def clear(self) -> None:
        """Empties the KV cache (every sequence)."""
        self._check_open()
        self._llama.llama_memory_clear(self._memory, True)

    def _fill(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        """Puts (token, position, sequence id, wants logits) entries into the batch."""
        if len(entries) > self.n_batch:
            raise ValueError(f"{len(entries)} tokens in one decode call; n_batch is {self.n_batch}")
        b = self._batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)

    def _decode(self) -> None:
        rc = self._llama.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} ({self._batch.n_tokens} tokens)")

    def _argmax(self, i: int) -> int:
        """The greedy token of the i-th output of the last decode call."""
        ptr = self._llama.llama_get_logits_ith(self._ctx, i)
        if not ptr:
            raise RuntimeError(f"llama.cpp has no logits for batch entry {i}")
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def _prefill(self, prompt_ids: Sequence[int], seq: int) -> int:
        """Decodes the prompt into sequence ``seq`` (chunks of n_batch); returns its greedy next token."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) > self.n_ctx:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens; each sequence holds {self.n_ctx}")
        n = len(prompt_ids)
        for start in range(0, n, self.n_batch):
            chunk = prompt_ids[start : start + self.n_batch]
            self._fill([(t, start + j, seq, start + j == n - 1) for j, t in enumerate(chunk)])
            self._decode()
        return self._argmax(self._batch.n_tokens - 1)

    # -- public -----------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """llama.cpp's tokenization of ``text`` (to check that its ids are ours)."""
        self._check_open()
        raw = text.encode()
        cap = len(raw) + 16
        buf = (self._llama.llama_token * cap)()
        n = self._llama.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens")
        return list(buf[:n])

    def greedy(self, prompt_ids: list[int], n: int) -> list[int]:
        """The ``n`` tokens greedy decoding appends to ``prompt_ids`` (argmax of the logits, no EOS stop)."""
        self.clear()
        if len(prompt_ids) + n - 1 > self.n_ctx:
            raise ValueError(f"{len(prompt_ids)} + {n} tokens; each sequence holds {self.n_ctx}")
        out: list[int] = []
        token = self._prefill(prompt_ids, 0)
        pos = len(prompt_ids)
        while True:
            out.append(token)
            if len(out) == n:
                return out
            self._fill([(token, pos, 0, True)])
            self._decode()
            token = self._argmax(0)
            pos += 1

    def prefill_seconds(self, prompt_ids: list[int]) -> float:
        """Seconds of one ``llama_decode`` of the whole prompt into an empty KV cache (plus its last logits)."""
        if len(prompt_ids) > self.n_batch:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit one decode call (n_batch={self.n_batch})")
        if not prompt_ids:
            raise ValueError("empty prompt")
        self.clear()
        n = len(prompt_ids)
        self._fill([(t, j, 0, j == n - 1) for j, t in enumerate(prompt_ids)])
        start = time.perf_counter()
        self._decode()
        self._argmax(n - 1)
        return time.perf_counter() - start

    def decode_step_seconds(self, prompts: list[list[int]], num_steps: int) -> list[float]:
        """Seconds of each of ``num_steps`` decode steps of ``len(prompts)`` sequences together
        (``decode_steps``, run to the end)."""
        return list(self.decode_steps(prompts, num_steps))

    def decode_steps(self, prompts: list[list[int]], num_steps: int) -> Iterator[float]:
        """Runs ``num_steps`` decode steps of ``len(prompts)`` sequences together,
        yielding each step's seconds (so a caller can interleave them with
        another engine's steps).

        Each prompt is prefilled into its own sequence (ids 0..B-1), untimed.
        Each step is one ``llama_decode`` of B tokens, one new (greedy) token
        per sequence, and the reading of the B rows of logits; its wall time
        is measured around both. The tokens each sequence got (its greedy
        continuation, prefill's token first) are left in ``last_decoded``.
        """
        n_seqs = len(prompts)
        if not 0 < n_seqs <= self.n_seq_max:
            raise ValueError(f"{n_seqs} sequences; this peer has 1..{self.n_seq_max}")
        longest = max(len(p) for p in prompts)
        if longest + num_steps > self.n_ctx:
            raise ValueError(f"{longest} + {num_steps} tokens; each sequence holds {self.n_ctx}")
        self.clear()
        tokens = [self._prefill(prompt, seq) for seq, prompt in enumerate(prompts)]
        positions = [len(p) for p in prompts]
        decoded = [[t] for t in tokens]
        for _ in range(num_steps):
            self._fill([(tokens[s], positions[s], s, True) for s in range(n_seqs)])
            start = time.perf_counter()
            self._decode()
            tokens = [self._argmax(s) for s in range(n_seqs)]
            elapsed = time.perf_counter() - start
            positions = [p + 1 for p in positions]
            for seq, token in enumerate(tokens):
                decoded[seq].append(token)
            self.last_decoded = decoded
            yield elapsed


def measure(
    gguf_path: Path,
    prompts_by_batch: dict[int, list[list[int]]],
    num_steps: int,
    prefill_prompt: list[int],
    n_threads: int = 2,
    peer: Optional["LlamaCppPeer"] = None,
) -> dict[str, Any]:
    """llama.cpp's decode steps per batch size and its prefill speed, as plain (JSON) data
    (on ``peer`` when given, a context big enough for them; else on one opened here).

    Returns ``{"engine", "gguf", "n_threads", "prefill": {tokens, seconds
    (median of 3), tokens_per_s, runs_s}, "decode": [{batch_size, num_steps,
    median_step_s, max_step_s, decode_tokens_per_s}, ...]}``, ``decode``
    sorted by batch size. One untimed prefill warms the context up first.

    Measure on a quiet machine: ggml's threads spin-wait for each other, so
    with ``n_threads`` equal to the cores any other busy process can make
    steps ~100x slower (a warning is logged when a step is over 5x the median).
    """
    if num_steps < 1:
        raise ValueError("num_steps must be at least 1")
    for size, prompts in prompts_by_batch.items():
        if len(prompts) != size:
            raise ValueError(f"batch size {size} was given {len(prompts)} prompts")
    longest = max([len(prefill_prompt)] + [len(p) + num_steps for ps in prompts_by_batch.values() for p in ps])
    n_seq_max = max([32] + list(prompts_by_batch))
    opened = peer is None
    if peer is None:
        peer = LlamaCppPeer(gguf_path, n_threads=n_threads, n_ctx=max(1024, longest), n_seq_max=n_seq_max,
                            n_batch=max(512, len(prefill_prompt)))
    with peer if opened else contextlib.nullcontext(peer):
        peer.prefill_seconds(prefill_prompt)  # warm-up: graph allocation, page faults
        runs = [peer.prefill_seconds(prefill_prompt) for _ in range(3)]
        prefill_s = statistics.median(runs)
        decode = []
        for size in sorted(prompts_by_batch):
            steps = peer.decode_step_seconds(prompts_by_batch[size], num_steps)
            step_s = statistics.median(steps)
            if max(steps) > 5 * step_s:
                # ggml's threads spin at their barriers: with n_threads = cores and
                # another busy process, a step can take 100x as long.
                logger.warning(
                    "llama.cpp batch %d: slowest step %.0f ms, median %.0f ms; is the machine busy?",
                    size, max(steps) * 1e3, step_s * 1e3,
                )
            decode.append(
                {
                    "batch_size": size,
                    "num_steps": num_steps,
                    "median_step_s": step_s,
                    "max_step_s": max(steps),
                    "decode_tokens_per_s": size / step_s,
                }
            )
            logger.info("llama.cpp %s batch %d: %.1f ms a step", Path(gguf_path).name, size, step_s * 1e3)
    return {
        "engine": "llama.cpp",
        "gguf": str(gguf_path),
        "n_threads": n_threads,
        "prefill": {
            "tokens": len(prefill_prompt),
            "seconds": prefill_s,
            "tokens_per_s": len(prefill_prompt) / prefill_s,
            "runs_s": runs,
        },
        "decode": decode,
    }
