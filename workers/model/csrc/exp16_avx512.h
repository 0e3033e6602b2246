/* exp(x) of sixteen floats with AVX-512F: exp8_avx2.h on 512-bit vectors (the
   same polynomial, the same instructions: exp_vec.h); for paged_prefill.c,
   which includes it inside its own AVX-512 guard. */
#include "exp_vec.h"
DEFINE_EXP(exp16, 512, _mm512_roundscale_ps)
