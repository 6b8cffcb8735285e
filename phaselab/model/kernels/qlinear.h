/* qlinear.h: what the qlinear_*.c files share (the small-batch linear kernel, one library with the
 * other kernels). Read this first; then qlinear_entry.c (the exported functions and how a call is
 * dispatched), then the instruction-set tier this CPU builds:
 *   qlinear_avx512.c   AVX-512 (+ AVX512-BF16: vdpbf16ps, the Q4_1X kernel)   helpers: qlinear_avx512.h
 *   qlinear_amx.c      AMX tile products for batched bf16 rows (Sapphire Rapids and later)
 *   qlinear_avx2.c     AVX2 + FMA + F16C (AMD Zen 2/3; the lane layouts Q4_1L, Q8_0L) helpers: qlinear_avx2.h
 *   qlinear_portable.c plain C loops (no AVX-512/AVX2; also the lane layouts outside the AVX2 build)
 *   qlinear_layouts.c  the re-laid weight formats: repacking at load, Q4_1X's column order
 * Every file is compiled into the library on every CPU; code for a tier the build lacks is left out
 * by the QL_* conditions below and compiles to nothing. Here: the tier conditions, the weight
 * formats, the scalar conversions and block readers every tier uses, and the job a call hands to
 * its row chunks.
 *
 * Decode multiplies a handful of activation rows by every weight matrix once per step, so its
 * cost is the bytes of W streamed from memory. This kernel reads W in its storage format and
 * widens it to float32 in registers, block by block, never materializing a dense copy:
 *
 *   fmt 0  F32    (N, K) float32
 *   fmt 1  BF16   (N, K) bfloat16 bit patterns
 *   fmt 2  Q8_0   (N, K/32) blocks of {fp16 d; int8 q[32]}          w = d * q            34 B / 32
 *   fmt 3  Q4_0   (N, K/32) blocks of {fp16 d; uint8 qs[16]}        w = d * (nibble - 8) 18 B / 32
 *   fmt 4  Q4_1   (N, K/32) blocks of {fp16 d; fp16 m; uint8 qs[16]} w = d * nibble + m  20 B / 32
 *   fmt 5  Q4_1X  Q4_1 re-laid at load for vdpbf16ps (bf16 activations, AVX512-BF16): 20 B / 32
 *                 (qlinear_repack; the layout and its arithmetic are described at dot_rows_q41x)
 *   fmt 6  Q4_1L  Q4_1 re-laid at load for 8-lane float32 FMAs (AVX2 builds): one vector lane per
 *                 block, 20 B / 32 (qlinear_repack; described at lanes_block_c and dot_rows_lanes)
 *   fmt 7  Q8_0L  Q8_0 re-laid the same way, 34 B / 32
 *
 * (GGML's layouts: in Q4 blocks, byte j holds element j in its low nibble, element j+16 in its
 * high one.) Activations x are (M, K) float32 or bfloat16; bf16 rows are widened once per call
 * into caller-provided scratch (exact), except for BF16 weights on a CPU with AVX512-BF16, where
 * pairs of bf16 products go straight through vdpbf16ps (exact products, float32 sums). Output y
 * is (M, N) float32 or bfloat16 (round to nearest even). Sums run in float32, in a different
 * order than a BLAS GEMM, so results equal the dequantized reference up to summation order.
 *
 * Work: output rows n are split statically over the OpenMP threads (torch's runtime, same
 * SONAME); each weight row is read once and used for up to MR activation rows at a time, staying
 * in L1 while further groups of MR rows reuse it. Nothing is allocated.
 *
 * `dequant_rows` widens whole rows (all of W, or the rows named by an index list: embedding
 * lookups) to float32 or bf16, for the GEMM path of larger row counts and for embeddings.
 *
 * Built by phaselab/model/kernels/library.py with -march=native: AVX-512 intrinsics where the CPU
 * has them, else AVX2 + FMA + F16C intrinsics (dot_rows8), else plain C loops the compiler
 * vectorizes as it can. PHASELAB_KERNEL_ISA=avx2 / portable builds the lower paths on any CPU.
 */
#ifndef QLINEAR_H
#define QLINEAR_H

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h" /* the pool hook's types; hadd8 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX512 1
#else
#define QL_AVX512 0
#endif
/* AVX2 + FMA + F16C without AVX-512 (AMD Zen 2/3, Intel before Skylake-SP; or forced by
 * PHASELAB_KERNEL_ISA=avx2): the same loops on 8-float vectors (dot_rows8 in qlinear_avx2.c) */
#if !QL_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QL_AVX2 1
#else
#define QL_AVX2 0
#endif
#if QL_AVX512 && defined(__AVX512BF16__)
#define QL_DPBF16 1
#else
#define QL_DPBF16 0
#endif
/* Intel AMX (Sapphire Rapids and later): bf16 tile products for the batched rows (amx_chunk) */
#if QL_DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define QL_AMX 0
#endif

/* functions one qlinear_*.c file defines for the others: not exported from the library */
#define QL_HIDDEN __attribute__((visibility("hidden")))

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_Q8_0 = 2, FMT_Q4_0 = 3, FMT_Q4_1 = 4, FMT_Q4_1X = 5, FMT_Q4_1L = 6, FMT_Q8_0L = 7 };

#define FMT_LAST FMT_Q8_0L
#define IS_LANES(fmt) ((fmt) == FMT_Q4_1L || (fmt) == FMT_Q8_0L)
#define LANES_BASE(fmt) ((fmt) == FMT_Q4_1L ? FMT_Q4_1 : FMT_Q8_0) /* the file's format of a lane layout */
#define MR 8

static const int BLOCK_BYTES[FMT_LAST + 1] = {0, 0, 34, 18, 20, 20, 20, 34};

static inline int64_t row_bytes(int fmt, int64_t K) {
    if (fmt == FMT_F32) return K * 4;
    if (fmt == FMT_BF16) return K * 2;
    return (K / 32) * BLOCK_BYTES[fmt];
}

static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    /* IEEE half -> float without F16C (the AVX-512 and AVX2 paths use _cvtsh_ss) */
#if QL_AVX512 || QL_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal half: normalize */
            int e = -1;
            uint32_t m = man;
            do { e++; m <<= 1; } while (!(m & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000 | (man << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* element-wise widening of one block / row segment, portable (used by dequant_rows and the
 * non-AVX-512 build) */
static inline void deq_block_c(int fmt, const uint8_t *b, float *out) {
    if (fmt == FMT_Q8_0) {
        const float d = fp16_to_f32(b);
        for (int j = 0; j < 32; j++) out[j] = d * (float)((const int8_t *)(b + 2))[j];
    } else if (fmt == FMT_Q4_0) {
        const float d = fp16_to_f32(b);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((b[2 + j] & 0x0f) - 8);
            out[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
        }
    } else { /* Q4_1 */
        const float d = fp16_to_f32(b), m = fp16_to_f32(b + 2);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(b[4 + j] & 0x0f) + m;
            out[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
    }
}

/* Q4_1X row of nb blocks: ng = nb / 16 groups of 16 blocks, then the nb % 16 tail blocks as Q4_1.
 *   [256 B per group: 8 pairs p of 32 B; byte 2b+e of pair p holds, in its low nibble, element
 *    2(2p)+e of block b, in its high nibble element 2(2p+1)+e]
 *   [tail blocks, 20 B each, as Q4_1] [d: fp16 x 16 ng] [m: fp16 x 16 ng]
 * So a 32 B load widened to 16-bit lanes gives, per lane pair, element pair t = 2p (low nibbles)
 * and t = 2p + 1 (high) of all 16 blocks of a group: one vdpbf16ps lane per block. */
static inline void q41x_block_c(const uint8_t *w, int64_t nb, int64_t b, float *out) {
    const int64_t ng = nb / 16, nt = nb % 16;
    if (b >= 16 * ng) {
        deq_block_c(FMT_Q4_1, w + 256 * ng + 20 * (b - 16 * ng), out);
        return;
    }
    const uint8_t *grp = w + 256 * (b / 16), *dm = w + 256 * ng + 20 * nt;
    const int bl = (int)(b % 16);
    const float d = fp16_to_f32(dm + 2 * b), m = fp16_to_f32(dm + 32 * ng + 2 * b);
    for (int el = 0; el < 32; el++) {
        const int t = el / 2, e = el % 2;
        const uint8_t byte = grp[32 * (t / 2) + 2 * bl + e];
        out[el] = d * (float)(t & 1 ? byte >> 4 : byte & 0x0f) + m;
    }
}

/* Lane layouts: a row of nb blocks as ng = nb / 8 groups of 8 blocks, then the nb % 8 tail blocks
 * in the file's format (LANES_BASE). A group holds the 8 blocks' bytes, interleaved:
 *   Q4_1L (160 B): 128 B of nibbles, byte 8 c + b = byte c of block b's qs (element c of the block
 *                  in its low nibble, element c + 16 in its high one); d: fp16 x 8; m: fp16 x 8
 *   Q8_0L (272 B): 256 B of int8, byte 8 e + b = element e of block b; d: fp16 x 8
 * So an 8-byte load widened to 32-bit lanes holds, in lane b, element(s) of block b: a float32
 * vector's lane per block, and the group's d (and m) apply as vectors. */
static inline void lanes_block_c(int fmt, const uint8_t *w, int64_t nb, int64_t b, float *out) {
    const int base = LANES_BASE(fmt), gb = 8 * BLOCK_BYTES[base];
    const int64_t ng = nb / 8;
    if (b >= 8 * ng) {
        deq_block_c(base, w + gb * ng + BLOCK_BYTES[base] * (b - 8 * ng), out);
        return;
    }
    const uint8_t *g = w + gb * (b / 8);
    const int l = (int)(b % 8);
    if (fmt == FMT_Q8_0L) {
        const float d = fp16_to_f32(g + 256 + 2 * l);
        for (int e = 0; e < 32; e++) out[e] = d * (float)(int8_t)g[8 * e + l];
        return;
    }
    const float d = fp16_to_f32(g + 128 + 2 * l), m = fp16_to_f32(g + 144 + 2 * l);
    for (int c = 0; c < 16; c++) {
        out[c] = d * (float)(g[8 * c + l] & 0x0f) + m;
        out[c + 16] = d * (float)(g[8 * c + l] >> 4) + m;
    }
}

/* The portable readers every tier falls back on: a row of any format widened to float32
 * (dequant_rows; the portable tier), and dot_rows_c. Static in each file that calls them, as they
 * were when the kernel was one file: the compiler specializes them for their callers there (the
 * AVX-512 tier runs the lane layouts Q4_1L / Q8_0L with dot_rows_c, the portable tier everything;
 * deq_row_c stays a call, as it was with its two callers in one file). */
#define QL_STATIC static __attribute__((unused))
QL_STATIC __attribute__((noinline)) void deq_row_c(int fmt, const uint8_t *w, int64_t K, float *out) {
    if (fmt == FMT_Q4_1X) {
        for (int64_t b = 0; b < K / 32; b++) q41x_block_c(w, K / 32, b, out + b * 32);
    } else if (IS_LANES(fmt)) {
        for (int64_t b = 0; b < K / 32; b++) lanes_block_c(fmt, w, K / 32, b, out + b * 32);
    } else if (fmt == FMT_F32) {
        memcpy(out, w, (size_t)K * 4);
    } else if (fmt == FMT_BF16) {
        for (int64_t k = 0; k < K; k++) out[k] = bf16_to_f32(((const uint16_t *)w)[k]);
    } else {
        const int bb = BLOCK_BYTES[fmt];
        for (int64_t b = 0; b < K / 32; b++) deq_block_c(fmt, w + b * bb, out + b * 32);
    }
}

/* portable: widen the row once per group of rows (on the stack when it fits), then plain dots (the
 * whole kernel without AVX-512 or AVX2; with them, the lane layouts outside the AVX2 build) */
QL_STATIC void dot_rows_c(int fmt, const uint8_t *w, const float *x, int64_t K, int mr, float *res) {
    float buf[4096];
    _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) res[m] = 0.f;
    for (int64_t k0 = 0; k0 < K; k0 += 4096) {
        const int64_t n = K - k0 < 4096 ? K - k0 : 4096; /* multiple of 32 except the dense tail */
        if (IS_LANES(fmt)) /* re-laid: block by block from the row's start */
            for (int64_t b = 0; b < n / 32; b++) lanes_block_c(fmt, w, K / 32, k0 / 32 + b, buf + 32 * b);
        else
            deq_row_c(fmt, w + row_bytes(fmt, k0), n, buf);
        _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) {
            float s = 0.f;
            const float *xm = x + m * K + k0;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < n; k++) s += buf[k] * xm[k];
            res[m] += s;
        }
    }
}

/* one row of bf16 activations in Q4_1X's kernel order (qlinear_layouts.c) */
QL_HIDDEN void q41x_order_row(const uint16_t *xm, int64_t K, uint16_t *om);

/* -- a call's work, cut into chunks of output rows (qlinear_entry.c runs them) ------------------- */

typedef struct {
    int fmt, y_bf16, dp;
    const uint8_t *w;
    int64_t N, K, M, rb, n0, units, nchunks;
    const float *xf, *bias;
    const void *x;
    void *y;
    const uint16_t *xp; /* Q4_1X: the activations permuted (q41x_prepare) */
    const float *sx;    /* Q4_1X, lane layouts: their per-block sums */
    const float *xl;    /* lane layouts: the activations in lane order (lanes_prepare) */
    const uint16_t *xv; /* AMX: the activations as B tiles (amx_prepare) */
} ql_job;

static inline void store_out(const ql_job *j, int64_t m, int64_t n, float v) {
    if (j->y_bf16)
        ((uint16_t *)j->y)[m * j->N + n] = f32_to_bf16(v);
    else
        ((float *)j->y)[m * j->N + n] = v;
}

/* dot_group(fmt, w, x, K, mr, res): the tier's dot_any (one weight row against mr <= MR activation
 * rows) called with a constant row count, so that the accumulators of its inlined dot_rows live in
 * registers. Each tier file defines dot_any, then expands this once. */
#define QL_DEFINE_DOT_GROUP                                                                                     \
    static void dot_group(int fmt, const uint8_t *w, const float *x, int64_t K, int mr, float *res) {       \
        switch (mr) {                                                                                       \
        case 1: dot_any(fmt, w, x, K, 1, res); break;                                                       \
        case 2: dot_any(fmt, w, x, K, 2, res); break;                                                       \
        case 3: dot_any(fmt, w, x, K, 3, res); break;                                                       \
        case 4: dot_any(fmt, w, x, K, 4, res); break;                                                       \
        case 5: dot_any(fmt, w, x, K, 5, res); break;                                                       \
        case 6: dot_any(fmt, w, x, K, 6, res); break;                                                       \
        case 7: dot_any(fmt, w, x, K, 7, res); break;                                                       \
        default: dot_any(fmt, w, x, K, 8, res); break;                                                      \
        }                                                                                                   \
    }

/* the row chunks, each defined by the one tier file this build compiles (qlinear_avx512.c,
 * qlinear_avx2.c or qlinear_portable.c): single weight rows (rows1), four at a time (rows4) */
QL_HIDDEN void rows1_chunk(void *ctx, int64_t c);
#if QL_AVX512 || QL_AVX2
QL_HIDDEN void rows4_chunk(void *ctx, int64_t c);
#endif

/* Q4_1X's prefetch distance (qlinear_entry.c: qlinear_set_prefetch), read by qlinear_avx512.c */
extern QL_HIDDEN int64_t g_q41x_prefetch;

#if QL_AMX
/* qlinear_amx.c */
QL_HIDDEN int amx_permitted(void);
QL_HIDDEN void amx_prepare(const uint16_t *x, int64_t M, int64_t K, uint16_t *xv);
QL_HIDDEN void amx_chunk(void *ctx, int64_t c);

static inline int amx_format(int fmt) {
    return fmt == FMT_Q4_1X || fmt == FMT_Q4_1 || fmt == FMT_Q8_0 || fmt == FMT_Q4_0 || fmt == FMT_BF16;
}
#endif

#endif
