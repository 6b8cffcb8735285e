/* qlinear_layouts.c: the weight layouts the linear kernel re-lays at load, and Q4_1X's column order.
 *   qlinear_repack        Q4_1 -> Q4_1X (vdpbf16ps, AVX512-BF16), Q4_1 / Q8_0 -> Q4_1L / Q8_0L (AVX2)
 *   q41x_order_row,       activations in Q4_1X's kernel order (the kernel's own preparation, the AMX
 *   kernel_order_x        path, and the tile GEMM of larger row counts)
 *   dequant_kernel_order  Q4_1X rows widened with their columns in that order (that GEMM's weights)
 * The layouts themselves are described in qlinear.h (q41x_block_c, lanes_block_c). */
#include "qlinear.h"
#include "qlinear_avx512.h"

/* One row of bf16 activations (K) in Q4_1X's kernel order: per full group of 16 blocks, element
 * pair t of block b moves to 32 t + 2 b; the tail columns stay where they are. */
void q41x_order_row(const uint16_t *xm, int64_t K, uint16_t *om) {
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
