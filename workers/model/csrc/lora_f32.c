/* LoRA side paths of one linear layer for every adapter of a step, in one call
   (workers/model/lora_kernels.py has the layout and the contract).

   y[r, :] += (B_s (A_s x[r, :])) * scale_s for each row r of each group (slot s): the
   shrink t = A_s x[r] [R] and the expand B_s t [n], both float32 FMA chains in
   ascending order from zero, the expand's chain times the slot's scaling (PEFT's
   lora_B(lora_A(x)) * scaling) added to y once. A slot's A and B are float32, or
   bfloat16 / float16 as the adapter was saved: 16-bit weights are widened to
   float32 in registers (exact: every bf16 and fp16 value is a float32 value), so
   the arithmetic is the float32 path's on the same values and a step reads half
   the bytes. bfloat16 panels interleave pairs of the reduction index (k in A,
   the rank in B: lora_kernels.py), so one load of VL 32-bit words gives two
   vectors in place, the even index's by a shift and the odd one's by a mask,
   instead of a widening shuffle per vector; each chain still runs in ascending
   order. The chains of a row
   never read another row, and the row, column and thread blocking only decides
   which chains run together, so a row's result is the same whatever its
   batch-mates (batch invariance). Threads: with many small groups (a decode step
   of several adapters) each thread takes whole groups, the same ones each call
   (static), so it streams its adapters' co-located panels on; otherwise phase 1 (every
   shrink) and phase 2 (every expand) split their blocks over the threads, t
   passing between them in scratch. No software prefetch: the weights stream in
   order, and prefetching 16 or 32 steps ahead measured no faster. */

#include <immintrin.h>
#include <omp.h>

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vec;
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
/* VL 16-bit values widened to float32: bf16 is the float's top half, fp16 the F16C conversion */
#define VLOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p))), 16))
#define VLOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))
/* VL pairs of bf16 (2 VL values) split in place: the even values, then the odd ones, as float32 */
typedef __m512i ivec;
#define VLOADI(p) _mm512_loadu_si512((const void*)(p))
#define BF16_EVEN(v) _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
#define BF16_ODD(v) _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)))
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VL 8
typedef __m256 vec;
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VLOAD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p))), 16))
#define VLOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
typedef __m256i ivec;
#define VLOADI(p) _mm256_loadu_si256((const __m256i*)(p))
#define BF16_EVEN(v) _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
#define BF16_ODD(v) _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)))
#else
#error "the native LoRA kernel needs AVX2, FMA and F16C"
#endif
/* A slot's weight format (lora_kernels.py FORMATS) */
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_F16 2
#define RB 4  /* rows of one adapter sharing each weight load */
#define CB 2  /* vectors of columns (rank in the shrink, outputs in the expand) per block */
#define BW (CB * VL)
#ifndef PAR_BYTES
#define PAR_BYTES (256 * 1024)  /* weights below which one thread beats waking the others */
#endif
#define EB 4  /* output panels per expand work item (a few KB of B: worth a thread's turn) */

int lora_vector_width(void) { return VL; }
static inline long fmt_bytes(int fmt) { return fmt == FMT_F32 ? 4 : 2; }
int lora_block_width(void) { return BW; }

/* One layer: per slot (NULL: the adapter does not target it) A in rank panels
   (panel c of width w = min(BW, rpad - c BW) is [k][w], at offset k c BW) and B in
   output panels (panel b holds the ranks [lo, hi) whose B entries are not all zero
   on outputs b BW .. b BW + BW - 1, as [hi - lo][BW], at offset offs[b]; fused
   layers are block-diagonal, and the skipped products are exact zeros). Offsets
   count elements of the slot's format. */
typedef struct {
    long k, n, npad, max_rpad, num_slots;
    const void* const* at;
    const void* const* bt;
    const long* rpad;
    const int* const* ranges;  /* per slot: 2 * (npad / BW) ints: lo, hi */
    const long* const* offs;   /* per slot: npad / BW offsets into bt */
    const int* fmt;            /* per slot: FMT_F32, FMT_BF16 or FMT_F16 (A and B alike) */
    const float* scale;        /* per slot: the expand's chain is multiplied by it */
} lora_layer_t;

/* One step: group g runs slot group_slot[g] on rows[group_start[g] .. group_start[g + 1]). */
typedef struct {
    long num_groups;
    const long* group_slot;
    const long* group_start;
    const long* rows;
    float* scratch;  /* [len(rows)][max_rpad of any layer] */
    long ldt;
} lora_batch_t;

#define INLINE static inline __attribute__((always_inline))

/* VL weights from element i of p in format fmt, as float32 (fmt constant at each call site) */
INLINE vec load_w(const void* p, long i, const int fmt) {
    if (fmt == FMT_BF16) return VLOAD_BF16((const unsigned short*)p + i);
    if (fmt == FMT_F16) return VLOAD_F16((const unsigned short*)p + i);
    return VLOAD((const float*)p + i);
}

/* t[r, c0 : c0 + cb * VL] = A_s[c0 : ..] . x[rows[r]] for rb rows (rb, cb constant
   at each call site, so the accumulators stay in registers). */
INLINE void shrink_rows(const void* at, long k, const float* x, long ldx, const long* rows, const int rb,
                        const int cb, const int fmt, float* t, long ldt) {
    vec acc[RB][CB];
    for (int r = 0; r < rb; ++r)
        for (int v = 0; v < cb; ++v) acc[r][v] = VZERO();
    if (fmt == FMT_BF16) {  /* k in pairs (the header): one load, two vectors */
        const unsigned short* ap = (const unsigned short*)at;
        long kk = 0;
        for (; kk + 1 < k; kk += 2) {
            vec w0[CB], w1[CB];
            for (int v = 0; v < cb; ++v) {
                const ivec raw = VLOADI(ap + kk * cb * VL + 2 * v * VL);
                w0[v] = BF16_EVEN(raw);
                w1[v] = BF16_ODD(raw);
            }
            for (int r = 0; r < rb; ++r) {
                const vec xv = VSET1(x[rows[r] * ldx + kk]);
                for (int v = 0; v < cb; ++v) acc[r][v] = VFMA(w0[v], xv, acc[r][v]);
            }
            for (int r = 0; r < rb; ++r) {
                const vec xv = VSET1(x[rows[r] * ldx + kk + 1]);
                for (int v = 0; v < cb; ++v) acc[r][v] = VFMA(w1[v], xv, acc[r][v]);
            }
        }
        if (kk < k)  /* k odd: the last pair's odd half is padding */
            for (int v = 0; v < cb; ++v) {
                const vec w0 = BF16_EVEN(VLOADI(ap + kk * cb * VL + 2 * v * VL));
                for (int r = 0; r < rb; ++r) acc[r][v] = VFMA(w0, VSET1(x[rows[r] * ldx + kk]), acc[r][v]);
            }
        for (int r = 0; r < rb; ++r)
            for (int v = 0; v < cb; ++v) VSTORE(t + r * ldt + v * VL, acc[r][v]);
        return;
    }
    for (long kk = 0; kk < k; ++kk) {
        vec w[CB];
        for (int v = 0; v < cb; ++v) w[v] = load_w(at, kk * cb * VL + v * VL, fmt);
        for (int r = 0; r < rb; ++r) {
            const vec xv = VSET1(x[rows[r] * ldx + kk]);
            for (int v = 0; v < cb; ++v) acc[r][v] = VFMA(w[v], xv, acc[r][v]);
        }
    }
    for (int r = 0; r < rb; ++r)
        for (int v = 0; v < cb; ++v) VSTORE(t + r * ldt + v * VL, acc[r][v]);
}

#define SHRINK(RBC, CBC) shrink_rows(at, L->k, x, ldx, rows, RBC, CBC, fmt, t + c0, ldt)

INLINE void shrink_block_as(const lora_layer_t* L, long s, const float* x, long ldx, const long* rows, int rb,
                            long c0, float* t, long ldt, const int fmt) {
    const void* at = (const char*)L->at[s] + fmt_bytes(fmt) * (fmt == FMT_BF16 ? (L->k + 1) / 2 * 2 : L->k) * c0;
    const long rp = L->rpad[s];
    if (rp - c0 >= BW) {
        switch (rb) {
            case 1: SHRINK(1, CB); break;
            case 2: SHRINK(2, CB); break;
            case 3: SHRINK(3, CB); break;
            default: SHRINK(RB, CB); break;
        }
    } else {  /* the last VL ranks */
        switch (rb) {
            case 1: SHRINK(1, 1); break;
            case 2: SHRINK(2, 1); break;
            case 3: SHRINK(3, 1); break;
            default: SHRINK(RB, 1); break;
        }
    }
}

static void shrink_block(const lora_layer_t* L, long s, const float* x, long ldx, const long* rows, int rb,
                         long c0, float* t, long ldt) {
    switch (L->fmt[s]) {
        case FMT_BF16: shrink_block_as(L, s, x, ldx, rows, rb, c0, t, ldt, FMT_BF16); break;
        case FMT_F16: shrink_block_as(L, s, x, ldx, rows, rb, c0, t, ldt, FMT_F16); break;
        default: shrink_block_as(L, s, x, ldx, rows, rb, c0, t, ldt, FMT_F32); break;
    }
}

/* y[rows[r], c0 : c0 + BW] += (B_s[c0 : ..] . t[r] over the ranks [lo, hi)) * scale. */
INLINE void expand_rows(const void* bt, int lo, int hi, const float* t, long ldt, const int rb, const int fmt,
                        float scale, float* y, long ldy, const long* rows, long width) {
    vec acc[RB][CB];
    for (int r = 0; r < rb; ++r)
        for (int v = 0; v < CB; ++v) acc[r][v] = VZERO();
    if (fmt == FMT_BF16) {  /* ranks in pairs (the header) */
        const unsigned short* bp = (const unsigned short*)bt;
        int j = lo;
        for (; j + 1 < hi; j += 2) {
            vec w0[CB], w1[CB];
            for (int v = 0; v < CB; ++v) {
                const ivec raw = VLOADI(bp + (long)(j - lo) * BW + 2 * v * VL);
                w0[v] = BF16_EVEN(raw);
                w1[v] = BF16_ODD(raw);
            }
            for (int r = 0; r < rb; ++r) {
                const vec tv = VSET1(t[r * ldt + j]);
                for (int v = 0; v < CB; ++v) acc[r][v] = VFMA(w0[v], tv, acc[r][v]);
            }
            for (int r = 0; r < rb; ++r) {
                const vec tv = VSET1(t[r * ldt + j + 1]);
                for (int v = 0; v < CB; ++v) acc[r][v] = VFMA(w1[v], tv, acc[r][v]);
            }
        }
        if (j < hi)  /* an odd count: the last pair's odd half is padding */
            for (int v = 0; v < CB; ++v) {
                const vec w0 = BF16_EVEN(VLOADI(bp + (long)(j - lo) * BW + 2 * v * VL));
                for (int r = 0; r < rb; ++r) acc[r][v] = VFMA(w0, VSET1(t[r * ldt + j]), acc[r][v]);
            }
    } else
    for (int j = lo; j < hi; ++j) {
        vec w[CB];
        for (int v = 0; v < CB; ++v) w[v] = load_w(bt, (j - lo) * BW + v * VL, fmt);
        for (int r = 0; r < rb; ++r) {
            const vec tv = VSET1(t[r * ldt + j]);
            for (int v = 0; v < CB; ++v) acc[r][v] = VFMA(w[v], tv, acc[r][v]);
        }
    }
    const vec sv = VSET1(scale);
    for (int r = 0; r < rb; ++r)
        for (int v = 0; v < CB; ++v) acc[r][v] = VMUL(acc[r][v], sv);
    for (int r = 0; r < rb; ++r) {
        float* yr = y + rows[r] * ldy;
        if (width == BW) {
            for (int v = 0; v < CB; ++v) VSTORE(yr + v * VL, VADD(VLOAD(yr + v * VL), acc[r][v]));
        } else {  /* the last panel of outputs */
            float buf[BW];
            for (int v = 0; v < CB; ++v) VSTORE(buf + v * VL, acc[r][v]);
            for (long c = 0; c < width; ++c) yr[c] += buf[c];
        }
    }
}

#define EXPAND(RBC) expand_rows(bt, lo, hi, t, ldt, RBC, fmt, L->scale[s], y + c0, ldy, rows, width)

INLINE void expand_block_as(const lora_layer_t* L, long s, const float* t, long ldt, int rb, long blk,
                            float* y, long ldy, const long* rows, const int fmt) {
    const void* bt = (const char*)L->bt[s] + fmt_bytes(fmt) * L->offs[s][blk];
    const int lo = L->ranges[s][2 * blk], hi = L->ranges[s][2 * blk + 1];
    const long c0 = blk * BW;
    const long width = L->n - c0 < BW ? L->n - c0 : BW;
    if (lo >= hi) return;  /* B is zero on these outputs: nothing to add */
    switch (rb) {
        case 1: EXPAND(1); break;
        case 2: EXPAND(2); break;
        case 3: EXPAND(3); break;
        default: EXPAND(RB); break;
    }
}

static void expand_block(const lora_layer_t* L, long s, const float* t, long ldt, int rb, long blk,
                         float* y, long ldy, const long* rows) {
    switch (L->fmt[s]) {
        case FMT_BF16: expand_block_as(L, s, t, ldt, rb, blk, y, ldy, rows, FMT_BF16); break;
        case FMT_F16: expand_block_as(L, s, t, ldt, rb, blk, y, ldy, rows, FMT_F16); break;
        default: expand_block_as(L, s, t, ldt, rb, blk, y, ldy, rows, FMT_F32); break;
    }
}

/* The blocks of group g: (row blocks) x (column blocks). */
static inline long group_rows(const lora_batch_t* B, long g) { return B->group_start[g + 1] - B->group_start[g]; }

static inline int targets(const lora_layer_t* L, long s) { return s >= 0 && s < L->num_slots && L->at[s]; }

/* Group g's shrink, then its expand, on one thread. */
static void run_group(const lora_layer_t* L, const lora_batch_t* B, long g, const float* x, long ldx, float* y,
                      long ldy) {
    const long s = B->group_slot[g];
    for (long r0 = 0; r0 < group_rows(B, g); r0 += RB) {
        const long first = B->group_start[g] + r0, left = group_rows(B, g) - r0;
        const int rb = (int)(left < RB ? left : RB);
        float* t = B->scratch + first * B->ldt;
        for (long c0 = 0; c0 < L->rpad[s]; c0 += BW) shrink_block(L, s, x, ldx, B->rows + first, rb, c0, t, B->ldt);
        for (long b = 0; b < L->npad / BW; ++b) expand_block(L, s, t, B->ldt, rb, b, y, ldy, B->rows + first);
    }
}

void lora_add_f32(const lora_layer_t* L, const lora_batch_t* B, const float* x, long ldx, float* y, long ldy) {
    const long G = B->num_groups;
    long shrink_items = 0, expand_items = 0, active = 0, max_rows = 0;
    for (long g = 0; g < G; ++g) {
        const long s = B->group_slot[g];
        if (!targets(L, s)) continue;
        active += 1;
        max_rows = group_rows(B, g) > max_rows ? group_rows(B, g) : max_rows;
        const long row_blocks = (group_rows(B, g) + RB - 1) / RB;
        shrink_items += row_blocks * ((L->rpad[s] + BW - 1) / BW);
        expand_items += row_blocks * ((L->npad / BW + EB - 1) / EB);
    }
    if (!shrink_items) return;
    long bytes = 0;  /* of weights this call reads */
    for (long g = 0; g < G; ++g)
        if (targets(L, B->group_slot[g]))
            bytes += fmt_bytes(L->fmt[B->group_slot[g]]) * L->rpad[B->group_slot[g]] * (L->k + L->npad);
    const int parallel = bytes > PAR_BYTES;
    if (active >= 2 * omp_get_max_threads() && max_rows <= RB) {  /* many small groups: a thread per group */
        #pragma omp parallel for schedule(static) if (parallel)  /* a thread keeps its adapters step after step: their co-located panels stream on */
        for (long g = 0; g < G; ++g)
            if (targets(L, B->group_slot[g])) run_group(L, B, g, x, ldx, y, ldy);
        return;
    }
    #pragma omp parallel if (parallel)
    {
        for (int phase = 0; phase < 2; ++phase) {
            const long items = phase ? expand_items : shrink_items;
            #pragma omp for schedule(static)
            for (long item = 0; item < items; ++item) {
                long rest = item, g = 0, s = 0, per_row_block = 0;
                for (; g < G; ++g) {  /* find the group of this item (a handful of groups) */
                    s = B->group_slot[g];
                    if (!targets(L, s)) continue;
                    per_row_block = phase ? (L->npad / BW + EB - 1) / EB : (L->rpad[s] + BW - 1) / BW;
                    const long n_items = (group_rows(B, g) + RB - 1) / RB * per_row_block;
                    if (rest < n_items) break;
                    rest -= n_items;
                }
                const long rb0 = rest / per_row_block * RB, blk = rest % per_row_block;
                const long first = B->group_start[g] + rb0;
                const long left = group_rows(B, g) - rb0;
                const int rb = (int)(left < RB ? left : RB);
                float* t = B->scratch + first * B->ldt;
                if (phase == 0) shrink_block(L, s, x, ldx, B->rows + first, rb, blk * BW, t, B->ldt);
                else
                    for (long b = blk * EB; b < (blk + 1) * EB && b < L->npad / BW; ++b)
                        expand_block(L, s, t, B->ldt, rb, b, y, ldy, B->rows + first);
            }
        }
    }
}
