
#include <float.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define MAX_DIM 256

/* exp(x) for 16 lanes: the same range reduction and polynomial as exp8 of cpu_ops. */
#include "exp16_avx512.h"
/* o[r] = o[r] * corr[r] + sum_j p[j][r] * v[j] for NR rows (r0 ..) and 64 columns from c: the
   accumulators (NR x 4 vectors) stay in registers over the tile's keys. */
static inline __attribute__((always_inline)) void pv_rows(float* o, const float* pt, const float* corr,
                                                          const float* vt, long row, int n, int D, int r0,
                                                          int NR, int c) {
    __m512 acc[6][4];
    #pragma GCC unroll 6
    for (int i = 0; i < NR; ++i) {
        const __m512 cr = _mm512_set1_ps(corr[r0 + i]);
        #pragma GCC unroll 4
        for (int w = 0; w < 4; ++w) acc[i][w] = _mm512_mul_ps(_mm512_load_ps(o + (long)(r0 + i) * D + c + 16 * w), cr);
    }
    for (int j = 0; j < n; ++j) {
        const float* vj = vt + (long)j * row + c;
        const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
        const __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
        #pragma GCC unroll 6
        for (int i = 0; i < NR; ++i) {
            const __m512 p = _mm512_set1_ps(pt[j * 16 + r0 + i]);
            acc[i][0] = _mm512_fmadd_ps(p, v0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(p, v1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(p, v2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(p, v3, acc[i][3]);
        }
    }
    #pragma GCC unroll 6
    for (int i = 0; i < NR; ++i) {
        #pragma GCC unroll 4
        for (int w = 0; w < 4; ++w) _mm512_store_ps(o + (long)(r0 + i) * D + c + 16 * w, acc[i][w]);
    }
}

/* The same for 16 columns at a time (head_dim not a multiple of 64), one row at a time. */
static void pv_generic(float* o, const float* pt, const float* corr, const float* vt, long row, int n,
                       int D, int r0, int NR, int c) {
    for (int i = 0; i < NR; ++i) {
        __m512 acc = _mm512_mul_ps(_mm512_load_ps(o + (long)(r0 + i) * D + c), _mm512_set1_ps(corr[r0 + i]));
        for (int j = 0; j < n; ++j)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(pt[j * 16 + r0 + i]), _mm512_loadu_ps(vt + (long)j * row + c), acc);
        _mm512_store_ps(o + (long)(r0 + i) * D + c, acc);
    }
}

/* One task: query positions [p0, p0 + nq) of a request (query rows from token t0 of q), the G query
   heads of KV head h, over the keys each may see (causal; the last `window` with a sliding window). */
static inline __attribute__((always_inline)) void prefill_task_d(
        const float* q, long ldq, float* out, long ldo, const float* k_cache, const float* v_cache,
        const int* table, int block_size, long row, int h, int G, int D, int p0, int nq, long t0, int window,
        float scale) {
    const int NR = nq * G;                       /* lanes in use: row i * G + g */
    float qt[MAX_DIM * 16] __attribute__((aligned(64)));      /* Q^T: qt[d * 16 + row] */
    float o[16 * MAX_DIM] __attribute__((aligned(64)));       /* o[row * D + d], unnormalized */
    float kt[16 * MAX_DIM] __attribute__((aligned(64)));      /* the tile's keys, contiguous */
    float pt[16 * 16] __attribute__((aligned(64)));           /* P: pt[j * 16 + row] */
    float corr[16] __attribute__((aligned(64)));
    int qpos[16] __attribute__((aligned(64)));
    memset(qt, 0, sizeof(float) * 16 * D);
    memset(o, 0, sizeof(float) * 16 * D);
    for (int r = 0; r < 16; ++r) qpos[r] = -1;               /* unused lanes see no key */
    for (int i = 0; i < nq; ++i)
        for (int g = 0; g < G; ++g) {
            const float* src = q + (t0 + i) * ldq + (long)(h * G + g) * D;
            for (int d = 0; d < D; ++d) qt[d * 16 + i * G + g] = src[d];
            qpos[i * G + g] = p0 + i;
        }
    const __m512i vqp = _mm512_load_si512(qpos);
    const __m512i vqlo = _mm512_sub_epi32(vqp, _mm512_set1_epi32(window));  /* keys > p - window */
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512 neg = _mm512_set1_ps(-FLT_MAX);
    __m512 m = neg, l = _mm512_setzero_ps();
    const int last = p0 + nq - 1;
    int kp = (window > 0 && p0 + 1 > window) ? p0 + 1 - window : 0;
    while (kp <= last) {
        /* a tile ends at the block's end, the next multiple of 16 or the task's last position: cut at
           absolute positions, so a row's visible keys fall in the same tiles whichever task (query tile,
           chunk of the prompt) holds it; masked lanes add exact zeros */
        const int off = kp % block_size;
        int n = block_size - off;
        if (n > 16 - kp % 16) n = 16 - kp % 16;
        if (n > last + 1 - kp) n = last + 1 - kp;
        const long base = ((long)table[kp / block_size] * block_size + off) * row + (long)h * D;
        for (int j = 0; j < n; ++j) memcpy(kt + (long)j * D, k_cache + base + (long)j * row, sizeof(float) * D);
        const float* vt = v_cache + base;                    /* value j at vt + j * row */
        for (int j = n; j < 16; ++j) memset(kt + (long)j * D, 0, sizeof(float) * D);
        /* S[j][row] = k_j . q_row: each key element broadcast against a vector of the rows */
        __m512 s[16];
        #pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) s[j] = _mm512_setzero_ps();
        for (int d = 0; d < D; ++d) {
            const __m512 qd = _mm512_load_ps(qt + d * 16);
            #pragma GCC unroll 16
            for (int j = 0; j < 16; ++j) s[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kt[j * D + d]), s[j]);
        }
        __m512 mx = m;
        __mmask16 mk[16];
        #pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
            const __m512i kv = _mm512_set1_epi32(kp + j);
            __mmask16 k = j < n ? _mm512_cmple_epi32_mask(kv, vqp) : 0;
            if (window > 0) k &= _mm512_cmpgt_epi32_mask(kv, vqlo);
            mk[j] = k;
            s[j] = _mm512_mask_mul_ps(neg, k, s[j], vscale);
            mx = _mm512_max_ps(mx, s[j]);
        }
        const __m512 c = exp16(_mm512_sub_ps(m, mx));
        _mm512_store_ps(corr, c);
        __m512 sum = _mm512_setzero_ps();
        #pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
            const __m512 p = _mm512_maskz_mov_ps(mk[j], exp16(_mm512_sub_ps(s[j], mx)));
            _mm512_store_ps(pt + j * 16, p);
            sum = _mm512_add_ps(sum, p);
        }
        l = _mm512_fmadd_ps(l, c, sum);
        m = mx;
        if (D % 64 == 0) {
            for (int c0 = 0; c0 < D; c0 += 64)
                for (int r0 = 0; r0 < NR; r0 += 6) {
                    switch (NR - r0 < 6 ? NR - r0 : 6) {
                        case 1: pv_rows(o, pt, corr, vt, row, n, D, r0, 1, c0); break;
                        case 2: pv_rows(o, pt, corr, vt, row, n, D, r0, 2, c0); break;
                        case 3: pv_rows(o, pt, corr, vt, row, n, D, r0, 3, c0); break;
                        case 4: pv_rows(o, pt, corr, vt, row, n, D, r0, 4, c0); break;
                        case 5: pv_rows(o, pt, corr, vt, row, n, D, r0, 5, c0); break;
                        default: pv_rows(o, pt, corr, vt, row, n, D, r0, 6, c0); break;
                    }
                }
        } else {
            for (int c0 = 0; c0 < D; c0 += 16) pv_generic(o, pt, corr, vt, row, n, D, 0, NR, c0);
        }
        kp += n;
    }
    float lsum[16] __attribute__((aligned(64)));
    _mm512_store_ps(lsum, l);
    for (int i = 0; i < nq; ++i)
        for (int g = 0; g < G; ++g) {
            const int r = i * G + g;
            const __m512 inv = _mm512_set1_ps(1.0f / lsum[r]);
            float* dst = out + (t0 + i) * ldo + (long)(h * G + g) * D;
            for (int d = 0; d < D; d += 16)
                _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_load_ps(o + (long)r * D + d), inv));
        }
}

/* prefill_task_d with head_dim known at compile time for the common sizes (the keys' offsets in the
   tile are then constants), any multiple of 16 otherwise. */
static void prefill_task(const float* q, long ldq, float* out, long ldo, const float* k_cache,
                         const float* v_cache, const int* table, int block_size, long row, int h, int G,
                         int D, int p0, int nq, long t0, int window, float scale) {
    if (D == 64)
        prefill_task_d(q, ldq, out, ldo, k_cache, v_cache, table, block_size, row, h, G, 64, p0, nq, t0, window, scale);
    else if (D == 128)
        prefill_task_d(q, ldq, out, ldo, k_cache, v_cache, table, block_size, row, h, G, 128, p0, nq, t0, window,
                       scale);
    else
        prefill_task_d(q, ldq, out, ldo, k_cache, v_cache, table, block_size, row, h, G, D, p0, nq, t0, window, scale);
}

/* Prefill attention of requests [r_begin, r_end): request r's query tokens are rows
   [query_start[r], query_start[r + 1]) of q (num_heads * head_dim floats each, row stride ldq), at
   positions seq_lens[r] - qlen .. seq_lens[r] - 1; their keys and values already sit in the paged
   cache. Output rows likewise in out (row stride ldo). */
void paged_prefill_f32(const float* q, long ldq, const float* k_cache, const float* v_cache,
                      const int* block_tables, int table_width, const int* query_start, const int* seq_lens,
                      int r_begin, int r_end, int num_heads, int num_kv_heads, int head_dim, int block_size,
                      float scale, int window, float* out, long ldo) {
    const int G = num_heads / num_kv_heads;
    if (G > 16 || head_dim % 16 || head_dim > MAX_DIM) return;   /* supports() keeps these away */
    const int R = 16 / G;                                   /* query positions per task */
    const long row = (long)num_kv_heads * head_dim;
    long ntasks = 0;
    for (int r = r_begin; r < r_end; ++r) {
        const int qlen = query_start[r + 1] - query_start[r];
        ntasks += (long)num_kv_heads * ((qlen + R - 1) / R);
    }
    int* tasks = (int*)malloc(sizeof(int) * 3 * (ntasks ? ntasks : 1));  /* (request, kv head, tile) */
    long t = 0;
    double work = 0;
    for (int r = r_begin; r < r_end; ++r) {
        const int qlen = query_start[r + 1] - query_start[r];
        const int tiles = (qlen + R - 1) / R;
        for (int tile = tiles - 1; tile >= 0; --tile)         /* the longest (latest) tiles first */
            for (int h = 0; h < num_kv_heads; ++h, ++t) {
                tasks[3 * t] = r; tasks[3 * t + 1] = h; tasks[3 * t + 2] = tile;
            }
        work += (double)qlen * seq_lens[r];
    }
    #pragma omp parallel for schedule(dynamic, 1) if (work * num_heads * head_dim > 65536.0)
    for (long i = 0; i < ntasks; ++i) {
        const int r = tasks[3 * i], h = tasks[3 * i + 1], tile = tasks[3 * i + 2];
        const int qlen = query_start[r + 1] - query_start[r];
        const int nq = (tile + 1) * R <= qlen ? R : qlen - tile * R;
        const int p0 = seq_lens[r] - qlen + tile * R;
        prefill_task(q, ldq, out, ldo, k_cache, v_cache, block_tables + (long)r * table_width, block_size,
                     row, h, G, head_dim, p0, nq, (long)query_start[r] + tile * R, window, scale);
    }
    free(tasks);
}
#else
void paged_prefill_f32(void) {}
#endif
