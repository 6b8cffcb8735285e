/* Helpers shared by the native kernels (paged_decode.c, prefill_attn.c, elementwise.c,
 * decode_layers.c and the qlinear_*.c files, all in one library): bf16 <-> float32 as torch
 * converts, buffers grown on demand, the thread-pool hook's types, and, where AVX-512 or AVX2 is
 * compiled, a vector exp and horizontal reductions.
 * Header-only: everything is static. */
#ifndef PHASELAB_SIMD_H
#define PHASELAB_SIMD_H

#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PL_AVX512 1
#else
#define PL_AVX512 0
#endif
/* AVX2 + FMA without AVX-512 (AMD Zen 2/3; PHASELAB_KERNEL_ISA=avx2): an 8-wide vector exp */
#if !PL_AVX512 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PL_AVX2 1
#else
#define PL_AVX2 0
#endif

/* A buffer grown on demand and kept (no allocation per call once warm); declared
 * `static _Thread_local pl_buf name;` so each thread has its own. NULL when out of memory. */
typedef struct {
    void *p;
    size_t n; /* bytes */
} pl_buf;

static inline void *pl_grow(pl_buf *b, size_t bytes) {
    if (bytes > b->n) {
        void *q = realloc(b->p, bytes);
        if (!q) return NULL;
        b->p = q;
        b->n = bytes;
    }
    return b->p;
}

/* pool.c's phaselab_pool_run(fn, ctx, n) calls fn(ctx, i) for i in [0, n) on its workers */
typedef void (*chunk_fn)(void *ctx, int64_t chunk);
typedef void (*pool_run_fn)(chunk_fn fn, void *ctx, int64_t nchunks);

static inline float bf16f(uint16_t h) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)h << 16};
    return c.f;
}

/* round to nearest even (NaN made quiet), as torch narrows float32 to bf16 */
static inline uint16_t f32_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7fffffff) > 0x7f800000) return (uint16_t)((c.u >> 16) | 0x40);
    return (uint16_t)((c.u + 0x7fff + ((c.u >> 16) & 1)) >> 16);
}

#if PL_AVX512
/* 2^x: degree-6 polynomial on the fraction, scalef by the integer part; relative error ~2e-7.
 * Inputs below -126 give 2^-126 (callers mask what must be exactly zero); large ones overflow to
 * inf as exp2f does. */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n); /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910071f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718055994531f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 exp_ps(__m512 x) { return exp2_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f))); }
#endif

#if PL_AVX2
/* exp2_ps on 8 lanes: the same polynomial; 2^n built in the exponent field (n in [-126, 127]),
 * inputs clamped to that range, so large ones give 2^127 * 2^0.5 at most, not inf (the callers'
 * arguments are <= 0: softmax scores minus their max) */
static inline __m256 exp2_ps8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-126.f)), _mm256_set1_ps(127.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n); /* [-0.5, 0.5] */
    __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24022650695910071f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.69314718055994531f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 exp_ps8(__m256 x) { return exp2_ps8(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f))); }

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hadd8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
