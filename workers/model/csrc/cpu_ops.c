
#include <math.h>
#include "exp8_avx2.h"
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

/* tanh(u) as Cephes' tanhf: an odd polynomial below |u| 0.625, else
   1 - 2 / (exp(2|u|) + 1) with exp_poly, the sign put back. */
static inline float tanh_poly(float u) {
    const float a = fabsf(u);
    const float z = u * u;
    float p = fmaf(-5.70498872745e-3f, z, 2.06390887954e-2f);
    p = fmaf(p, z, -5.37397155531e-2f);
    p = fmaf(p, z, 1.33314422036e-1f);
    p = fmaf(p, z, -3.33332819422e-1f);
    const float small = fmaf(p * z, u, u);
    const float big = 1.0f - 2.0f / (exp_poly(a + a) + 1.0f);
    return a < 0.625f ? small : (u < 0.0f ? -big : big);
}

/* out[t, i] = gelu_tanh(gu[t, i]) * gu[t, inter + i] (Gemma's GeGLU), gelu_tanh
   in torch's order: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)));
   the AVX2 lanes run tanh_poly's operations, so every element gets the same bits
   whichever loop computes it */
void gelu_tanh_and_mul_f32(const float* gu, float* out, long tokens, long inter) {
    const float beta = (float)0.79788456080286535588, kappa = 0.044715f;  /* sqrt(2 / pi) */
    #pragma omp parallel for schedule(static) if (tokens * inter > 8192)
    for (long t = 0; t < tokens; ++t) {
        const float* g = gu + t * 2 * inter;
        const float* up = g + inter;
        float* o = out + t * inter;
        long i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
        const __m256 vb = _mm256_set1_ps(beta), vk = _mm256_set1_ps(kappa), cut = _mm256_set1_ps(0.625f);
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= inter; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            const __m256 u = _mm256_mul_ps(vb, _mm256_add_ps(x, _mm256_mul_ps(vk, cube)));
            const __m256 a = _mm256_andnot_ps(sign, u), z = _mm256_mul_ps(u, u);
            __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(-5.70498872745e-3f), z, _mm256_set1_ps(2.06390887954e-2f));
            p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
            p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
            p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
            const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), u, u);
            __m256 big = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp8(_mm256_add_ps(a, a)), one)));
            big = _mm256_or_ps(big, _mm256_and_ps(sign, u));
            const __m256 th = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, cut, _CMP_LT_OQ));
            const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, th));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < inter; ++i) {
            const float x = g[i];
            const float cube = x * x * x;
            const float u = beta * (x + kappa * cube);
            o[i] = 0.5f * x * (1.0f + tanh_poly(u)) * up[i];
        }
    }
}

/* In place over each of `heads` rows of `dim` floats in each token's row of x
   (row stride ld): x = rms_norm(x) * weight, row_inv_rms's order, the same bits
   as add_rms_norm_f32 on those rows (Qwen3's and Gemma 3's per-head q/k norms). */
void head_rms_norm_f32(float* x, long tokens, long heads, long dim, long ld, const float* weight, float eps) {
    #pragma omp parallel for schedule(static) if (tokens * heads >= 256)
    for (long t = 0; t < tokens; ++t) {
        for (long h = 0; h < heads; ++h) {
            float* r = x + t * ld + h * dim;
            const float inv = row_inv_rms(r, dim, eps);
            #pragma omp simd
            for (long i = 0; i < dim; ++i) r[i] = weight[i] * (r[i] * inv);
        }
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
