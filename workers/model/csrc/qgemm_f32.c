
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#define MRQ 6
typedef __m512 vec;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
/* 32 bytes of k-pairs -> q of input 2kk (lo) and 2kk+1 (hi) for columns 0..15 (0) and 16..31 (1) */
/* (each byte widened straight from memory, then its nibbles split in 32-bit lanes: two shuffles
   per 32 bytes instead of six, the same values) */
#define LOAD_U4(p, lo0, lo1, hi0, hi1) do {                                              \
    const __m512i a_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p)));       \
    const __m512i b_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)((p) + 16))); \
    const __m512i m_ = _mm512_set1_epi32(0x0F);                                          \
    lo0 = _mm512_cvtepi32_ps(_mm512_and_si512(a_, m_));                                  \
    lo1 = _mm512_cvtepi32_ps(_mm512_and_si512(b_, m_));                                  \
    hi0 = _mm512_cvtepi32_ps(_mm512_srli_epi32(a_, 4));                                  \
    hi1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b_, 4));                                  \
} while (0)
/* 5-bit: the 4-bit nibbles as LOAD_U4, plus bit 4 of inputs 2kk and 2kk+1 from NR bytes of high
   bits at ph: bit sh of each byte (sh = 2kk mod 8) for input 2kk, bit sh+1 for input 2kk+1. */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define ADD_FIFTH(v, hb, bit) _mm256_mask_add_epi8(v, _mm256_test_epi8_mask(hb, _mm256_set1_epi8((char)(1 << (bit)))), \
                                                   v, _mm256_set1_epi8(16))
#else
#define ADD_FIFTH(v, hb, bit) _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb,              \
    _mm256_set1_epi8((char)(1 << (bit)))), _mm256_set1_epi8((char)(1 << (bit)))), _mm256_set1_epi8(16)))
#endif
#define LOAD_U5(p, ph, sh, lo0, lo1, hi0, hi1) do {                                      \
    const __m256i b_ = _mm256_loadu_si256((const __m256i*)(p));                          \
    const __m256i hb_ = _mm256_loadu_si256((const __m256i*)(ph));                        \
    const __m256i m_ = _mm256_set1_epi8(0x0F);                                           \
    const __m256i l_ = ADD_FIFTH(_mm256_and_si256(b_, m_), hb_, sh);                     \
    const __m256i h_ = ADD_FIFTH(_mm256_and_si256(_mm256_srli_epi16(b_, 4), m_), hb_, (sh) + 1); \
    lo0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(l_)));          \
    lo1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(l_, 1)));     \
    hi0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(h_)));          \
    hi1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(h_, 1)));     \
} while (0)
#define LOAD_S8(p, w0, w1) do {                                                          \
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p))));        \
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((p) + 16))));  \
} while (0)
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
#define MRQ 3
typedef __m256 vec;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define LOAD_U4(p, lo0, lo1, hi0, hi1) do {  /* as the AVX-512 one: widened from memory */  \
    const __m256i a_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p)));      \
    const __m256i b_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((p) + 8))); \
    const __m256i m_ = _mm256_set1_epi32(0x0F);                                          \
    lo0 = _mm256_cvtepi32_ps(_mm256_and_si256(a_, m_));                                  \
    lo1 = _mm256_cvtepi32_ps(_mm256_and_si256(b_, m_));                                  \
    hi0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(a_, 4));                                  \
    hi1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b_, 4));                                  \
} while (0)
/* bit `bit` of each byte of hb moved to bit 4 (16-bit shifts: what crosses a byte is masked off) */
static inline __m128i fifth_bit(__m128i hb, int bit) {
    const __m128i t = bit <= 4 ? _mm_slli_epi16(hb, 4 - bit) : _mm_srli_epi16(hb, bit - 4);
    return _mm_and_si128(t, _mm_set1_epi8(16));
}
#define LOAD_U5(p, ph, sh, lo0, lo1, hi0, hi1) do {                                      \
    const __m128i b_ = _mm_loadu_si128((const __m128i*)(p));                             \
    const __m128i hb_ = _mm_loadu_si128((const __m128i*)(ph));                           \
    const __m128i m_ = _mm_set1_epi8(0x0F);                                              \
    const __m128i l_ = _mm_or_si128(_mm_and_si128(b_, m_), fifth_bit(hb_, sh));          \
    const __m128i h_ = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b_, 4), m_), fifth_bit(hb_, (sh) + 1)); \
    lo0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(l_));                                  \
    lo1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(l_, 8)));               \
    hi0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(h_));                                  \
    hi1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(h_, 8)));               \
} while (0)
#define LOAD_S8(p, w0, w1) do {                                                          \
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p))));         \
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)((p) + 8))));   \
} while (0)
#else
#error "the quantized GEMM needs AVX2 and FMA"
#endif
#define NR (2 * VL)

int qgemm_panel_width(void) { return NR; }

#include "qdot.h"
#ifndef DECODE_ROWS
#define DECODE_ROWS 16
#endif

/* R rows of x against one panel; xs: the rows' group sums [R][G] (stride G). */
#define QUKR(R)                                                                             \
static void qukr_##R(const float* x, long ldx, const float* xs, long G,                     \
                     const unsigned char* q, const float* sc, const float* mn, int bits,     \
                     long K, long gs, float* y, long ldy, int nvalid, const float* bias) {  \
    vec acc[R][2];                                                                          \
    for (int r = 0; r < R; ++r) { acc[r][0] = VZERO(); acc[r][1] = VZERO(); }               \
    for (long g = 0; g < G; ++g) {                                                          \
        vec ga[R][2];                                                                       \
        for (int r = 0; r < R; ++r) { ga[r][0] = VZERO(); ga[r][1] = VZERO(); }             \
        const long k0 = g * gs;                                                             \
        const long len = k0 + gs <= K ? gs : K - k0;  /* the last group may be shorter */   \
        if (bits == 4) {                                                             \
            const unsigned char* qp = q + (k0 / 2) * NR;                                    \
            for (long kk = 0; kk < len / 2; ++kk) {                                         \
                vec l0, l1, h0, h1;                                                         \
                LOAD_U4(qp + kk * NR, l0, l1, h0, h1);                                      \
                for (int r = 0; r < R; ++r) {                                               \
                    const vec xa = VSET1(x[r * ldx + k0 + 2 * kk]);                         \
                    ga[r][0] = VFMA(l0, xa, ga[r][0]); ga[r][1] = VFMA(l1, xa, ga[r][1]);   \
                    const vec xb = VSET1(x[r * ldx + k0 + 2 * kk + 1]);                     \
                    ga[r][0] = VFMA(h0, xb, ga[r][0]); ga[r][1] = VFMA(h1, xb, ga[r][1]);   \
                }                                                                           \
            }                                                                               \
        } else if (bits == 5) {  /* nibbles [K/2][NR], then high bits [K/8][NR]; len % 8 == 0 */ \
            const unsigned char* qp = q + (k0 / 2) * NR;                                    \
            const unsigned char* hp = q + (K / 2 + k0 / 8) * NR;                            \
            for (long j = 0; j < len / 8; ++j)                                              \
            for (int s = 0; s < 4; ++s) {  /* a constant trip count: unrolled, constant masks */ \
                const long kk = 4 * j + s;                                                  \
                vec l0, l1, h0, h1;                                                         \
                LOAD_U5(qp + kk * NR, hp + j * NR, 2 * s, l0, l1, h0, h1);                  \
                for (int r = 0; r < R; ++r) {                                               \
                    const vec xa = VSET1(x[r * ldx + k0 + 2 * kk]);                         \
                    ga[r][0] = VFMA(l0, xa, ga[r][0]); ga[r][1] = VFMA(l1, xa, ga[r][1]);   \
                    const vec xb = VSET1(x[r * ldx + k0 + 2 * kk + 1]);                     \
                    ga[r][0] = VFMA(h0, xb, ga[r][0]); ga[r][1] = VFMA(h1, xb, ga[r][1]);   \
                }                                                                           \
            }                                                                               \
        } else {                                                                            \
            const signed char* qp = (const signed char*)q + k0 * NR;                        \
            for (long k = 0; k < len; ++k) {                                                \
                vec w0, w1;                                                                 \
                LOAD_S8(qp + k * NR, w0, w1);                                               \
                for (int r = 0; r < R; ++r) {                                               \
                    const vec xa = VSET1(x[r * ldx + k0 + k]);                              \
                    ga[r][0] = VFMA(w0, xa, ga[r][0]); ga[r][1] = VFMA(w1, xa, ga[r][1]);   \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        const vec s0 = VLOAD(sc + g * NR), s1 = VLOAD(sc + g * NR + VL);                    \
        for (int r = 0; r < R; ++r) {                                                       \
            acc[r][0] = VFMA(s0, ga[r][0], acc[r][0]); acc[r][1] = VFMA(s1, ga[r][1], acc[r][1]); \
        }                                                                                   \
        if (mn) {                                                                           \
            const vec m0 = VLOAD(mn + g * NR), m1 = VLOAD(mn + g * NR + VL);                \
            for (int r = 0; r < R; ++r) {                                                   \
                const vec xsum = VSET1(xs[r * G + g]);                                      \
                acc[r][0] = VFMA(m0, xsum, acc[r][0]); acc[r][1] = VFMA(m1, xsum, acc[r][1]); \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    if (bias) {                                                                             \
        const vec b0 = VLOAD(bias), b1 = VLOAD(bias + VL);                                  \
        for (int r = 0; r < R; ++r) { acc[r][0] = VADD(acc[r][0], b0); acc[r][1] = VADD(acc[r][1], b1); } \
    }                                                                                       \
    for (int r = 0; r < R; ++r) {                                                           \
        if (nvalid == NR) {                                                                 \
            VSTORE(y + r * ldy, acc[r][0]); VSTORE(y + r * ldy + VL, acc[r][1]);            \
        } else {                                                                            \
            float tmp[NR];                                                                  \
            VSTORE(tmp, acc[r][0]); VSTORE(tmp + VL, acc[r][1]);                            \
            memcpy(y + r * ldy, tmp, sizeof(float) * nvalid);                               \
        }                                                                                   \
    }                                                                                       \
}

QUKR(1) QUKR(2) QUKR(3)
#if MRQ > 3
QUKR(4) QUKR(5) QUKR(6)
#endif

typedef void (*qukr_fn)(const float*, long, const float*, long, const unsigned char*, const float*,
                        const float*, int, long, long, float*, long, int, const float*);
static const qukr_fn QUKRS[MRQ + 1] = {
    0, qukr_1, qukr_2, qukr_3,
#if MRQ > 3
    qukr_4, qukr_5, qukr_6,
#endif
};

/* The rows' group sums xs [M][G] (in order over each group) that every panel reads. */
void qgemm_group_sums(const float* x, long M, long K, long ldx, long gs, float* xs) {
    const long G = (K + gs - 1) / gs;
    for (long m = 0; m < M; ++m)
        for (long g = 0; g < G; ++g) {
            float s = 0.0f;
            const long end = (g + 1) * gs < K ? (g + 1) * gs : K;
            for (long k = g * gs; k < end; ++k) s += x[m * ldx + k];
            xs[m * G + g] = s;
        }
}

/* Panels [p0, p1) of qgemm_f32 on the calling thread, by its few-rows loop (the same bits as
   qgemm_f32 for any M), with xs from qgemm_group_sums: for callers that spread several GEMMs
   over their own threads in one parallel region (moe_f32.c: every chosen expert of a layer). */
void qgemm_panels_f32(const float* x, long M, long K, long ldx, const float* xs, const unsigned char* q,
                      const float* scales, const float* mins, int bits, long gs, long N, const float* bias,
                      float* y, long ldy, long p0, long p1) {
    const long G = (K + gs - 1) / gs;
    const long qbytes = K * bits / 8 * NR;
    for (long p = p0; p < p1; ++p) {
        const int nvalid = (N - p * NR) < NR ? (int)(N - p * NR) : NR;
        const float* b = bias ? bias + p * NR : 0;
        for (long m = 0; m < M; m += MRQ) {
            const int rows = (M - m) < MRQ ? (int)(M - m) : MRQ;
            QUKRS[rows](x + m * ldx, ldx, xs + m * G, G, q + p * qbytes, scales + p * G * NR,
                        mins ? mins + p * G * NR : 0, bits, K, gs, y + m * ldy + p * NR, ldy, nvalid, b);
        }
    }
}

#include "qgemm_prefill.h"

/* y[M, ldy] = x[M, ldx] @ W.T (+ bias) for a quantized W (module doc).
   q: panels, each K * bits / 8 * NR bytes (5-bit: K / 2 * NR of nibbles, then K / 8 * NR of high bits); scales / mins: panels of ceil(K / gs) * NR
   floats (mins NULL: none); bias: NULL or ceil(N / NR) * NR floats. */
void qgemm_f32(const float* x, long M, long K, long ldx, const unsigned char* q, const float* scales,
               const float* mins, int bits, long gs, long N, const float* bias, float* y, long ldy) {
    if (bits & QDOT_FLAG) {  /* int8 activations, the dot-product layouts (qdot.h) */
        qdot_gemm(x, M, K, ldx, q, scales, mins, bits & ~(QDOT_FLAG | QDOT_HALF), (bits & QDOT_HALF) != 0, N, bias,
                  y, ldy);
        return;
    }
    const int parallel = (double)M * (double)N * (double)K > 262144.0;
    if (M >= DECODE_ROWS) {  /* many rows (prefill): each panel decoded once, then strips of rows on it */
        qgemm_prefill(x, M, K, ldx, q, scales, mins, bits, gs, N, bias, y, ldy, parallel);
        return;
    }
    const long P = (N + NR - 1) / NR;
    const long G = (K + gs - 1) / gs;
    float* xs = (float*)malloc(sizeof(float) * (M * G + 1));
    qgemm_group_sums(x, M, K, ldx, gs, xs);
    #pragma omp parallel for schedule(static) if (parallel)
    for (long p = 0; p < P; ++p)
        qgemm_panels_f32(x, M, K, ldx, xs, q, scales, mins, bits, gs, N, bias, y, ldy, p, p + 1);
    free(xs);
}
