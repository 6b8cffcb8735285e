/* qlinear_portable.c: the linear kernel in plain C, the tier of a build without AVX-512 or AVX2
 * (PHASELAB_KERNEL_ISA=portable, or a CPU without them; qlinear.h says where the other tiers are):
 *   dot_group      one weight row against up to MR activation rows: dot_rows_c (qlinear.h), the
 *                  row widened once per group of activation rows, then plain dots
 *   rows1_chunk    the row chunks qlinear() runs on the pool
 * The compiler vectorizes the loops as the build's flags allow. Compiles to nothing in an AVX-512 or
 * AVX2 build. */
#include "qlinear.h"

#if !QL_AVX512 && !QL_AVX2
static inline __attribute__((always_inline)) void dot_any(int fmt, const uint8_t *w, const float *x, int64_t K,
                                                          int mr, float *res) {
    dot_rows_c(fmt, w, x, K, mr, res);
}

QL_DEFINE_DOT_GROUP /* dot_group: dot_any at a constant row count (qlinear.h) */

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
            dot_group(j->fmt, wr, j->xf + m0 * j->K, j->K, mr, res);
            _Pragma("GCC unroll 8") for (int m = 0; m < mr; m++) store_out(j, m0 + m, n, res[m] + bn);
        }
    }
}
#endif
