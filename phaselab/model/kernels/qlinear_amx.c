/* qlinear_amx.c: Intel AMX for the batched bf16 rows of the linear kernel (Sapphire Rapids and
 * later: QL_AMX, which needs AVX512-BF16 too; qlinear.h says where the other tiers are). Holds the
 * tile configuration, Linux's permission for the tile state (amx_permitted), the activations laid
 * out as B tiles (amx_prepare), a strip of weight rows widened to bf16 (amx_widen) and the row
 * chunk that multiplies them (amx_chunk); qlinear() in qlinear_entry.c decides when it runs
 * (qlinear_set_amx_min). Compiles to nothing without AMX. */
#include "qlinear.h"
#include "qlinear_avx512.h"

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
 * rows the kernel costs about what one row costs, where the dot-product loops (qlinear_avx512.c)
 * grow with every row. Q4_1X is widened in its kernel order (dequant_kernel_order's), the activations taken
 * in the same order (q41x_order_row): a permutation of K leaves x W^T as it is. BF16 weights are
 * loaded into tile A straight from W. Linux hands AMX's tile state to a process only on request
 * (arch_prctl ARCH_REQ_XCOMP_PERM); refused, the path is off (qlinear_features bit 3). */
#define AMX_KC 512 /* columns widened per pass: 16 rows x 512 bf16 = 16 KiB of L1 */
#define AMX_MG 4   /* C tiles: activation rows per widening = 16 AMX_MG */
static int g_amx_ok = -1; /* -1: not asked yet; 0: refused by the kernel; 1: granted */

int amx_permitted(void) {
    if (g_amx_ok < 0) /* ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18; per process */
        g_amx_ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return g_amx_ok;
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
void amx_prepare(const uint16_t *x, int64_t M, int64_t K, uint16_t *xv) {
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

/* the C tiles of activation groups [0, G) += A (tile 4) times their B tiles (tile 5, loaded in turn) */
static inline __attribute__((always_inline)) void amx_products(const uint16_t *xv, int64_t gstride, int G) {
    _tile_loadd(5, xv, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (G > 1) { _tile_loadd(5, xv + gstride, 64); _tile_dpbf16ps(1, 4, 5); }
    if (G > 2) { _tile_loadd(5, xv + 2 * gstride, 64); _tile_dpbf16ps(2, 4, 5); }
    if (G > 3) { _tile_loadd(5, xv + 3 * gstride, 64); _tile_dpbf16ps(3, 4, 5); }
}

/* units are strips of 16 weight rows from n0 (the last one may be short) */
void amx_chunk(void *ctx, int64_t c) {
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
#endif /* QL_AMX */
