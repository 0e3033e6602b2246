/* exp(x) of one vector of floats: the Cephes polynomial, instruction for
   instruction the scalar exp_poly of cpu_ops.c, so a lane and the scalar tail
   agree bit for bit. DEFINE_EXP(name, W, round) defines
   `static inline __mW name(__mW x)` for W = 256 (AVX2 + FMA, round =
   _mm256_round_ps: exp8_avx2.h) or W = 512 (AVX-512F, round =
   _mm512_roundscale_ps: exp16_avx512.h). */
#ifndef PREFIXSERVE_EXP_VEC_H
#define PREFIXSERVE_EXP_VEC_H
#define DEFINE_EXP(name, W, round)                                                                  \
static inline __m##W name(__m##W x) {                                                               \
    x = _mm##W##_max_ps(_mm##W##_min_ps(x, _mm##W##_set1_ps(88.0f)), _mm##W##_set1_ps(-87.0f));    \
    const __m##W n = round(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504088896341f)),              \
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                           \
    __m##W r = _mm##W##_fmadd_ps(n, _mm##W##_set1_ps(-0.693359375f), x);                            \
    r = _mm##W##_fmadd_ps(n, _mm##W##_set1_ps(2.12194440e-4f), r);                                  \
    __m##W p = _mm##W##_set1_ps(1.9875691500e-4f);                                                  \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.3981999507e-3f));                                \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(8.3334519073e-3f));                                \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(4.1665795894e-2f));                                \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.6666665459e-1f));                                \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(5.0000001201e-1f));                                \
    p = _mm##W##_add_ps(_mm##W##_fmadd_ps(p, _mm##W##_mul_ps(r, r), r), _mm##W##_set1_ps(1.0f));    \
    const __m##W##i e = _mm##W##_slli_epi32(                                                        \
        _mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127)), 23);                 \
    return _mm##W##_mul_ps(p, _mm##W##_castsi##W##_ps(e));                                          \
}
#endif
