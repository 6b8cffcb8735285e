/* Small-batch linear layers on the CPU: y = x W^T (+ bias), W read as stored.
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
 * Built by phaselab/model/kernels/__init__.py with -march=native: AVX-512 intrinsics where the CPU
 * has them, else AVX2 + FMA + F16C intrinsics (dot_rows8), else plain C loops the compiler
 * vectorizes as it can. PHASELAB_KERNEL_ISA=avx2 / portable builds the lower paths on any CPU.
 */
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
 * PHASELAB_KERNEL_ISA=avx2): the same loops on 8-float vectors (dot_rows8 below) */
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

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_Q8_0 = 2, FMT_Q4_0 = 3, FMT_Q4_1 = 4, FMT_Q4_1X = 5, FMT_Q4_1L = 6, FMT_Q8_0L = 7 };

/* How far ahead in the weight stream a Q4_1X row's bytes are prefetched (the whole row, so that the
 * d/m and tail-block lines are covered too). The best distance depends on the CPU: on the AMD EPYC with AVX512-BF16
 * the step's layers streamed at 24.2 GB/s 2 KiB ahead and 22.3 GB/s 4 KiB ahead (group-based prefetch); on the AMX Xeon a
 * batch-1 step's layers took 3.26 ms 4 KiB ahead and 3.54 ms 2 KiB ahead. So the engine measures it
 * at start-up on the model's own layers (prefetch_probe.choose; PHASELAB_PREFETCH_BYTES
 * forces it) and sets it here. */
#define Q41X_PREFETCH_DEFAULT 2048
static int64_t g_q41x_prefetch = Q41X_PREFETCH_DEFAULT;
void qlinear_set_prefetch(int64_t bytes) { g_q41x_prefetch = bytes > 0 ? bytes : Q41X_PREFETCH_DEFAULT; }
int64_t qlinear_prefetch(void) { return g_q41x_prefetch; }

#define FMT_LAST FMT_Q8_0L
#define IS_LANES(fmt) ((fmt) == FMT_Q4_1L || (fmt) == FMT_Q8_0L)
#define LANES_BASE(fmt) ((fmt) == FMT_Q4_1L ? FMT_Q4_1 : FMT_Q8_0) /* the file's format of a lane layout */
#define MR 8
#ifndef QL_PREFETCH
#define QL_PREFETCH 4096 /* bytes ahead in a weight row that the AVX-512 block loops prefetch */
#endif
#ifndef ROWS4_MIN
#define ROWS4_MIN 4 /* default: activation rows from which four weight rows are processed together */
#endif
/* per format, the activation rows from which four weight rows are processed together (dot_rows4);
 * set by the start-up probe (qlinear_set_rows4_min): where it pays differs between CPUs. On an AMD
 * EPYC the Q8_0 head at 4 rows took 3.1 ms four weight rows at a time and 1.1 ms one at a time. */
static int g_rows4_min[FMT_LAST + 1] = {[0 ... FMT_LAST] = ROWS4_MIN};

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

/* One row of bf16 activations (K) in Q4_1X's kernel order: per full group of 16 blocks, element
 * pair t of block b moves to 32 t + 2 b; the tail columns stay where they are. */
static void q41x_order_row(const uint16_t *xm, int64_t K, uint16_t *om) {
    const int64_t ng = K / 512;
    for (int64_t g = 0; g < ng; g++) {
#if QL_AVX512
        /* element pairs as dwords: pair t of block b is dword 16 b + t of the group */
        const __m512i stride = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
        for (int t = 0; t < 16; t++)
            _mm512_storeu_si512((void *)(om + 512 * g + 32 * t),
                                _mm512_i32gather_epi32(_mm512_add_epi32(stride, _mm512_set1_epi32(t)),
                                                       (const void *)(xm + 512 * g), 4));
#else
        for (int t = 0; t < 16; t++)
            for (int b = 0; b < 16; b++) {
                om[512 * g + 32 * t + 2 * b] = xm[512 * g + 32 * b + 2 * t];
                om[512 * g + 32 * t + 2 * b + 1] = xm[512 * g + 32 * b + 2 * t + 1];
            }
#endif
    }
    memcpy(om + 512 * ng, xm + 512 * ng, (size_t)(K - 512 * ng) * 2);
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

static void deq_row_c(int fmt, const uint8_t *w, int64_t K, float *out) {
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

#if QL_AVX512
/* one 32-element block of W -> two float32 vectors (elements 0-15, 16-31) */
static inline __attribute__((always_inline)) void deq_block(int fmt, const uint8_t *b, __m512 *lo, __m512 *hi) {
    if (fmt == FMT_Q8_0) {
        const __m512 d = _mm512_set1_ps(fp16_to_f32(b));
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 2));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
    } else {
        const int q41 = fmt == FMT_Q4_1;
        __m512 d, m;
        if (q41) { /* d and m converted together: one vcvtph2ps for both halves */
            int32_t dm;
            memcpy(&dm, b, 4);
            const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
            d = _mm512_broadcastss_ps(f);
            m = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
        } else {
            const float df = fp16_to_f32(b);
            d = _mm512_set1_ps(df);
            m = _mm512_set1_ps(-8.f * df);
        }
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + (q41 ? 4 : 2)));
        const __m128i mask = _mm_set1_epi8(0x0f);
        const __m128i ql = _mm_and_si128(q, mask), qh = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ql)), d, m);
        *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qh)), d, m);
    }
}

/* float32 -> bf16 bit patterns, round to nearest even (weights: no NaNs) */
static inline __m256i bf16_round(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* 32 widened weights (lo: the first 16) to out + at, as float32 or bf16 (nearest even) */
static inline void store32(void *out, int64_t at, int out_bf16, __m512 lo, __m512 hi) {
    if (out_bf16) {
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), bf16_round(lo));
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at + 16), bf16_round(hi));
    } else {
        _mm512_storeu_ps((float *)out + at, lo);
        _mm512_storeu_ps((float *)out + at + 16, hi);
    }
}

/* 16 dense weights from element k (masked: only `mask` lanes read) */
static inline __attribute__((always_inline)) __m512 dense16(int fmt, const uint8_t *w, int64_t k, __mmask16 mask) {
    if (fmt == FMT_F32) return _mm512_maskz_loadu_ps(mask, (const float *)w + k);
    const __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* res[m] = W_row . x[m] for m < mr; x rows are float32, K apart. Two accumulator chains per row
 * (low and high half of each block), so even one row keeps two FMAs in flight. */
static inline __attribute__((always_inline)) void dot_rows(int fmt, const uint8_t *w, const float *x, int64_t K,
                                                           int mr, float *res) {
    __m512 alo[MR], ahi[MR];
    _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) alo[m] = ahi[m] = _mm512_setzero_ps();
    const int64_t nfull = K / 32;
    if (fmt >= FMT_Q8_0) {
        const int bb = BLOCK_BYTES[fmt];
        for (int64_t b = 0; b < nfull; b++) {
            __m512 lo, hi;
            /* every other block, the line QL_PREFETCH bytes ahead: the Q8_0 head (49152x576) at one
             * row on the AMX Xeon streamed at 9.5 GB/s without it, 16-17 with it (2 threads, 24 GB/s
             * read bandwidth; 1 KiB ahead 14.5-15, 2 KiB 15.6; the blocks' 34 bytes straddle lines) */
            if ((b & 1) == 0) _mm_prefetch((const char *)(w + b * bb + QL_PREFETCH), _MM_HINT_T0);
            deq_block(fmt, w + b * bb, &lo, &hi);
            const float *xb = x + b * 32;
            _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) {
                alo[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb + m * K), alo[m]);
                ahi[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + m * K + 16), ahi[m]);
            }
        }
    } else {
        for (int64_t b = 0; b < nfull; b++) {
            const __m512 lo = dense16(fmt, w, b * 32, 0xffff), hi = dense16(fmt, w, b * 32 + 16, 0xffff);
            const float *xb = x + b * 32;
            _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) {
                alo[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb + m * K), alo[m]);
                ahi[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + m * K + 16), ahi[m]);
            }
        }
        const int64_t r = K - nfull * 32;
        if (r > 0) {
            const __mmask16 ml = (__mmask16)(r >= 16 ? 0xffff : (1u << r) - 1);
            const __mmask16 mh = (__mmask16)(r > 16 ? (1u << (r - 16)) - 1 : 0);
            const int64_t k = nfull * 32;
            const __m512 lo = dense16(fmt, w, k, ml), hi = dense16(fmt, w, k + 16, mh);
            _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) {
                alo[m] = _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(ml, x + m * K + k), alo[m]);
                ahi[m] = _mm512_fmadd_ps(hi, _mm512_maskz_loadu_ps(mh, x + m * K + k + 16), ahi[m]);
            }
        }
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) res[m] = _mm512_reduce_add_ps(_mm512_add_ps(alo[m], ahi[m]));
}

/* Four weight rows at once, for larger activation row counts: each x vector loaded feeds four
 * FMAs, so x (M*K floats, beyond L1 at 16+ rows) is read once per four output rows instead of
 * once per row. res[r * 4 + m] = W_row(r) . x[m], m < mr <= 4. K a multiple of 32. */
static inline __attribute__((always_inline)) void dot_rows4(int fmt, const uint8_t *w, int64_t rb, const float *x,
                                                            int64_t K, int mr, float *res) {
    __m512 acc[4][4];
    _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)
        _Pragma("GCC unroll 4") for (int m = 0; m < mr; m++) acc[r][m] = _mm512_setzero_ps();
    const int64_t nb = K / 32;
    for (int64_t b = 0; b < nb; b++) {
        __m512 lo[4], hi[4];
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
            if (fmt >= FMT_Q8_0) {
                deq_block(fmt, w + r * rb + b * BLOCK_BYTES[fmt], &lo[r], &hi[r]);
            } else {
                lo[r] = dense16(fmt, w + r * rb, b * 32, 0xffff);
                hi[r] = dense16(fmt, w + r * rb, b * 32 + 16, 0xffff);
            }
        }
        _Pragma("GCC unroll 4") for (int m = 0; m < mr; m++) {
            const __m512 xl = _mm512_loadu_ps(x + m * K + b * 32), xh = _mm512_loadu_ps(x + m * K + b * 32 + 16);
            _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
                acc[r][m] = _mm512_fmadd_ps(lo[r], xl, acc[r][m]);
                acc[r][m] = _mm512_fmadd_ps(hi[r], xh, acc[r][m]);
            }
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)
        _Pragma("GCC unroll 4") for (int m = 0; m < mr; m++) res[r * 4 + m] = _mm512_reduce_add_ps(acc[r][m]);
}

static void dot4_group(int fmt, const uint8_t *w, int64_t rb, const float *x, int64_t K, int mr, float *res) {
#define DOT4_FMT(F)                                                         \
    switch (mr) {                                                           \
    case 1: dot_rows4(F, w, rb, x, K, 1, res); break;                       \
    case 2: dot_rows4(F, w, rb, x, K, 2, res); break;                       \
    case 3: dot_rows4(F, w, rb, x, K, 3, res); break;                       \
    default: dot_rows4(F, w, rb, x, K, 4, res); break;                      \
    }
    switch (fmt) {
    case FMT_F32: DOT4_FMT(FMT_F32) break;
    case FMT_BF16: DOT4_FMT(FMT_BF16) break;
    case FMT_Q8_0: DOT4_FMT(FMT_Q8_0) break;
    case FMT_Q4_0: DOT4_FMT(FMT_Q4_0) break;
    default: DOT4_FMT(FMT_Q4_1) break;
    }
#undef DOT4_FMT
}

#if QL_DPBF16
/* bf16 weights x bf16 activations: 32 products per vdpbf16ps, accumulated in float32 */
static inline __attribute__((always_inline)) void dot_rows_dpbf16(const uint16_t *w, const uint16_t *x, int64_t K,
                                                                  int mr, float *res) {
    __m512 acc[MR];
    _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m512i wv = _mm512_loadu_si512((const void *)(w + k));
        _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512((const void *)(x + m * K + k)),
                                      (__m512bh)wv);
    }
    if (k < K) {
        const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        const __m512i wv = _mm512_maskz_loadu_epi16(mask, w + k);
        _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k),
                                      (__m512bh)wv);
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) res[m] = _mm512_reduce_add_ps(acc[m]);
}
#endif
#endif /* QL_AVX512 */

#if QL_AVX2
/* one 32-element block of W -> four float32 vectors of 8, in element order; d q + m rounded once
 * (one FMA), as deq_block does */
static inline __attribute__((always_inline)) void deq_block8(int fmt, const uint8_t *b, __m256 v[4]) {
    if (fmt == FMT_Q8_0) {
        const __m256 d = _mm256_set1_ps(fp16_to_f32(b));
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)
            v[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i)))));
        return;
    }
    const int q41 = fmt == FMT_Q4_1;
    __m256 d, m;
    if (q41) { /* d and m converted together */
        int32_t dm;
        memcpy(&dm, b, 4);
        const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        d = _mm256_broadcastss_ps(f);
        m = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
    } else {
        const float df = fp16_to_f32(b);
        d = _mm256_set1_ps(df);
        m = _mm256_set1_ps(-8.f * df);
    }
    /* each half of the 16 bytes widened to 32-bit lanes straight from memory, then the nibbles
     * split there (bytes 0-7 hold elements 0-7 and 16-23, bytes 8-15 elements 8-15 and 24-31).
     * Splitting the nibbles in bytes first and widening from a register (two more shuffles) ran
     * 1.33x slower on an AMD EPYC (Zen 3): Q4_1 at one row, one thread, 118 -> 88 ps per weight. */
    const uint8_t *qs = b + (q41 ? 4 : 2);
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0f);
    v[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(lo, mask)), d, m);
    v[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(hi, mask)), d, m);
    v[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), d, m);
    v[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), d, m);
}

/* 8 dense weights from element k (whole vectors only; tails are summed in scalar) */
static inline __attribute__((always_inline)) __m256 dense8(int fmt, const uint8_t *w, int64_t k) {
    if (fmt == FMT_F32) return _mm256_loadu_ps((const float *)w + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* res[m] = W_row . x[m] for m < mr, as dot_rows on 8-float vectors. AVX2 has 16 vector registers:
 * 4 hold the block's weights, so each row gets 4 accumulator chains at mr <= 2, 2 at mr <= 4 and
 * one above (enough independent FMAs in flight either way, no spills). */
static inline __attribute__((always_inline)) void dot_rows8(int fmt, const uint8_t *w, const float *x, int64_t K,
                                                            int mr, float *res) {
    enum { NA = 4 };
    const int na = mr <= 2 ? 4 : mr <= 4 ? 2 : 1;
    __m256 acc[MR][NA];
    _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++)
        _Pragma("GCC unroll 4") for (int a = 0; a < na; a++) acc[m][a] = _mm256_setzero_ps();
    const int64_t nfull = K / 32;
    const int bb = fmt >= FMT_Q8_0 ? BLOCK_BYTES[fmt] : 0;
    for (int64_t b = 0; b < nfull; b++) {
        __m256 v[4];
        if (fmt >= FMT_Q8_0) {
            deq_block8(fmt, w + b * bb, v);
        } else {
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) v[i] = dense8(fmt, w, b * 32 + 8 * i);
        }
        const float *xb = x + b * 32;
        _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++)
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)
                acc[m][i % na] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xb + m * K + 8 * i), acc[m][i % na]);
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) {
        _Pragma("GCC unroll 4") for (int a = 1; a < na; a++) acc[m][0] = _mm256_add_ps(acc[m][0], acc[m][a]);
        res[m] = hadd8(acc[m][0]);
    }
    if (fmt < FMT_Q8_0) /* dense formats: the K % 32 tail */
        for (int64_t k = nfull * 32; k < K; k++) {
            const float wk = fmt == FMT_F32 ? ((const float *)w)[k] : bf16_to_f32(((const uint16_t *)w)[k]);
            _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) res[m] += wk * x[m * K + k];
        }
}

/* 32 widened weights (v: in element order) to out + at, as float32 or bf16 (nearest even) */
static inline void store32_8(void *out, int64_t at, int out_bf16, const __m256 v[4]) {
    if (!out_bf16) {
        _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) _mm256_storeu_ps((float *)out + at + 8 * i, v[i]);
        return;
    }
    __m256i r[4];
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        const __m256i u = _mm256_castps_si256(v[i]);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        r[i] = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    }
    /* packus interleaves 128-bit lanes: [a0-3 b0-3 | a4-7 b4-7]; the permute restores the order */
    _Pragma("GCC unroll 2") for (int i = 0; i < 2; i++)
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at + 16 * i),
                            _mm256_permute4x64_epi64(_mm256_packus_epi32(r[2 * i], r[2 * i + 1]), 0xd8));
}

/* Four weight rows against many activation rows (the batched decode), AVX2's counterpart of
 * dot_rows4. With 16 vector registers a block of four widened rows does not fit beside the
 * accumulators, and widening each block again for every group of activation rows (as dot_rows8
 * does per row) costs more than the FMAs it feeds. So the four rows are widened once per slice
 * of PANEL_K elements into a panel on the stack (L1), and every group of PANEL_MT activation rows
 * runs over it: per 8 elements, PANEL_MT x loads and 4 panel loads feed 4 * PANEL_MT FMAs, 12
 * independent accumulators. Partial sums of each slice are added in float32 (K > PANEL_K: a
 * different summation order, as any blocking is). */
#define PANEL_K 1024
#define PANEL_M 64
#define PANEL_MT 3

/* res[r * PANEL_M + m] += panel row r . x[m] over n elements (p: row stride ps floats) */
static inline __attribute__((always_inline)) void panel_dot(const float *p, int64_t ps, const float *x, int64_t K,
                                                            int64_t n, int mt, float *res) {
    __m256 acc[4][PANEL_MT];
    _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)
        _Pragma("GCC unroll 3") for (int m = 0; m < mt; m++) acc[r][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < n; k += 8) {
        __m256 xv[PANEL_MT];
        _Pragma("GCC unroll 3") for (int m = 0; m < mt; m++) {
            xv[m] = _mm256_loadu_ps(x + m * K + k);
            __asm__("" : "+x"(xv[m])); /* in a register: GCC would fold the load into each FMA (below too) */
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
            __m256 w = _mm256_loadu_ps(p + r * ps + k);
            __asm__("" : "+x"(w));
            _Pragma("GCC unroll 3") for (int m = 0; m < mt; m++) acc[r][m] = _mm256_fmadd_ps(w, xv[m], acc[r][m]);
        }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++)
        _Pragma("GCC unroll 3") for (int m = 0; m < mt; m++) res[r * PANEL_M + m] += hadd8(acc[r][m]);
}

static void panel_group(const float *p, int64_t ps, const float *x, int64_t K, int64_t n, int mt, float *res) {
    switch (mt) {
    case 1: panel_dot(p, ps, x, K, n, 1, res); break;
    case 2: panel_dot(p, ps, x, K, n, 2, res); break;
    default: panel_dot(p, ps, x, K, n, PANEL_MT, res); break;
    }
}

/* the four rows from wr (row stride rb bytes), elements [k0, k0 + n), widened into panel (stride
 * PANEL_K); n and k0 multiples of 32 */
static void lanes_widen(int fmt, const uint8_t *w, int64_t nb, int64_t k0, int64_t n, float *out, int lanes);
static void panel_fill(int fmt, const uint8_t *wr, int64_t rb, int64_t k0, int64_t n, float *panel) {
    for (int r = 0; r < 4; r++) {
        const uint8_t *w = wr + r * rb;
        float *out = panel + r * PANEL_K;
        if (IS_LANES(fmt)) { /* k0: a multiple of PANEL_K, so of a group's 256 */
            lanes_widen(fmt, w, rb / BLOCK_BYTES[fmt], k0, n, out, 1);
            continue;
        }
        for (int64_t b = 0; b < n / 32; b++) {
            __m256 v[4];
            if (fmt >= FMT_Q8_0) {
                deq_block8(fmt, w + (k0 / 32 + b) * BLOCK_BYTES[fmt], v);
            } else {
                _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) v[i] = dense8(fmt, w, k0 + b * 32 + 8 * i);
            }
            store32_8(out, b * 32, 0, v);
        }
    }
}

/* -- lane layouts (Q4_1L, Q8_0L): a vector lane per block (layout at lanes_block_c) ------------- */

/* r[i] lane j <- r[j] lane i */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        u[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
        u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xee);
        u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
        u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xee);
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* a group's elements c and c + 16 (c < 16) of its 8 blocks, as float32 vectors (lane b: block b) */
static inline __attribute__((always_inline)) void lanes_pair(int fmt, const uint8_t *wg, int c, __m256 *e0, __m256 *e1) {
    if (fmt == FMT_Q8_0L) {
        *e0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wg + 8 * c))));
        *e1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wg + 8 * (c + 16)))));
        return;
    }
    const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wg + 8 * c)));
    *e0 = _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0x0f)));
    *e1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
}

/* elements [k0, k0 + n) of a lane-layout row of nb blocks widened to float32 (k0 a multiple of 256
 * or at the tail, n a multiple of 32): per group, d q (+ m) rounded once (as deq_block8 does) with a
 * lane per block, stored in the lanes' order (lanes = 1: element e of block b at 8 e + b, as
 * lanes_prepare orders activations; the four-row pass's panel) or transposed back to the file's
 * order (lanes = 0: dequant_rows); the tail blocks in the file's order either way */
static void lanes_widen(int fmt, const uint8_t *w, int64_t nb, int64_t k0, int64_t n, float *out, int lanes) {
    const int base = LANES_BASE(fmt), bb = BLOCK_BYTES[base], gb = 8 * bb, q4 = fmt == FMT_Q4_1L;
    const int64_t ng = nb / 8;
    int64_t k = k0;
    for (; k < k0 + n && k / 256 < ng; k += 256) {
        const uint8_t *wg = w + gb * (k / 256);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + (q4 ? 128 : 256))));
        const __m256 m = q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + 144))) : _mm256_setzero_ps();
        float *o = out + (k - k0);
        for (int q8 = 0; q8 < 2; q8++) { /* elements c and c + 16 for c = 8 q8 + i */
            __m256 r[2][8];
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {
                lanes_pair(fmt, wg, 8 * q8 + i, &r[0][i], &r[1][i]);
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)
                    r[h][i] = q4 ? _mm256_fmadd_ps(r[h][i], d, m) : _mm256_mul_ps(d, r[h][i]);
            }
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
                if (lanes) { /* r[h][i]: element 16 h + 8 q8 + i of the 8 blocks */
                    _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + 8 * (16 * h + 8 * q8 + i), r[h][i]);
                } else {
                    transpose8(r[h]); /* r[h][b]: block b's elements 16 h + 8 q8 + 0..7 */
                    _Pragma("GCC unroll 8") for (int b = 0; b < 8; b++) _mm256_storeu_ps(o + 32 * b + 16 * h + 8 * q8, r[h][b]);
                }
            }
        }
    }
    for (; k < k0 + n; k += 32) {
        __m256 v[4];
        deq_block8(base, w + gb * ng + bb * (k / 32 - 8 * ng), v);
        store32_8(out, k - k0, 0, v);
    }
}

/* One lane-layout row against mr activation rows. A weight is d q (+ m), so per block
 *     w . x = d (q . x) (+ m sum(x)),
 * and with a lane per block, q . x of the group's 8 blocks accumulates in one vector: per 32
 * weights two (Q4_1L: one) 8-byte loads widened to 32-bit lanes, two conversions and two FMAs per
 * activation row (the file's layout needs a d (and m) broadcast and a dequantizing multiply per
 * block on top). d (and m) then apply as vectors once per 256 weights, sum(x) per block coming
 * from the call's preparation (lanes_prepare), as do the activations in the lanes' order (xp: per
 * group, element e of block b at 8 e + b). Tail blocks (nb % 8) run in the file's format on x. */
static inline __attribute__((always_inline)) void dot_rows_lanes(int fmt, const uint8_t *w, int64_t nb, const float *xp,
                                                                 const float *x, const float *sx, int64_t K, int mr,
                                                                 float *res) {
    enum { CH = 8 };
    const int ch = mr == 1 ? 8 : mr == 2 ? 4 : mr <= 4 ? 2 : 1; /* independent FMA chains per row */
    const int base = LANES_BASE(fmt), bb = BLOCK_BYTES[base], gb = 8 * bb, q4 = fmt == FMT_Q4_1L;
    const int64_t ng = nb / 8, nt = nb % 8;
    __m256 acc[MR];
    _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *wg = w + gb * g;
        __m256 t[MR][CH];
        _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++)
            _Pragma("GCC unroll 8") for (int c = 0; c < ch; c++) t[m][c] = _mm256_setzero_ps();
        _Pragma("GCC unroll 16") for (int c = 0; c < 16; c++) {
            __m256 lo, hi;
            lanes_pair(fmt, wg, c, &lo, &hi);
            const int c0 = (2 * c) % ch, c1 = (2 * c + 1) % ch;
            _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) {
                const float *xg = xp + m * K + 256 * g;
                t[m][c0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xg + 8 * c), t[m][c0]);
                t[m][c1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xg + 8 * (c + 16)), t[m][c1]);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + (q4 ? 128 : 256))));
        const __m256 mv = q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + 144))) : _mm256_setzero_ps();
        _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) {
            __m256 tm = t[m][0];
            _Pragma("GCC unroll 8") for (int c = 1; c < ch; c++) tm = _mm256_add_ps(tm, t[m][c]);
            acc[m] = _mm256_fmadd_ps(d, tm, acc[m]);
            if (q4) acc[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(sx + m * nb + 8 * g), acc[m]);
        }
    }
    for (int64_t j = 0; j < nt; j++) {
        __m256 v[4];
        deq_block8(base, w + gb * ng + bb * j, v);
        const float *xb = x + 32 * (8 * ng + j);
        _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++)
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++)
                acc[m] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xb + m * K + 8 * i), acc[m]);
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) res[m] = hadd8(acc[m]);
}

#define MR_LANES 4 /* rows per pass: see rows1_chunk */
#define LANES_CASES(F)                                                  \
    switch (mr) {                                                        \
    case 1: dot_rows_lanes(F, w, nb, xp, x, sx, K, 1, res); break;       \
    case 2: dot_rows_lanes(F, w, nb, xp, x, sx, K, 2, res); break;       \
    case 3: dot_rows_lanes(F, w, nb, xp, x, sx, K, 3, res); break;       \
    default: dot_rows_lanes(F, w, nb, xp, x, sx, K, 4, res); break;      \
    }
static void dot_group_lanes(int fmt, const uint8_t *w, int64_t nb, const float *xp, const float *x, const float *sx,
                            int64_t K, int mr, float *res) {
    if (fmt == FMT_Q8_0L) {
        LANES_CASES(FMT_Q8_0L)
    } else {
        LANES_CASES(FMT_Q4_1L)
    }
}

/* the activations (float32, M x K) in the lane layouts' order (xp: per full group of 256 columns,
 * element e of block b at 8 e + b, by 8x8 transposes; the tail columns as they are) and their
 * per-block sums (sx: M x nb; Q4_1L's m term) */
static void lanes_prepare(const float *x, int64_t M, int64_t K, float *xp, float *sx) {
    const int64_t nb = K / 32, ng = nb / 8;
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        float *om = xp + m * K;
        for (int64_t g = 0; g < ng; g++)
            for (int e8 = 0; e8 < 4; e8++) { /* elements 8 e8 + i of the 8 blocks */
                __m256 r[8];
                _Pragma("GCC unroll 8") for (int b = 0; b < 8; b++) r[b] = _mm256_loadu_ps(xm + 256 * g + 32 * b + 8 * e8);
                transpose8(r);
                _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) _mm256_storeu_ps(om + 256 * g + 8 * (8 * e8 + i), r[i]);
            }
        memcpy(om + 256 * ng, xm + 256 * ng, (size_t)(K - 256 * ng) * 4);
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = xm + 32 * b;
            const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                           _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
            sx[m * nb + b] = hadd8(s);
        }
    }
}
#endif /* QL_AVX2 */

/* portable: widen the row once per group of rows (on the stack when it fits), then plain dots (the
 * whole kernel without AVX-512 or AVX2; with them, the lane layouts outside the AVX2 build) */
static void dot_rows_c(int fmt, const uint8_t *w, const float *x, int64_t K, int mr, float *res) {
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

static inline __attribute__((always_inline)) void dot_any(int fmt, const uint8_t *w, const float *x, int64_t K,
                                                          int mr, float *res) {
#if QL_AVX512
    switch (fmt) { /* constant format: each copy inlines only its own dequantization */
    case FMT_F32: dot_rows(FMT_F32, w, x, K, mr, res); break;
    case FMT_BF16: dot_rows(FMT_BF16, w, x, K, mr, res); break;
    case FMT_Q8_0: dot_rows(FMT_Q8_0, w, x, K, mr, res); break;
    case FMT_Q4_0: dot_rows(FMT_Q4_0, w, x, K, mr, res); break;
    case FMT_Q4_1L:
    case FMT_Q8_0L: dot_rows_c(fmt, w, x, K, mr, res); break;
    default: dot_rows(FMT_Q4_1, w, x, K, mr, res); break;
    }
#elif QL_AVX2
    switch (fmt) {
    case FMT_F32: dot_rows8(FMT_F32, w, x, K, mr, res); break;
    case FMT_BF16: dot_rows8(FMT_BF16, w, x, K, mr, res); break;
    case FMT_Q8_0: dot_rows8(FMT_Q8_0, w, x, K, mr, res); break;
    case FMT_Q4_0: dot_rows8(FMT_Q4_0, w, x, K, mr, res); break;
    case FMT_Q4_1L:
    case FMT_Q8_0L: dot_rows_c(fmt, w, x, K, mr, res); break; /* not reached: rows1_chunk runs dot_rows_lanes */
    default: dot_rows8(FMT_Q4_1, w, x, K, mr, res); break;
    }
#else
    dot_rows_c(fmt, w, x, K, mr, res);
#endif
}

/* constant row counts, so the accumulators of dot_rows live in registers */
static void dot_group(int fmt, const uint8_t *w, const float *x, int64_t K, int mr, float *res) {
    switch (mr) {
    case 1: dot_any(fmt, w, x, K, 1, res); break;
    case 2: dot_any(fmt, w, x, K, 2, res); break;
    case 3: dot_any(fmt, w, x, K, 3, res); break;
    case 4: dot_any(fmt, w, x, K, 4, res); break;
    case 5: dot_any(fmt, w, x, K, 5, res); break;
    case 6: dot_any(fmt, w, x, K, 6, res); break;
    case 7: dot_any(fmt, w, x, K, 7, res); break;
    default: dot_any(fmt, w, x, K, 8, res); break;
    }
}

#if QL_DPBF16
static void dot_group_dp(const uint16_t *w, const uint16_t *x, int64_t K, int mr, float *res) {
    switch (mr) {
    case 1: dot_rows_dpbf16(w, x, K, 1, res); break;
    case 2: dot_rows_dpbf16(w, x, K, 2, res); break;
    case 3: dot_rows_dpbf16(w, x, K, 3, res); break;
    case 4: dot_rows_dpbf16(w, x, K, 4, res); break;
    case 5: dot_rows_dpbf16(w, x, K, 5, res); break;
    case 6: dot_rows_dpbf16(w, x, K, 6, res); break;
    case 7: dot_rows_dpbf16(w, x, K, 7, res); break;
    default: dot_rows_dpbf16(w, x, K, 8, res); break;
    }
}

/* Q4_1X weights x bf16 activations. A weight is d q + m with q a nibble; the word 0x4300 | q is
 * the bf16 number 128 + q exactly, so
 *     w . x = d (128 + q) . x + (m - 128 d) sum(x)      per block,
 * where (128 + q) . x comes from vdpbf16ps (exact products, float32 sums) and sum(x) per block is
 * computed once per call. A 32 B load, widened to 16-bit lanes and masked with 0x000f | 0x4300
 * (one vpternlogd per nibble half), feeds two vdpbf16ps whose lane b accumulates block b of the
 * group: d and m - 128 d of 16 blocks then apply as vectors, once per 512 weights. The activations
 * are permuted once per call into the same order (xp: per full group, element pair t of block b at
 * t * 32 + 2b). Tail blocks (nb % 16, kept as Q4_1) run one block per vdpbf16ps on x as given.
 * The offset costs accuracy only at the float32 level (|128 + q| <= 143 against |q| <= 15: the
 * sums lose about 3 bits of float32's 24; measured 2e-7 of sum |w x|). */
static inline __attribute__((always_inline)) void dot_rows_q41x(const uint8_t *w, int64_t nb, const uint16_t *xp,
                                                                const uint16_t *xn, const float *sx, int64_t K,
                                                                int mr, float *res) {
    enum { CH = 4 };
    const int ch = mr == 1 ? 4 : mr <= 3 ? 2 : 1; /* independent vdpbf16ps chains per row */
    const int64_t ng = nb / 16, nt = nb % 16;
    const uint16_t *dv = (const uint16_t *)(w + 256 * ng + 20 * nt), *mv = dv + 16 * ng;
    const __m512i low = _mm512_set1_epi16(0x000f), one28 = _mm512_set1_epi16(0x4300);
    const __m512 c128 = _mm512_set1_ps(128.f);
    __m512 acc[MR];
    float tail[MR];
    _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) { acc[m] = _mm512_setzero_ps(); tail[m] = 0.f; }
    {
        const uint8_t *ahead = w + g_q41x_prefetch; /* the row that far ahead, all 20 nb of its bytes */
        for (int64_t o = 0; o < 20 * nb; o += 64) _mm_prefetch((const char *)(ahead + o), _MM_HINT_T0);
    }
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *wg = w + 256 * g;
        __m512 t[MR][CH];
        _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++)
            _Pragma("GCC unroll 4") for (int c = 0; c < ch; c++) t[m][c] = _mm512_setzero_ps();
        _Pragma("GCC unroll 8") for (int p = 0; p < 8; p++) {
            const __m512i wd = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wg + 32 * p)));
            const __m512i q0 = _mm512_ternarylogic_epi32(wd, low, one28, 0xEA); /* (a & b) | c */
            const __m512i q1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(wd, 4), low, one28, 0xEA);
            const int c0 = (2 * p) % ch, c1 = (2 * p + 1) % ch;
            _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) {
                const uint16_t *xg = xp + m * K + 512 * g + 64 * p;
                t[m][c0] = _mm512_dpbf16_ps(t[m][c0], (__m512bh)q0, (__m512bh)_mm512_loadu_si512(xg));
                t[m][c1] = _mm512_dpbf16_ps(t[m][c1], (__m512bh)q1, (__m512bh)_mm512_loadu_si512(xg + 32));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dv + 16 * g)));
        const __m512 mo = _mm512_fnmadd_ps(c128, d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mv + 16 * g))));
        _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) {
            __m512 tm = t[m][0];
            _Pragma("GCC unroll 4") for (int c = 1; c < ch; c++) tm = _mm512_add_ps(tm, t[m][c]);
            acc[m] = _mm512_fmadd_ps(d, tm, acc[m]);
            acc[m] = _mm512_fmadd_ps(mo, _mm512_loadu_ps(sx + m * nb + 16 * g), acc[m]);
        }
    }
    for (int64_t j = 0; j < nt; j++) {
        const int64_t b = 16 * ng + j;
        const uint8_t *blk = w + 256 * ng + 20 * j;
        int32_t dm;
        memcpy(&dm, blk, 4);
        const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        const float df = _mm_cvtss_f32(f), mf = _mm_cvtss_f32(_mm_movehdup_ps(f)) - 128.f * df;
        const __m256i wd = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 4)));
        const __m256i lo = _mm256_ternarylogic_epi32(wd, _mm512_castsi512_si256(low), _mm512_castsi512_si256(one28), 0xEA);
        const __m256i hi = _mm256_ternarylogic_epi32(_mm256_srli_epi16(wd, 4), _mm512_castsi512_si256(low),
                                                     _mm512_castsi512_si256(one28), 0xEA);
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); /* elements 0-15, 16-31 */
        const __m512 dvec = _mm512_set1_ps(df);
        _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) {
            const __m512 tb = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q,
                                               (__m512bh)_mm512_loadu_si512(xn + m * K + 32 * b));
            acc[m] = _mm512_fmadd_ps(dvec, tb, acc[m]);
            tail[m] += mf * sx[m * nb + b];
        }
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) res[m] = _mm512_reduce_add_ps(acc[m]) + tail[m];
}

static void dot_group_q41x(const uint8_t *w, int64_t nb, const uint16_t *xp, const uint16_t *xn, const float *sx,
                           int64_t K, int mr, float *res) {
    switch (mr) {
    case 1: dot_rows_q41x(w, nb, xp, xn, sx, K, 1, res); break;
    case 2: dot_rows_q41x(w, nb, xp, xn, sx, K, 2, res); break;
    case 3: dot_rows_q41x(w, nb, xp, xn, sx, K, 3, res); break;
    case 4: dot_rows_q41x(w, nb, xp, xn, sx, K, 4, res); break;
    case 5: dot_rows_q41x(w, nb, xp, xn, sx, K, 5, res); break;
    case 6: dot_rows_q41x(w, nb, xp, xn, sx, K, 6, res); break;
    case 7: dot_rows_q41x(w, nb, xp, xn, sx, K, 7, res); break;
    default: dot_rows_q41x(w, nb, xp, xn, sx, K, 8, res); break;
    }
}

/* the activations in Q4_1X's order (xp: bf16, M x K) and their per-block sums (sx: M x nb) */
static void q41x_prepare(const uint16_t *x, int64_t M, int64_t K, uint16_t *xp, float *sx) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xm = x + m * K;
        q41x_order_row(xm, K, xp + m * K);
        for (int64_t b = 0; b < nb; b++) {
            __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xm + 32 * b))), 16));
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xm + 32 * b + 16))), 16)));
            sx[m * nb + b] = _mm512_reduce_add_ps(v);
        }
    }
}
#endif

#if QL_AVX512
/* group g of a Q4_1X row (ng groups, nt tail blocks) widened to float32 in the kernel's column
 * order: v[2 t], v[2 t + 1] are columns [512 g + 32 t, +16) and [+16, +32), t < 16. d q + m is
 * rounded once (one FMA), as deq_block does. For dequant_kernel_order and the AMX widening. */
static inline __attribute__((always_inline)) void q41x_group(const uint8_t *w, int64_t ng, int64_t nt, int64_t g,
                                                             __m512 v[32]) {
    const uint16_t *dv = (const uint16_t *)(w + 256 * ng + 20 * nt), *mv = dv + 16 * ng;
    const __m512i lanes_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i lanes_hi = _mm512_add_epi32(lanes_lo, _mm512_set1_epi32(8));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dv + 16 * g)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mv + 16 * g)));
    /* lane 2b + e of the first 16 bytes of a pair belongs to block b, of the second 16 to block b + 8 */
    const __m512 d0 = _mm512_permutexvar_ps(lanes_lo, d), d1 = _mm512_permutexvar_ps(lanes_hi, d);
    const __m512 m0 = _mm512_permutexvar_ps(lanes_lo, m), m1 = _mm512_permutexvar_ps(lanes_hi, m);
    const __m512i low = _mm512_set1_epi32(0x0f);
    _Pragma("GCC unroll 8") for (int p = 0; p < 8; p++) {
        const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 256 * g + 32 * p)));
        const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 256 * g + 32 * p + 16)));
        /* pair t = 2p: the low nibbles; t = 2p + 1: the high ones */
        v[4 * p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b0, low)), d0, m0);
        v[4 * p + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b1, low)), d1, m1);
        v[4 * p + 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4)), d0, m0);
        v[4 * p + 3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4)), d1, m1);
    }
}
#endif

#if QL_AMX
/* -- AMX: the batched rows as bf16 tile products --------------------------------------------------
 *
 * From g_amx_min[fmt] activation rows (bf16 only), 16 weight rows at a time are widened to bf16
 * (d q + m in float32, one FMA, then rounded to nearest even: the weights the GEMM path of larger
 * row counts multiplies, dequant_rows with out_bf16) into an L1 buffer, 512 columns at a time,
 * and multiplied there by TDPBF16PS: tile A = 16 weight rows x 32 columns, tile B = the same 32
 * columns of 16 activation rows in pairs (amx_prepare), tile C (float32, 16 x 16) += A B summed
 * over all of K, up to four C tiles (64 activation rows) per widening. So the weights are read and
 * widened once per call whatever the row count, and the products cost next to nothing: at 8-64
 * rows the kernel costs about what one row costs, where the dot-product loops above grow with
 * every row. Q4_1X is widened in its kernel order (dequant_kernel_order's), the activations taken
 * in the same order (q41x_order_row): a permutation of K leaves x W^T as it is. BF16 weights are
 * loaded into tile A straight from W. Linux hands AMX's tile state to a process only on request
 * (arch_prctl ARCH_REQ_XCOMP_PERM); refused, the path is off (qlinear_features bit 3). */
#define AMX_KC 512 /* columns widened per pass: 16 rows x 512 bf16 = 16 KiB of L1 */
#define AMX_MG 4   /* C tiles: activation rows per widening = 16 AMX_MG */
/* default: activation rows from which the AMX path runs (qlinear_set_amx_min). Per call on the AMX
 * Xeon it tied with the dot-product loops at 4 rows (0.93-1.23x their time over the model's shapes)
 * and won by 1.6-2.1x at 8: 8 is where it wins by more than the probe's tie factor (1.25). */
#ifndef AMX_MIN
#define AMX_MIN 8
#endif
static int g_amx_ok = -1; /* -1: not asked yet; 0: refused by the kernel; 1: granted */
static int g_amx_min[FMT_LAST + 1] = {[0 ... FMT_LAST] = AMX_MIN};

static int amx_permitted(void) {
    if (g_amx_ok < 0) /* ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18; per process */
        g_amx_ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return g_amx_ok;
}

static inline int amx_format(int fmt) {
    return fmt == FMT_Q4_1X || fmt == FMT_Q4_1 || fmt == FMT_Q8_0 || fmt == FMT_Q4_0 || fmt == FMT_BF16;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* tiles 0-3: C (16 x 16 float32); 4: A (16 weight rows x 32 bf16); 5: B (16 column pairs x 16 rows) */
static void amx_configure(void) {
    amx_tilecfg c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* x (M, K) bf16 -> xv: per group of 16 rows (zeros past M), K/2 column pairs of 16 rows each: the
 * B tiles, (k/2, row) -> the pair (x[row][k], x[row][k + 1]) */
static void amx_prepare(const uint16_t *x, int64_t M, int64_t K, uint16_t *xv) {
    const int64_t kp = K / 2, ngr = (M + 15) / 16;
    const uint32_t *x32 = (const uint32_t *)x;
    uint32_t *v = (uint32_t *)xv;
    for (int64_t g = 0; g < ngr; g++)
        for (int64_t r = 0; r < kp; r++)
            for (int i = 0; i < 16; i++) {
                const int64_t m = 16 * g + i;
                v[(g * kp + r) * 16 + i] = m < M ? x32[m * kp + r] : 0;
            }
}

/* columns [k0, k0 + kc) of weight row w (kc a multiple of 32; Q4_1X: one group of 512 or its tail
 * blocks) widened to bf16 at out */
static inline void amx_widen(int fmt, const uint8_t *w, int64_t K, int64_t k0, int64_t kc, uint16_t *out) {
    if (fmt == FMT_BF16) {
        memcpy(out, (const uint16_t *)w + k0, (size_t)kc * 2);
        return;
    }
    if (fmt == FMT_Q4_1X) {
        const int64_t nb = K / 32, ng = nb / 16, nt = nb % 16;
        if (k0 < 512 * ng) { /* group k0 / 512, as dequant_kernel_order widens it */
            __m512 v[32];
            q41x_group(w, ng, nt, k0 / 512, v);
            _Pragma("GCC unroll 16") for (int t = 0; t < 16; t++)
                _mm512_storeu_si512((void *)(out + 32 * t), (__m512i)_mm512_cvtne2ps_pbh(v[2 * t + 1], v[2 * t]));
            return;
        }
        for (int64_t b = (k0 - 512 * ng) / 32; b < (k0 + kc - 512 * ng) / 32; b++, out += 32) { /* tail blocks, as Q4_1 */
            __m512 lo, hi;
            deq_block(FMT_Q4_1, w + 256 * ng + 20 * b, &lo, &hi);
            _mm512_storeu_si512((void *)out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
        return;
    }
    const int bb = BLOCK_BYTES[fmt];
    for (int64_t b = k0 / 32; b < (k0 + kc) / 32; b++, out += 32) {
        __m512 lo, hi;
        deq_block(fmt, w + b * bb, &lo, &hi);
        _mm512_storeu_si512((void *)out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}
#endif /* QL_AMX */

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

#if QL_AVX512
/* units are groups of four weight rows from n0 (dot_rows4) */
static void rows4_chunk(void *ctx, int64_t c) {
    const ql_job *j = (const ql_job *)ctx;
    const int64_t q0 = c * j->units / j->nchunks, q1 = (c + 1) * j->units / j->nchunks;
    for (int64_t nq = q0; nq < q1; nq++) {
        const int64_t n = j->n0 + nq * 4;
        const uint8_t *wr = j->w + n * j->rb;
        for (int64_t m0 = 0; m0 < j->M; m0 += 4) {
            const int mr = (int)(j->M - m0 < 4 ? j->M - m0 : 4);
            float res[16];
            dot4_group(j->fmt, wr, j->rb, j->xf + m0 * j->K, j->K, mr, res);
            for (int r = 0; r < 4; r++) {
                const float bn = j->bias ? j->bias[n + r] : 0.f;
                for (int m = 0; m < mr; m++) store_out(j, m0 + m, n + r, res[r * 4 + m] + bn);
            }
        }
    }
}
#endif

#if QL_AVX2
/* units are groups of four weight rows from n0 (panel_dot); K a multiple of 32 */
static void rows4_chunk(void *ctx, int64_t c) {
    const ql_job *j = (const ql_job *)ctx;
    const int64_t q0 = c * j->units / j->nchunks, q1 = (c + 1) * j->units / j->nchunks;
    float panel[4 * PANEL_K] __attribute__((aligned(32)));
    float res[4 * PANEL_M];
    for (int64_t nq = q0; nq < q1; nq++) {
        const int64_t n = j->n0 + nq * 4;
        const uint8_t *wr = j->w + n * j->rb;
        for (int64_t m0 = 0; m0 < j->M; m0 += PANEL_M) {
            const int64_t mm = j->M - m0 < PANEL_M ? j->M - m0 : PANEL_M;
            memset(res, 0, sizeof res);
            for (int64_t k0 = 0; k0 < j->K; k0 += PANEL_K) {
                const int64_t kn = j->K - k0 < PANEL_K ? j->K - k0 : PANEL_K;
                const float *p = panel;
                int64_t ps = PANEL_K;
                if (j->fmt == FMT_F32) { /* already float32: the rows themselves */
                    p = (const float *)wr + k0;
                    ps = j->K;
                } else {
                    panel_fill(j->fmt, wr, j->rb, k0, kn, panel);
                }
                const float *xs = IS_LANES(j->fmt) ? j->xl : j->xf; /* a lane layout's panel: in lane order */
                for (int64_t mi = 0; mi < mm; mi += PANEL_MT) {
                    const int mt = (int)(mm - mi < PANEL_MT ? mm - mi : PANEL_MT);
                    panel_group(p, ps, xs + (m0 + mi) * j->K + k0, j->K, kn, mt, res + mi);
                }
            }
            for (int r = 0; r < 4; r++) {
                const float bn = j->bias ? j->bias[n + r] : 0.f;
                for (int64_t m = 0; m < mm; m++) store_out(j, m0 + m, n + r, res[r * PANEL_M + m] + bn);
            }
        }
    }
}
#endif

/* the lane layouts run MR_LANES rows per pass: their group sums take registers beside the
 * accumulators, and at 8 rows they spilled (AMD EPYC, AVX2, 2 threads, Q4_1L: K = 1536 at 8 rows
 * 244 ps per weight in one pass, 194 in two of 4; K = 576 140 and 156, within this machine's noise) */
#ifndef MR_LANES
#define MR_LANES MR
#endif

/* units are single weight rows from n0, each used for up to MR activation rows at a time */
static void rows1_chunk(void *ctx, int64_t c) {
    const ql_job *j = (const ql_job *)ctx;
    const int64_t r0 = c * j->units / j->nchunks, r1 = (c + 1) * j->units / j->nchunks;
    const int per = IS_LANES(j->fmt) ? MR_LANES : MR;
    for (int64_t n = j->n0 + r0; n < j->n0 + r1; n++) {
        const uint8_t *wr = j->w + n * j->rb;
        const float bn = j->bias ? j->bias[n] : 0.f;
        for (int64_t m0 = 0; m0 < j->M; m0 += per) {
            const int mr = (int)(j->M - m0 < per ? j->M - m0 : per);
            float res[MR];
#if QL_DPBF16
            if (j->fmt == FMT_Q4_1X)
                dot_group_q41x(wr, j->K / 32, j->xp + m0 * j->K, (const uint16_t *)j->x + m0 * j->K,
                               j->sx + m0 * (j->K / 32), j->K, mr, res);
            else if (j->dp)
                dot_group_dp((const uint16_t *)wr, (const uint16_t *)j->x + m0 * j->K, j->K, mr, res);
            else
#endif
#if QL_AVX2
            if (IS_LANES(j->fmt))
                dot_group_lanes(j->fmt, wr, j->K / 32, j->xl + m0 * j->K, j->xf + m0 * j->K, j->sx + m0 * (j->K / 32), j->K,
                               mr, res);
            else
#endif
                dot_group(j->fmt, wr, j->xf + m0 * j->K, j->K, mr, res);
            _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) store_out(j, m0 + m, n, res[m] + bn);
        }
    }
}

#if QL_AMX
/* the C tiles of activation groups [0, G) += A (tile 4) times their B tiles (tile 5, loaded in turn) */
static inline __attribute__((always_inline)) void amx_products(const uint16_t *xv, int64_t gstride, int G) {
    _tile_loadd(5, xv, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (G > 1) { _tile_loadd(5, xv + gstride, 64); _tile_dpbf16ps(1, 4, 5); }
    if (G > 2) { _tile_loadd(5, xv + 2 * gstride, 64); _tile_dpbf16ps(2, 4, 5); }
    if (G > 3) { _tile_loadd(5, xv + 3 * gstride, 64); _tile_dpbf16ps(3, 4, 5); }
}

/* units are strips of 16 weight rows from n0 (the last one may be short) */
static void amx_chunk(void *ctx, int64_t c) {
    const ql_job *j = (const ql_job *)ctx;
    const int64_t s0 = c * j->units / j->nchunks, s1 = (c + 1) * j->units / j->nchunks;
    if (s0 >= s1) return;
    const int64_t K = j->K, kp = K / 2;
    uint16_t abuf[16 * AMX_KC] __attribute__((aligned(64)));
    float cbuf[16 * 16] __attribute__((aligned(64)));
    const __m512i cidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    amx_configure();
    for (int64_t s = s0; s < s1; s++) {
        const int64_t n = j->n0 + 16 * s, rows = j->N - n < 16 ? j->N - n : 16;
        const uint8_t *wr = j->w + n * j->rb;
        const int direct = j->fmt == FMT_BF16 && rows == 16; /* tile A straight from W */
        if (rows < 16) memset(abuf, 0, sizeof abuf);      /* the missing rows multiply as zeros */
        const __mmask16 rmask = (__mmask16)(rows == 16 ? 0xffff : (1u << rows) - 1);
        const __m512 bv = j->bias ? _mm512_maskz_loadu_ps(rmask, j->bias + n) : _mm512_setzero_ps();
        for (int64_t m0 = 0; m0 < j->M; m0 += 16 * AMX_MG) {
            const int G = (int)((j->M - m0 + 15) / 16 < AMX_MG ? (j->M - m0 + 15) / 16 : AMX_MG);
            const uint16_t *xg = j->xv + (m0 / 16) * kp * 32;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t k0 = 0; k0 < K;) {
                /* Q4_1X: a group, then all its tail blocks; other formats: AMX_KC columns */
                int64_t kc = K - k0 < AMX_KC ? K - k0 : AMX_KC;
                if (j->fmt == FMT_Q4_1X && k0 + kc > K / 512 * 512 && k0 < K / 512 * 512) kc = K / 512 * 512 - k0;
                const uint16_t *a = abuf;
                int64_t astride = kc * 2;
                if (direct) {
                    a = (const uint16_t *)wr + k0;
                    astride = j->rb;
                } else {
                    /* this chunk's share of each row's bytes, in the next strip: the widening runs
                     * from L1/L2 while the next strip streams in */
                    const int64_t p0 = j->rb * k0 / K, p1 = j->rb * (k0 + kc) / K;
                    for (int64_t r = 0; r < rows; r++) {
                        if (s + 1 < s1)
                            for (int64_t p = p0; p < p1; p += 64) _mm_prefetch((const char *)(wr + (16 + r) * j->rb + p), _MM_HINT_T0);
                        amx_widen(j->fmt, wr + r * j->rb, K, k0, kc, abuf + r * kc);
                    }
                }
                for (int64_t kk = 0; kk < kc; kk += 32) {
                    _tile_loadd(4, a + kk, astride);
                    const uint16_t *xk = xg + (k0 + kk) / 2 * 32;
                    switch (G) {
                    case 1: amx_products(xk, kp * 32, 1); break;
                    case 2: amx_products(xk, kp * 32, 2); break;
                    case 3: amx_products(xk, kp * 32, 3); break;
                    default: amx_products(xk, kp * 32, 4); break;
                    }
                }
                k0 += kc;
            }
            for (int g = 0; g < G; g++) {
                switch (g) {
                case 0: _tile_stored(0, cbuf, 64); break;
                case 1: _tile_stored(1, cbuf, 64); break;
                case 2: _tile_stored(2, cbuf, 64); break;
                default: _tile_stored(3, cbuf, 64); break;
                }
                const int64_t mg = m0 + 16 * g, mn = j->M - mg < 16 ? j->M - mg : 16;
                for (int64_t i = 0; i < mn; i++) { /* C is (weight row, activation row): column i is y's row */
                    const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(cidx, cbuf + i, 4), bv);
                    if (j->y_bf16)
                        _mm256_mask_storeu_epi16((uint16_t *)j->y + (mg + i) * j->N + n, rmask, (__m256i)_mm512_cvtneps_pbh(v));
                    else
                        _mm512_mask_storeu_ps((float *)j->y + (mg + i) * j->N + n, rmask, v);
                }
            }
        }
    }
    _tile_release();
}
#endif

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

/* Q4_1X rows (N, K) widened to float32 (out_bf16 = 0) or bf16 with K in the kernel's order: element
 * pair t of block b of group g at 512 g + 32 t + 2 b, the tail blocks as they are. For the GEMM of
 * larger row counts, whose activations take the same column order (a permutation of K leaves
 * x W^T as it is): each 32-byte load is written out as it is decoded, no transpose. */
int dequant_kernel_order(int fmt, const void *w, int64_t N, int64_t K, void *out, int out_bf16) {
    if (fmt != FMT_Q4_1X || K <= 0 || K % 32 != 0) return 1;
    const int64_t nb = K / 32, ng = nb / 16, nt = nb % 16, rb = row_bytes(fmt, K);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < N; r++) {
        const uint8_t *wr = (const uint8_t *)w + r * rb;
#if QL_AVX512
        for (int64_t g = 0; g < ng; g++) {
            __m512 v[32];
            q41x_group(wr, ng, nt, g, v);
            for (int t = 0; t < 16; t++) store32(out, r * K + 512 * g + 32 * t, out_bf16, v[2 * t], v[2 * t + 1]);
        }
        for (int64_t j = 0; j < nt; j++) {
            __m512 lo, hi;
            deq_block(FMT_Q4_1, wr + 256 * ng + 20 * j, &lo, &hi);
            store32(out, r * K + 512 * ng + 32 * j, out_bf16, lo, hi);
        }
#else
        (void)nt;
        float buf[32];
        for (int64_t b = 0; b < nb; b++) {
            q41x_block_c(wr, nb, b, buf);
            for (int el = 0; el < 32; el++) { /* element el of block b -> its kernel-order column */
                const int64_t col = b < 16 * ng ? 512 * (b / 16) + 32 * (el / 2) + 2 * (b % 16) + el % 2 : 32 * b + el;
                if (out_bf16)
                    ((uint16_t *)out)[r * K + col] = f32_to_bf16(buf[el]);
                else
                    ((float *)out)[r * K + col] = buf[el];
            }
        }
#endif
    }
    return 0;
}

/* out (M, K) = bf16 activations x with their columns in Q4_1X's kernel order (q41x_order_row), to
 * meet the columns dequant_kernel_order widens */
int kernel_order_x(int fmt, const uint16_t *x, int64_t M, int64_t K, uint16_t *out) {
    if (fmt != FMT_Q4_1X || K <= 0 || K % 32 != 0) return 1;
#pragma omp parallel for schedule(static) if (M * K > (1 << 16))
    for (int64_t m = 0; m < M; m++) q41x_order_row(x + m * K, K, out + m * K);
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

/* Q4_1 / Q8_0 rows (N, K/32 blocks) -> Q4_1L / Q8_0L rows (lanes_block_c's layout), the same bytes */
static void repack_lanes(int fmt, const uint8_t *src, int64_t N, int64_t K, uint8_t *dst) {
    const int bb = BLOCK_BYTES[LANES_BASE(fmt)], q4 = fmt == FMT_Q4_1L, nq = q4 ? 16 : 32;
    const int64_t nb = K / 32, ng = nb / 8, nt = nb % 8, rb = bb * nb;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *s = src + n * rb;
        uint8_t *o = dst + n * rb;
        for (int64_t g = 0; g < ng; g++)
            for (int b = 0; b < 8; b++) {
                const uint8_t *blk = s + bb * (8 * g + b);
                uint8_t *og = o + 8 * bb * g;
                for (int c = 0; c < nq; c++) og[8 * c + b] = blk[(q4 ? 4 : 2) + c];
                memcpy(og + 8 * nq + 2 * b, blk, 2); /* d */
                if (q4) memcpy(og + 144 + 2 * b, blk + 2, 2); /* m */
            }
        memcpy(o + 8 * bb * ng, s + 8 * bb * ng, (size_t)(bb * nt));
    }
}

/* Q4_1 rows (N, K/32 blocks) -> Q4_1X rows (dot_rows_q41x's layout); Q4_1 / Q8_0 rows -> Q4_1L /
 * Q8_0L rows (lanes_block_c's): the same bytes per row. */
int qlinear_repack(int fmt_to, const void *src, int64_t N, int64_t K, void *dst) {
    if ((fmt_to != FMT_Q4_1X && !IS_LANES(fmt_to)) || K <= 0 || K % 32 != 0 || src == dst) return 1;
    if (IS_LANES(fmt_to)) {
        repack_lanes(fmt_to, (const uint8_t *)src, N, K, (uint8_t *)dst);
        return 0;
    }
    const int64_t nb = K / 32, ng = nb / 16, nt = nb % 16, rb = 20 * nb;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *s = (const uint8_t *)src + n * rb;
        uint8_t *o = (uint8_t *)dst + n * rb, *dm = o + 256 * ng + 20 * nt;
        for (int64_t g = 0; g < ng; g++)
            for (int p = 0; p < 8; p++)
                for (int b = 0; b < 16; b++)
                    for (int e = 0; e < 2; e++) {
                        const uint8_t *qs = s + (16 * g + b) * 20 + 4;
                        const int el0 = 4 * p + e, el1 = 4 * p + 2 + e; /* elements of pairs 2p, 2p + 1 */
                        const int q0 = el0 < 16 ? qs[el0] & 0x0f : qs[el0 - 16] >> 4;
                        const int q1 = el1 < 16 ? qs[el1] & 0x0f : qs[el1 - 16] >> 4;
                        o[256 * g + 32 * p + 2 * b + e] = (uint8_t)(q0 | q1 << 4);
                    }
        memcpy(o + 256 * ng, s + 20 * 16 * ng, (size_t)(20 * nt));
        for (int64_t b = 0; b < 16 * ng; b++) {
            memcpy(dm + 2 * b, s + 20 * b, 2);
            memcpy(dm + 32 * ng + 2 * b, s + 20 * b + 2, 2);
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
int qlinear_abi(void) { return 7; }
