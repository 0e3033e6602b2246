
#include <stddef.h>

typedef void (*gemm_fn)(const float*, long, long, long, const float*, long, const float*, float*, long);
typedef void (*qgemm_fn)(const float*, long, long, long, const unsigned char*, const float*, const float*, int,
                         long, long, const float*, float*, long);
typedef void (*norm_fn)(const float*, float*, const float*, float*, long, long, float);
typedef void (*rotary_fn)(float*, long, long, long, long, const float*, const float*);
typedef void (*silu_fn)(const float*, float*, long, long);
typedef void (*decode_fn)(const float*, long, const float*, long, const float*, long, const long*, void*, void*,
                          const int*, int, const int*, int, int, int, int, int, float, int, float*, long,
                          const int*, const long*, int);
typedef void (*i8gemm_fn)(const float*, long, long, long, const signed char*, const float*, const int*, long,
                          const float*, float*, long);

/* LoRA (workers/model/lora_kernels.py): lora_add_f32(layer's side paths, this step's rows, x, ldx, y, ldy) */
typedef void (*lora_fn)(const void*, const void*, const float*, long, float*, long);
typedef struct { gemm_fn gemm; qgemm_fn qgemm; norm_fn norm; rotary_fn rotary; silu_fn silu; decode_fn decode;
                 i8gemm_fn i8gemm; lora_fn lora; const void* lora_rows; /* NULL: no adapter rows this step */ } fns_t;
/* kind 0: packed float panels in w (bias may be NULL); kind 1: quantized (qgemm.py; mins may be NULL);
   kind 2: w8a8 int8 panels (i8gemm.py; scales, and the column sums in mins) */
typedef struct { long kind; const void* w; const float* scales; const float* mins; const float* bias;
                 long bits; long group; long n; long k; const void* lora; /* NULL: no side paths */ } lin_t;
typedef struct { const float* norm1; const float* norm2; lin_t qkv, o, gate_up, down;
                 void* k_cache; void* v_cache; long window; float eps; float scale; } layer_t;

static void linear(const fns_t* f, const lin_t* w, const float* x, long T, float* y) {
    if (w->kind == 0) f->gemm(x, T, w->k, w->k, (const float*)w->w, w->n, w->bias, y, w->n);
    else if (w->kind == 1) f->qgemm(x, T, w->k, w->k, (const unsigned char*)w->w, w->scales, w->mins, (int)w->bits,
                                    w->group, w->n, w->bias, y, w->n);
    else f->i8gemm(x, T, w->k, w->k, (const signed char*)w->w, w->scales, (const int*)w->mins, w->n, w->bias, y,
                   w->n);
    if (w->lora && f->lora_rows) f->lora(w->lora, f->lora_rows, x, w->k, y, w->n);  /* Linear.forward's add_to */
}

/* Every layer of a decode-only step, in NativeDecoder.forward's order: residual
   [T, hidden] holds the embeddings and is the residual stream; out receives
   the final norm. scratch: T * (3 hidden + qkv + heads * dim + 3 inter) floats. */
void decoder_decode(const fns_t* f, const layer_t* layers, long num_layers, long T, long hidden,
                    long hq, long hkv, long d, float* residual, float* out, const float* final_norm,
                    float final_eps, const float* cos, const float* sin, const long* slots, const int* tables,
                    long width, const int* lens, long num_reqs, long block_size, float* scratch,
                    const int* tail_lo, const long* tail_slots, long tail_width) {
    const long nqkv = layers[0].qkv.n, inter = layers[0].down.k;
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
        linear(f, &L->gate_up, h, T, gu);
        f->silu(gu, act, T, inter);
        linear(f, &L->down, act, T, down);
    }
    f->norm(down, residual, final_norm, out, T, hidden, final_eps);
}
