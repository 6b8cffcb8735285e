/* The decoder layer's elementwise glue in bf16 (and float32, at the end of the file), one call each
 * instead of several torch ops:
 *
 *   add_rms_norm  residual = bf16(x + residual) (in place; x may be NULL: no add), then
 *                 out = bf16(w * bf16(residual * rsqrt(mean(residual^2) + eps)))
 *                 torch's order of roundings (statistics in float32, the product with the weight
 *                 rounded once more), as RMSNorm.forward and `h + attn(...)` compute them
 *   silu_mul      out = bf16(bf16(silu(gate)) * up) for rows [gate | up] of a fused projection
 *
 * In torch each is 3-6 ops that each widen, compute and narrow a whole tensor: at batch 1 about
 * 9 ops x 30 layers of dispatch (a quarter of the step), at a 2048-token prefill ~190 ms of passes
 * over memory. Results equal torch's up to the last bit of a float32 sum order (the mean of
 * squares) and of exp (silu): a bf16 rounding can differ by one unit where the exact value sits on
 * a rounding boundary (tests/test_elementwise.py counts them).
 * Rows are split over phaselab's pool (elementwise_set_pool) when there are enough of them.
 * Returns 0, or 1 for an unsupported shape.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define EW_AVX512 PL_AVX512

static pool_run_fn g_pool_run = NULL;
void elementwise_set_pool(void *fn) { g_pool_run = (pool_run_fn)fn; }

#define ROWS_PER_ITEM 16
#define MIN_POOLED_ELEMS 65536 /* below this a call runs on the caller alone (waking workers costs more) */

static void run_rows(chunk_fn fn, void *ctx, int64_t rows, int64_t elems) {
    const int64_t items = (rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    if (g_pool_run && elems >= MIN_POOLED_ELEMS && items > 1) {
        g_pool_run(fn, ctx, items);
        return;
    }
    for (int64_t i = 0; i < items; i++) fn(ctx, i);
}

#if EW_AVX512
static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* round to nearest even (NaN made quiet), as torch narrows float32 to bf16 */
static inline __m512 round_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline void store_bf16(uint16_t *p, __m512 rounded) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}
#endif

/* -- add + RMSNorm -------------------------------------------------------------------------- */
typedef struct {
    const uint16_t *x, *w;
    uint16_t *res, *out;
    int64_t T, N;
    float eps;
} norm_job;

static void norm_item(void *ctx, int64_t item) {
    const norm_job *j = (const norm_job *)ctx;
    const int64_t N = j->N, r1 = (item + 1) * ROWS_PER_ITEM < j->T ? (item + 1) * ROWS_PER_ITEM : j->T;
    for (int64_t r = item * ROWS_PER_ITEM; r < r1; r++) {
        uint16_t *res = j->res + r * N, *out = j->out + r * N;
        const uint16_t *x = j->x ? j->x + r * N : NULL;
        int64_t i = 0;
        float ss = 0.f;
#if EW_AVX512
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= N; i += 16) {
            __m512 v = load_bf16(res + i);
            if (x) {
                v = round_bf16(_mm512_add_ps(load_bf16(x + i), v));
                store_bf16(res + i, v);
            }
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
#endif
        for (; i < N; i++) {
            float v = bf16f(res[i]);
            if (x) {
                res[i] = f32_bf16(bf16f(x[i]) + v);
                v = bf16f(res[i]);
            }
            ss += v * v;
        }
        const float inv = 1.f / sqrtf(ss / (float)N + j->eps);
        i = 0;
#if EW_AVX512
        const __m512 iv = _mm512_set1_ps(inv);
        for (; i + 16 <= N; i += 16) {
            const __m512 y = round_bf16(_mm512_mul_ps(load_bf16(res + i), iv));
            store_bf16(out + i, round_bf16(_mm512_mul_ps(load_bf16(j->w + i), y)));
        }
#endif
        for (; i < N; i++) out[i] = f32_bf16(bf16f(j->w[i]) * bf16f(f32_bf16(bf16f(res[i]) * inv)));
    }
}

int add_rms_norm(const uint16_t *x, uint16_t *res, const uint16_t *w, uint16_t *out, int64_t T, int64_t N, float eps) {
    if (T < 0 || N <= 0) return 1;
    norm_job j = {x, w, res, out, T, N, eps};
    run_rows(norm_item, &j, T, T * N);
    return 0;
}

/* -- SiLU(gate) * up ------------------------------------------------------------------------- */
typedef struct {
    const uint16_t *gu;
    uint16_t *out;
    int64_t T, N;
} silu_job;

static void silu_item(void *ctx, int64_t item) {
    const silu_job *j = (const silu_job *)ctx;
    const int64_t N = j->N, r1 = (item + 1) * ROWS_PER_ITEM < j->T ? (item + 1) * ROWS_PER_ITEM : j->T;
    for (int64_t r = item * ROWS_PER_ITEM; r < r1; r++) {
        const uint16_t *g = j->gu + r * 2 * N, *u = g + N;
        uint16_t *o = j->out + r * N;
        int64_t i = 0;
#if EW_AVX512
        const __m512 one = _mm512_set1_ps(1.f);
        for (; i + 16 <= N; i += 16) {
            const __m512 gv = load_bf16(g + i);
            const __m512 s = round_bf16(_mm512_div_ps(gv, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
            store_bf16(o + i, round_bf16(_mm512_mul_ps(s, load_bf16(u + i))));
        }
#endif
        for (; i < N; i++) {
            const float gv = bf16f(g[i]);
            o[i] = f32_bf16(bf16f(f32_bf16(gv / (1.f + expf(-gv)))) * bf16f(u[i]));
        }
    }
}

int silu_mul(const uint16_t *gu, uint16_t *out, int64_t T, int64_t N) {
    if (T < 0 || N <= 0) return 1;
    silu_job j = {gu, out, T, N};
    run_rows(silu_item, &j, T, T * N);
    return 0;
}

/* -- the same two in float32 ------------------------------------------------------------------
 * torch's float32 ops compute each step once and round it once; so do these, apart from the sum
 * of squares (its order: vector lanes, then the lanes added) and exp (simd.h's polynomial, ~2e-7
 * relative, where torch uses its own vector exp). tests/test_elementwise.py holds both against a
 * float64 reference with the bound of those differences.
 *   add_rms_norm_f32  residual = x + residual; out = (residual * rsqrt(mean(residual^2) + eps)) * w
 *   silu_mul_f32      out = silu(gate) * up
 * On an AMD EPYC (AVX2) torch's fused rms_norm took 48 us a call at batch 1 (2.9 ms of a 30 ms
 * decode step over 61 calls). */
typedef struct {
    const float *x, *w;
    float *res, *out;
    int64_t T, N;
    float eps;
} norm32_job;

static void norm32_item(void *ctx, int64_t item) {
    const norm32_job *j = (const norm32_job *)ctx;
    const int64_t N = j->N, r1 = (item + 1) * ROWS_PER_ITEM < j->T ? (item + 1) * ROWS_PER_ITEM : j->T;
    for (int64_t r = item * ROWS_PER_ITEM; r < r1; r++) {
        float *res = j->res + r * N, *out = j->out + r * N;
        const float *x = j->x ? j->x + r * N : NULL;
        int64_t i = 0;
        float ss = 0.f;
#if EW_AVX512
        __m512 acc = _mm512_setzero_ps();
        for (; i + 16 <= N; i += 16) {
            __m512 v = _mm512_loadu_ps(res + i);
            if (x) {
                v = _mm512_add_ps(_mm512_loadu_ps(x + i), v);
                _mm512_storeu_ps(res + i, v);
            }
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = _mm512_reduce_add_ps(acc);
#elif PL_AVX2
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= N; i += 8) {
            __m256 v = _mm256_loadu_ps(res + i);
            if (x) {
                v = _mm256_add_ps(_mm256_loadu_ps(x + i), v);
                _mm256_storeu_ps(res + i, v);
            }
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        ss = hadd8(acc);
#endif
        for (; i < N; i++) {
            if (x) res[i] = x[i] + res[i];
            ss += res[i] * res[i];
        }
        const float inv = 1.f / sqrtf(ss / (float)N + j->eps);
        i = 0;
#if EW_AVX512
        const __m512 iv = _mm512_set1_ps(inv);
        for (; i + 16 <= N; i += 16)
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(res + i), iv), _mm512_loadu_ps(j->w + i)));
#elif PL_AVX2
        const __m256 iv = _mm256_set1_ps(inv);
        for (; i + 8 <= N; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(res + i), iv), _mm256_loadu_ps(j->w + i)));
#endif
        for (; i < N; i++) out[i] = (res[i] * inv) * j->w[i];
    }
}

int add_rms_norm_f32(const float *x, float *res, const float *w, float *out, int64_t T, int64_t N, float eps) {
    if (T < 0 || N <= 0) return 1;
    norm32_job j = {x, w, res, out, T, N, eps};
    run_rows(norm32_item, &j, T, T * N);
    return 0;
}

typedef struct {
    const float *gu;
    float *out;
    int64_t T, N;
} silu32_job;

static void silu32_item(void *ctx, int64_t item) {
    const silu32_job *j = (const silu32_job *)ctx;
    const int64_t N = j->N, r1 = (item + 1) * ROWS_PER_ITEM < j->T ? (item + 1) * ROWS_PER_ITEM : j->T;
    for (int64_t r = item * ROWS_PER_ITEM; r < r1; r++) {
        const float *g = j->gu + r * 2 * N, *u = g + N;
        float *o = j->out + r * N;
        int64_t i = 0;
#if EW_AVX512
        const __m512 one = _mm512_set1_ps(1.f);
        for (; i + 16 <= N; i += 16) {
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
        }
#elif PL_AVX2
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= N; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            /* exp_ps8 clamps its power of two at 127: a gate below -88 gives g / (1 + ~2^127), a
             * tiny negative number (torch: -0 or a denormal), never inf / inf */
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp_ps8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < N; i++) o[i] = (g[i] / (1.f + expf(-g[i]))) * u[i];
    }
}

int silu_mul_f32(const float *gu, float *out, int64_t T, int64_t N) {
    if (T < 0 || N <= 0) return 1;
    silu32_job j = {gu, out, T, N};
    run_rows(silu32_item, &j, T, T * N);
    return 0;
}

/* -- the logits: widened to float32, and the greedy pick ---------------------------------------
 * torch runs both as parallel ops above 32768 elements, and on 2 cores under OMP_WAIT_POLICY=PASSIVE
 * waking OpenMP's team cost more than the work: a (1, 49152) bf16 -> float32 copy took 103 us on
 * two threads and 6 on one, argmax 90-165 us (a scalar loop). Here they run on the caller alone
 * for a decode step's few rows and on the pool for many. */
typedef struct {
    const uint16_t *x;
    float *y;
    int64_t T, N;
} widen_job;

static void widen_item(void *ctx, int64_t item) {
    const widen_job *j = (const widen_job *)ctx;
    const int64_t r0 = item * ROWS_PER_ITEM, r1 = r0 + ROWS_PER_ITEM < j->T ? r0 + ROWS_PER_ITEM : j->T;
    const uint16_t *x = j->x + r0 * j->N;
    float *y = j->y + r0 * j->N;
    const int64_t n = (r1 - r0) * j->N;
    for (int64_t i = 0; i < n; i++) y[i] = bf16f(x[i]); /* exact: the bits shifted into place */
}

/* y (T, N) float32 = x (T, N) bf16 */
int bf16_to_f32(const uint16_t *x, float *y, int64_t T, int64_t N) {
    if (T < 0 || N < 0) return 1;
    widen_job j = {x, y, T, N};
    run_rows(widen_item, &j, T, T * N);
    return 0;
}

/* the first index of the largest value of x[0..n), a NaN counting as the largest (the first NaN
 * wins), as torch.argmax picks */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t i = 0, best_i = 0;
    float best = x[0];
#if EW_AVX512
    if (n >= 16) {
        __m512 bv = _mm512_loadu_ps(x);
        __m512i bi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = bi;
        __mmask16 nan = _mm512_cmp_ps_mask(bv, bv, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n && !nan; i += 16) {
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
            const __m512 v = _mm512_loadu_ps(x + i);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ); /* strictly: a lane keeps its first */
            bv = _mm512_mask_mov_ps(bv, gt, v);
            bi = _mm512_mask_mov_epi32(bi, gt, idx);
            nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        if (nan) { /* torch's answer is the first NaN: find it in order */
            for (int64_t t = 0; t < n; t++)
                if (x[t] != x[t]) return t;
        }
        best = _mm512_reduce_max_ps(bv);
        const __mmask16 at = _mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ);
        best_i = _mm512_mask_reduce_min_epi32(at, bi); /* of the lanes holding it, the earliest index */
    }
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > best) {
            best = x[i];
            best_i = i;
        }
    }
    return best_i;
}

typedef struct {
    const float *x;
    int64_t *out;
    int64_t T, N;
} argmax_job;

static void argmax_item(void *ctx, int64_t item) {
    const argmax_job *j = (const argmax_job *)ctx;
    const int64_t r0 = item * ROWS_PER_ITEM, r1 = r0 + ROWS_PER_ITEM < j->T ? r0 + ROWS_PER_ITEM : j->T;
    for (int64_t r = r0; r < r1; r++) j->out[r] = argmax_row(j->x + r * j->N, j->N);
}

/* out (T,) int64 = argmax of each row of x (T, N) float32, N >= 1 */
int argmax_rows(const float *x, int64_t *out, int64_t T, int64_t N) {
    if (T < 0 || N < 1) return 1;
    argmax_job j = {x, out, T, N};
    run_rows(argmax_item, &j, T, T * N);
    return 0;
}
