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
 * Scores are summed in float32 (on AVX512-BF16 from exact bf16 products), softmax and the weighted
 * sum computed in float32, whatever the cache dtype.
 *
 * Work is split over (request, 128-token part, KV head or all of them) items (see PART below), run
 * by phaselab's thread pool (pool.c, set with paged_decode_set_pool) or, without it, by the
 * process's OpenMP runtime (the one torch loaded: same SONAME); the thread count is OpenMP's
 * either way.
 * Built by phaselab/model/kernels/library.py into the one kernel library (build.py: -O3 -march=native,
 * the vectorizing parts of -ffast-math, -fopenmp).
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

/* exp(s[t] - max) in place over one part's scores; returns the sum, *m_out the max. Where AVX-512
 * or AVX2 is compiled the exponentials are simd.h's vector exp (scalar expf was a call per score: at
 * batch 32 with 512-token contexts, 4.6 million calls a step) */
static inline float exp_row(float *s, int64_t len, float *m_out) {
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
    *m_out = m;
    return sum;
}

/* A request's context is cut into parts of PART tokens (split-K, "flash decoding"): one work item
 * is one part against one KV head or all of them (pd_item), for their query heads. It leaves, per
 * query head, the part's max score m, l = sum exp(s - m) and acc = sum exp(s - m) v; the item that
 * finishes a (request, head group) last merges its parts in part order. The parts are fixed token
 * ranges, so a request's result does not depend on the batch around it or on which thread ran
 * what (batched = alone, bit for bit), and at batch 1 a 512-token context is 4 part items for 2
 * threads to share (before, KVH = 3 items on 2 threads: one thread did two thirds). */
#define PART 128
#define PREFETCH_PART (64 * 1024) /* bytes of a part's K, and of its V, requested before its arithmetic */

/* each cached token's element offset in the cache (block table walked once per part) */
static inline void part_rows(const int64_t *table, int64_t t0, int64_t t1, int64_t h, int64_t KVH, int64_t D,
                             int64_t BS, int64_t *rows) {
    for (int64_t t = t0; t < t1;) {
        const int64_t base = table[t / BS] * BS, off = t % BS, n = t1 - t < BS - off ? t1 - t : BS - off;
        for (int64_t i = 0; i < n; i++) rows[t - t0 + i] = ((base + off + i) * KVH + h) * D;
        t += n;
    }
}

/* The portable part: float32 loops the compiler vectorizes, any head size, either cache dtype,
 * for the G query heads of each of nh consecutive KV heads at once (query head j reads KV head
 * j / G: a token's K and V rows of all nh heads are one contiguous read). q (nh G, D) unscaled;
 * scores (nh G, PART); qg and acc (nh G, D) scratch; ml (nh G, 2) out. */
static inline __attribute__((always_inline)) void part_loops(
    const float *q, const void *k, const void *v, int bf16, const int64_t *rows, int64_t n, int64_t G, int64_t nh,
    int64_t D, float scale, float *scores, float *qg, float *acc, float *ml) {
    const int64_t Q = nh * G;
    for (int64_t j = 0; j < Q * D; j++) qg[j] = q[j] * scale;
    for (int64_t i = 0; i < n; i++) { /* scores[j][i] = q_j . k_i */
        const int64_t row = rows[i]; /* a local: indexed through rows[i], the loop stayed scalar */
        for (int64_t j = 0; j < Q; j++) {
            const float *qq = qg + j * D;
            const int64_t kk = row + (j / G) * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; d++) s += qq[d] * cached(k, bf16, kk + d);
            scores[j * PART + i] = s;
        }
    }
    for (int64_t j = 0; j < Q; j++) ml[2 * j + 1] = exp_row(scores + j * PART, n, ml + 2 * j);
    /* acc_j = sum_i p_j[i] v_i, summed in this thread's scratch (qg is free now): `acc` is in the
     * caller's buffer beside other threads' parts, where a store per token would share cache lines */
    float *sum = qg;
    memset(sum, 0, sizeof(float) * (size_t)(Q * D));
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = rows[i];
        for (int64_t j = 0; j < Q; j++) {
            const float p = scores[j * PART + i];
            const int64_t vv = row + (j / G) * D;
            float *a = sum + j * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) a[d] += p * cached(v, bf16, vv + d);
        }
    }
    memcpy(acc, sum, sizeof(float) * (size_t)(Q * D));
}

#define PART_ARGS                                                                                         \
    const float *q, const uint16_t *qb, const void *k, const void *v, int bf16, const int64_t *rows, int64_t n, \
        int64_t G, int64_t nh, int64_t D, float scale, float *scores, float *qg, float *acc, float *ml
typedef void (*part_fn)(PART_ARGS);

/* the common head sizes get their own copy, with D a constant the compiler unrolls, and so does
 * the cache dtype (`bf16` a literal: one loop per dtype, no branch in it) */
#define LOOPS_CALL(BF16, DIM) part_loops(q, k, v, BF16, rows, n, G, nh, DIM, scale, scores, qg, acc, ml)
static void loops_d64(PART_ARGS) {
    (void)D, (void)qb;
    if (bf16) LOOPS_CALL(1, 64); else LOOPS_CALL(0, 64);
}
static void loops_d128(PART_ARGS) {
    (void)D, (void)qb;
    if (bf16) LOOPS_CALL(1, 128); else LOOPS_CALL(0, 128);
}
static void loops_any(PART_ARGS) {
    (void)qb;
    if (bf16) LOOPS_CALL(1, D); else LOOPS_CALL(0, D);
}

#if PL_AVX512 && defined(__AVX512BF16__)
#define PD_DPBF16 1
/* 16 vectors -> one vector of their 16 horizontal sums, in order: 15 adds and 30 shuffles for 16
 * dot products (a reduce per vector is 4 adds and 4 shuffles each). Lane 4L + k of the tree's
 * result holds v[L + 4k]; the final permute puts v[i] in lane i. */
static inline __m512 sum16(const __m512 *v) {
    __m512 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++) /* [v0's 8 partial sums | v1's 8] */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* four vectors' 4 partial sums, one per 128-bit lane */
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) z[i] = _mm512_add_ps(_mm512_unpacklo_ps(y[2 * i], y[2 * i + 1]),
                                                     _mm512_unpackhi_ps(y[2 * i], y[2 * i + 1]));
    const __m512 r = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[1]))));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* acc (NJ heads, D) = sum_i p_j[i] v_i: each V row widened once for NJ heads' float32 FMAs */
static inline __attribute__((always_inline)) void pv_heads(const uint16_t *v, const int64_t *rows, int64_t n,
                                                           const float *p, int NJ, int D, float *acc) {
    __m512 a[16];
    for (int c = 0; c < NJ * D / 16; c++) a[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *vr = v + rows[i];
        if (i + 8 < n)
            for (int c = 0; c < D / 32; c++) _mm_prefetch((const char *)(v + rows[i + 8] + 32 * c), _MM_HINT_T0);
        __m512 w[8];
        for (int c = 0; c < D / 16; c++) w[c] = widen16(vr + 16 * c);
        for (int j = 0; j < NJ; j++) {
            const __m512 pj = _mm512_set1_ps(p[j * PART + i]);
            for (int c = 0; c < D / 16; c++) a[j * (D / 16) + c] = _mm512_fmadd_ps(pj, w[c], a[j * (D / 16) + c]);
        }
    }
    for (int c = 0; c < NJ * D / 16; c++) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

/* The AVX512-BF16 part (bf16 cache, head size DIM = 64 or 128, q exactly bf16: qb): scores as
 * vdpbf16ps dot products of the bf16 q and K rows (every product exact in float32, sums in float32),
 * 16 tokens at a time reduced by sum16, then scaled; softmax as above; P.V in float32 FMAs. */
static inline __attribute__((always_inline)) void part_dp(const uint16_t *qb, const uint16_t *k, const uint16_t *v,
                                                          const int64_t *rows, int64_t n, int64_t G, int DIM,
                                                          float scale, float *scores, float *acc, float *ml) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t j = 0; j < G; j++) {
        __m512bh qv[4];
        for (int c = 0; c < DIM / 32; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qb + j * DIM + 32 * c);
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
            __m512 d[16];
            for (int u = 0; u < 16; u++) {
                d[u] = _mm512_setzero_ps();
                if (j == 0 && i0 + u + 16 < n) /* the next 16 rows, while these compute (first head only) */
                    for (int c = 0; c < DIM / 32; c++) _mm_prefetch((const char *)(k + rows[i0 + u + 16] + 32 * c), _MM_HINT_T0);
                if (i0 + u < n) {
                    const uint16_t *kr = k + rows[i0 + u];
                    for (int c = 0; c < DIM / 32; c++)
                        d[u] = _mm512_dpbf16_ps(d[u], (__m512bh)_mm512_loadu_si512(kr + 32 * c), qv[c]);
                }
            }
            const __m512 r = _mm512_mul_ps(sum16(d), sc);
            if (i0 + 16 <= n) _mm512_storeu_ps(scores + j * PART + i0, r);
            else _mm512_mask_storeu_ps(scores + j * PART + i0, (__mmask16)((1u << (n - i0)) - 1), r);
        }
        ml[2 * j + 1] = exp_row(scores + j * PART, n, ml + 2 * j);
    }
    const int per = DIM == 64 ? 4 : 2; /* query heads per V pass: 16 accumulators at most */
    for (int64_t j = 0; j < G; j += per) {
        const int64_t nj = G - j < per ? G - j : per;
        float *pa = acc + j * DIM;
        const float *pp = scores + j * PART;
        /* literal head counts, so the accumulators stay in registers */
        if (DIM == 64 && nj == 4) pv_heads(v, rows, n, pp, 4, 64, pa);
        else if (DIM == 64 && nj == 3) pv_heads(v, rows, n, pp, 3, 64, pa);
        else if (nj == 2) pv_heads(v, rows, n, pp, 2, DIM, pa);
        else pv_heads(v, rows, n, pp, 1, DIM, pa);
    }
}

/* the nh KV heads one after another over the same rows (the later ones' rows then come from L2) */
#define DP_CALL(DIM)                                                                                     \
    for (int64_t h = 0; h < nh; h++)                                                                      \
    part_dp(qb + h * G * DIM, (const uint16_t *)k + h * DIM, (const uint16_t *)v + h * DIM, rows, n, G, DIM, \
            scale, scores, acc + h * G * DIM, ml + h * G * 2)
static void dp_d64(PART_ARGS) {
    (void)q, (void)bf16, (void)D, (void)qg;
    DP_CALL(64);
}
static void dp_d128(PART_ARGS) {
    (void)q, (void)bf16, (void)D, (void)qg;
    DP_CALL(128);
}
#else
#define PD_DPBF16 0
#endif

/* set by paged_decode_set_pool (pool.c's phaselab_pool_run); NULL: OpenMP's team */
static pool_run_fn g_pool_run = NULL;
void paged_decode_set_pool(void *fn) { g_pool_run = (pool_run_fn)fn; }

/* the part kernel: 0 auto (AVX512-BF16 where compiled and the call qualifies), 1 the same, forced
 * for tests (a call that does not qualify still takes the loops), 2 the portable loops
 * (PHASELAB_DECODE_ATTN, kernels.decode_attn_mode) */
static int g_mode = 0;
void paged_decode_set_mode(int mode) { g_mode = mode; }
/* bit 0: the AVX512-BF16 part kernel is compiled in */
int paged_decode_features(void) { return PD_DPBF16; }

typedef struct {
    const float *q;
    const uint16_t *qb;
    const void *k, *v;
    int bf16;
    const int64_t *tables;
    int64_t max_blocks;
    const int64_t *lens;
    float *out;
    int64_t H, KVH, D, BS, G;
    int64_t nh, parts; /* KV heads per item; parts: the most of any request */
    float scale;
    part_fn part;
    float *part_acc;   /* (B, KVH / nh, parts, nh * G, D) */
    float *part_ml;    /* (B, KVH / nh, parts, nh * G, 2) */
    atomic_int *done;  /* (B, KVH / nh) parts finished */
    atomic_int failed;
} pd_job;

static _Thread_local pl_buf tl_scratch; /* the thread running a part: its scores and sums */

/* out (Q, D) of one (request, KV head group) from its np parts, Q = nh * G query heads, in part
 * order: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p with M the largest m_p */
static void merge_parts(const pd_job *j, int64_t first, int64_t np, float *out) {
    const int64_t Q = j->nh * j->G, D = j->D;
    for (int64_t h = 0; h < Q; h++) {
        float M = -FLT_MAX, L = 0.f;
        for (int64_t p = 0; p < np; p++) {
            const float m = j->part_ml[((first + p) * Q + h) * 2];
            M = m > M ? m : M;
        }
        float *o = out + h * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.f;
        for (int64_t p = 0; p < np; p++) {
            const float *ml = j->part_ml + ((first + p) * Q + h) * 2, *a = j->part_acc + ((first + p) * Q + h) * D;
            const float w = expf(ml[0] - M);
            L += w * ml[1];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] += w * a[d];
        }
        for (int64_t d = 0; d < D; d++) o[d] /= L;
    }
}

/* One item: part p of request b against KV heads [h0, h0 + nh), over the same cached rows: with
 * nh = KVH a part's K and V rows (all heads of a token, contiguous) come from memory once. How
 * heads are grouped into items does not change a bit of the result (each head's parts are computed
 * and merged the same way): only the part boundaries could, and they are fixed. */
static void pd_item(void *ctx, int64_t item) {
    pd_job *j = (pd_job *)ctx;
    const int64_t G = j->G, D = j->D, nh = j->nh, Q = nh * G, bg = item / j->parts, p = item % j->parts;
    const int64_t groups = j->KVH / nh, b = bg / groups, h0 = (bg % groups) * nh, len = j->lens[b], t0 = p * PART;
    if (t0 >= len) return; /* a shorter request than the longest: no such part */
    const int64_t t1 = len - t0 < PART ? len : t0 + PART, np = (len + PART - 1) / PART;
    float *buf = pl_grow(&tl_scratch, sizeof(float) * (size_t)(Q * PART + Q * D));
    if (!buf) {
        atomic_store(&j->failed, 1);
        return;
    }
    int64_t rows[PART];
    part_rows(j->tables + b * j->max_blocks, t0, t1, h0, j->KVH, D, j->BS, rows);
    /* The part's K rows, then its V rows, requested towards L2 all at once before any arithmetic. The
     * loops' own prefetches run 8-16 tokens ahead, about 25 ns of arithmetic against ~100 ns from
     * memory: a batch-1 layer streamed its context at 14 GB/s, about 60% of the read bandwidth.
     * Requested up front, 512 tokens took 25.8 us a layer instead of 29.5 and 8 x 512 217 instead of
     * 242 (AMX Xeon, decode_attention.py, contexts streamed from memory). At most PREFETCH_PART bytes
     * of each (a part of a model with wide KV heads is more than an L2 holds: 128 tokens x 8 heads x
     * 128 x 2 bytes is 256 KiB a side); the loops' prefetches cover the rest. */
    {
        const int64_t el = j->bf16 ? 2 : 4, row_bytes = nh * D * el;
        const int64_t n = (t1 - t0) * row_bytes <= PREFETCH_PART ? t1 - t0 : PREFETCH_PART / row_bytes;
        const char *kb = (const char *)j->k, *vb = (const char *)j->v;
        for (int64_t i = 0; i < n; i++)
            for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(kb + rows[i] * el + o, 0, 2);
        for (int64_t i = 0; i < n; i++)
            for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(vb + rows[i] * el + o, 0, 2);
    }
    const int64_t qoff = (b * j->H + h0 * G) * D; /* query heads h0 G .. (h0 + nh) G, contiguous */
    j->part(j->q + qoff, j->qb ? j->qb + qoff : NULL, j->k, j->v, j->bf16, rows, t1 - t0, G, nh, D, j->scale, buf,
            buf + Q * PART, j->part_acc + item * Q * D, j->part_ml + item * Q * 2);
    /* the last part of this (request, head group) to finish merges them all (acq_rel: it sees theirs) */
    if (np == 1 || atomic_fetch_add_explicit(&j->done[bg], 1, memory_order_acq_rel) == np - 1)
        merge_parts(j, bg * j->parts, np, j->out + (b * j->H + h0 * G) * D);
}

/* the caller's per-call buffers (partial results, counters, bf16 q); workers write into them, so
 * they belong to the calling thread, not to whichever thread runs a part */
static _Thread_local pl_buf tl_call;

int paged_decode(const float *q, const void *k, const void *v, int bf16, const int64_t *tables,
                 int64_t max_blocks, const int64_t *lens, float *out, int64_t B, int64_t H, int64_t KVH,
                 int64_t D, int64_t BS, float scale) {
    if (KVH <= 0 || H % KVH != 0 || D <= 0 || D > MAX_HEAD_DIM || BS <= 0) return 1;
    const int64_t G = H / KVH;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) {
        if (lens[b] <= 0 || lens[b] > max_blocks * BS) return 1;
        if (lens[b] > max_len) max_len = lens[b];
    }
    /* all KV heads in one item (one pass over each part's rows: a token's K row, all heads, is one
     * stretch of memory) when the parts alone give every thread two or more items; else one KV head
     * per item, so that a short batch still splits evenly. With four parts per thread as the bar, a
     * 512-token request at batch 1 ran 12 one-head items in 32.4 us a layer, with two as the bar 4
     * all-head items in 29.7 (768 tokens: 46.5 and 40.0; AMX Xeon, 2 threads, decode_attention.py) */
    int64_t total_parts = 0;
    for (int64_t b = 0; b < B; b++) total_parts += (lens[b] + PART - 1) / PART;
    const int64_t nh = total_parts >= 2 * (int64_t)omp_get_max_threads() ? KVH : 1;
    const int64_t parts = (max_len + PART - 1) / PART, items = B * (KVH / nh) * parts;
    const size_t n_acc = (size_t)(items * nh * G * D), n_ml = (size_t)(items * nh * G * 2);
    const size_t n_done = (size_t)(B * (KVH / nh)), n_qb = (size_t)(B * H * D);
    char *raw = pl_grow(&tl_call, sizeof(float) * (n_acc + n_ml) + sizeof(atomic_int) * n_done + 2 * n_qb + 128);
    if (!raw) return 2;
    char *buf = (char *)(((uintptr_t)raw + 63) & ~(uintptr_t)63); /* parts' sums on whole cache lines */
    pd_job j = {q, NULL, k, v, bf16, tables, max_blocks, lens, out, H, KVH, D, BS, G, nh, parts, scale,
                D == 64 ? loops_d64 : D == 128 ? loops_d128 : loops_any, (float *)buf, (float *)buf + n_acc,
                (atomic_int *)((float *)buf + n_acc + n_ml), 0};
    for (size_t i = 0; i < n_done; i++) atomic_init(&j.done[i], 0);
#if PD_DPBF16
    if (g_mode != 2 && bf16 && (D == 64 || D == 128)) {
        /* q as bf16, when every value is one (the bf16 model's RoPE output is): else the loops */
        uint16_t *qb = (uint16_t *)(((uintptr_t)(j.done + n_done) + 63) & ~(uintptr_t)63);
        int exact = 1;
        for (size_t i = 0; i < n_qb && exact; i++) {
            qb[i] = f32_bf16(q[i]);
            exact = bf16f(qb[i]) == q[i];
        }
        if (exact) {
            j.qb = qb;
            j.part = D == 64 ? dp_d64 : dp_d128;
        }
    }
#endif
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

static _Thread_local pl_buf tl_io; /* the caller's float32 q (and bf16's output) */

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
    float *qf = pl_grow(&tl_io, sizeof(float) * (size_t)(2 * B * H * D));
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
    float *qf = pl_grow(&tl_io, sizeof(float) * (size_t)(B * H * D)); /* the output goes straight to `out` */
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

/* The ABI of the whole kernel library (every source library.py compiles into it: the signatures it
 * declares); library.py refuses a build that answers another number. One number for all of them. */
int phaselab_kernel_abi(void) { return 13; }
