#include <stddef.h>
#include <string.h>

#include "decoder_types.h"

/* moe: NULL for a dense layer (gate_up, silu or gelu, down), else the layer's experts (f->moe runs them).
   q_norm / k_norm: NULL, or an RMSNorm over each query / key head before the rotation (Qwen3, Gemma 3).
   norm3 / norm4: NULL for Llama's layout (norm2 is the MLP's input norm), else Gemma's: norm2 normalizes
   the attention output, norm3 is the MLP's input norm and norm4 normalizes the MLP's output.
   local: the layer rotates with the second RoPE table (Gemma 3's sliding-window layers).
   cap: the attention scores' soft cap (Gemma 2; 0: none). */
typedef struct { const float* norm1; const float* norm2; lin_t qkv, o, gate_up, down;
                 void* k_cache; void* v_cache; long window; float eps; float scale; const moe_t* moe;
                 const float* q_norm; const float* k_norm; const float* norm3; const float* norm4;
                 long gelu; long local; float qk_eps; float cap; } layer_t;

/* Every layer of a decode-only step, in NativeDecoder.forward's order: residual
   [T, hidden] holds the embeddings and is the residual stream; out receives
   the final norm. scratch: T * (3 hidden + qkv + heads * dim + 3 inter) floats, inter the widest
   dense layer's (0 when every layer is MoE: the MoE layer allocates its own). cos_local / sin_local:
   the local layers' table (the same pointers as cos / sin where there is one table).
   cap_layers / num_cap / cap_out: EAGLE-3's features (workers/spec_eagle3.py): the residual stream entering
   layer cap_layers[j] (the embeddings for layer 0) is copied to cap_out + j * T * hidden; num_cap 0: none. */
void decoder_decode(const fns_t* f, const layer_t* layers, long num_layers, long T, long hidden,
                    long hq, long hkv, long d, float* residual, float* out, const float* final_norm,
                    float final_eps, const float* cos, const float* sin, const float* cos_local,
                    const float* sin_local, const long* slots, const int* tables,
                    long width, const int* lens, long num_reqs, long block_size, float* scratch,
                    const int* tail_lo, const long* tail_slots, long tail_width,
                    const long* cap_layers, long num_cap, float* cap_out) {
    const long nqkv = layers[0].qkv.n;
    long inter = 0;
    for (long i = 0; i < num_layers; ++i) if (!layers[i].moe && layers[i].down.k > inter) inter = layers[i].down.k;
    float* h = scratch;
    float* qkv = h + T * hidden;
    float* attn = qkv + T * nqkv;
    float* o = attn + T * hq * d;
    float* gu = o + T * hidden;
    float* act = gu + T * 2 * inter;
    float* down = act + T * inter;
    f->norm(NULL, residual, layers[0].norm1, h, T, hidden, layers[0].eps);
    for (long i = 0; i < num_layers; ++i) {
        const layer_t* L = layers + i;
        if (i) f->norm(down, residual, L->norm1, h, T, hidden, L->eps);
        for (long j = 0; j < num_cap; ++j)  /* residual now holds the stream entering layer i */
            if (cap_layers[j] == i) memcpy(cap_out + j * T * hidden, residual, sizeof(float) * T * hidden);
        linear(f, &L->qkv, h, T, qkv);
        if (L->q_norm) {  /* in place, before the rotation */
            f->head_norm(qkv, T, hq, d, nqkv, L->q_norm, L->qk_eps);
            f->head_norm(qkv + hq * d, T, hkv, d, nqkv, L->k_norm, L->qk_eps);
        }
        f->rotary(qkv, T, hq + hkv, d, nqkv, L->local ? cos_local : cos, L->local ? sin_local : sin);
        f->decode(qkv, nqkv, qkv + hq * d, nqkv, qkv + (hq + hkv) * d, nqkv, slots, L->k_cache, L->v_cache,
                  tables, (int)width, lens, (int)num_reqs, (int)hq, (int)hkv, (int)d, (int)block_size,
                  L->scale, (int)L->window, attn, hq * d, tail_lo, tail_slots, (int)tail_width, L->cap);
        linear(f, &L->o, attn, T, o);
        if (L->norm3) {  /* Gemma: residual += norm2(o); h = norm3(residual) */
            f->norm(NULL, o, L->norm2, o, T, hidden, L->eps);
            f->norm(o, residual, L->norm3, h, T, hidden, L->eps);
        } else {
            f->norm(o, residual, L->norm2, h, T, hidden, L->eps);
        }
        if (L->moe) {
            f->moe(f, L->moe, h, T, hidden, down);
        } else {
            linear(f, &L->gate_up, h, T, gu);
            (L->gelu ? f->gelu : f->silu)(gu, act, T, L->down.k);
            linear(f, &L->down, act, T, down);
        }
        if (L->norm4) f->norm(NULL, down, L->norm4, down, T, hidden, L->eps);  /* in place, row by row */
    }
    f->norm(down, residual, final_norm, out, T, hidden, final_eps);
}
