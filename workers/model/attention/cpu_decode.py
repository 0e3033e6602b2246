"""A native paged-attention decode kernel for CPUs (float32), built on first use.

Torch's decode path gathers each request's blocks into a padded tensor and
then attends over it: the KV bytes cross memory three times. This kernel reads
every key and value once, straight from the paged cache, with an online
softmax per block, threads over (request, KV head) pairs, and keeps the GQA
query heads of one KV head together so each key is loaded once::

    for each (request r, kv head h):          (OpenMP, dynamic schedule)
        for each block b of r:                 positions [lo, seq_len)
            s[g, j] = q[r, h*G+g] . K[b, j, h]   for the G query heads of h
            online softmax update of acc[g], m[g], l[g] with V[b, j, h]
        out[r, h*G+g] = acc[g] / l[g]

It is plain C compiled with the system's ``cc`` into the prefixserve cache
folder and loaded with ctypes (which releases the GIL during the call). No
compiler, or a failed build, leaves ``load()`` returning None and the torch
path in use; nothing else changes.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <float.h>

#define MAX_GROUP 32
#define MAX_DIM 256
#define MAX_BLOCK 256

void paged_decode_f32(
    const float* q, const float* k_cache, const float* v_cache,
    const int* block_tables, int table_width, const int* seq_lens,
    int num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, int window, float* out)
{
    const int group = num_heads / num_kv_heads;
    const long row = (long)num_kv_heads * head_dim;          /* one token's K (or V) */
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int r = 0; r < num_reqs; ++r) {
        for (int h = 0; h < num_kv_heads; ++h) {
            float acc[MAX_GROUP][MAX_DIM];
            float m[MAX_GROUP], l[MAX_GROUP];
            float s[MAX_GROUP][MAX_BLOCK];
            const float* qh = q + ((long)r * num_heads + (long)h * group) * head_dim;
            for (int g = 0; g < group; ++g) {
                m[g] = -FLT_MAX; l[g] = 0.0f;
                for (int d = 0; d < head_dim; ++d) acc[g][d] = 0.0f;
            }
            const int len = seq_lens[r];
            const int lo = (window > 0 && len > window) ? len - window : 0;
            for (int start = lo - lo % block_size; start < len; start += block_size) {
                const int blk = block_tables[(long)r * table_width + start / block_size];
                const int j0 = start < lo ? lo - start : 0;
                const int j1 = (len - start) < block_size ? (len - start) : block_size;
                const float* kb = k_cache + ((long)blk * block_size) * row + (long)h * head_dim;
                const float* vb = v_cache + ((long)blk * block_size) * row + (long)h * head_dim;
                for (int g = 0; g < group; ++g) {
                    const float* qg = qh + (long)g * head_dim;
                    float mx = m[g];
                    for (int j = j0; j < j1; ++j) {
                        const float* kj = kb + (long)j * row;
                        float dot = 0.0f;
                        #pragma omp simd reduction(+:dot)
                        for (int d = 0; d < head_dim; ++d) dot += qg[d] * kj[d];
                        dot *= scale;
                        s[g][j] = dot;
                        if (dot > mx) mx = dot;
                    }
                    const float corr = expf(m[g] - mx);
                    l[g] *= corr;
                    #pragma omp simd
                    for (int d = 0; d < head_dim; ++d) acc[g][d] *= corr;
                    m[g] = mx;
                    for (int j = j0; j < j1; ++j) {
                        const float p = expf(s[g][j] - mx);
                        const float* vj = vb + (long)j * row;
                        l[g] += p;
                        #pragma omp simd
                        for (int d = 0; d < head_dim; ++d) acc[g][d] += p * vj[d];
                    }
                }
            }
            float* oh = out + ((long)r * num_heads + (long)h * group) * head_dim;
            for (int g = 0; g < group; ++g) {
                const float inv = 1.0f / l[g];
                for (int d = 0; d < head_dim; ++d) oh[(long)g * head_dim + d] = acc[g][d] * inv;
            }
        }
    }
}
"""

MAX_GROUP, MAX_DIM, MAX_BLOCK = 32, 256, 256
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=fast"]
_lock = threading.Lock()
_loaded: dict[str, Optional[ctypes.CDLL]] = {}


def _cache_dir() -> Path:
    root = os.environ.get("PREFIXSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "prefixserve")
    return Path(root) / "kernels"


def load() -> Optional[ctypes.CDLL]:
    """Builds (once per source version and machine) and loads the kernel.

    Returns:
        The library, or None when no C compiler is found or the build fails
        (logged once; callers fall back to torch).
    """
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + os.uname().machine).encode()).hexdigest()[:16]
    with _lock:
        if digest in _loaded:
            return _loaded[digest]
        _loaded[digest] = lib = _build_and_load(digest)
        return lib


def _build_and_load(digest: str) -> Optional[ctypes.CDLL]:
    target = _cache_dir() / f"paged_decode_{digest}.so"
    if not target.exists():
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            logger.info("no C compiler found: CPU decode attention uses the torch path")
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / "paged_decode.c"
            src.write_text(_SOURCE)
            built = Path(tmp) / target.name
            proc = subprocess.run([cc, *_FLAGS, str(src), "-o", str(built), "-lm"], capture_output=True, text=True)
            if proc.returncode != 0:
                logger.warning("building the CPU decode kernel failed; using the torch path:\n%s", proc.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic: concurrent builders agree
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 5 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    return lib


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this call (CPU, float32, sizes in range)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and kv_cache.dtype == torch.float32
        and kv_cache.is_contiguous()
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_DIM
        and block_size <= MAX_BLOCK
    )


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int],
) -> torch.Tensor:
    """Attention of one query per request over its paged K/V (see module doc).

    Args:
        q: [B, num_heads, head_dim] float32.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous.
        block_tables: [B, width] int32.
        seq_lens: [B] int32 (the query sits at position seq_len - 1).
    """
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    num_reqs, num_heads, head_dim = q.shape
    lib.paged_decode_f32(
        q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), num_reqs, num_heads, kv_cache.shape[3], head_dim, kv_cache.shape[2],
        float(scale), int(sliding_window or 0), out.data_ptr(),
    )
    return out
