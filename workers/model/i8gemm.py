"""A native int8 x int8 GEMM for W8A8 (CPU): ``y = x @ W.T (+ b)`` with ``W``
int8 per output channel (``w_scale[c] * wq[c, :]``) and ``x`` quantized per
row when called (``a_r = max|x_r| / 127``, ``xq_r = round(x_r / a_r)``)::

    y[r, c] = a_r * w_scale[c] * (sum over k of xq[r, k] * wq[c, k])  (+ b[c])

The sum is computed in int32, exactly, so every row's result is the same
whatever the batch (batch-invariant by construction) and whatever the thread
count. Products come from integer dot-product instructions, four int8 pairs
per 32-bit lane:

    AVX-512 VNNI    vpdpbusd (u8 x s8); x is stored as xq + 128 (u8) and
                    128 * sum(wq[c, :]) is subtracted after the loop
    AVX2            vpmaddubsw on |xq| and wq with xq's sign (no saturation:
                    127 * 127 * 2 < 2^15), then vpmaddwd

Layout of a panel of NR output columns: int8 ``[K4 / 4][NR][4]`` (four
consecutive inputs of a column per 32-bit lane; K padded to K4, a multiple of
four, with zeros). Per weight it reads one byte; per 64 (VNNI) or 32 (AVX2)
multiply-adds one instruction, four times the float FMA rate.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np
import torch

from workers.model import native

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI 1
#define IVL 16
#define MR 6
typedef __m512i ivec;
typedef __m512 fvec;
#define IZERO() _mm512_setzero_si512()
#define ILOAD(p) _mm512_loadu_si512((const void*)(p))
#define BCAST4(p) _mm512_set1_epi32(*(const int*)(p))
#define DOT(acc, x, w) _mm512_dpbusd_epi32(acc, x, w)
#define ISUB(a, b) _mm512_sub_epi32(a, b)
#define TOF(v) _mm512_cvtepi32_ps(v)
#define FLOAD(p) _mm512_loadu_ps(p)
#define FSTORE(p, v) _mm512_storeu_ps(p, v)
#define FMUL(a, b) _mm512_mul_ps(a, b)
#define FFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define FZERO() _mm512_setzero_ps()
#define FSET1(x) _mm512_set1_ps(x)
#elif defined(__AVX2__)
#define VNNI 0
#define IVL 8
#define MR 4
typedef __m256i ivec;
typedef __m256 fvec;
#define IZERO() _mm256_setzero_si256()
#define ILOAD(p) _mm256_loadu_si256((const __m256i*)(p))
#define BCAST4(p) _mm256_set1_epi32(*(const int*)(p))
static inline __m256i dot_avx2(__m256i acc, __m256i x, __m256i w) {
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}
#define DOT(acc, x, w) dot_avx2(acc, x, w)
#define ISUB(a, b) _mm256_sub_epi32(a, b)
#define TOF(v) _mm256_cvtepi32_ps(v)
#define FLOAD(p) _mm256_loadu_ps(p)
#define FSTORE(p, v) _mm256_storeu_ps(p, v)
#define FMUL(a, b) _mm256_mul_ps(a, b)
#define FFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define FZERO() _mm256_setzero_ps()
#define FSET1(x) _mm256_set1_ps(x)
#else
#error "the int8 GEMM needs AVX2"
#endif
#define NR (2 * IVL)

int i8gemm_panel_width(void) { return NR; }
int i8gemm_vnni(void) { return VNNI; }

/* R rows of quantized x (K4 bytes each) against one panel. */
#define UKR(R)                                                                               \
static void ukr_##R(const unsigned char* xq, long K4, const float* xs, const signed char* w,  \
                    const float* ws, const int* wsum, const float* bias, float* y, long ldy,  \
                    int nvalid) {                                                            \
    ivec acc[R][2];                                                                          \
    for (int r = 0; r < R; ++r) { acc[r][0] = IZERO(); acc[r][1] = IZERO(); }               \
    for (long kq = 0; kq < K4 / 4; ++kq) {                                                   \
        const ivec w0 = ILOAD(w + kq * NR * 4), w1 = ILOAD(w + kq * NR * 4 + IVL * 4);      \
        for (int r = 0; r < R; ++r) {                                                        \
            const ivec xb = BCAST4(xq + r * K4 + kq * 4);                                    \
            acc[r][0] = DOT(acc[r][0], xb, w0); acc[r][1] = DOT(acc[r][1], xb, w1);         \
        }                                                                                    \
    }                                                                                        \
    const fvec s0 = FLOAD(ws), s1 = FLOAD(ws + IVL);                                         \
    /* One explicit FMA per output, bias or not (zero), so no compiler contraction differs  \
       between row counts: y = (acc * w_scale) * a_r + b. */                                \
    const fvec b0 = bias ? FLOAD(bias) : FZERO(), b1 = bias ? FLOAD(bias + IVL) : FZERO();   \
    for (int r = 0; r < R; ++r) {                                                            \
        ivec a0 = acc[r][0], a1 = acc[r][1];                                                 \
        if (VNNI) { a0 = ISUB(a0, ILOAD(wsum)); a1 = ISUB(a1, ILOAD(wsum + IVL)); }         \
        const fvec xr = FSET1(xs[r]);                                                        \
        const fvec y0 = FFMA(FMUL(TOF(a0), s0), xr, b0), y1 = FFMA(FMUL(TOF(a1), s1), xr, b1); \
        if (nvalid == NR) {                                                                  \
            FSTORE(y + r * ldy, y0); FSTORE(y + r * ldy + IVL, y1);                          \
        } else {                                                                             \
            float tmp[NR];                                                                   \
            FSTORE(tmp, y0); FSTORE(tmp + IVL, y1);                                          \
            memcpy(y + r * ldy, tmp, sizeof(float) * nvalid);                                \
        }                                                                                    \
    }                                                                                        \
}

UKR(1) UKR(2) UKR(3) UKR(4)
#if MR > 4
UKR(5) UKR(6)
#endif

typedef void (*ukr_fn)(const unsigned char*, long, const float*, const signed char*, const float*,
                       const int*, const float*, float*, long, int);
static const ukr_fn UKRS[MR + 1] = {
    0, ukr_1, ukr_2, ukr_3, ukr_4,
#if MR > 4
    ukr_5, ukr_6,
#endif
};

/* Row r of x: a_r = max|x_r| / 127 into xs[r], round(x_r / a_r) into xq (K4 bytes; +128 with VNNI). */
static void quantize_row(const float* x, long K, long K4, unsigned char* xq, float* xs) {
    float amax = 0.0f;
    for (long k = 0; k < K; ++k) { const float a = fabsf(x[k]); if (a > amax) amax = a; }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    xs[0] = amax / 127.0f;
    for (long k = 0; k < K4; ++k) {
        int q = 0;
        if (k < K) {
            q = (int)nearbyintf(x[k] * inv);
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
        }
        xq[k] = (unsigned char)(VNNI ? q + 128 : (signed char)q);
    }
}

/* y[M, ldy] = x[M, ldx] @ W.T (+ bias); w: panels of K4 * NR bytes; ws, wsum, bias: P * NR. */
void i8gemm_f32(const float* x, long M, long K, long ldx, const signed char* w, const float* ws,
                const int* wsum, long N, const float* bias, float* y, long ldy) {
    const long K4 = (K + 3) / 4 * 4;
    const long P = (N + NR - 1) / NR;
    unsigned char* xq = (unsigned char*)malloc((size_t)(M * K4 + 64));
    float* xs = (float*)malloc(sizeof(float) * (size_t)(M + 1));
    const int parallel = (double)M * (double)N * (double)K > 262144.0;
    #pragma omp parallel if (parallel)
    {
        #pragma omp for schedule(static)
        for (long m = 0; m < M; ++m) quantize_row(x + m * ldx, K, K4, xq + m * K4, xs + m);
        #pragma omp for schedule(static)
        for (long p = 0; p < P; ++p) {
            const int nvalid = (N - p * NR) < NR ? (int)(N - p * NR) : NR;
            for (long m = 0; m < M; m += MR) {
                const int rows = (M - m) < MR ? (int)(M - m) : MR;
                UKRS[rows](xq + m * K4, K4, xs + m, w + p * K4 * NR, ws + p * NR, wsum + p * NR,
                           bias ? bias + p * NR : 0, y + m * ldy + p * NR, ldy, nvalid);
            }
        }
    }
    free(xq);
    free(xs);
}
"""

_P, _L = ctypes.c_void_p, ctypes.c_long
_SIGNATURES = {"i8gemm_f32": [_P, _L, _L, _L, _P, _P, _P, _L, _P, _P, _L]}


def load() -> Optional[ctypes.CDLL]:
    """The built kernel, or None (no compiler, no AVX2, or a failed build)."""
    lib = native.build("i8gemm_f32", _SOURCE, signatures=_SIGNATURES)
    if lib is not None:
        lib.i8gemm_panel_width.restype = ctypes.c_int
        lib.i8gemm_vnni.restype = ctypes.c_int
    return lib


class Int8Weight:
    """An int8 weight ``[N, K]`` with one scale per output channel, for :func:`i8gemm_f32`.

    Args:
        q: ``[N, K]`` int8 in -127..127.
        scales: ``[N]`` float32 (``W ~ scales[:, None] * q``).
        bias: ``[N]`` or None.
        lib: The kernel (``load()``).
        name: Format name, for logs and metrics.
    """

    def __init__(self, q: np.ndarray, scales: np.ndarray, bias: Optional[torch.Tensor], lib: ctypes.CDLL,
                 name: str = "w8a8") -> None:
        n, k = q.shape
        if q.dtype != np.int8 or q.min() < -127:
            raise ValueError(f"int8 weight of {n}x{k}: values must be int8 in -127..127")
        self.lib, self.name = lib, name
        self.out_features, self.in_features = n, k
        nr = lib.i8gemm_panel_width()
        num_panels, k4 = -(-n // nr), -(-k // 4) * 4
        padded = np.zeros((num_panels * nr, k4), dtype=np.int8)
        padded[:n, :k] = q
        # [P, NR, K4/4, 4] -> [P, K4/4, NR, 4]
        panels = padded.reshape(num_panels, nr, k4 // 4, 4).transpose(0, 2, 1, 3)
        self.q = torch.from_numpy(np.ascontiguousarray(panels).reshape(-1).view(np.uint8))
        self.scales = torch.zeros(num_panels * nr, dtype=torch.float32)
        self.scales[:n] = torch.from_numpy(np.asarray(scales, dtype=np.float32).reshape(n))
        # 128 * sum of a column's weights: what x + 128 adds to its dot products (VNNI).
        self.wsum = torch.from_numpy(padded.astype(np.int32).sum(axis=1) * 128).to(torch.int32).contiguous()
        self.bias: Optional[torch.Tensor] = None
        if bias is not None:
            self.bias = torch.zeros(num_panels * nr, dtype=torch.float32)
            self.bias[:n] = bias.detach().float()

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads (panels, scales, column sums, bias)."""
        tensors = [self.q, self.scales, self.wsum] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def _panels(self) -> tuple[torch.Tensor, int]:
        """The packed integers as ``[P, K4 / 4, NR, 4]`` int8, and K rounded up to 4 (``K4``)."""
        k4 = -(-self.in_features // 4) * 4
        return self.q.view(torch.int8).view(-1, k4 // 4, self.lib.i8gemm_panel_width(), 4), k4

    def int8_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The weight as it was given: ``(q [N, K] int8, scales [N] float32)``, read back from the panels."""
        panels, k4 = self._panels()
        rows = panels.permute(0, 2, 1, 3).reshape(-1, k4)
        n = self.out_features
        return rows[:n, : self.in_features].numpy().copy(), self.scales[:n].numpy().copy()

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``scale * q`` of ``ids`` as float32 ``[len(ids), K]``, read back from the panels."""
        panels, k4 = self._panels()
        nr = panels.shape[2]
        q = panels[ids // nr, :, ids % nr, :].reshape(len(ids), k4)[:, : self.in_features]
        return q.float() * self.scales[ids].unsqueeze(1)

    rows = dequantized_rows

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, self.bias)

    def matmul_no_bias(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None)

    def _run(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype != torch.float32:
            x = x.reshape(-1, self.in_features).contiguous().float()
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        if m:
            self.lib.i8gemm_f32(x.data_ptr(), m, self.in_features, x.stride(0), self.q.data_ptr(),
                                self.scales.data_ptr(), self.wsum.data_ptr(), self.out_features,
                                bias.data_ptr() if bias is not None else None, y.data_ptr(), self.out_features)
        return y
