"""Fused elementwise kernels of the decoder layer on CPU (float32), native:

    add_rms_norm(x, residual, weight)   residual += x; out = rms_norm(residual) * weight
    rms_norm(x, weight)                 out = rms_norm(x) * weight
    rotary(qk, cos, sin)                in place, HF's rotate-half convention
    silu_and_mul(gate_up)               silu(gate) * up

Eager torch spends ~8 op dispatches on an RMSNorm, ~8 on the rotary
embedding and 3 on SiLU-and-mul, each a pass over memory; these are one call
and one pass each, threaded over tokens. Every row is computed on its own in
a fixed order (the norm's sum of squares runs over the hidden size, in order),
so, as with the native GEMM, a token's result does not depend on the rest of
the batch. Arithmetic follows HF's float32 order (mean of squares, rsqrt of
mean + eps, times the weight); the sum's order differs from torch's
vectorized ``mean`` by float rounding.

Built with ``workers/model/native.py``; without a compiler ``load()`` is None
and the layers keep their torch code.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from workers.model import native

# exp(x) of a vector of floats, the same Cephes polynomial, instruction for
# instruction, as ``exp_poly`` below, so a lane and the scalar tail agree bit
# for bit. ``W`` stands for the vector width in bits.
_EXP_TEMPLATE = r"""
static inline __mW expN(__mW x) {
    x = _mmW_max_ps(_mmW_min_ps(x, _mmW_set1_ps(88.0f)), _mmW_set1_ps(-87.0f));
    const __mW n = ROUND_PS(_mmW_mul_ps(x, _mmW_set1_ps(1.44269504088896341f)),
                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __mW r = _mmW_fmadd_ps(n, _mmW_set1_ps(-0.693359375f), x);
    r = _mmW_fmadd_ps(n, _mmW_set1_ps(2.12194440e-4f), r);
    __mW p = _mmW_set1_ps(1.9875691500e-4f);
    p = _mmW_fmadd_ps(p, r, _mmW_set1_ps(1.3981999507e-3f));
    p = _mmW_fmadd_ps(p, r, _mmW_set1_ps(8.3334519073e-3f));
    p = _mmW_fmadd_ps(p, r, _mmW_set1_ps(4.1665795894e-2f));
    p = _mmW_fmadd_ps(p, r, _mmW_set1_ps(1.6666665459e-1f));
    p = _mmW_fmadd_ps(p, r, _mmW_set1_ps(5.0000001201e-1f));
    p = _mmW_add_ps(_mmW_fmadd_ps(p, _mmW_mul_ps(r, r), r), _mmW_set1_ps(1.0f));
    const __mWi e = _mmW_slli_epi32(_mmW_add_epi32(_mmW_cvtps_epi32(n), _mmW_set1_epi32(127)), 23);
    return _mmW_mul_ps(p, _mmW_castsiW_ps(e));
}
"""


def exp_source(bits: int) -> str:
    """``exp8`` (256-bit, AVX2) or ``exp16`` (512-bit, AVX-512F): C source, no include or guard."""
    rounding = {256: "_mm256_round_ps", 512: "_mm512_roundscale_ps"}[bits]
    return (_EXP_TEMPLATE.replace("expN", f"exp{bits // 32}").replace("ROUND_PS", rounding)
            .replace("castsiW", f"castsi{bits}").replace("W", str(bits)))


# exp(x) of eight floats with AVX2, shared by the kernels that need it (SiLU
# here, the softmax of ``attention/cpu_decode.py``).
EXP8_AVX2 = """
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
""" + exp_source(256) + """#endif
"""

_SOURCE = r"""
#include <math.h>
""" + EXP8_AVX2 + r"""
/* 1 / rms(x): the sum of squares in a fixed order for any row (eight lanes
   of four vector accumulators over the multiples of 32, then the lanes in
   order, then the tail), so a row's value never depends on the batch. */
static inline float row_inv_rms(const float* x, long n, float eps) {
    float sum = 0.0f;
    long i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 32 <= n; i += 32) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        const __m256 x2 = _mm256_loadu_ps(x + i + 16), x3 = _mm256_loadu_ps(x + i + 24);
        a0 = _mm256_fmadd_ps(x0, x0, a0); a1 = _mm256_fmadd_ps(x1, x1, a1);
        a2 = _mm256_fmadd_ps(x2, x2, a2); a3 = _mm256_fmadd_ps(x3, x3, a3);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (int j = 0; j < 8; ++j) sum += lanes[j];
#endif
    for (; i < n; ++i) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)n + eps);
}

/* residual[t] += x[t] (x may be NULL), out[t] = rms_norm(residual[t]) * weight */
void add_rms_norm_f32(const float* x, float* residual, const float* weight, float* out,
                      long tokens, long hidden, float eps) {
    #pragma omp parallel for schedule(static) if (tokens >= 16)
    for (long t = 0; t < tokens; ++t) {
        float* r = residual + t * hidden;
        if (x) {
            const float* xt = x + t * hidden;
            #pragma omp simd
            for (long i = 0; i < hidden; ++i) r[i] += xt[i];
        }
        const float inv = row_inv_rms(r, hidden, eps);
        float* o = out + t * hidden;
        #pragma omp simd
        for (long i = 0; i < hidden; ++i) o[i] = weight[i] * (r[i] * inv);
    }
}

/* qk: [tokens] rows of `heads` heads of `dim` floats, row stride ld; cos/sin: [tokens, dim/2] */
void rotary_f32(float* qk, long tokens, long heads, long dim, long ld, const float* cos, const float* sin) {
    const long half = dim / 2;
    #pragma omp parallel for schedule(static) if (tokens * heads * dim > 65536)
    for (long t = 0; t < tokens; ++t) {
        const float* c = cos + t * half;
        const float* s = sin + t * half;
        for (long h = 0; h < heads; ++h) {
            float* x1 = qk + t * ld + h * dim;
            float* x2 = x1 + half;
            #pragma omp simd
            for (long i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* exp(x) for the SiLU: Cephes' single-precision polynomial on the reduced
   argument (within ~1 ulp of expf), written so the compiler vectorizes it;
   every element goes through the same instructions. */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    union { int i; float f; } scale;
    scale.i = ((int)n + 127) << 23;
    return p * scale.f;
}

/* out[t, i] = silu(gu[t, i]) * gu[t, inter + i]; eight at a time with AVX2
   (exp8 is exp_poly lane by lane, so every element gets the same bits
   whichever loop computes it) */
void silu_and_mul_f32(const float* gu, float* out, long tokens, long inter) {
    #pragma omp parallel for schedule(static) if (tokens * inter > 8192)
    for (long t = 0; t < tokens; ++t) {
        const float* g = gu + t * 2 * inter;
        const float* u = g + inter;
        float* o = out + t * inter;
        long i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(zero, gv));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; ++i) o[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
    }
}

/* out[r] = the index of the first maximum of row r, or of its first NaN if it
   has one (torch.argmax's rule): the greedy sampler's argmax in one pass over
   the logits, eight lanes at a time, rows split over the threads. */
void argmax_rows_f32(const float* x, long rows, long cols, long ld, long* out) {
    #pragma omp parallel for schedule(static) if (rows * cols >= 262144)
    for (long r = 0; r < rows; ++r) {
        const float* v = x + r * ld;
        long best = 0, i = 0;
        float top = v[0];
        int has_nan = 0;
#if defined(__AVX2__)
        if (cols >= 16) {
            __m256 bv = _mm256_loadu_ps(v);
            __m256i bi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = bi;
            const __m256i eight = _mm256_set1_epi32(8);
            __m256 nan = _mm256_cmp_ps(bv, bv, _CMP_UNORD_Q);
            for (i = 8; i + 8 <= cols; i += 8) {
                idx = _mm256_add_epi32(idx, eight);
                const __m256 cur = _mm256_loadu_ps(v + i);
                const __m256 gt = _mm256_cmp_ps(cur, bv, _CMP_GT_OQ);  /* strictly: ties keep the earlier index */
                bv = _mm256_blendv_ps(bv, cur, gt);
                bi = _mm256_blendv_epi8(bi, idx, _mm256_castps_si256(gt));
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(cur, cur, _CMP_UNORD_Q));
            }
            has_nan = _mm256_movemask_ps(nan);
            if (!has_nan) {
                float vals[8];
                int idxs[8];
                _mm256_storeu_ps(vals, bv);
                _mm256_storeu_si256((__m256i*)idxs, bi);
                top = vals[0];
                best = idxs[0];
                for (int j = 1; j < 8; ++j)
                    if (vals[j] > top || (vals[j] == top && idxs[j] < best)) { top = vals[j]; best = idxs[j]; }
            }
        } else {
            i = 1;
        }
#else
        i = 1;
#endif
        if (has_nan) {
            for (i = 0; i < cols && !isnan(v[i]); ++i) {}
            best = i;
        } else {
            if (isnan(top)) i = cols;  /* v[0] is NaN: it is the answer */
            for (; i < cols; ++i) {
                if (isnan(v[i])) { best = i; break; }
                if (v[i] > top) { top = v[i]; best = i; }
            }
        }
        out[r] = best;
    }
}

/* Structured outputs: in each listed row of x, -inf where the row's packed
   mask clears the token's bit (bit i % 32 of 32-bit word i / 32, xgrammar's
   layout). Words with every bit set are skipped, cleared words are filled
   eight lanes at a time; only the constrained rows are touched. */
void mask_rows_f32(float* x, long ld, long cols, const long* rows, long num_rows, const unsigned int* masks,
                   long words) {
    const float neg_inf = -INFINITY;
    for (long r = 0; r < num_rows; ++r) {
        float* v = x + rows[r] * ld;
        const unsigned int* m = masks + r * words;
        long full = cols / 32;
        if (full > words) full = words;
        for (long w = 0; w < full; ++w) {
            const unsigned int bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            float* p = v + w * 32;
#if defined(__AVX2__)
            const __m256 ninf = _mm256_set1_ps(neg_inf);
            if (bits == 0u) {
                _mm256_storeu_ps(p, ninf); _mm256_storeu_ps(p + 8, ninf);
                _mm256_storeu_ps(p + 16, ninf); _mm256_storeu_ps(p + 24, ninf);
                continue;
            }
            const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            for (int g = 0; g < 4; ++g) {
                const __m256i byte = _mm256_set1_epi32((int)((bits >> (8 * g)) & 0xFFu));
                const __m256i off = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bits), _mm256_setzero_si256());
                const __m256 cur = _mm256_loadu_ps(p + 8 * g);
                _mm256_storeu_ps(p + 8 * g, _mm256_blendv_ps(cur, ninf, _mm256_castsi256_ps(off)));
            }
#else
            for (int b = 0; b < 32; ++b)
                if (!((bits >> b) & 1u)) p[b] = neg_inf;
#endif
        }
        for (long i = full * 32; i < cols; ++i) {
            const long w = i / 32;
            if (w >= words || !((m[w] >> (i % 32)) & 1u)) v[i] = neg_inf;
        }
    }
}
"""

# -ffp-contract=off: a * c - b * s is not fused into one FMA in some rows and not
# others; every element is computed by the same two roundings. -fno-math-errno
# lets expf vectorize (glibc's vector math): a column's element is always
# computed by the same code, whatever the number of rows.
_FLAGS = (*native.FLAGS, "-ffp-contract=off", "-fno-math-errno")
_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm_f32": [_P, _P, _P, _P, _L, _L, _F],
    "rotary_f32": [_P, _L, _L, _L, _L, _P, _P],
    "silu_and_mul_f32": [_P, _P, _L, _L],
    "argmax_rows_f32": [_P, _L, _L, _L, _P],
    "mask_rows_f32": [_P, _L, _L, _P, _L, _P, _L],
}


def load() -> Optional[ctypes.CDLL]:
    """The kernels, or None (no compiler or a failed build)."""
    return native.build("cpu_ops", _SOURCE, _FLAGS, _SIGNATURES)


def _ok(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def add_rms_norm(lib: ctypes.CDLL, x: Optional[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``residual += x`` in place (when ``x`` is given); returns ``rms_norm(residual) * weight``.

    ``x`` and ``residual`` are ``[T, H]`` contiguous float32 on CPU.
    """
    tokens, hidden = residual.shape
    out = torch.empty_like(residual)
    lib.add_rms_norm_f32(x.data_ptr() if x is not None else None, residual.data_ptr(), weight.data_ptr(),
                         out.data_ptr(), tokens, hidden, eps)
    return out


def rotary(lib: ctypes.CDLL, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates ``qk`` ``[T, heads, D]`` in place (rows may be strided, heads and D contiguous);
    ``cos`` / ``sin`` ``[T, D / 2]`` contiguous."""
    tokens, heads, dim = qk.shape
    assert qk.stride(2) == 1 and qk.stride(1) == dim
    lib.rotary_f32(qk.data_ptr(), tokens, heads, dim, qk.stride(0), cos.data_ptr(), sin.data_ptr())


def silu_and_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for contiguous ``[T, 2I]``."""
    tokens, width = gate_up.shape
    out = torch.empty(tokens, width // 2, dtype=gate_up.dtype)
    lib.silu_and_mul_f32(gate_up.data_ptr(), out.data_ptr(), tokens, width // 2)
    return out


def argmax_rows(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64) of float32 ``[N, V]`` rows with a unit column
    stride, torch's answer for ties (the first) and NaNs (the first NaN)."""
    rows, cols = x.shape
    assert x.stride(1) == 1 and cols > 0
    out = torch.empty(rows, dtype=torch.long)
    lib.argmax_rows_f32(x.data_ptr(), rows, cols, x.stride(0), out.data_ptr())
    return out


def mask_rows(lib: ctypes.CDLL, x: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> None:
    """In place: ``x[rows[r], i] = -inf`` where bit ``i`` of ``masks[r]`` is
    clear (``masks`` ``[len(rows), words]`` int32, bit ``i % 32`` of word
    ``i // 32``; tokens past ``32 * words`` are disallowed). ``x`` is float32
    ``[N, V]`` with a unit column stride; ``rows`` int64."""
    assert x.stride(1) == 1 and masks.dtype == torch.int32 and masks.is_contiguous() and rows.dtype == torch.long
    assert masks.shape[0] == rows.shape[0]
    lib.mask_rows_f32(x.data_ptr(), x.stride(0), x.shape[1], rows.data_ptr(), rows.shape[0], masks.data_ptr(),
                      masks.shape[1])


__all__ = ["add_rms_norm", "argmax_rows", "mask_rows", "load", "rotary", "silu_and_mul", "_ok"]
