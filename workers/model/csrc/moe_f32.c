#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decoder_types.h"

/* A mixture-of-experts layer on the native kernels (workers/model/moe_native.py): the router's
   GEMM, each token's top-k experts, then every chosen expert once over the tokens that chose it
   (a gather of their rows, gate/up, SiLU, down: one GEMM pair per expert, grouped), and each
   token's outputs added in ascending expert order, as transformers adds them:

       out[t] = ((0 + y_e1[t] * w_e1) + y_e2[t] * w_e2) ...    e1 < e2 < ...

   Built with -ffp-contract=off: y * w is rounded before it is added, as torch's two ops
   round it, so moe.py's torch loop (on the weights moe_route_f32 gives) has the same bits.
   Each token's routing and each expert's rows (qgemm / gemm) are computed on their own: a
   token's output does not depend on its batch-mates. */

/* Each row of logits [T, E]: softmax in float32, the k largest probabilities (largest first;
   equal ones: the lower expert id first, as a stable sort), divided by their sum when norm. */
void moe_route_f32(const float* logits, long T, long E, long k, long norm, float* weights, long* ids) {
    float* p = (float*)malloc(sizeof(float) * (size_t)E);
    for (long t = 0; t < T; ++t) {
        const float* l = logits + t * E;
        float top = l[0], sum = 0.0f;
        for (long e = 1; e < E; ++e) top = l[e] > top ? l[e] : top;
        for (long e = 0; e < E; ++e) { p[e] = expf(l[e] - top); sum += p[e]; }
        for (long e = 0; e < E; ++e) p[e] = p[e] / sum;
        float* w = weights + t * k;
        long* id = ids + t * k;
        float chosen = 0.0f;
        for (long j = 0; j < k; ++j) {
            long best = -1;
            for (long e = 0; e < E; ++e) {
                int taken = 0;
                for (long i = 0; i < j; ++i) taken |= id[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            id[j] = best;
            w[j] = p[best];
            chosen += w[j];
        }
        if (norm)
            for (long j = 0; j < k; ++j) w[j] = w[j] / chosen;
    }
    free(p);
}

/* out[T, hidden] = the MoE layer of x[T, hidden] (both contiguous); f supplies gemm / qgemm
   (the experts' and the router's linears) and silu. */
void moe_forward_f32(const fns_t* f, const moe_t* m, const float* x, long T, long hidden, float* out) {
    const long E = m->num_experts, K = m->top_k, I = m->inter;
    float* logits = (float*)malloc(sizeof(float) * (size_t)(T * E));
    float* w = (float*)malloc(sizeof(float) * (size_t)(T * K));
    long* ids = (long*)malloc(sizeof(long) * (size_t)(T * K));
    long* rows = (long*)malloc(sizeof(long) * (size_t)T);
    float* rw = (float*)malloc(sizeof(float) * (size_t)T);
    float* xg = (float*)malloc(sizeof(float) * (size_t)(T * hidden));
    float* gu = (float*)malloc(sizeof(float) * (size_t)(T * 2 * I));
    float* act = (float*)malloc(sizeof(float) * (size_t)(T * I));
    float* y = (float*)malloc(sizeof(float) * (size_t)(T * hidden));
    linear(f, &m->router, x, T, logits);
    moe_route_f32(logits, T, E, K, m->norm_topk, w, ids);
    memset(out, 0, sizeof(float) * (size_t)(T * hidden));
    for (long e = 0; e < E; ++e) {
        long n = 0;
        for (long t = 0; t < T; ++t) {  /* the tokens that chose e, ascending, with their weights */
            long j = 0;
            while (j < K && ids[t * K + j] != e) ++j;
            if (j < K || m->dense) { rows[n] = t; rw[n] = j < K ? w[t * K + j] : 0.0f; ++n; }
        }
        if (!n) continue;
        const float* src = x;
        if (n == 1) src = x + rows[0] * hidden;  /* one row: read it in place */
        else if (n < T)
            for (long r = 0; r < n; ++r) memcpy(xg + r * hidden, x + rows[r] * hidden, sizeof(float) * (size_t)hidden);
        if (n > 1 && n < T) src = xg;
        linear(f, &m->gate_up[e], src, n, gu);
        f->silu(gu, act, n, I);
        linear(f, &m->down[e], act, n, y);
        for (long r = 0; r < n; ++r) {
            float* o = out + rows[r] * hidden;
            const float* yr = y + r * hidden;
            const float wr = rw[r];
            for (long c = 0; c < hidden; ++c) o[c] = o[c] + yr[c] * wr;
        }
    }
    free(logits); free(w); free(ids); free(rows); free(rw); free(xg); free(gu); free(act); free(y);
}
