
#include <math.h>
#include <float.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define MAX_GROUP 32

/* Soft-capped scores (Gemma 2's attn_logit_softcapping): s -> cap * tanh(s / cap), applied to the
   scaled score before the softmax, as transformers does; cap 0 leaves scores as they are. */
static inline float cap_score(float s, float cap) { return cap > 0.0f ? cap * tanhf(s / cap) : s; }

/* The first position a query at len - 1 attends to under a sliding window (0: none). */
static inline int window_lo(int len, int window) { return (window > 0 && len > window) ? len - window : 0; }
#define MAX_DIM 256
#define MAX_BLOCK 256

/* KV element type. Built twice: float32, and with -DKV_INT8 for the int8 cache
   (kv_int8.py): each (token, head) row is head_dim int8 values followed by
   their float32 scale, so a row is D + 4 bytes and x ~ scale * q. */
#ifdef KV_INT8
typedef signed char kv_t;
#define HS(D) ((D) + 4)
#define ROW_SCALE(p, D) (*(const float*)((const char*)(p) + (D)))
/* A row converted to floats once, then read by all G query heads. */
#define ROW_AS_FLOAT(name, src, D)                                                          \
    float name##_buf[D];                                                                    \
    for (int d_ = 0; d_ < (D); ++d_) name##_buf[d_] = (float)(src)[d_];                     \
    const float* name = name##_buf;
#else
#define ROW_AS_FLOAT(name, src, D) const float* name = (src);
typedef float kv_t;
#define HS(D) (D)
#define ROW_SCALE(p, D) 1.0f
#endif

/* Offsets (in kv_t) of rows [j0, j1) of the block starting at position start
   (block_base: its first row): positions before tlo through the block table,
   positions from tlo on (a tree-verification row's own path) at their listed
   slots tslots[p - tlo]. The arithmetic over the rows is the same either way. */
static inline void row_offsets(long* offs, int j0, int j1, int start, long block_base, long row,
                               const long* tslots, int tlo) {
    for (int j = j0; j < j1; ++j)
        offs[j] = start + j < tlo ? block_base + (long)j * row : tslots[start + j - tlo] * row;
}

/* One (request, KV head): the G query heads of KV head h over positions
   [lo, len) of the paged cache; q rows of G * head_dim floats at qh, output
   likewise at oh. Per block: scores of all G heads (each key loaded once),
   the block max, exp in one vectorizable pass, then each value row loaded
   once for all G accumulators. ATTEND(G, D) specializes it for a group size
   and head_dim known at compile time (the accumulators then live in vector
   registers); attend_any serves every other shape. */
#define ATTEND_BODY(G, D)                                                                   \
    float acc[G][D];                                                                        \
    float m[G], l[G];                                                                       \
    float s[G][MAX_BLOCK];                                                                  \
    for (int g = 0; g < G; ++g) {                                                           \
        m[g] = -FLT_MAX; l[g] = 0.0f;                                                       \
        for (int d = 0; d < D; ++d) acc[g][d] = 0.0f;                                       \
    }                                                                                       \
    for (int start = lo - lo % block_size; start < len; start += block_size) {              \
        const int blk = table[start / block_size];                                          \
        const int j0 = start < lo ? lo - start : 0;                                         \
        const int j1 = (len - start) < block_size ? (len - start) : block_size;             \
        long offs[MAX_BLOCK];  /* row j's offset: in the block, or a tree row's own slot */ \
        row_offsets(offs, j0, j1, start, ((long)blk * block_size) * row, row, tslots, tlo); \
        const long hoff = (long)h * HS(D);                                                  \
        if (start + block_size < len) { /* the next block's rows of this head, ahead */     \
            const long nb = (long)table[start / block_size + 1] * block_size * row + (long)h * HS(D); \
            for (int j = 0; j < block_size; ++j)                                            \
                for (int d = 0; d < D; d += 16) {                                           \
                    __builtin_prefetch(k_cache + nb + (long)j * row + d);                   \
                    __builtin_prefetch(v_cache + nb + (long)j * row + d);                   \
                }                                                                           \
        }                                                                                   \
        for (int j = j0; j < j1; ++j) {                                                     \
            const kv_t* kj = k_cache + offs[j] + hoff;                                      \
            const float ks = scale * ROW_SCALE(kj, D);  /* = scale for a float cache */     \
            ROW_AS_FLOAT(kf, kj, D)                                                         \
            for (int g = 0; g < G; ++g) {                                                   \
                const float* qg = qh + (long)g * D;                                         \
                float dot = 0.0f;                                                           \
                _Pragma("omp simd reduction(+:dot)")                                        \
                for (int d = 0; d < D; ++d) dot += qg[d] * kf[d];                           \
                s[g][j] = cap_score(dot * ks, cap);                                         \
            }                                                                               \
        }                                                                                   \
        for (int g = 0; g < G; ++g) {                                                       \
            float mx = m[g];                                                                \
            for (int j = j0; j < j1; ++j) mx = s[g][j] > mx ? s[g][j] : mx;                 \
            const float corr = expf(m[g] - mx);                                             \
            m[g] = mx;                                                                      \
            float sum = 0.0f;                                                               \
            _Pragma("omp simd reduction(+:sum)")                                            \
            for (int j = j0; j < j1; ++j) { s[g][j] = expf(s[g][j] - mx); sum += s[g][j]; } \
            l[g] = l[g] * corr + sum;                                                       \
            for (int d = 0; d < D; ++d) acc[g][d] *= corr;                                  \
        }                                                                                   \
        for (int j = j0; j < j1; ++j) {                                                     \
            const kv_t* vj = v_cache + offs[j] + hoff;                                      \
            const float vs = ROW_SCALE(vj, D);                                              \
            ROW_AS_FLOAT(vf, vj, D)                                                         \
            for (int g = 0; g < G; ++g) {                                                   \
                const float p = s[g][j] * vs;                                               \
                for (int d = 0; d < D; ++d) acc[g][d] += p * vf[d];                         \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    for (int g = 0; g < G; ++g) {                                                           \
        const float inv = 1.0f / l[g];                                                      \
        for (int d = 0; d < D; ++d) oh[(long)g * D + d] = acc[g][d] * inv;                  \
    }

#define ATTEND_ARGS const float* qh, float* oh, const kv_t* k_cache, const kv_t* v_cache, \
    const int* table, int len, int lo, int h, int block_size, long row, float scale, const long* tslots, int tlo, \
    float cap

#define ATTEND(G, D) static void attend_##G##_##D(ATTEND_ARGS) { ATTEND_BODY(G, D) }
ATTEND(1, 64) ATTEND(2, 64) ATTEND(3, 64) ATTEND(4, 64) ATTEND(5, 64) ATTEND(6, 64) ATTEND(7, 64) ATTEND(8, 64)
ATTEND(1, 128) ATTEND(2, 128) ATTEND(3, 128) ATTEND(4, 128) ATTEND(5, 128) ATTEND(6, 128) ATTEND(7, 128) ATTEND(8, 128)

static void attend_any(ATTEND_ARGS, int G, int D) { ATTEND_BODY(G, D) }

typedef void (*attend_fn)(ATTEND_ARGS);
static const attend_fn ATTEND_64[9] = {0, attend_1_64, attend_2_64, attend_3_64, attend_4_64,
                                       attend_5_64, attend_6_64, attend_7_64, attend_8_64};
static const attend_fn ATTEND_128[9] = {0, attend_1_128, attend_2_128, attend_3_128, attend_4_128,
                                        attend_5_128, attend_6_128, attend_7_128, attend_8_128};

#if defined(__AVX2__) && defined(__FMA__) && !defined(KV_INT8)
#include <immintrin.h>
#define FAST_F32 1

#include "exp8_avx2.h"
/* Software prefetch into L2 (T1), PREFETCH_AHEAD blocks ahead, spread over the block's scores: the
   hardware prefetcher alone stops at each block's end (blocks lie anywhere in the pool), and a burst
   of L1 prefetches stalls on the core's few miss buffers; measured here (paged_decode at batch 32,
   150 positions) 11 GB/s without, 16 GB/s with. */
#define PREFETCH_AHEAD 2
static inline void prefetch_rows(const float* k, const float* v, long span) {
    for (long d = 0; d < span; d += 16) {
        _mm_prefetch((const char*)(k + d), _MM_HINT_T1);
        _mm_prefetch((const char*)(v + d), _MM_HINT_T1);
    }
}

/* tanh of eight floats: Cephes' tanhf (an odd polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) from
   there, exp8's clamp giving 1 for large |x|), within a few ulp of libm's tanhf; then cap * tanh(s / cap)
   as cap_score. */
static inline __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 ax = _mm256_andnot_ps(sign, x);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp8(_mm256_add_ps(ax, ax));
    const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), ax, ax);
    const __m256 r = _mm256_blendv_ps(small, big, _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_GE_OQ));
    return _mm256_or_ps(r, _mm256_and_ps(x, sign));
}
static inline __m256 cap8(__m256 s, float cap) {
    const __m256 c = _mm256_set1_ps(cap);
    return _mm256_mul_ps(c, tanh8(_mm256_div_ps(s, c)));
}

/* The largest lane; the lanes' sum in a fixed order. */
static inline float hmax8(__m256 a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
static inline float hsum8(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* The sums of four vectors, as the four lanes of one. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* The query heads of KV heads [h0, h1) of one request (q row at qr, output
   row at orow) for a float32 cache and head_dim a multiple of 8, vectorized
   by hand. Per block: the block's rows of all these KV heads are read
   together (one contiguous stretch of the cache when [h0, h1) is every
   head); scores of four keys at a time per query head (four independent FMA
   chains, reduced together); exp eight scores at a time; each value chunk
   of up to 64 floats accumulated in registers over the whole block. The
   block's values are prefetched while its scores are computed, and the next
   block's keys while its values are summed, so the memory stays busy. A
   query head's arithmetic is the same whatever the head range or batch. */
static void attend_fast(const float* qr, float* orow, const float* k_cache, const float* v_cache,
                        const int* table, int len, int lo, int h0, int h1, int G, int D, int block_size,
                        long row, float scale, float* part, const long* tslots, int tlo, float cap) {
    const int NQ = (h1 - h0) * G;               /* query heads handled here */
    const float* qh = qr + (long)h0 * G * D;
    float* oh = orow + (long)h0 * G * D;
    float acc[NQ * D] __attribute__((aligned(32)));
    float m[NQ], l[NQ];
    float s[NQ][MAX_BLOCK + 16] __attribute__((aligned(32)));
    for (int g = 0; g < NQ; ++g) { m[g] = -FLT_MAX; l[g] = 0.0f; }
    memset(acc, 0, sizeof(float) * NQ * D);
    const __m128 vscale = _mm_set1_ps(scale);
    const long span = (long)(h1 - h0) * D;      /* floats of a row read here */
    const int first = lo - lo % block_size;
    for (int b = 0; b < PREFETCH_AHEAD && first + b * block_size < len; ++b) {  /* the first blocks, at once */
        const long nb = (long)table[first / block_size + b] * block_size * row + (long)h0 * D;
        for (int j = 0; j < block_size; ++j)
            prefetch_rows(k_cache + nb + (long)j * row, v_cache + nb + (long)j * row, span);
    }
    for (int start = first; start < len; start += block_size) {
        const int bi = start / block_size;
        const int j0 = start < lo ? lo - start : 0;
        const int j1 = (len - start) < block_size ? (len - start) : block_size;
        long offs[MAX_BLOCK];  /* row j's offset (heads from h0): in the block, or a tree row's own slot */
        row_offsets(offs, j0, j1, start, ((long)table[bi] * block_size) * row, row, tslots, tlo);
        for (int j = j0; j < j1; ++j) offs[j] += (long)h0 * D;
        /* scores s[g][j] for j in [j0, j1), four keys at a time (a short tail repeats the last key);
           the block's rows are read in order */
        /* the keys and values of the block PREFETCH_AHEAD blocks on, into L2, four rows with
           every four keys scored (spread out, not in a burst) */
        const float *pk = 0, *pv = 0;
        if (start + PREFETCH_AHEAD * block_size < len) {
            const long nb = (long)table[bi + PREFETCH_AHEAD] * block_size * row + (long)h0 * D;
            pk = k_cache + nb; pv = v_cache + nb;
        }
        for (int j = j0; j < j1; j += 4) {
            if (pk)
                for (int jj = j; jj < j + 4 && jj < block_size; ++jj)
                    prefetch_rows(pk + (long)jj * row, pv + (long)jj * row, span);
            for (int h = 0; h < h1 - h0; ++h) {
                const float* kb = k_cache + (long)h * D;
                const float* k0 = kb + offs[j];
                const float* k1 = kb + offs[j + 1 < j1 ? j + 1 : j1 - 1];
                const float* k2 = kb + offs[j + 2 < j1 ? j + 2 : j1 - 1];
                const float* k3 = kb + offs[j + 3 < j1 ? j + 3 : j1 - 1];
                for (int g = h * G; g < (h + 1) * G; ++g) {
                    const float* qg = qh + (long)g * D;
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    for (int d = 0; d < D; d += 8) {
                        const __m256 qv = _mm256_loadu_ps(qg + d);
                        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
                        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
                        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
                    }
                    _mm_storeu_ps(&s[g][j], _mm_mul_ps(hsum4(a0, a1, a2, a3), vscale));
                }
            }
        }
        if (cap > 0.0f)  /* capped scores, eight at a time (lanes past j1 are scratch, never read) */
            for (int g = 0; g < NQ; ++g)
                for (int j = j0; j < j1; j += 8)
                    _mm256_storeu_ps(&s[g][j], cap8(_mm256_loadu_ps(&s[g][j]), cap));
        for (int g = 0; g < NQ; ++g) {
            const float* vb = v_cache + (long)(g / G) * D;
            /* the block's max (exact in any order), then p_j = exp(s_j - max) and their sum, eight
               lanes at a time in a fixed order (lanes past j1 masked out) */
            __m256 vmax = _mm256_set1_ps(m[g]);
            int j = j0;
            for (; j + 8 <= j1; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(&s[g][j]));
            float mx = hmax8(vmax);
            for (; j < j1; ++j) mx = s[g][j] > mx ? s[g][j] : mx;
            const float corr = mx == m[g] ? 1.0f : expf(m[g] - mx);
            m[g] = mx;
            const __m256 vmx = _mm256_set1_ps(mx);
            __m256 vsum = _mm256_setzero_ps();
            for (j = j0; j < j1; j += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(&s[g][j]), vmx));
                if (j1 - j < 8)
                    e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                        _mm256_set1_epi32(j1 - j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
                _mm256_storeu_ps(&s[g][j], e);
                vsum = _mm256_add_ps(vsum, e);
            }
            l[g] = l[g] * corr + hsum8(vsum);
            /* acc[g] = acc[g] * corr + sum_j p_j V_j, one chunk of up to 64 floats in registers */
            float* ag = acc + (long)g * D;
            const __m256 vc = _mm256_set1_ps(corr);
            for (int c = 0; c < D; c += 64) {
                const int w = (D - c) < 64 ? (D - c) / 8 : 8;
                if (w == 8) {
                    __m256 r0 = _mm256_mul_ps(_mm256_load_ps(ag + c), vc);
                    __m256 r1 = _mm256_mul_ps(_mm256_load_ps(ag + c + 8), vc);
                    __m256 r2 = _mm256_mul_ps(_mm256_load_ps(ag + c + 16), vc);
                    __m256 r3 = _mm256_mul_ps(_mm256_load_ps(ag + c + 24), vc);
                    __m256 r4 = _mm256_mul_ps(_mm256_load_ps(ag + c + 32), vc);
                    __m256 r5 = _mm256_mul_ps(_mm256_load_ps(ag + c + 40), vc);
                    __m256 r6 = _mm256_mul_ps(_mm256_load_ps(ag + c + 48), vc);
                    __m256 r7 = _mm256_mul_ps(_mm256_load_ps(ag + c + 56), vc);
                    for (int j = j0; j < j1; ++j) {
                        const __m256 p = _mm256_set1_ps(s[g][j]);
                        const float* vj = vb + offs[j] + c;
                        r0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj), r0);
                        r1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8), r1);
                        r2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 16), r2);
                        r3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 24), r3);
                        r4 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 32), r4);
                        r5 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 40), r5);
                        r6 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 48), r6);
                        r7 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 56), r7);
                    }
                    _mm256_store_ps(ag + c, r0); _mm256_store_ps(ag + c + 8, r1);
                    _mm256_store_ps(ag + c + 16, r2); _mm256_store_ps(ag + c + 24, r3);
                    _mm256_store_ps(ag + c + 32, r4); _mm256_store_ps(ag + c + 40, r5);
                    _mm256_store_ps(ag + c + 48, r6); _mm256_store_ps(ag + c + 56, r7);
                } else {
                    for (int i = 0; i < w; ++i) {
                        __m256 r = _mm256_mul_ps(_mm256_load_ps(ag + c + 8 * i), vc);
                        for (int j = j0; j < j1; ++j)
                            r = _mm256_fmadd_ps(_mm256_set1_ps(s[g][j]), _mm256_loadu_ps(vb + offs[j] + c + 8 * i), r);
                        _mm256_store_ps(ag + c + 8 * i, r);
                    }
                }
            }
        }
    }
    if (part) {  /* one chunk of a split sequence: m, l and the unnormalized acc, merged later */
        memcpy(part, m, sizeof(float) * NQ);
        memcpy(part + NQ, l, sizeof(float) * NQ);
        memcpy(part + 2 * NQ, acc, sizeof(float) * NQ * D);
        return;
    }
    for (int g = 0; g < NQ; ++g) {
        const __m256 inv = _mm256_set1_ps(1.0f / l[g]);
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(oh + (long)g * D + d, _mm256_mul_ps(_mm256_load_ps(acc + (long)g * D + d), inv));
    }
}

/* Positions [lo, len) of a request cut at multiples of CHUNK (absolute
   positions, so the cut depends on the request alone, never on the batch). */
#define CHUNK 512
static inline int num_chunks(int lo, int len) { return (len - 1) / CHUNK - lo / CHUNK + 1; }

/* The query heads' outputs from their chunks' (m, l, acc) (chunk c at parts + c * stride), in
   chunk order. */
static void merge_chunks(const float* parts, long stride, int nc, int NQ, int D, float* oh) {
    for (int g = 0; g < NQ; ++g) {
        float mx = -FLT_MAX;
        for (int c = 0; c < nc; ++c) mx = parts[c * stride + g] > mx ? parts[c * stride + g] : mx;
        float lsum = 0.0f;
        __m256 acc[MAX_DIM / 8];
        for (int i = 0; i < D / 8; ++i) acc[i] = _mm256_setzero_ps();
        for (int c = 0; c < nc; ++c) {
            const float* pc = parts + c * stride;
            const float w = expf(pc[g] - mx);
            lsum += pc[NQ + g] * w;
            const __m256 vw = _mm256_set1_ps(w);
            const float* ac = pc + 2 * NQ + (long)g * D;
            for (int i = 0; i < D / 8; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(ac + 8 * i), vw, acc[i]);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / lsum);
        for (int i = 0; i < D / 8; ++i) _mm256_storeu_ps(oh + (long)g * D + 8 * i, _mm256_mul_ps(acc[i], inv));
    }
}
#endif

static void attend(const float* qh, float* oh, const kv_t* k_cache, const kv_t* v_cache,
                   const int* table, int len, int lo, int h, int G, int D, int block_size,
                   long row, float scale, const long* tslots, int tlo, float cap) {
    attend_fn fn = 0;
    if (G <= 8 && D == 64) fn = ATTEND_64[G];
    else if (G <= 8 && D == 128) fn = ATTEND_128[G];
    if (fn) fn(qh, oh, k_cache, v_cache, table, len, lo, h, block_size, row, scale, tslots, tlo, cap);
    else attend_any(qh, oh, k_cache, v_cache, table, len, lo, h, block_size, row, scale, tslots, tlo, cap, G, D);
}

/* Decode attention: request r's query (num_heads * head_dim floats at
   q + r * ldq) over its positions [0, seq_lens[r]) of the paged cache; out
   rows at out + r * ldo. With k and v (rows at k + r * ldk, v + r * ldv),
   each request's new key and value are first written to slot_mapping[r].
   With tail_lo (tree verification, spec_decode.py): a row r with
   tail_lo[r] >= 0 reads positions p >= tail_lo[r] from the slots
   tail_slots[r * tail_width + p - tail_lo[r]] (its own path through the
   tree) instead of through its block table. softcap > 0 caps every scaled
   score to softcap * tanh(score / softcap) before the softmax (Gemma 2). */
#define TAIL_LO(r, len) ((tail_lo && tail_lo[r] >= 0) ? tail_lo[r] : (len))
#define TAIL_SLOTS(r) (tail_slots ? tail_slots + (long)(r) * tail_width : 0)
/* One token's K (or V) of every head into its cache row (quantized per head for int8). */
static void store_row(kv_t* dst, const float* src, int num_kv_heads, int D) {
#ifdef KV_INT8
    for (int h = 0; h < num_kv_heads; ++h) {
        const float* x = src + (long)h * D;
        kv_t* o = dst + (long)h * HS(D);
        float amax = 0.0f;
        for (int d = 0; d < D; ++d) { const float a = fabsf(x[d]); amax = a > amax ? a : amax; }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const float sc = amax / 127.0f;
        for (int d = 0; d < D; ++d) {
            int qv = (int)nearbyintf(x[d] * inv);
            o[d] = (kv_t)(qv > 127 ? 127 : (qv < -127 ? -127 : qv));
        }
        memcpy(o + D, &sc, sizeof(float));
    }
#else
    memcpy(dst, src, sizeof(float) * (long)num_kv_heads * D);
#endif
}

void paged_decode_f32(
    const float* q, long ldq, const float* k, long ldk, const float* v, long ldv, const long* slot_mapping,
    kv_t* k_cache, kv_t* v_cache, const int* block_tables, int table_width, const int* seq_lens,
    int num_reqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, int window, float* out, long ldo, const int* tail_lo, const long* tail_slots, int tail_width,
    float softcap)
{
    const int G = num_heads / num_kv_heads;
    const long row = (long)num_kv_heads * HS(head_dim);      /* one token's K (or V), in kv_t */
    if (k) {
        for (int r = 0; r < num_reqs; ++r) {
            store_row(k_cache + slot_mapping[r] * row, k + (long)r * ldk, num_kv_heads, head_dim);
            store_row(v_cache + slot_mapping[r] * row, v + (long)r * ldv, num_kv_heads, head_dim);
        }
    }
    long work = 0;
    for (int r = 0; r < num_reqs; ++r) work += seq_lens[r];
    work *= (long)num_heads * head_dim;
#ifdef FAST_F32
    if (head_dim % 8 == 0) {
        /* Tasks: (request, a range of `per` KV heads, a chunk of CHUNK positions). Every head of a
           request together (one contiguous read per block) when there are tasks enough to keep the
           threads busy, else fewer heads per task. A sequence longer than a chunk is attended chunk
           by chunk in parallel (flash-decoding) and the chunks merged in order; one chunk writes
           its output directly. A query head's arithmetic depends only on its request. */
        const int threads = omp_get_max_threads();
        long chunks = 0;
        for (int r = 0; r < num_reqs; ++r) {
            const int len = seq_lens[r];
            chunks += num_chunks(window_lo(len, window), len);
        }
        int per = num_kv_heads;
        while (per > 1 && chunks * ((num_kv_heads + per - 1) / per) < 2L * threads) per = (per + 1) / 2;
        const int parts = (num_kv_heads + per - 1) / per;
        const long ntasks = chunks * parts;
        int* tasks = (int*)malloc(sizeof(int) * 3 * ntasks);   /* (request, head part, chunk) */
        long* slot = (long*)malloc(sizeof(long) * ntasks);      /* where a split task's (m, l, acc) go */
        long t = 0, nsplit = 0;
        const long part_floats = (long)per * G * (head_dim + 2);
        for (int r = 0; r < num_reqs; ++r) {
            const int len = seq_lens[r];
            const int nc = num_chunks(window_lo(len, window), len);
            for (int p = 0; p < parts; ++p)
                for (int c = 0; c < nc; ++c, ++t) {
                    tasks[3 * t] = r; tasks[3 * t + 1] = p; tasks[3 * t + 2] = c;
                    slot[t] = nc > 1 ? (nsplit++) * part_floats : -1;
                }
        }
        float* partial = nsplit ? (float*)malloc(sizeof(float) * nsplit * part_floats) : 0;
        #pragma omp parallel if (work > 16384)
        {
            #pragma omp for schedule(dynamic, 1)
            for (long i = 0; i < ntasks; ++i) {
                const int r = tasks[3 * i], p = tasks[3 * i + 1], c = tasks[3 * i + 2];
                const int len = seq_lens[r];
                const int lo = window_lo(len, window);
                const int h0 = p * per, h1 = (h0 + per) < num_kv_heads ? h0 + per : num_kv_heads;
                const int first = (lo / CHUNK + c) * CHUNK;
                const int c_lo = first > lo ? first : lo;
                const int c_hi = first + CHUNK < len ? first + CHUNK : len;
                attend_fast(q + (long)r * ldq, out + (long)r * ldo, k_cache, v_cache,
                            block_tables + (long)r * table_width, c_hi, c_lo, h0, h1, G, head_dim,
                            block_size, row, scale, slot[i] >= 0 ? partial + slot[i] : 0,
                            TAIL_SLOTS(r), TAIL_LO(r, len), softcap);
            }
            if (nsplit) {
                #pragma omp for schedule(dynamic, 1)
                for (long i = 0; i < ntasks; ++i) {
                    if (slot[i] < 0 || tasks[3 * i + 2] != 0) continue;   /* each split (request, part) once */
                    const int r = tasks[3 * i], p = tasks[3 * i + 1];
                    const int len = seq_lens[r];
                    const int nc = num_chunks(window_lo(len, window), len);
                    const int h0 = p * per, h1 = (h0 + per) < num_kv_heads ? h0 + per : num_kv_heads;
                    merge_chunks(partial + slot[i], part_floats, nc, (h1 - h0) * G, head_dim,
                                 out + (long)r * ldo + (long)h0 * G * head_dim);
                }
            }
        }
        free(tasks); free(slot); free(partial);
        return;
    }
#endif
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) if (work > 16384)
    for (int r = 0; r < num_reqs; ++r) {
        for (int h = 0; h < num_kv_heads; ++h) {
            const int len = seq_lens[r];
            const int lo = window_lo(len, window);
            attend(q + (long)r * ldq + (long)h * G * head_dim, out + (long)r * ldo + (long)h * G * head_dim,
                   k_cache, v_cache, block_tables + (long)r * table_width, len, lo, h, G, head_dim,
                   block_size, row, scale, TAIL_SLOTS(r), TAIL_LO(r, len), softcap);
        }
    }
}
