/* qlinear_avx2.h: the AVX2 tier's inline helpers that more than one file uses: a block of any
 * quantized format widened to four float32 vectors of 8 (deq_block8), 8 dense weights (dense8), 32
 * widened weights stored as float32 or bf16 (store32_8); and the lane layouts' functions that
 * qlinear_entry.c calls (defined in qlinear_avx2.c). Empty unless QL_AVX2. */
#ifndef QLINEAR_AVX2_H
#define QLINEAR_AVX2_H

#include "qlinear.h"

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

/* elements [k0, k0 + n) of a lane-layout row widened to float32, in the lanes' order or the file's */
QL_HIDDEN void lanes_widen(int fmt, const uint8_t *w, int64_t nb, int64_t k0, int64_t n, float *out, int lanes);
/* the activations in the lane layouts' order and their per-block sums */
QL_HIDDEN void lanes_prepare(const float *x, int64_t M, int64_t K, float *xp, float *sx);
#endif /* QL_AVX2 */

#endif
