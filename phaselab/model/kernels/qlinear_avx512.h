/* qlinear_avx512.h: the AVX-512 tier's inline helpers that more than one file uses: a block of
 * any quantized format widened to two float32 vectors (deq_block), 16 dense weights (dense16), 32
 * widened weights stored as float32 or bf16 (store32), a Q4_1X group widened in its kernel order
 * (q41x_group); read by qlinear_avx512.c, qlinear_amx.c, qlinear_layouts.c and dequant_rows in
 * qlinear_entry.c. Empty unless QL_AVX512. */
#ifndef QLINEAR_AVX512_H
#define QLINEAR_AVX512_H

#include "qlinear.h"

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

#if QL_DPBF16
/* the activations in Q4_1X's order and their per-block sums (qlinear_avx512.c) */
QL_HIDDEN void q41x_prepare(const uint16_t *x, int64_t M, int64_t K, uint16_t *xp, float *sx);
#endif
#endif /* QL_AVX512 */

#endif
