/* qlinear_avx512.c: the AVX-512 tier of the linear kernel (CPUs with AVX512F + BW, built with
 * -march=native; qlinear.h says where the other tiers are). Holds, under QL_AVX512:
 *   dot_rows / dot_group     one weight row of F32, BF16, Q8_0, Q4_0 or Q4_1 against up to MR rows
 *   dot_rows4 / dot4_group   four weight rows at once, from rows4_min activation rows
 *   rows1_chunk, rows4_chunk the row chunks qlinear() runs on the pool
 * and, with AVX512-BF16 (QL_DPBF16), the vdpbf16ps kernels: BF16 x bf16 (dot_rows_dpbf16) and
 * the Q4_1X layout (dot_rows_q41x, q41x_prepare). The lane layouts (Q4_1L, Q8_0L) run the portable
 * loops here (dot_rows_c). Compiles to nothing without AVX-512. */
#include "qlinear.h"
#include "qlinear_avx512.h"

#if QL_AVX512
#ifndef QL_PREFETCH
#define QL_PREFETCH 4096 /* bytes ahead in a weight row that the AVX-512 block loops prefetch */
#endif

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

static inline __attribute__((always_inline)) void dot_any(int fmt, const uint8_t *w, const float *x, int64_t K,
                                                          int mr, float *res) {
    switch (fmt) { /* constant format: each copy inlines only its own dequantization */
    case FMT_F32: dot_rows(FMT_F32, w, x, K, mr, res); break;
    case FMT_BF16: dot_rows(FMT_BF16, w, x, K, mr, res); break;
    case FMT_Q8_0: dot_rows(FMT_Q8_0, w, x, K, mr, res); break;
    case FMT_Q4_0: dot_rows(FMT_Q4_0, w, x, K, mr, res); break;
    case FMT_Q4_1L:
    case FMT_Q8_0L: dot_rows_c(fmt, w, x, K, mr, res); break;
    default: dot_rows(FMT_Q4_1, w, x, K, mr, res); break;
    }
}

QL_DEFINE_DOT_GROUP /* dot_group: dot_any at a constant row count (qlinear.h) */

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
void q41x_prepare(const uint16_t *x, int64_t M, int64_t K, uint16_t *xp, float *sx) {
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

/* units are groups of four weight rows from n0 (dot_rows4) */
void rows4_chunk(void *ctx, int64_t c) {
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

/* units are single weight rows from n0, each used for up to MR activation rows at a time */
void rows1_chunk(void *ctx, int64_t c) {
    const ql_job *j = (const ql_job *)ctx;
    const int64_t r0 = c * j->units / j->nchunks, r1 = (c + 1) * j->units / j->nchunks;
    const int per = MR;
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
                dot_group(j->fmt, wr, j->xf + m0 * j->K, j->K, mr, res);
            _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) store_out(j, m0 + m, n, res[m] + bn);
        }
    }
}
#endif /* QL_AVX512 */
