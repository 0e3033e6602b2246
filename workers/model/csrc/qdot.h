/* Integer-activation GEMM over group-quantized weights (qdot.py): included by qgemm_f32.c, whose
   qgemm_f32 runs it when bits has QDOT_FLAG set. Groups of QB = 32 inputs; per row and group
   the activations are quantized to int8 at run time (dx = max|x| / 127, xq = round(x / dx)),
   the group's integer dot products sum exactly in int32, and then

       y[r, c] = sum over groups g, in order:  (scale[g][c] * dx[r][g]) * isum[r][g][c]
                                             + min[g][c] * xs[r][g]        (xs: the group's float sum of x)

   isum is exact whatever the order of its products, and the float part runs per row in the same
   order whatever the batch: batch-invariant. Panel layouts (NR columns, qgemm_f32.c's):

       4-bit  bytes [K / 8][NR][4]: byte t of (j, c) holds q[8j + t][c] (low nibble) and
              q[8j + 4 + t][c] (high nibble): a 32-bit lane gives 4 inputs of one column twice
       8-bit  int8  [K / 4][NR][4] (four consecutive inputs of a column per lane), -127..127

   Products: AVX-512 VNNI vpdpbusd (u8 x s8); AVX-512BW or AVX2 vpmaddubsw + vpmaddwd (no
   saturation: 15 * 127 * 2 and 127 * 127 * 2 < 2^15). 8-bit weights are signed, so the unsigned
   operand is |xq| and the weights take xq's sign. */
#define QDOT_FLAG 64
#define QDOT_HALF 128  /* with QDOT_FLAG: scales and mins are half floats (GGUF's own, exact in float32) */
#define QB 32

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QDOT_OK 1
#define QMR 4
typedef __m512i qivec;
#define QI_ZERO() _mm512_setzero_si512()
#define QI_LOAD(p) _mm512_loadu_si512((const void*)(p))
#define QI_ADD(a, b) _mm512_add_epi32(a, b)
#define QI_LOW4(b) _mm512_and_si512(b, _mm512_set1_epi8(0x0F))
#define QI_HIGH4(b) _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(0x0F))
#define QI_BCAST(v) _mm512_set1_epi32(v)
#define QI_SIGNED(w, x) _mm512_mask_sub_epi8(w, _mm512_movepi8_mask(x), _mm512_setzero_si512(), w)
#define QI_ABS(x) _mm512_abs_epi8(x)
#define QI_TOF(v) _mm512_cvtepi32_ps(v)
#if defined(__AVX512VNNI__)
#define QI_DOT(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#else
#define QI_DOT(acc, u, s) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
#endif
#elif defined(__AVX512F__)
#define QDOT_OK 0  /* AVX-512F without BW: no byte operations at this width; the exact path serves */
#elif defined(__AVX2__)
#define QDOT_OK 1
#define QMR 2
typedef __m256i qivec;
#define QI_ZERO() _mm256_setzero_si256()
#define QI_LOAD(p) _mm256_loadu_si256((const __m256i*)(p))
#define QI_ADD(a, b) _mm256_add_epi32(a, b)
#define QI_LOW4(b) _mm256_and_si256(b, _mm256_set1_epi8(0x0F))
#define QI_HIGH4(b) _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F))
#define QI_BCAST(v) _mm256_set1_epi32(v)
#define QI_SIGNED(w, x) _mm256_sign_epi8(w, x)
#define QI_ABS(x) _mm256_sign_epi8(x, x)
#define QI_TOF(v) _mm256_cvtepi32_ps(v)
#define QI_DOT(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif

int qdot_available(void) { return QDOT_OK; }

#if QDOT_OK
static inline int load4(const signed char* p) { int v; memcpy(&v, p, 4); return v; }

#if defined(__AVX512F__)
#define HLOAD(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))
#elif defined(__F16C__)
#define HLOAD(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
#else  /* AVX2 without F16C: the same exact conversion, in C */
static inline float half_to_float(unsigned short h) {
    const unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (e == 0) { const float f = ldexpf((float)man, -24); return sign ? -f : f; }
    const unsigned bits = sign | (e == 31 ? 0x7f800000u : (e + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline vec hload_soft(const unsigned short* p) {
    float t[VL];
    for (int i = 0; i < VL; ++i) t[i] = half_to_float(p[i]);
    return VLOAD(t);
}
#define HLOAD(p) hload_soft(p)
#endif
/* VL scales (or mins) from i: float32, or half floats where half */
static inline vec qd_load(const float* p, long i, int half) {
    return half ? HLOAD((const unsigned short*)(const void*)p + i) : VLOAD(p + i);
}

/* R rows of quantized x (K bytes each; dx, xs [R][G]) against one panel: four integer sums per
   row and group (two column halves x two interleaved chains), added exactly, then the float part. */
#define QDKR(R)                                                                                     \
static void qdkr_##R(const signed char* xq, long K, const float* dx, const float* xs, long G,      \
                     const unsigned char* q, const float* sc, const float* mn, int bits, int half, \
                     float* y, long ldy, int nvalid, const float* bias) {                          \
    vec acc[R][2];                                                                                  \
    for (int r = 0; r < R; ++r) { acc[r][0] = VZERO(); acc[r][1] = VZERO(); }                       \
    for (long g = 0; g < G; ++g) {                                                                  \
        qivec s[R][4];                                                                              \
        for (int r = 0; r < R; ++r) for (int i = 0; i < 4; ++i) s[r][i] = QI_ZERO();                \
        if (bits == 4) {                                                                            \
            const unsigned char* qp = q + g * (QB / 8) * NR * 4;                                    \
            for (int j = 0; j < QB / 8; ++j) {                                                      \
                const qivec b0 = QI_LOAD(qp + j * NR * 4), b1 = QI_LOAD(qp + j * NR * 4 + VL * 4);  \
                const qivec l0 = QI_LOW4(b0), h0 = QI_HIGH4(b0), l1 = QI_LOW4(b1), h1 = QI_HIGH4(b1); \
                for (int r = 0; r < R; ++r) {                                                       \
                    const signed char* xr = xq + r * K + g * QB + 8 * j;                            \
                    const qivec xa = QI_BCAST(load4(xr)), xb = QI_BCAST(load4(xr + 4));             \
                    s[r][0] = QI_DOT(s[r][0], l0, xa); s[r][1] = QI_DOT(s[r][1], l1, xa);           \
                    s[r][2] = QI_DOT(s[r][2], h0, xb); s[r][3] = QI_DOT(s[r][3], h1, xb);           \
                }                                                                                   \
            }                                                                                       \
        } else {                                                                                    \
            const unsigned char* qp = q + g * (QB / 4) * NR * 4;                                    \
            for (int j = 0; j < QB / 4; ++j) {                                                      \
                const qivec w0 = QI_LOAD(qp + j * NR * 4), w1 = QI_LOAD(qp + j * NR * 4 + VL * 4);  \
                const int h = 2 * (j & 1);                                                          \
                for (int r = 0; r < R; ++r) {                                                       \
                    const qivec xa = QI_BCAST(load4(xq + r * K + g * QB + 4 * j)), ax = QI_ABS(xa); \
                    s[r][h] = QI_DOT(s[r][h], ax, QI_SIGNED(w0, xa));                               \
                    s[r][h + 1] = QI_DOT(s[r][h + 1], ax, QI_SIGNED(w1, xa));                       \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        const vec s0 = qd_load(sc, g * NR, half), s1 = qd_load(sc, g * NR + VL, half);              \
        for (int r = 0; r < R; ++r) {                                                               \
            const vec d = VSET1(dx[r * G + g]);                                                     \
            const vec i0 = QI_TOF(QI_ADD(s[r][0], s[r][2])), i1 = QI_TOF(QI_ADD(s[r][1], s[r][3])); \
            acc[r][0] = VFMA(VMUL(s0, d), i0, acc[r][0]); acc[r][1] = VFMA(VMUL(s1, d), i1, acc[r][1]); \
        }                                                                                           \
        if (mn) {                                                                                   \
            const vec m0 = qd_load(mn, g * NR, half), m1 = qd_load(mn, g * NR + VL, half);          \
            for (int r = 0; r < R; ++r) {                                                           \
                const vec xsum = VSET1(xs[r * G + g]);                                              \
                acc[r][0] = VFMA(m0, xsum, acc[r][0]); acc[r][1] = VFMA(m1, xsum, acc[r][1]);       \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    for (int r = 0; r < R; ++r) {                                                                   \
        vec a0 = acc[r][0], a1 = acc[r][1];                                                         \
        if (bias) { a0 = VADD(a0, VLOAD(bias)); a1 = VADD(a1, VLOAD(bias + VL)); }                  \
        if (nvalid == NR) {                                                                         \
            VSTORE(y + r * ldy, a0); VSTORE(y + r * ldy + VL, a1);                                  \
        } else {                                                                                    \
            float tmp[NR];                                                                          \
            VSTORE(tmp, a0); VSTORE(tmp + VL, a1);                                                  \
            memcpy(y + r * ldy, tmp, sizeof(float) * nvalid);                                       \
        }                                                                                           \
    }                                                                                               \
}

QDKR(1) QDKR(2)
#if QMR > 2
QDKR(3) QDKR(4)
#endif

typedef void (*qdkr_fn)(const signed char*, long, const float*, const float*, long, const unsigned char*,
                        const float*, const float*, int, int, float*, long, int, const float*);
static const qdkr_fn QDKRS[QMR + 1] = {
    0, qdkr_1, qdkr_2,
#if QMR > 2
    qdkr_3, qdkr_4,
#endif
};

/* Row x (K inputs, K % QB == 0) per group: dx = max|x| / 127, xq = round(x / dx), xs = sum of x (in order). */
static void qdot_quantize_row(const float* x, long K, signed char* xq, float* dx, float* xs) {
    for (long g = 0; g < K / QB; ++g) {
        const float* xg = x + g * QB;
        float amax = 0.0f, sum = 0.0f;
        for (int k = 0; k < QB; ++k) { const float a = fabsf(xg[k]); amax = a > amax ? a : amax; }
        for (int k = 0; k < QB; ++k) sum += xg[k];
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int k = 0; k < QB; ++k) xq[g * QB + k] = (signed char)(int)nearbyintf(xg[k] * inv);
        dx[g] = amax / 127.0f;
        xs[g] = sum;
    }
}

/* qgemm_f32 with QDOT_FLAG: K % QB == 0, groups of QB; q in the layouts above. */
static void qdot_gemm(const float* x, long M, long K, long ldx, const unsigned char* q, const float* scales,
                      const float* mins, int bits, int half, long N, const float* bias, float* y, long ldy) {
    const long P = (N + NR - 1) / NR, G = K / QB;
    const long qbytes = K * bits / 8 * NR;
    signed char* xq = (signed char*)malloc((size_t)(M * K + 64));
    float* dx = (float*)malloc(sizeof(float) * (size_t)(2 * M * G + 1));
    float* xs = dx + M * G;
    const int parallel = (double)M * (double)N * (double)K > 262144.0;
    #pragma omp parallel if (parallel)
    {
        #pragma omp for schedule(static)
        for (long m = 0; m < M; ++m) qdot_quantize_row(x + m * ldx, K, xq + m * K, dx + m * G, xs + m * G);
        #pragma omp for schedule(static)
        for (long p = 0; p < P; ++p) {
            const int nvalid = (N - p * NR) < NR ? (int)(N - p * NR) : NR;
            for (long m = 0; m < M; m += QMR) {
                const int rows = (M - m) < QMR ? (int)(M - m) : QMR;
                /* half: the same element offsets, counted in halves (qd_load) */
                const long so = half ? p * G * NR / 2 : p * G * NR;
                QDKRS[rows](xq + m * K, K, dx + m * G, xs + m * G, G, q + p * qbytes, scales + so,
                            mins ? mins + so : 0, bits, half, y + m * ldy + p * NR, ldy, nvalid,
                            bias ? bias + p * NR : 0);
            }
        }
    }
    free(xq);
    free(dx);
}
#else
static void qdot_gemm(const float* x, long M, long K, long ldx, const unsigned char* q, const float* scales,
                      const float* mins, int bits, int half, long N, const float* bias, float* y, long ldy) {
    (void)x; (void)M; (void)K; (void)ldx; (void)q; (void)scales; (void)mins; (void)bits; (void)half; (void)N;
    (void)bias;
    (void)y; (void)ldy;  /* never called: qdot_available() is 0 and the weights refuse the layout */
}
#endif
