/* Many rows (prefill, large decode batches) of qgemm_f32 (included by qgemm_f32.c): the same
   operations in the same order as its few-rows kernel qukr, so the same bits, arranged as the
   float32 GEMM (gemm_f32.c) arranges its large-M path:

   1. x is packed in strips of FR rows, [K][FR] (row r's value at k is xp[k * FR + r]; rows past
      M are zeros, computed and never stored), so the FR broadcasts of a step come from one
      cache line and one stream, and a strip's group sums are FR in-order sums side by side
      (xs [G][FR]: the compiler may vectorize across rows; each row's sum stays a sequential
      float sum from zero, the bits of qgemm_group_sums). Packing and sums run on every thread.
   2. Each task, a panel, decodes its q to floats once (exact small integers, K x NR floats in
      L2) and runs every strip on them: per group an FMA chain from zero over the group's
      inputs, then the group's scale, then its min, the running sums waiting in acc (L1)
      between groups so that the registers hold FR rows of group sums.

   Measured against the previous arrangement (rows read in place, sums on one thread):
   docs/QUANTIZATION.md, "Prefill". */
#define FR (2 * MRQ)
#ifndef QPF
#define QPF 32  /* software prefetch distance of the decoded panel, in k steps (gemm_f32.c's PF) */
#endif

/* A panel's q as exact small-integer floats, [K][NR] (4- and 5-bit: inputs 2kk and
   2kk + 1 from byte row kk, as the microkernel reads them). */
static void decode_panel(const unsigned char* q, int bits, long K, float* wf) {
    if (bits == 4) {
        for (long kk = 0; kk < K / 2; ++kk) {
            vec l0, l1, h0, h1;
            LOAD_U4(q + kk * NR, l0, l1, h0, h1);
            VSTORE(wf + (2 * kk) * NR, l0); VSTORE(wf + (2 * kk) * NR + VL, l1);
            VSTORE(wf + (2 * kk + 1) * NR, h0); VSTORE(wf + (2 * kk + 1) * NR + VL, h1);
        }
    } else if (bits == 5) {
        for (long kk = 0; kk < K / 2; ++kk) {
            vec l0, l1, h0, h1;
            LOAD_U5(q + kk * NR, q + (K / 2 + kk / 4) * NR, 2 * (kk % 4), l0, l1, h0, h1);
            VSTORE(wf + (2 * kk) * NR, l0); VSTORE(wf + (2 * kk) * NR + VL, l1);
            VSTORE(wf + (2 * kk + 1) * NR, h0); VSTORE(wf + (2 * kk + 1) * NR + VL, h1);
        }
    } else {
        for (long k = 0; k < K; ++k) {
            vec w0, w1;
            LOAD_S8((const signed char*)q + k * NR, w0, w1);
            VSTORE(wf + k * NR, w0); VSTORE(wf + k * NR + VL, w1);
        }
    }
}

/* Strip s of x packed ([K][FR], zeros past M) and its group sums xs [G][FR]. */
static void pack_strip(const float* x, long M, long K, long ldx, long gs, long s, float* xp, float* xs) {
    const long m0 = s * FR;
    const int rows = M - m0 < FR ? (int)(M - m0) : FR;
    const float* xr[FR];  /* rows past M read row m0 (any finite row) and are then zeroed */
    for (int r = 0; r < FR; ++r) xr[r] = x + (m0 + (r < rows ? r : 0)) * ldx;
    for (long k = 0; k < K; ++k)
        for (int r = 0; r < FR; ++r) xp[k * FR + r] = xr[r][k];
    if (rows < FR)
        for (long k = 0; k < K; ++k)
            for (int r = rows; r < FR; ++r) xp[k * FR + r] = 0.0f;
    const long G = (K + gs - 1) / gs;
    for (long g = 0; g < G; ++g) {
        float sum[FR];
        for (int r = 0; r < FR; ++r) sum[r] = 0.0f;
        const long end = (g + 1) * gs < K ? (g + 1) * gs : K;
        for (long k = g * gs; k < end; ++k)
            for (int r = 0; r < FR; ++r) sum[r] += xp[k * FR + r];
        for (int r = 0; r < FR; ++r) xs[g * FR + r] = sum[r];
    }
}

/* FR packed rows against a decoded panel wf; the first R rows are stored. */
static void fukr_packed(const float* xp, const float* xs, long G, const float* wf, const float* sc,
                        const float* mn, int bits, long K, long gs, float* y, long ldy, int R, int nvalid,
                        const float* bias) {
    float acc[FR][NR] __attribute__((aligned(64)));
    for (long g = 0; g < G; ++g) {
        const long k0 = g * gs;
        const long len = k0 + gs <= K ? gs : K - k0;
        const long k1 = k0 + (bits == 8 ? len : (len / 2) * 2);
        vec ga[FR][2];
        for (int r = 0; r < FR; ++r) { ga[r][0] = VZERO(); ga[r][1] = VZERO(); }
        for (long k = k0; k < k1; ++k) {
            _mm_prefetch((const char*)(wf + (k + QPF) * NR), _MM_HINT_T0);  /* the panel is in L2 */
            _mm_prefetch((const char*)(wf + (k + QPF) * NR + 16), _MM_HINT_T0);
            const vec w0 = VLOAD(wf + k * NR), w1 = VLOAD(wf + k * NR + VL);
            for (int r = 0; r < FR; ++r) {
                const vec xa = VSET1(xp[k * FR + r]);
                ga[r][0] = VFMA(w0, xa, ga[r][0]); ga[r][1] = VFMA(w1, xa, ga[r][1]);
            }
        }
        const vec s0 = VLOAD(sc + g * NR), s1 = VLOAD(sc + g * NR + VL);
        for (int r = 0; r < FR; ++r) {
            vec a0 = g ? VLOAD(acc[r]) : VZERO(), a1 = g ? VLOAD(acc[r] + VL) : VZERO();
            a0 = VFMA(s0, ga[r][0], a0); a1 = VFMA(s1, ga[r][1], a1);
            if (mn) {
                const vec xsum = VSET1(xs[g * FR + r]);
                a0 = VFMA(VLOAD(mn + g * NR), xsum, a0); a1 = VFMA(VLOAD(mn + g * NR + VL), xsum, a1);
            }
            VSTORE(acc[r], a0); VSTORE(acc[r] + VL, a1);
        }
    }
    for (int r = 0; r < R; ++r) {
        vec a0 = VLOAD(acc[r]), a1 = VLOAD(acc[r] + VL);
        if (bias) { a0 = VADD(a0, VLOAD(bias)); a1 = VADD(a1, VLOAD(bias + VL)); }
        if (nvalid == NR) {
            VSTORE(y + r * ldy, a0); VSTORE(y + r * ldy + VL, a1);
        } else {
            float tmp[NR];
            VSTORE(tmp, a0); VSTORE(tmp + VL, a1);
            memcpy(y + r * ldy, tmp, sizeof(float) * nvalid);
        }
    }
}

/* qgemm_f32 for M >= DECODE_ROWS (its arguments). */
static void qgemm_prefill(const float* x, long M, long K, long ldx, const unsigned char* q, const float* scales,
                          const float* mins, int bits, long gs, long N, const float* bias, float* y, long ldy,
                          int parallel) {
    const long P = (N + NR - 1) / NR;
    const long G = (K + gs - 1) / gs;
    const long qbytes = K * bits / 8 * NR;
    const long strips = (M + FR - 1) / FR;
    float* xp = (float*)aligned_alloc(64, sizeof(float) * (strips * (K + G) * FR + 16));
    float* xsp = xp + strips * K * FR;
    #pragma omp parallel if (parallel)
    {
        #pragma omp for schedule(static)
        for (long s = 0; s < strips; ++s) pack_strip(x, M, K, ldx, gs, s, xp + s * K * FR, xsp + s * G * FR);
        float* wf = (float*)aligned_alloc(64, sizeof(float) * (K + 1) * NR);
        #pragma omp for schedule(dynamic, 1)
        for (long p = 0; p < P; ++p) {
            const int nvalid = (N - p * NR) < NR ? (int)(N - p * NR) : NR;
            const float* b = bias ? bias + p * NR : 0;
            decode_panel(q + p * qbytes, bits, K, wf);
            for (long s = 0; s < strips; ++s) {
                const int rows = (M - s * FR) < FR ? (int)(M - s * FR) : FR;
                fukr_packed(xp + s * K * FR, xsp + s * G * FR, G, wf, scales + p * G * NR,
                            mins ? mins + p * G * NR : 0, bits, K, gs, y + s * FR * ldy + p * NR, ldy, rows,
                            nvalid, b);
            }
        }
        free(wf);
    }
    free(xp);
}
