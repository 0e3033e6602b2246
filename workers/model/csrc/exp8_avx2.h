/* exp(x) of eight floats with AVX2 (SiLU in cpu_ops.c, the softmax of
   paged_decode.c); exp_vec.h has the function, exp16_avx512.h its 512-bit twin. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "exp_vec.h"
DEFINE_EXP(exp8, 256, _mm256_round_ps)
#endif
