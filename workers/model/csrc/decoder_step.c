#include <stddef.h>

#include "decoder_types.h"

/* moe: NULL for a dense layer (gate_up, silu, down), else the layer's experts (f->moe runs them) */
typedef struct { const float* norm1; const float* norm2; lin_t qkv, o, gate_up, down;
                 void* k_cache; void* v_cache; long window; float eps; float scale; const moe_t* moe; } layer_t;

/* Every layer of a decode-only step, in NativeDecoder.forward's order: residual
   [T, hidden] holds the embeddings and is the residual stream; out receives
   the final norm. scratch: T * (3 hidden + qkv + heads * dim + 3 inter) floats, inter the widest
   dense layer's (0 when every layer is MoE: the MoE layer allocates its own). */
void decoder_decode(const fns_t* f, const layer_t* layers, long num_layers, long T, long hidden,
                    long hq, long hkv, long d, float* residual, float* out, const float* final_norm,
                    float final_eps, const float* cos, const float* sin, const long* slots, const int* tables,
                    long width, const int* lens, long num_reqs, long block_size, float* scratch,
                    const int* tail_lo, const long* tail_slots, long tail_width) {
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
        linear(f, &L->qkv, h, T, qkv);
        f->rotary(qkv, T, hq + hkv, d, nqkv, cos, sin);
        f->decode(qkv, nqkv, qkv + hq * d, nqkv, qkv + (hq + hkv) * d, nqkv, slots, L->k_cache, L->v_cache,
                  tables, (int)width, lens, (int)num_reqs, (int)hq, (int)hkv, (int)d, (int)block_size,
                  L->scale, (int)L->window, attn, hq * d, tail_lo, tail_slots, (int)tail_width);
        linear(f, &L->o, attn, T, o);
        f->norm(o, residual, L->norm2, h, T, hidden, L->eps);
        if (L->moe) {
            f->moe(f, L->moe, h, T, hidden, down);
        } else {
            linear(f, &L->gate_up, h, T, gu);
            f->silu(gu, act, T, L->down.k);
            linear(f, &L->down, act, T, down);
        }
    }
    f->norm(down, residual, final_norm, out, T, hidden, final_eps);
}
