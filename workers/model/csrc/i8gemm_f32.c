
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
