#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decoder_types.h"

/* A mixture-of-experts layer on the native kernels (workers/model/moe_native.py): the router's
   GEMM, each token's top-k experts, then every chosen expert once over the tokens that chose it
   (a gather of their rows, gate/up, SiLU, down: one GEMM pair per expert, grouped), and each
   token's outputs added in ascending expert order, as transformers adds them, then the shared
   expert's (Qwen2-MoE) times the sigmoid of its gate:

       out[t] = ((0 + y_e1[t] * w_e1) + y_e2[t] * w_e2) ... + s[t] * sigmoid(g[t])    e1 < e2 < ...

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

/* Rows of each expert below this: the grouped path below (qgemm_f32 switches to its many-rows
   kernel from 16 rows, gemm_f32 from 32; the bits are the same either way, only the speed differs). */
#define GROUPED_ROWS 16

static long groups(const lin_t* w) { return w->kind == 1 ? (w->k + w->group - 1) / w->group : 0; }

/* Whether the grouped path can run lins[0..A): one kind (packed float or quantized, no LoRA), one
   group size, and the panel-range kernels of that kind. */
static int groupable(const fns_t* f, const moe_t* m, const lin_t* const* lins, long A) {
    for (long a = 0; a < A; ++a) {
        const lin_t* w = lins[a];
        if (w->lora || w->kind != lins[0]->kind || w->group != lins[0]->group) return 0;
        if (w->kind == 0 && !(f->gemm_panels && m->gemm_panel_width > 0)) return 0;
        if (w->kind == 1 && !(f->qgemm_panels && f->qgemm_sums && m->panel_width > 0)) return 0;
        if (w->kind > 1) return 0;
    }
    return 1;
}

/* One GEMM of every active expert in one parallel region: work items are (expert, output panel),
   expert-major; x_e / y_e are the experts' row blocks at xoff[a] * ldx / xoff[a] * ldy; xs: the
   rows' group sums (quantized). */
static void grouped_gemm(const fns_t* f, const moe_t* m, const lin_t* const* lins, long A, const long* xoff,
                         const float* x, long ldx, const float* xs, float* y, long ldy) {
    const long nr = lins[0]->kind == 1 ? m->panel_width : m->gemm_panel_width;
    const long P = (lins[0]->n + nr - 1) / nr, G = groups(lins[0]);
    #pragma omp for schedule(static)
    for (long item = 0; item < A * P; ++item) {
        const long a = item / P, p = item % P, n = xoff[a + 1] - xoff[a];
        const lin_t* w = lins[a];
        if (w->kind == 0)
            f->gemm_panels(x + xoff[a] * ldx, n, w->k, ldx, (const float*)w->w, w->n, w->bias, y + xoff[a] * ldy,
                           ldy, p, p + 1);
        else
            f->qgemm_panels(x + xoff[a] * ldx, n, w->k, ldx, xs + xoff[a] * G, (const unsigned char*)w->w,
                            w->scales, w->mins, (int)w->bits, w->group, w->n, w->bias, y + xoff[a] * ldy, ldy,
                            p, p + 1);
    }
}

/* Every chosen expert's gate/up, SiLU and down with 3 barriers instead of a parallel region per
   GEMM (each region's barrier is several microseconds, and a thread descheduled on a shared
   machine holds the others at every one). xoff: the active experts' row blocks, expert-major;
   xs1 / xs2: room for the rows' group sums of gate/up's and down's inputs. */
static void grouped_experts(const fns_t* f, const moe_t* m, const lin_t* const* gl, const lin_t* const* dl,
                            long A, const long* xoff, const float* xg, long hidden, float* gu, float* act,
                            float* y, float* xs1, float* xs2) {
    const long I = m->inter, rows = xoff[A], G1 = groups(gl[0]), G2 = groups(dl[0]);
    for (long a = 0; a < A && G1; ++a)  /* a few rows: cheaper here than a barrier */
        f->qgemm_sums(xg + xoff[a] * hidden, xoff[a + 1] - xoff[a], gl[a]->k, hidden, gl[a]->group,
                      xs1 + xoff[a] * G1);
    #pragma omp parallel
    {
        grouped_gemm(f, m, gl, A, xoff, xg, hidden, xs1, gu, 2 * I);
        #pragma omp for schedule(static)
        for (long r = 0; r < rows; ++r) {
            f->silu(gu + r * 2 * I, act + r * I, 1, I);
            if (G2) f->qgemm_sums(act + r * I, 1, I, I, dl[0]->group, xs2 + r * G2);
        }
        grouped_gemm(f, m, dl, A, xoff, act, I, xs2, y, hidden);
    }
}

/* out += sigmoid(shared_gate(x)) * shared_expert(x), row by row (moe.py's order: the product rounded,
   then added); the sigmoid is 1 / (1 + expf(-g)). */
static void shared_expert(const fns_t* f, const moe_t* m, const float* x, long T, long hidden, float* out) {
    const long I = m->shared_inter;
    float* gu = (float*)malloc(sizeof(float) * (size_t)(T * 2 * I));
    float* act = (float*)malloc(sizeof(float) * (size_t)(T * I));
    float* y = (float*)malloc(sizeof(float) * (size_t)(T * hidden));
    float* g = (float*)malloc(sizeof(float) * (size_t)T);
    linear(f, &m->shared_gate_up, x, T, gu);
    f->silu(gu, act, T, I);
    linear(f, &m->shared_down, act, T, y);
    linear(f, &m->shared_gate, x, T, g);
    for (long t = 0; t < T; ++t) {
        const float s = 1.0f / (1.0f + expf(-g[t]));
        float* o = out + t * hidden;
        const float* yt = y + t * hidden;
        for (long c = 0; c < hidden; ++c) o[c] = o[c] + yt[c] * s;
    }
    free(gu); free(act); free(y); free(g);
}

/* out[T, hidden] = the MoE layer of x[T, hidden] (both contiguous); f supplies gemm / qgemm
   (the experts' and the router's linears) and silu. */
void moe_forward_f32(const fns_t* f, const moe_t* m, const float* x, long T, long hidden, float* out) {
    const long E = m->num_experts, K = m->top_k, I = m->inter;
    float* logits = (float*)malloc(sizeof(float) * (size_t)(T * E));
    float* w = (float*)malloc(sizeof(float) * (size_t)(T * K));
    long* ids = (long*)malloc(sizeof(long) * (size_t)(T * K));
    long* active = (long*)malloc(sizeof(long) * (size_t)E);
    long* xoff = (long*)malloc(sizeof(long) * (size_t)(E + 1));
    long* rows = (long*)malloc(sizeof(long) * (size_t)(T * E));
    float* rw = (float*)malloc(sizeof(float) * (size_t)(T * E));
    linear(f, &m->router, x, T, logits);
    moe_route_f32(logits, T, E, K, m->norm_topk, w, ids);
    long A = 0, most = 0;
    xoff[0] = 0;
    for (long e = 0; e < E; ++e) {  /* each expert's tokens, ascending, with their weights; experts ascending */
        long n = xoff[A];
        for (long t = 0; t < T; ++t) {
            long j = 0;
            while (j < K && ids[t * K + j] != e) ++j;
            if (j < K || m->dense) { rows[n] = t; rw[n] = j < K ? w[t * K + j] : 0.0f; ++n; }
        }
        if (n == xoff[A]) continue;
        most = n - xoff[A] > most ? n - xoff[A] : most;
        active[A++] = e;
        xoff[A] = n;
    }
    const long total = xoff[A];
    const lin_t** gl = (const lin_t**)malloc(sizeof(lin_t*) * (size_t)(A + 1));
    const lin_t** dl = (const lin_t**)malloc(sizeof(lin_t*) * (size_t)(A + 1));
    for (long a = 0; a < A; ++a) { gl[a] = &m->gate_up[active[a]]; dl[a] = &m->down[active[a]]; }
    const int grouped = A > 0 && most < GROUPED_ROWS && groupable(f, m, gl, A) && groupable(f, m, dl, A);
    float* xg = (float*)malloc(sizeof(float) * (size_t)(total * hidden));
    float* gu = (float*)malloc(sizeof(float) * (size_t)(total * 2 * I));
    float* act = (float*)malloc(sizeof(float) * (size_t)(total * I));
    float* y = (float*)malloc(sizeof(float) * (size_t)(total * hidden));
    for (long r = 0; r < total; ++r) memcpy(xg + r * hidden, x + rows[r] * hidden, sizeof(float) * (size_t)hidden);
    if (grouped) {
        float* xs1 = (float*)malloc(sizeof(float) * (size_t)(total * groups(gl[0]) + 1));
        float* xs2 = (float*)malloc(sizeof(float) * (size_t)(total * groups(dl[0]) + 1));
        grouped_experts(f, m, gl, dl, A, xoff, xg, hidden, gu, act, y, xs1, xs2);
        free(xs1); free(xs2);
    } else {
        for (long a = 0; a < A; ++a) {  /* one GEMM pair per expert, each threaded on its own */
            const long r0 = xoff[a], n = xoff[a + 1] - r0;
            linear(f, &m->gate_up[active[a]], xg + r0 * hidden, n, gu + r0 * 2 * I);
            f->silu(gu + r0 * 2 * I, act + r0 * I, n, I);
            linear(f, &m->down[active[a]], act + r0 * I, n, y + r0 * hidden);
        }
    }
    memset(out, 0, sizeof(float) * (size_t)(T * hidden));
    for (long r = 0; r < total; ++r) {  /* expert-major: each token's experts in ascending order */
        float* o = out + rows[r] * hidden;
        const float* yr = y + r * hidden;
        const float wr = rw[r];
        for (long c = 0; c < hidden; ++c) o[c] = o[c] + yr[c] * wr;
    }
    free(logits); free(w); free(ids); free(active); free(xoff); free(rows); free(rw);
    free(xg); free(gu); free(act); free(y); free(gl); free(dl);
    if (m->shared_inter > 0) shared_expert(f, m, x, T, hidden, out);
}
