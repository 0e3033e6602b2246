/* What the step driver (decoder_step.c) and the MoE layer (moe_f32.c) share: the kernels they
   call through function pointers (workers/model/native_structs.py fills them), a linear
   layer's weights, and `linear`, which runs one. */
#ifndef PREFIXSERVE_DECODER_TYPES_H
#define PREFIXSERVE_DECODER_TYPES_H
typedef void (*gemm_fn)(const float*, long, long, long, const float*, long, const float*, float*, long);
typedef void (*qgemm_fn)(const float*, long, long, long, const unsigned char*, const float*, const float*, int,
                         long, long, const float*, float*, long);
typedef void (*norm_fn)(const float*, float*, const float*, float*, long, long, float);
typedef void (*rotary_fn)(float*, long, long, long, long, const float*, const float*);
typedef void (*silu_fn)(const float*, float*, long, long);  /* and gelu_tanh_and_mul_f32 (GeGLU) */
typedef void (*head_norm_fn)(float*, long, long, long, long, const float*, float);
typedef void (*decode_fn)(const float*, long, const float*, long, const float*, long, const long*, void*, void*,
                          const int*, int, const int*, int, int, int, int, int, float, int, float*, long,
                          const int*, const long*, int, float);  /* last: the score cap (0: none) */
typedef void (*i8gemm_fn)(const float*, long, long, long, const signed char*, const float*, const int*, long,
                          const float*, float*, long);

/* qgemm_f32.c's pieces for callers that thread several GEMMs themselves: a panel range, group sums */
typedef void (*qpanels_fn)(const float*, long, long, long, const float*, const unsigned char*, const float*,
                           const float*, int, long, long, const float*, float*, long, long, long);
typedef void (*qsums_fn)(const float*, long, long, long, long, float*);
typedef void (*gpanels_fn)(const float*, long, long, long, const float*, long, const float*, float*, long, long,
                           long);

/* LoRA (workers/model/lora_kernels.py): lora_add_f32(layer's side paths, this step's rows, x, ldx, y, ldy) */
typedef void (*lora_fn)(const void*, const void*, const float*, long, float*, long);
struct fns;
struct moe;
/* moe_forward_f32 (moe_f32.c): out[T, hidden] = the MoE layer of x[T, hidden] */
typedef void (*moe_fn)(const struct fns*, const struct moe*, const float*, long, long, float*);
typedef struct fns { gemm_fn gemm; qgemm_fn qgemm; norm_fn norm; rotary_fn rotary; silu_fn silu; decode_fn decode;
                     i8gemm_fn i8gemm; lora_fn lora; const void* lora_rows; /* NULL: no adapter rows this step */
                     moe_fn moe; qpanels_fn qgemm_panels; qsums_fn qgemm_sums; gpanels_fn gemm_panels;
                     /* the last three NULL: an MoE layer runs one GEMM call per expert */
                     silu_fn gelu; head_norm_fn head_norm;  /* Gemma's GeGLU; Qwen3's / Gemma 3's q/k norms */
                   } fns_t;
/* kind 0: packed float panels in w (bias may be NULL); kind 1: quantized (qgemm.py; mins may be NULL);
   kind 2: w8a8 int8 panels (i8gemm.py; scales, and the column sums in mins) */
typedef struct { long kind; const void* w; const float* scales; const float* mins; const float* bias;
                 long bits; long group; long n; long k; const void* lora; /* NULL: no side paths */ } lin_t;
/* A mixture-of-experts layer (moe.py): the router, each expert's gate/up and down, and how tokens pick
   experts; dense != 0 runs every expert on every token (bench moe's baseline: weight 0 where not chosen).
   shared_inter > 0: Qwen2-MoE's shared expert (gate/up, down) over every token, times the sigmoid of its
   gate (a linear to one output), added after the routed experts. */
typedef struct moe { lin_t router; const lin_t* gate_up; const lin_t* down; long num_experts; long top_k;
                     long norm_topk; long inter; long dense;
                     long panel_width; long gemm_panel_width; /* qgemm's, gemm's (0: no grouped path) */
                     lin_t shared_gate_up; lin_t shared_down; lin_t shared_gate; long shared_inter; } moe_t;

static inline void linear(const fns_t* f, const lin_t* w, const float* x, long T, float* y) {
    if (w->kind == 0) f->gemm(x, T, w->k, w->k, (const float*)w->w, w->n, w->bias, y, w->n);
    else if (w->kind == 1) f->qgemm(x, T, w->k, w->k, (const unsigned char*)w->w, w->scales, w->mins, (int)w->bits,
                                    w->group, w->n, w->bias, y, w->n);
    else f->i8gemm(x, T, w->k, w->k, (const signed char*)w->w, w->scales, (const int*)w->mins, w->n, w->bias, y,
                   w->n);
    if (w->lora && f->lora_rows) f->lora(w->lora, f->lora_rows, x, w->k, y, w->n);  /* Linear.forward's add_to */
}
#endif
