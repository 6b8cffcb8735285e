/* A decode-only step's decoder layers in one call: per layer, the same kernel calls the Python
 * layer loop makes (llama.py DecoderLayer.forward on its native path), in the same order, on the
 * same buffers' values -- so the result is bit-identical to it (tests/test_decode_layers.py):
 *
 *     x  = add_rms_norm(h, residual, norm_in)        residual += h (layer 0: no add)
 *     qkv = qlinear(W_qkv, x)                         + bias when the model has one
 *     att = decode_rope_attend(qkv, cos, sin, ...)    RoPE, K/V write, paged attention
 *     a  = qlinear(W_o, att)
 *     x  = add_rms_norm(a, residual, norm_post)       residual += a
 *     gu = qlinear(W_gate_up, x)
 *     h  = qlinear(W_down, silu_mul(gu))
 *
 * What it saves is the glue: at batch 1 on a 2-core AMD EPYC the Python loop spent about 7 ms of
 * an 18 ms step (30 layers) outside the kernels -- module calls, ctypes, torch's allocations and
 * views (benchmarks/RESULTS.md). qlinear (qlinear_entry.c) is in the same library. bf16 selects
 * the bfloat16 kernels (activations,
 * cache and norm weights in bf16), else float32. Buffers come from one thread-local allocation
 * grown on demand; the pool runs each kernel's work as it does for the Python loop.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "simd.h" /* pl_buf */

/* the kernels of this library the loop calls (qlinear_entry.c: the linear layers and, dequant_rows,
 * the embedding lookup; paged_decode.c, elementwise.c) */
int qlinear(int fmt, const void *w, int64_t N, int64_t K, const void *x, int x_bf16, int64_t M, float *scratch,
            const float *bias, void *y, int y_bf16, int use_dp);
int dequant_rows(int fmt, const void *w, int64_t N, int64_t K, const int64_t *idx, int64_t R, void *out, int out_bf16);
int decode_rope_attend(const uint16_t *qkv, int64_t stride, const uint16_t *cos, const uint16_t *sin, uint16_t *kc,
                       uint16_t *vc, const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                       const int64_t *lens, uint16_t *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                       float scale);
int decode_rope_attend_f32(const float *qkv, int64_t stride, const float *cos, const float *sin, float *kc, float *vc,
                           const int64_t *slots, const int64_t *tables, int64_t max_blocks, const int64_t *lens,
                           float *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale);
int add_rms_norm(const uint16_t *x, uint16_t *res, const uint16_t *w, uint16_t *out, int64_t T, int64_t N, float eps);
int add_rms_norm_f32(const float *x, float *res, const float *w, float *out, int64_t T, int64_t N, float eps);
int silu_mul(const uint16_t *gu, uint16_t *out, int64_t T, int64_t N);
int silu_mul_f32(const float *gu, float *out, int64_t T, int64_t N);
int bf16_to_f32(const uint16_t *x, float *y, int64_t T, int64_t N);

enum { QKV = 0, O = 1, GATE_UP = 2, DOWN = 3 };

/* Where a call's time goes, for benchmarks/step_profile.py: wall nanoseconds per kernel kind,
 * summed over calls while profiling is on (decode_layers_profile; two clock reads per kernel call,
 * about 7 per layer, nothing when off). Kinds: the four linear layers (QKV, O, GATE_UP, DOWN),
 * attention (RoPE + K/V write + paged attention), norms, SiLU * up; decode_forward's two ends: the
 * embedding rows and RoPE tables looked up, and the final norm, LM head and logits widened. */
enum { P_ATTN = 4, P_NORM = 5, P_SILU = 6, P_EMBED = 7, P_HEAD = 8, P_KINDS = 9 };
static atomic_int g_prof_on = 0;
static _Atomic int64_t g_prof[P_KINDS];

/* on: 1 starts (and zeroes), 0 stops; ns (P_KINDS) receives the sums so far when not NULL */
void decode_layers_profile(int on, int64_t *ns) {
    if (ns)
        for (int i = 0; i < P_KINDS; i++) ns[i] = atomic_load(&g_prof[i]);
    if (on)
        for (int i = 0; i < P_KINDS; i++) atomic_store(&g_prof[i], 0);
    atomic_store(&g_prof_on, on);
}

static inline int64_t prof_now(int on) {
    if (!on) return 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* t: the previous stamp, moved to now; the time since goes to `kind` */
static inline void prof_add(int on, int kind, int64_t *t) {
    if (!on) return;
    const int64_t now = prof_now(1);
    atomic_fetch_add_explicit(&g_prof[kind], now - *t, memory_order_relaxed);
    *t = now;
}

/* one decoder layer's weights as stored (kernels.DecodeLayer mirrors this layout) */
typedef struct {
    int32_t fmt[4];          /* qlinear format ids of qkv, o, gate_up, down */
    const void *w[4];        /* their blocks */
    int64_t n[4], k[4];      /* (out, in) features */
    const float *bias[4];    /* float32 biases or NULL */
    const void *norm_in;     /* RMSNorm weights in the activation dtype */
    const void *norm_post;
} dl_layer;

static _Thread_local pl_buf tl_buf;

/* bytes of scratch qlinear needs (qlinear_scratch_floats) for M rows of K inputs, any format: the
 * widest need is Q4_1L with bf16 rows, or on AMX Q4_1X's reordered rows beside B tiles of up to 15
 * padding rows (M K / 2 + (M + 15) K / 2 + 16) */
static inline size_t qlinear_scratch_bytes(int64_t M, int64_t K) {
    return (size_t)(2 * M * K + M * (K / 32) + 8 * K + 16) * sizeof(float);
}

static inline int norm(int bf16, const void *x, void *res, const void *w, void *out, int64_t M, int64_t N, float eps) {
    return bf16 ? add_rms_norm((const uint16_t *)x, (uint16_t *)res, (const uint16_t *)w, (uint16_t *)out, M, N, eps)
                : add_rms_norm_f32((const float *)x, (float *)res, (const float *)w, (float *)out, M, N, eps);
}

/* h_out (M, hidden) = the last layer's MLP output; residual (M, hidden) updated in place (it enters
 * as the embedding: the first layer adds nothing to it). kv: the first layer's cache (its K half),
 * kv_layer_stride / kv_half_stride: bytes from one layer's K to the next layer's, and from K to V.
 * Returns 0; 1 for a shape or format the kernels refuse; 2 out of memory. */
int decode_layers(const dl_layer *L, int64_t num_layers, int64_t M, int bf16, const void *h_in, void *residual,
                  void *h_out, const void *cos, const void *sin, char *kv, int64_t kv_layer_stride,
                  int64_t kv_half_stride, const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                  const int64_t *lens, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale, float eps) {
    if (num_layers <= 0 || M <= 0) return 1;
    const size_t el = bf16 ? 2 : 4;
    const int64_t hidden = L[0].k[QKV];
    int64_t widest = 0, deepest = 0; /* the largest output and input row of any linear */
    for (int64_t l = 0; l < num_layers; l++)
        for (int i = 0; i < 4; i++) {
            if (L[l].n[i] > widest) widest = L[l].n[i];
            if (L[l].k[i] > deepest) deepest = L[l].k[i];
        }
    /* x, a: (M, hidden); big: qkv / gate_up outputs; mid: attention / silu outputs; scratch: float32 */
    const size_t sx = (size_t)(M * hidden) * el, sbig = (size_t)(M * widest) * el, smid = sbig;
    const size_t sscr = qlinear_scratch_bytes(M, deepest);
    char *buf = pl_grow(&tl_buf, 2 * sx + sbig + smid + sscr + 64);
    if (!buf) return 2;
    void *x = buf, *a = buf + sx, *big = buf + 2 * sx, *mid = buf + 2 * sx + sbig;
    float *scratch = (float *)(((uintptr_t)(buf + 2 * sx + sbig + smid) + 63) & ~(uintptr_t)63);
    const void *h = h_in;
    const int on = atomic_load_explicit(&g_prof_on, memory_order_relaxed);
    int64_t t = prof_now(on);
    for (int64_t l = 0; l < num_layers; l++) {
        const dl_layer *y = L + l;
        char *kc = kv + l * kv_layer_stride, *vc = kc + kv_half_stride;
        if (norm(bf16, h, residual, y->norm_in, x, M, hidden, eps)) return 1;
        prof_add(on, P_NORM, &t);
        if (qlinear(y->fmt[QKV], y->w[QKV], y->n[QKV], y->k[QKV], x, bf16, M, scratch, y->bias[QKV], big, bf16, 1))
            return 1;
        prof_add(on, QKV, &t);
        const int rc = bf16 ? decode_rope_attend((const uint16_t *)big, y->n[QKV], (const uint16_t *)cos,
                                                 (const uint16_t *)sin, (uint16_t *)kc, (uint16_t *)vc, slots, tables,
                                                 max_blocks, lens, (uint16_t *)mid, M, H, KVH, D, BS, scale)
                            : decode_rope_attend_f32((const float *)big, y->n[QKV], (const float *)cos,
                                                     (const float *)sin, (float *)kc, (float *)vc, slots, tables,
                                                     max_blocks, lens, (float *)mid, M, H, KVH, D, BS, scale);
        if (rc) return rc;
        prof_add(on, P_ATTN, &t);
        if (qlinear(y->fmt[O], y->w[O], y->n[O], y->k[O], mid, bf16, M, scratch, y->bias[O], a, bf16, 1))
            return 1;
        prof_add(on, O, &t);
        if (norm(bf16, a, residual, y->norm_post, x, M, hidden, eps)) return 1;
        prof_add(on, P_NORM, &t);
        if (qlinear(y->fmt[GATE_UP], y->w[GATE_UP], y->n[GATE_UP], y->k[GATE_UP], x, bf16, M, scratch,
                      y->bias[GATE_UP], big, bf16, 1))
            return 1;
        prof_add(on, GATE_UP, &t);
        const int64_t inter = y->n[GATE_UP] / 2;
        if (bf16 ? silu_mul((const uint16_t *)big, (uint16_t *)mid, M, inter)
                 : silu_mul_f32((const float *)big, (float *)mid, M, inter))
            return 1;
        prof_add(on, P_SILU, &t);
        if (qlinear(y->fmt[DOWN], y->w[DOWN], y->n[DOWN], y->k[DOWN], mid, bf16, M, scratch, y->bias[DOWN], h_out,
                      bf16, 1))
            return 1;
        prof_add(on, DOWN, &t);
        h = h_out;
    }
    return 0;
}

/* -- a decode-only step's whole forward in one call -----------------------------------------------
 *
 * decode_layers and the model's two ends around it, as llama.py's forward runs them on its native
 * path, in the same order on the same values (bit-identical; tests/test_decode_layers.py):
 *
 *     residual = dequant_rows(embedding, ids)         the rows of the looked-up tokens
 *     cos, sin = the tables' rows at `positions`      (the caller's tables, in the activation dtype)
 *     h = decode_layers(...)
 *     x = add_rms_norm(h, residual, final_norm)
 *     logits = qlinear(head, x)                       in the activation dtype, then widened to float32
 *
 * Why: after a step has streamed ~100 MB of weights through the caches, each small torch op between
 * the native calls costs tens of microseconds in cache misses (embedding, RoPE lookup, norm, head
 * wrapper, widening: about 0.25 ms of a 6.5 ms batch-1 step on the AMX Xeon, benchmarks/RESULTS.md). */
typedef struct {
    int32_t emb_fmt;         /* the embedding's rows as stored (dequant_rows' format ids) */
    const void *emb;
    int64_t vocab_in;        /* its rows */
    const void *cos, *sin;   /* (max_pos, D) RoPE tables in the activation dtype */
    int64_t max_pos;
    const void *norm;        /* the final RMSNorm weight, in the activation dtype */
    int32_t head_fmt;        /* the LM head as qlinear reads it: (vocab, hidden) */
    const void *head;
    int64_t vocab;
} df_ends;

static _Thread_local pl_buf tl_fwd;

/* logits (M, vocab) float32. ids, positions: (M,) int64. Returns as decode_layers; 1 also for an id
 * or position outside its table. */
int decode_forward(const dl_layer *L, int64_t num_layers, const df_ends *E, int64_t M, int bf16, const int64_t *ids,
                   const int64_t *positions, float *logits, char *kv, int64_t kv_layer_stride, int64_t kv_half_stride,
                   const int64_t *slots, const int64_t *tables, int64_t max_blocks, const int64_t *lens, int64_t H,
                   int64_t KVH, int64_t D, int64_t BS, float scale, float eps) {
    if (num_layers <= 0 || M <= 0 || !E) return 1;
    for (int64_t m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= E->vocab_in || positions[m] < 0 || positions[m] >= E->max_pos) return 1;
    const size_t el = bf16 ? 2 : 4;
    const int64_t hidden = L[0].k[QKV], V = E->vocab;
    /* residual, h, x: (M, hidden); cos, sin: (M, D); logits in the activation dtype (bf16 only: a
     * float32 model's head writes `logits` directly); the head's scratch (qlinear_scratch_floats) */
    const size_t sh = (size_t)(M * hidden) * el, sd = (size_t)(M * D) * el, sl = bf16 ? (size_t)(M * V) * el : 0;
    const size_t sscr = qlinear_scratch_bytes(M, hidden);
    char *buf = pl_grow(&tl_fwd, 3 * sh + 2 * sd + sl + sscr + 64 * 8);
    if (!buf) return 2;
    char *p = (char *)(((uintptr_t)buf + 63) & ~(uintptr_t)63);
#define DF_TAKE(var, n)                                        \
    void *var = p;                                             \
    p = (char *)(((uintptr_t)(p + (n)) + 63) & ~(uintptr_t)63)
    DF_TAKE(residual, sh);
    DF_TAKE(h, sh);
    DF_TAKE(x, sh);
    DF_TAKE(cos, sd);
    DF_TAKE(sin, sd);
    DF_TAKE(act_logits, sl);
    float *scratch = (float *)p;
#undef DF_TAKE
    const int on = atomic_load_explicit(&g_prof_on, memory_order_relaxed);
    int64_t t = prof_now(on);
    if (dequant_rows(E->emb_fmt, E->emb, E->vocab_in, hidden, ids, M, residual, bf16)) return 1;
    for (int64_t m = 0; m < M; m++) {
        memcpy((char *)cos + (size_t)(m * D) * el, (const char *)E->cos + (size_t)(positions[m] * D) * el, (size_t)D * el);
        memcpy((char *)sin + (size_t)(m * D) * el, (const char *)E->sin + (size_t)(positions[m] * D) * el, (size_t)D * el);
    }
    prof_add(on, P_EMBED, &t);
    const int rc = decode_layers(L, num_layers, M, bf16, NULL, residual, h, cos, sin, kv, kv_layer_stride,
                                 kv_half_stride, slots, tables, max_blocks, lens, H, KVH, D, BS, scale, eps);
    if (rc) return rc;
    t = prof_now(on);
    if (norm(bf16, h, residual, E->norm, x, M, hidden, eps)) return 1;
    if (qlinear(E->head_fmt, E->head, V, hidden, x, bf16, M, scratch, NULL, bf16 ? act_logits : (void *)logits, bf16,
                  1))
        return 1;
    if (bf16 && bf16_to_f32((const uint16_t *)act_logits, logits, M, V)) return 1;
    prof_add(on, P_HEAD, &t);
    return 0;
}
