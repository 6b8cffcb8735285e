/* Paged decode attention on the CPU: single-token queries read K/V straight from the cache blocks.
 *
 * The torch path gathers every decode context into a contiguous buffer (a read and a write of the
 * whole context per layer) before scaled_dot_product_attention reads it again. This kernel reads
 * each cached K and V row exactly once, through the block table, and uses it for all the query
 * heads of its group (GQA), so the context moves through memory once per layer.
 *
 * Layouts (all contiguous, row-major):
 *   q        (B, H, D)                     float32
 *   k, v     (num_blocks, BS, KVH, D)      float32, or bfloat16 as uint16 bit patterns
 *   tables   (B, max_blocks)               int64, block ids of each request in token order
 *   lens     (B,)                          int64, tokens to attend to (the new one included)
 *   out      (B, H, D)                     float32
 * Query head h attends with KV head h / (H / KVH), as Hugging Face's repeat_kv pairs them.
 * Scores, softmax and the weighted sum are computed in float32 whatever the cache dtype.
 *
 * Work is split over (request, KV head) pairs, run by phaselab's thread pool (pool.c, set with
 * paged_decode_set_pool) or, without it, by the process's OpenMP runtime (the one torch loaded:
 * same SONAME); the thread count is OpenMP's either way.
 * Built by phaselab/model/kernels/__init__.py (-O3 -march=native -ffast-math -fopenmp).
 * Returns 0 on success, 1 for unsupported shapes, 2 when scratch memory cannot be allocated.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MAX_HEAD_DIM 512

/* cached element i as float32: a float32 cache, or bf16 bit patterns widened in a register (no
 * copy through a buffer; with `bf16` a constant after inlining, the loops vectorize either way) */
static inline __attribute__((always_inline)) float cached(const void *cache, int bf16, int64_t i) {
    if (!bf16) return ((const float *)cache)[i];
    union { uint32_t u; float f; } c = {.u = ((uint32_t)((const uint16_t *)cache)[i]) << 16};
    return c.f;
}

/* softmax in place. Where AVX-512 or AVX2 is compiled the exponentials are simd.h's vector exp (scalar
 * expf was a call per score: at batch 32 with 512-token contexts, 4.6 million calls a step) */
static inline void softmax_row(float *s, int64_t len) {
    float m = -FLT_MAX, sum = 0.f;
    int64_t t = 0;
#if PL_AVX512
    __m512 mv = _mm512_set1_ps(-FLT_MAX);
    for (; t + 16 <= len; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t));
    m = _mm512_reduce_max_ps(mv);
#elif PL_AVX2
    __m256 mv = _mm256_set1_ps(-FLT_MAX);
    for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    m = hmax8(mv);
#endif
    for (; t < len; t++) m = s[t] > m ? s[t] : m;
    t = 0;
#if PL_AVX512
    const __m512 mm = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (; t + 16 <= len; t += 16) {
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), mm));
        _mm512_storeu_ps(s + t, e);
        acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#elif PL_AVX2
    const __m256 mm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp_ps8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mm));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hadd8(acc);
#endif
    for (; t < len; t++) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (t = 0; t < len; t++) s[t] *= inv;
}

/* Query heads [h0*G, (h0+nh)*G) of one request against KV heads [h0, h0+nh): for each cached
 * token, its K (then V) row of these nh KV heads is one contiguous read, used by all nh*G query
 * heads. With nh = KVH a request's whole context streams through memory exactly once. */
static inline __attribute__((always_inline)) void attend_one(
    const float *q, const void *k, const void *v, int bf16, const int64_t *table, int64_t len, int64_t h0,
    int64_t nh, int64_t G, int64_t KVH, int64_t D, int64_t BS, float scale, float *scores, float *acc,
    float *qg, float *out) {
    const int64_t Q = nh * G; /* query heads handled here */
    for (int64_t j = 0; j < Q * D; j++) qg[j] = q[j] * scale;
    /* scores[j][t] = q_j . k_t(head of j) */
    for (int64_t t0 = 0; t0 < len; t0 += BS) { /* block by block: no division per token */
        const int64_t base = table[t0 / BS] * BS, n = len - t0 < BS ? len - t0 : BS;
        for (int64_t i = 0; i < n; i++) {
            const int64_t row = ((base + i) * KVH + h0) * D;
            for (int64_t j = 0; j < Q; j++) {
                const float *qq = qg + j * D;
                const int64_t kk = row + (j / G) * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; d++) s += qq[d] * cached(k, bf16, kk + d);
                scores[j * len + t0 + i] = s;
            }
        }
    }
    for (int64_t j = 0; j < Q; j++) softmax_row(scores + j * len, len); /* each query head's */
    /* out_j = sum_t p_j[t] v_t(head of j) */
    memset(acc, 0, sizeof(float) * (size_t)(Q * D));
    for (int64_t t0 = 0; t0 < len; t0 += BS) {
        const int64_t base = table[t0 / BS] * BS, n = len - t0 < BS ? len - t0 : BS;
        for (int64_t i = 0; i < n; i++) {
            const int64_t row = ((base + i) * KVH + h0) * D;
            for (int64_t j = 0; j < Q; j++) {
                const float p = scores[j * len + t0 + i];
                const int64_t vv = row + (j / G) * D;
                float *a = acc + j * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) a[d] += p * cached(v, bf16, vv + d);
            }
        }
    }
    memcpy(out, acc, sizeof(float) * (size_t)(Q * D));
}

#define ATTEND_ARGS                                                                                         \
    const float *q, const void *k, const void *v, int bf16, const int64_t *table, int64_t len, int64_t h0, \
        int64_t nh, int64_t G, int64_t KVH, int64_t D, int64_t BS, float scale, float *scores, float *acc,   \
        float *qg, float *out
typedef void (*attend_fn)(ATTEND_ARGS);

/* the common head sizes get their own copy, with D a constant the compiler unrolls, and so does
 * the cache dtype (`bf16` a literal: one loop per dtype, no branch in it) */
#define ATTEND_CALL(BF16, DIM) \
    attend_one(q, k, v, BF16, table, len, h0, nh, G, KVH, DIM, BS, scale, scores, acc, qg, out)
static void attend_d64(ATTEND_ARGS) {
    (void)D;
    if (bf16) ATTEND_CALL(1, 64); else ATTEND_CALL(0, 64);
}
static void attend_d128(ATTEND_ARGS) {
    (void)D;
    if (bf16) ATTEND_CALL(1, 128); else ATTEND_CALL(0, 128);
}
static void attend_any(ATTEND_ARGS) {
    if (bf16) ATTEND_CALL(1, D); else ATTEND_CALL(0, D);
}

/* set by paged_decode_set_pool (pool.c's phaselab_pool_run); NULL: OpenMP's team */
static pool_run_fn g_pool_run = NULL;
void paged_decode_set_pool(void *fn) { g_pool_run = (pool_run_fn)fn; }

typedef struct {
    const float *q;
    const void *k, *v;
    int bf16;
    const int64_t *tables;
    int64_t max_blocks;
    const int64_t *lens;
    float *out;
    int64_t H, KVH, D, BS, G, nh, per_request;
    float scale;
    attend_fn attend;
    int64_t score_len; /* scratch floats for scores: nh * G * the longest context */
    atomic_int failed;
} pd_job;

/* each thread's scratch, grown on demand and kept (no allocation per call once warm) */
static _Thread_local float *tl_buf = NULL;
static _Thread_local size_t tl_len = 0;

static float *scratch(size_t n) {
    if (n > tl_len) {
        float *b = realloc(tl_buf, n * sizeof(float));
        if (!b) return NULL;
        tl_buf = b;
        tl_len = n;
    }
    return tl_buf;
}

static void pd_item(void *ctx, int64_t item) {
    pd_job *j = (pd_job *)ctx;
    const int64_t per_head = j->nh * j->G * j->D;
    float *buf = scratch((size_t)(j->score_len + 2 * per_head));
    if (!buf) {
        atomic_store(&j->failed, 1);
        return;
    }
    const int64_t b = item / j->per_request, h0 = (item % j->per_request) * j->nh;
    j->attend(j->q + (b * j->H + h0 * j->G) * j->D, j->k, j->v, j->bf16, j->tables + b * j->max_blocks, j->lens[b],
              h0, j->nh, j->G, j->KVH, j->D, j->BS, j->scale, buf, buf + j->score_len, buf + j->score_len + per_head,
              j->out + (b * j->H + h0 * j->G) * j->D);
}

int paged_decode(const float *q, const void *k, const void *v, int bf16, const int64_t *tables,
                 int64_t max_blocks, const int64_t *lens, float *out, int64_t B, int64_t H, int64_t KVH,
                 int64_t D, int64_t BS, float scale) {
    if (KVH <= 0 || H % KVH != 0 || D <= 0 || D > MAX_HEAD_DIM || BS <= 0) return 1;
    const int64_t G = H / KVH;
    const attend_fn attend = D == 64 ? attend_d64 : D == 128 ? attend_d128 : attend_any;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) {
        if (lens[b] <= 0 || lens[b] > max_blocks * BS) return 1;
        if (lens[b] > max_len) max_len = lens[b];
    }
    /* one work item per request (all KV heads: one pass over its context) when there are enough
     * requests to keep every thread busy, else one per (request, KV head) */
    const int64_t nh = B >= 2 * (int64_t)omp_get_max_threads() ? KVH : 1;
    pd_job j = {q, k, v, bf16, tables, max_blocks, lens, out, H, KVH, D, BS, G, nh, KVH / nh, scale, attend,
                nh * G * max_len, 0};
    const int64_t items = B * j.per_request;
    if (g_pool_run) {
        g_pool_run(pd_item, &j, items);
    } else {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) pd_item(&j, item);
    }
    return atomic_load(&j.failed) ? 2 : 0;
}

/* -- a decode-only batch's attention glue in one call (bf16 activations and cache) ---------------
 *
 * What the torch path runs between the fused qkv projection and o_proj, per layer: RoPE on the q
 * and k heads (bf16 elementwise ops), the K/V write into the cache slots, the widening of q to
 * float32, the kernel above, and the narrowing of its output to bf16: about 25 small torch ops
 * per layer, most of a batch-1 step's time outside the matmuls. Here the same arithmetic runs in
 * one call, rounded exactly where torch rounds, so the result is bit-identical:
 *   RoPE   y = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), each product of two bf16 values
 *          exact in float32 (as torch computes a bf16 op: widen, compute in float32, round to
 *          nearest even), cos/sin the caller's bf16 tables of each row's position
 *   cache  the rotated k and the v rows of every request written to its slot, before any reads
 *   out    float32 attention rounded to bf16 (nearest even), (B, H*D)
 * qkv rows are [q heads | k heads | v heads], `stride` elements apart. Returns like paged_decode. */

/* one head's RoPE; rotate_half(x) = [-x2, x1]; the halves in separate loops so they vectorize */
static inline float rope_one(uint16_t x, uint16_t xr_bits, int neg, uint16_t c, uint16_t s) {
    const float xr = neg ? -bf16f(xr_bits) : bf16f(xr_bits);
    return bf16f(f32_bf16(bf16f(f32_bf16(bf16f(x) * bf16f(c))) + bf16f(f32_bf16(xr * bf16f(s)))));
}

static void rope_row(const uint16_t *x, const uint16_t *c, const uint16_t *s, int64_t D, float *qd, uint16_t *kd) {
    const int64_t half = D / 2;
    if (qd) {
        for (int64_t d = 0; d < half; d++) qd[d] = rope_one(x[d], x[d + half], 1, c[d], s[d]);
        for (int64_t d = half; d < D; d++) qd[d] = rope_one(x[d], x[d - half], 0, c[d], s[d]);
    } else {
        for (int64_t d = 0; d < half; d++) kd[d] = f32_bf16(rope_one(x[d], x[d + half], 1, c[d], s[d]));
        for (int64_t d = half; d < D; d++) kd[d] = f32_bf16(rope_one(x[d], x[d - half], 0, c[d], s[d]));
    }
}

static _Thread_local float *tl_io = NULL; /* the caller's float32 q (and bf16's output), grown on demand */
static _Thread_local size_t tl_io_len = 0;

static float *io_buffer(size_t n) {
    if (n > tl_io_len) {
        float *b = realloc(tl_io, n * sizeof(float));
        if (!b) return NULL;
        tl_io = b;
        tl_io_len = n;
    }
    return tl_io;
}

/* what both fused calls accept: GQA groups, an even head size within MAX_HEAD_DIM, whole qkv rows */
static int fused_shape_ok(int64_t stride, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS) {
    return KVH > 0 && H % KVH == 0 && D > 0 && D % 2 == 0 && D <= MAX_HEAD_DIM && BS > 0 && B > 0 &&
           stride >= (H + 2 * KVH) * D;
}

int decode_rope_attend(const uint16_t *qkv, int64_t stride, const uint16_t *cos, const uint16_t *sin, uint16_t *kc,
                       uint16_t *vc, const int64_t *slots, const int64_t *tables, int64_t max_blocks,
                       const int64_t *lens, uint16_t *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS,
                       float scale) {
    if (!fused_shape_ok(stride, B, H, KVH, D, BS)) return 1;
    float *qf = io_buffer((size_t)(2 * B * H * D));
    if (!qf) return 2;
    float *of = qf + B * H * D;
    for (int64_t b = 0; b < B; b++) {
        const uint16_t *row = qkv + b * stride, *c = cos + b * D, *sn = sin + b * D;
        const int64_t slot = slots[b];
        for (int64_t h = 0; h < H; h++) rope_row(row + h * D, c, sn, D, qf + (b * H + h) * D, NULL);
        for (int64_t h = 0; h < KVH; h++) rope_row(row + (H + h) * D, c, sn, D, NULL, kc + (slot * KVH + h) * D);
        memcpy(vc + slot * KVH * D, row + (H + KVH) * D, sizeof(uint16_t) * (size_t)(KVH * D));
    }
    const int rc = paged_decode(qf, kc, vc, 1, tables, max_blocks, lens, of, B, H, KVH, D, BS, scale);
    if (rc != 0) return rc;
    for (int64_t i = 0; i < B * H * D; i++) out[i] = f32_bf16(of[i]);
    return 0;
}

/* decode_rope_attend for a float32 model: the same call with float32 qkv, tables, cache and output.
 * torch's float32 RoPE rounds each product and the sum once, x * cos + rotate_half(x) * sin with no
 * fused multiply-add; the library is built with contraction allowed, so this function turns it off
 * (bit-identical to apply_rope + write_kv + paged_decode; tests/test_attention_fused.py). */
__attribute__((optimize("fp-contract=off"))) static void rope_row_f32(const float *x, const float *c,
                                                                      const float *s, int64_t D, float *y) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < half; d++) {
        const float a = x[d] * c[d], b = -x[d + half] * s[d];
        y[d] = a + b;
    }
    for (int64_t d = half; d < D; d++) {
        const float a = x[d] * c[d], b = x[d - half] * s[d];
        y[d] = a + b;
    }
}

int decode_rope_attend_f32(const float *qkv, int64_t stride, const float *cos, const float *sin, float *kc, float *vc,
                           const int64_t *slots, const int64_t *tables, int64_t max_blocks, const int64_t *lens,
                           float *out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale) {
    if (!fused_shape_ok(stride, B, H, KVH, D, BS)) return 1;
    float *qf = io_buffer((size_t)(B * H * D)); /* the output goes straight to `out` */
    if (!qf) return 2;
    for (int64_t b = 0; b < B; b++) {
        const float *row = qkv + b * stride, *c = cos + b * D, *sn = sin + b * D;
        const int64_t slot = slots[b];
        for (int64_t h = 0; h < H; h++) rope_row_f32(row + h * D, c, sn, D, qf + (b * H + h) * D);
        for (int64_t h = 0; h < KVH; h++) rope_row_f32(row + (H + h) * D, c, sn, D, kc + (slot * KVH + h) * D);
        memcpy(vc + slot * KVH * D, row + (H + KVH) * D, sizeof(float) * (size_t)(KVH * D));
    }
    return paged_decode(qf, kc, vc, 0, tables, max_blocks, lens, out, B, H, KVH, D, BS, scale);
}

/* -- RoPE + K/V write for any batch (prefill chunks, mixed steps) ------------------------------
 * The same roundings as decode_rope_attend's first half (bit-identical to apply_rope + write_kv),
 * for T rows of a step that the fused decode call does not cover: the rotated q heads go to q_out
 * (T, H, D) bf16 for the attention kernels, the rotated k and the v rows to their cache slots.
 * Rows are split over the pool in items of 16 when there are enough of them. Returns like above. */
typedef struct {
    const uint16_t *qkv, *cos, *sin;
    uint16_t *kc, *vc, *q_out;
    const int64_t *slots;
    int64_t stride, T, H, KVH, D;
} rw_job;

#define RW_ROWS 16

static void rw_item(void *ctx, int64_t item) {
    const rw_job *j = (const rw_job *)ctx;
    const int64_t H = j->H, KVH = j->KVH, D = j->D, end = (item + 1) * RW_ROWS < j->T ? (item + 1) * RW_ROWS : j->T;
    for (int64_t b = item * RW_ROWS; b < end; b++) {
        const uint16_t *row = j->qkv + b * j->stride, *c = j->cos + b * D, *sn = j->sin + b * D;
        const int64_t slot = j->slots[b];
        for (int64_t h = 0; h < H; h++) rope_row(row + h * D, c, sn, D, NULL, j->q_out + (b * H + h) * D);
        for (int64_t h = 0; h < KVH; h++) rope_row(row + (H + h) * D, c, sn, D, NULL, j->kc + (slot * KVH + h) * D);
        memcpy(j->vc + slot * KVH * D, row + (H + KVH) * D, sizeof(uint16_t) * (size_t)(KVH * D));
    }
}

int rope_write_kv(const uint16_t *qkv, int64_t stride, const uint16_t *cos, const uint16_t *sin, uint16_t *kc,
                  uint16_t *vc, const int64_t *slots, uint16_t *q_out, int64_t T, int64_t H, int64_t KVH, int64_t D) {
    if (KVH <= 0 || H % KVH != 0 || D <= 0 || D % 2 != 0 || T < 0 || stride < (H + 2 * KVH) * D) return 1;
    rw_job j = {qkv, cos, sin, kc, vc, q_out, slots, stride, T, H, KVH, D};
    const int64_t items = (T + RW_ROWS - 1) / RW_ROWS;
    if (g_pool_run && items > 1) {
        g_pool_run(rw_item, &j, items);
    } else {
        for (int64_t i = 0; i < items; i++) rw_item(&j, i);
    }
    return 0;
}

int phaselab_kernel_abi(void) { return 9; }
