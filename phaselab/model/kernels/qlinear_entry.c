/* qlinear_entry.c: the linear kernel's exported functions (bound in qlinear.py) and its dispatch.
 *   qlinear               y = x W^T + bias: picks the path (AMX, Q4_1X, four or one weight row at a
 *                         time) from the format, the row count and the process-wide thresholds below,
 *                         prepares the activations, and runs the tier's row chunks (qlinear.h) on the
 *                         pool (qlinear_set_pool) or OpenMP's team
 *   dequant_rows          whole rows widened (the GEMM path of larger row counts, embedding lookups)
 *   qlinear_set_* / qlinear_rows4_min, qlinear_amx_min, qlinear_prefetch
 *                         the thresholds the start-up probes set (kernels/linear_probe.py,
 *                         kernels/prefetch_probe.py)
 *   qlinear_features, qlinear_scratch_floats
 * qlinear_repack, kernel_order_x and dequant_kernel_order are in qlinear_layouts.c. */
#include "qlinear.h"
#include "qlinear_avx2.h"
#include "qlinear_avx512.h"

/* How far ahead in the weight stream a Q4_1X row's bytes are prefetched (the whole row, so that the
 * d/m and tail-block lines are covered too). The best distance depends on the CPU: on the AMD EPYC with AVX512-BF16
 * the step's layers streamed at 24.2 GB/s 2 KiB ahead and 22.3 GB/s 4 KiB ahead (group-based prefetch); on the AMX Xeon a
 * batch-1 step's layers took 3.26 ms 4 KiB ahead and 3.54 ms 2 KiB ahead. So the engine measures it
 * at start-up on the model's own layers (prefetch_probe.choose; PHASELAB_PREFETCH_BYTES
 * forces it) and sets it here. */
#define Q41X_PREFETCH_DEFAULT 2048
QL_HIDDEN int64_t g_q41x_prefetch = Q41X_PREFETCH_DEFAULT;
void qlinear_set_prefetch(int64_t bytes) { g_q41x_prefetch = bytes > 0 ? bytes : Q41X_PREFETCH_DEFAULT; }
int64_t qlinear_prefetch(void) { return g_q41x_prefetch; }

#ifndef ROWS4_MIN
#define ROWS4_MIN 4 /* default: activation rows from which four weight rows are processed together */
#endif
/* per format, the activation rows from which four weight rows are processed together (dot_rows4);
 * set by the start-up probe (qlinear_set_rows4_min): where it pays differs between CPUs. On an AMD
 * EPYC the Q8_0 head at 4 rows took 3.1 ms four weight rows at a time and 1.1 ms one at a time. */
static int g_rows4_min[FMT_LAST + 1] = {[0 ... FMT_LAST] = ROWS4_MIN};

#if QL_AMX
/* default: activation rows from which the AMX path runs (qlinear_set_amx_min). Per call on the AMX
 * Xeon it tied with the dot-product loops at 4 rows (0.93-1.23x their time over the model's shapes)
 * and won by 1.6-2.1x at 8: 8 is where it wins by more than the probe's tie factor (1.25). */
#ifndef AMX_MIN
#define AMX_MIN 8
#endif
static int g_amx_min[FMT_LAST + 1] = {[0 ... FMT_LAST] = AMX_MIN};
#endif

/* -- running the rows in parallel ------------------------------------------------------------ */

/* set by qlinear_set_pool (pool.c's phaselab_pool_run); NULL: OpenMP's team */
static pool_run_fn g_pool_run = NULL;
void qlinear_set_pool(void *fn) { g_pool_run = (pool_run_fn)fn; }

#define CHUNKS_PER_THREAD 8 /* small enough to balance a thread the OS delays, big enough to amortize a claim */

static void run_chunks(chunk_fn fn, void *ctx, int64_t nchunks) {
    if (g_pool_run) {
        g_pool_run(fn, ctx, nchunks);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; c++) fn(ctx, c);
}

static int64_t num_chunks(int64_t units) {
    const int64_t want = (int64_t)omp_get_max_threads() * CHUNKS_PER_THREAD;
    return units < want ? units : want;
}

/* y (M, N) = x (M, K) W^T + bias. x_bf16 / y_bf16: 1 when that side is bfloat16.
 * scratch: float32 room for qlinear_scratch_floats(fmt, M, K, x_bf16) values: M*K when x is bf16
 * and must be widened (or, for Q4_1X, permuted), plus M*K + M*K/32 for a lane layout's
 * lane-ordered activations and block sums; NULL when that is 0.
 * use_dp: 1 to run BF16 weights x bf16 activations through vdpbf16ps (ignored when absent).
 * Output rows are cut into chunks run by the pool (qlinear_set_pool) or OpenMP's team.
 * Returns 0, or 1 for an unsupported format/shape. */
int qlinear(int fmt, const void *w, int64_t N, int64_t K, const void *x, int x_bf16, int64_t M, float *scratch,
            const float *bias, void *y, int y_bf16, int use_dp) {
    if (fmt < 0 || fmt > FMT_LAST || N <= 0 || K <= 0 || M <= 0) return 1;
    if (fmt >= FMT_Q8_0 && K % 32 != 0) return 1;
#if QL_AMX
    if (x_bf16 && M >= g_amx_min[fmt] && amx_format(fmt) && K % 32 == 0 && scratch && amx_permitted()) {
        const uint16_t *xa = (const uint16_t *)x;
        float *rest = scratch;
        if (fmt == FMT_Q4_1X) { /* the activations in the kernel's column order first */
            uint16_t *xp = (uint16_t *)scratch;
            for (int64_t m = 0; m < M; m++) q41x_order_row(xa + m * K, K, xp + m * K);
            xa = xp;
            rest = scratch + (M * K + 1) / 2;
        }
        uint16_t *xv = (uint16_t *)(((uintptr_t)rest + 63) & ~(uintptr_t)63);
        amx_prepare(xa, M, K, xv);
        ql_job j = {.fmt = fmt, .y_bf16 = y_bf16, .w = (const uint8_t *)w, .N = N, .K = K, .M = M,
                    .rb = row_bytes(fmt, K), .bias = bias, .x = x, .y = y, .xv = xv, .n0 = 0, .units = (N + 15) / 16};
        j.nchunks = num_chunks(j.units);
        run_chunks(amx_chunk, &j, j.nchunks);
        return 0;
    }
#endif
    if (fmt == FMT_Q4_1X) { /* bf16 activations through vdpbf16ps only (the format exists for it) */
        if (!QL_DPBF16 || !x_bf16 || !scratch) return 1;
#if QL_DPBF16
        uint16_t *xp = (uint16_t *)scratch; /* M*K bf16, then M*K/32 sums: within M*K floats */
        float *sx = scratch + (M * K + 1) / 2;
        q41x_prepare((const uint16_t *)x, M, K, xp, sx);
        ql_job j = {.fmt = fmt, .y_bf16 = y_bf16, .w = (const uint8_t *)w, .N = N, .K = K, .M = M,
                    .rb = row_bytes(fmt, K), .bias = bias, .x = x, .y = y, .xp = xp, .sx = sx,
                    .n0 = 0, .units = N};
        j.nchunks = num_chunks(j.units);
        run_chunks(rows1_chunk, &j, j.nchunks);
#endif
        return 0;
    }
    const int dp = QL_DPBF16 && use_dp && fmt == FMT_BF16 && x_bf16;
    const float *xf = (const float *)x;
    if ((x_bf16 && !dp) || IS_LANES(fmt)) {
        if (!scratch) return 1;
    }
    if (x_bf16 && !dp) {
        const uint16_t *xs = (const uint16_t *)x;
        for (int64_t i = 0; i < M * K; i++) scratch[i] = bf16_to_f32(xs[i]);
        xf = scratch;
    }
    ql_job j = {.fmt = fmt, .y_bf16 = y_bf16, .dp = dp, .w = (const uint8_t *)w, .N = N, .K = K, .M = M,
                .rb = row_bytes(fmt, K), .xf = xf, .bias = bias, .x = x, .y = y};
#if QL_AVX2
    if (IS_LANES(fmt)) { /* lane-ordered activations and block sums, after the widened x when x is bf16 */
        float *xl = scratch + (x_bf16 ? M * K : 0);
        lanes_prepare(xf, M, K, xl, xl + M * K);
        j.xl = xl;
        j.sx = xl + M * K;
    }
#endif
#if QL_AVX512 || QL_AVX2
    /* from rows4_min activation rows: four weight rows per pass (dot_rows4; AVX2: panel_dot), the
     * last N % 4 rows below (the lane layouts' pass is AVX2's only) */
    const int64_t n4 = (M >= g_rows4_min[fmt] && !dp && K % 32 == 0 && (!IS_LANES(fmt) || QL_AVX2)) ? N / 4 * 4 : 0;
    if (n4 > 0) {
        j.n0 = 0;
        j.units = n4 / 4;
        j.nchunks = num_chunks(j.units);
        run_chunks(rows4_chunk, &j, j.nchunks);
    }
#else
    const int64_t n4 = 0;
#endif
    if (n4 < N) {
        j.n0 = n4;
        j.units = N - n4;
        j.nchunks = num_chunks(j.units);
        run_chunks(rows1_chunk, &j, j.nchunks);
    }
    return 0;
}

/* out (R, K) = rows of W widened to float32 (out_bf16 = 0) or bf16: all N rows in order when
 * idx is NULL (R = N), else rows idx[0..R) (embedding lookup; ids checked by the caller). */
int dequant_rows(int fmt, const void *w, int64_t N, int64_t K, const int64_t *idx, int64_t R, void *out,
                 int out_bf16) {
    if (fmt < 0 || fmt > FMT_LAST || K <= 0 || (fmt >= FMT_Q8_0 && K % 32 != 0)) return 1;
    if (!idx) R = N;
    const int64_t rb = row_bytes(fmt, K);
    /* a decode step's embedding lookup is a row or a few: waking OpenMP's team for them cost more
     * than the rows (135 us for one 576-wide row under OMP_WAIT_POLICY=PASSIVE) */
#pragma omp parallel for schedule(static) if (R * K >= (1 << 16))
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *wr = (const uint8_t *)w + (idx ? idx[r] : r) * rb;
#if QL_AVX512
        if (fmt >= FMT_Q8_0 && fmt != FMT_Q4_1X && !IS_LANES(fmt)) { /* vectorized: one block -> 32 floats or 32 bf16 (nearest even) */
            const int bb = BLOCK_BYTES[fmt];
            for (int64_t b = 0; b < K / 32; b++) {
                __m512 lo, hi;
                deq_block(fmt, wr + b * bb, &lo, &hi);
                store32(out, r * K + b * 32, out_bf16, lo, hi);
            }
            continue;
        }
#elif QL_AVX2
        if (IS_LANES(fmt)) { /* a group (256 elements) at a time, then the tail blocks */
            float buf[256] __attribute__((aligned(32)));
            for (int64_t k0 = 0; k0 < K; k0 += 256) {
                const int64_t n = K - k0 < 256 ? K - k0 : 256;
                lanes_widen(fmt, wr, K / 32, k0, n, buf, 0);
                for (int64_t b = 0; b < n / 32; b++) {
                    __m256 v[4];
                    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) v[i] = _mm256_load_ps(buf + 32 * b + 8 * i);
                    store32_8(out, r * K + k0 + 32 * b, out_bf16, v);
                }
            }
            continue;
        }
        if (fmt >= FMT_Q8_0 && fmt != FMT_Q4_1X) {
            const int bb = BLOCK_BYTES[fmt];
            for (int64_t b = 0; b < K / 32; b++) {
                __m256 v[4];
                deq_block8(fmt, wr + b * bb, v);
                store32_8(out, r * K + b * 32, out_bf16, v);
            }
            continue;
        }
#endif
        if (!out_bf16) {
            deq_row_c(fmt, wr, K, (float *)out + r * K);
        } else if (fmt == FMT_BF16) {
            memcpy((uint16_t *)out + r * K, wr, (size_t)K * 2);
        } else {
            float buf[32];
            uint16_t *o = (uint16_t *)out + r * K;
            for (int64_t k0 = 0; k0 < K; k0 += 32) {
                const int64_t n = K - k0 < 32 ? K - k0 : 32;
                if (fmt == FMT_Q4_1X)
                    q41x_block_c(wr, K / 32, k0 / 32, buf);
                else if (IS_LANES(fmt))
                    lanes_block_c(fmt, wr, K / 32, k0 / 32, buf);
                else
                    deq_row_c(fmt, wr + row_bytes(fmt, k0), n, buf);
                for (int64_t j = 0; j < n; j++) o[k0 + j] = f32_to_bf16(buf[j]);
            }
        }
    }
    return 0;
}

int qlinear_features(void) {
#if QL_AMX
    const int amx = amx_permitted();
#else
    const int amx = 0;
#endif
    return QL_AVX512 | (QL_DPBF16 << 1) | (QL_AVX2 << 2) | (amx << 3);
}
/* rows < 1: the default; a large value turns the AMX path off for fmt */
void qlinear_set_amx_min(int fmt, int rows) {
#if QL_AMX
    if (fmt >= 0 && fmt <= FMT_LAST) g_amx_min[fmt] = rows < 1 ? AMX_MIN : rows;
#else
    (void)fmt, (void)rows;
#endif
}
int qlinear_amx_min(int fmt) {
#if QL_AMX
    return fmt >= 0 && fmt <= FMT_LAST ? g_amx_min[fmt] : -1;
#else
    (void)fmt;
    return -1;
#endif
}
void qlinear_set_rows4_min(int fmt, int rows) {
    if (fmt >= 0 && fmt <= FMT_LAST) g_rows4_min[fmt] = rows < 1 ? ROWS4_MIN : rows; /* < 1: the default */
}
int qlinear_rows4_min(int fmt) { return fmt >= 0 && fmt <= FMT_LAST ? g_rows4_min[fmt] : -1; }
int64_t qlinear_scratch_floats(int fmt, int64_t M, int64_t K, int x_bf16) {
    const int64_t need = (x_bf16 ? M * K : 0) + (IS_LANES(fmt) ? M * K + M * (K / 32) : 0);
#if QL_AMX
    if (x_bf16 && amx_format(fmt) && K % 32 == 0) { /* Q4_1X's reordered rows, then the B tiles (64-aligned) */
        const int64_t amx = (fmt == FMT_Q4_1X ? (M * K + 1) / 2 : 0) + 16 + (M + 15) / 16 * 16 * K / 2;
        return need > amx ? need : amx;
    }
#endif
    return need;
}
