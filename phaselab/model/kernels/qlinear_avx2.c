/* qlinear_avx2.c: the AVX2 + FMA + F16C tier of the linear kernel (AMD Zen 2/3, Intel before
 * Skylake-SP, or any CPU with them under PHASELAB_KERNEL_ISA=avx2; qlinear.h says where the other
 * tiers are). Holds, under QL_AVX2:
 *   dot_rows8 / dot_group    one weight row of F32, BF16, Q8_0, Q4_0 or Q4_1 against up to MR rows
 *   panel_dot / panel_fill   four weight rows at once, widened into an L1 panel (rows4_chunk)
 *   the lane layouts Q4_1L and Q8_0L (a float32 vector lane per block): lanes_widen, dot_rows_lanes,
 *                            lanes_prepare (their layout is described at lanes_block_c, qlinear.h)
 *   rows1_chunk, rows4_chunk the row chunks qlinear() runs on the pool
 * Compiles to nothing in an AVX-512 or a portable build. */
#include "qlinear.h"
#include "qlinear_avx2.h"

#if QL_AVX2
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
void lanes_widen(int fmt, const uint8_t *w, int64_t nb, int64_t k0, int64_t n, float *out, int lanes) {
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
void lanes_prepare(const float *x, int64_t M, int64_t K, float *xp, float *sx) {
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

static inline __attribute__((always_inline)) void dot_any(int fmt, const uint8_t *w, const float *x, int64_t K,
                                                          int mr, float *res) {
    switch (fmt) {
    case FMT_F32: dot_rows8(FMT_F32, w, x, K, mr, res); break;
    case FMT_BF16: dot_rows8(FMT_BF16, w, x, K, mr, res); break;
    case FMT_Q8_0: dot_rows8(FMT_Q8_0, w, x, K, mr, res); break;
    case FMT_Q4_0: dot_rows8(FMT_Q4_0, w, x, K, mr, res); break;
    case FMT_Q4_1L:
    case FMT_Q8_0L: dot_rows_c(fmt, w, x, K, mr, res); break; /* not reached: rows1_chunk runs dot_rows_lanes */
    default: dot_rows8(FMT_Q4_1, w, x, K, mr, res); break;
    }
}

QL_DEFINE_DOT_GROUP /* dot_group: dot_any at a constant row count (qlinear.h) */

/* units are groups of four weight rows from n0 (panel_dot); K a multiple of 32 */
void rows4_chunk(void *ctx, int64_t c) {
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

/* the lane layouts run MR_LANES rows per pass: their group sums take registers beside the
 * accumulators, and at 8 rows they spilled (AMD EPYC, AVX2, 2 threads, Q4_1L: K = 1536 at 8 rows
 * 244 ps per weight in one pass, 194 in two of 4; K = 576 140 and 156, within this machine's noise) */
/* units are single weight rows from n0, each used for up to MR activation rows at a time */
void rows1_chunk(void *ctx, int64_t c) {
    const ql_job *j = (const ql_job *)ctx;
    const int64_t r0 = c * j->units / j->nchunks, r1 = (c + 1) * j->units / j->nchunks;
    const int per = IS_LANES(j->fmt) ? MR_LANES : MR;
    for (int64_t n = j->n0 + r0; n < j->n0 + r1; n++) {
        const uint8_t *wr = j->w + n * j->rb;
        const float bn = j->bias ? j->bias[n] : 0.f;
        for (int64_t m0 = 0; m0 < j->M; m0 += per) {
            const int mr = (int)(j->M - m0 < per ? j->M - m0 : per);
            float res[MR];
            if (IS_LANES(j->fmt))
                dot_group_lanes(j->fmt, wr, j->K / 32, j->xl + m0 * j->K, j->xf + m0 * j->K, j->sx + m0 * (j->K / 32), j->K,
                               mr, res);
            else
                dot_group(j->fmt, wr, j->xf + m0 * j->K, j->K, mr, res);
            _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) store_out(j, m0 + m, n, res[m] + bn);
        }
    }
}
#endif /* QL_AVX2 */
