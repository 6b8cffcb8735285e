/* Prefill attention on the CPU: one request's chunk of new query rows, causally, against its whole
 * context in the paged KV cache (a cached prefix, earlier chunks, and the chunk's own K/V, which the
 * caller has already written), in bf16 with float32 accumulation.
 *
 * Why: torch's flash attention for CPU ran at 60-77 GFLOP/s on a 512-token prompt with 64-wide
 * heads here (AMD EPYC, 2 cores), about 40% of a prefill's time, and a chunk after a cached prefix
 * took a second pass plus a merge. This kernel reads the context once through the block table, for
 * any start position, and keeps the arithmetic in the dot-product units:
 *
 *   pack   per KV head, the context's K and V are laid out once per call in the order the inner
 *          loops read them, 16 keys per 64-byte vector:
 *            Kp[key block of 16][d pair][16 keys]   (bf16 pairs: dims 2i, 2i+1 of one key)
 *            Vp[key pair][D]                         (bf16 pairs: keys 2j, 2j+1 of one dim)
 *   tile   4 query rows (consecutive positions of one head) against 64 keys at a time:
 *            S = q.K     with AVX512-BF16 `vdpbf16ps` (a broadcast q pair times 16 keys), or two
 *                        float32 FMAs per pair where the CPU lacks it (same packed layout)
 *            online softmax in float32 (running max and sum; exp2 by a degree-6 polynomial)
 *            O += P.V    P rounded to bf16 (as torch's flash attention does for bf16), V pairs
 *   output O / sum, rounded to bf16 (nearest even)
 *
 * Layouts: q rows (n, H, D) bf16 with row stride `q_stride` elements (the columns of a fused qkv
 * projection), cache (num_blocks, BS, KVH, D) bf16, table (blocks of the request) int64, out (n, H, D)
 * bf16 contiguous. Query row i sits at position start + i and attends to positions 0..start+i.
 * Query head h reads KV head h / (H / KVH), as Hugging Face's repeat_kv pairs them.
 *
 * mode: 0 = the default compiled path (AVX512-BF16 where the CPU has it), 1 = AVX-512 float32 FMA,
 * 2 = portable C, 3 = AVX512-BF16, 4 = AMX tiles (where the CPU has them and Linux grants them);
 * prefill_attn_features() says which were compiled. Work runs on phaselab's pool
 * (prefill_attn_set_pool) or OpenMP's team. Returns 0, 1 for an unsupported shape or mode, 2 when
 * memory cannot be allocated.
 */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define PA_AVX512 PL_AVX512
#if PA_AVX512 && defined(__AVX512BF16__)
#define PA_DPBF16 1
#else
#define PA_DPBF16 0
#endif

/* Intel AMX: 16 query rows against 32 keys per step as bf16 tile products (amx_item) */
#if PA_DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PA_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define PA_AMX 0
#endif

#define MAX_D 256
#define ROWS 4   /* query rows per tile */
#define KBLK 64  /* keys per softmax step: 4 vectors of 16 */
#define LOG2E 1.4426950408889634f

static pool_run_fn g_pool_run = NULL;
void prefill_attn_set_pool(void *fn) { g_pool_run = (pool_run_fn)fn; }

static void run(chunk_fn fn, void *ctx, int64_t n) {
    if (n <= 0) return;
    if (g_pool_run) {
        g_pool_run(fn, ctx, n);
        return;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; i++) fn(ctx, i);
}

typedef struct pa_job pa_job;
/* ROWS query rows against keys [0, kend): acc (ROWS, D) unnormalized, m and l each row's max and sum */
typedef void (*tile_fn)(const pa_job *, const uint16_t *const *, const int64_t *, const uint32_t *, const uint32_t *,
                        float *, float *, float *, int64_t);
struct pa_job {
    const uint16_t *q, *kc, *vc;
    const int64_t *table;
    uint16_t *out;
    uint32_t *kp, *vp; /* packed K and V, per KV head: Lp * D / 2 uint32 each */
    int64_t q_stride, start, n, L, Lp, H, KVH, G, D, BS, ntiles;
    float scale2; /* scale * log2(e): scores in the exp2 domain */
    tile_fn tile;
};

/* -- packing ------------------------------------------------------------------------------------ */

static inline const uint16_t *row_of(const uint16_t *cache, const pa_job *j, int64_t t, int64_t h) {
    return cache + ((j->table[t / j->BS] * j->BS + t % j->BS) * j->KVH + h) * j->D;
}

/* item = (KV head, 64 keys): its K sub-blocks and V key pairs; keys >= L are zero */
static void pack_item(void *ctx, int64_t item) {
    const pa_job *j = (const pa_job *)ctx;
    const int64_t nb = j->Lp / KBLK, h = item / nb, t0 = (item % nb) * KBLK, D = j->D, P = D / 2;
    uint32_t *kp = j->kp + h * j->Lp * P, *vp = j->vp + h * j->Lp * P;
    for (int64_t sb = t0; sb < t0 + KBLK; sb += 16) {
        uint32_t *dst = kp + sb * P; /* [pair][16 keys] */
        for (int64_t i = 0; i < 16; i++) {
            const int64_t t = sb + i;
            if (t < j->L) {
                const uint32_t *k = (const uint32_t *)row_of(j->kc, j, t, h);
                for (int64_t p = 0; p < P; p++) dst[p * 16 + i] = k[p];
            } else {
                for (int64_t p = 0; p < P; p++) dst[p * 16 + i] = 0;
            }
        }
    }
    for (int64_t t = t0; t < t0 + KBLK; t += 2) {
        uint32_t *dst = vp + (t / 2) * D; /* [key pair][D] */
        const uint16_t *a = t < j->L ? row_of(j->vc, j, t, h) : NULL;
        const uint16_t *b = t + 1 < j->L ? row_of(j->vc, j, t + 1, h) : NULL;
        for (int64_t d = 0; d < D; d++) dst[d] = (a ? a[d] : 0) | (uint32_t)(b ? b[d] : 0) << 16;
    }
}

/* -- AVX-512 tile -------------------------------------------------------------------------------- */
#if PA_AVX512

static inline __m512 even_f(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
static inline __m512 odd_f(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
}

/* ROWS query rows (head h, positions pos[r]) of width DIM against keys [0, kend) */
static inline __attribute__((always_inline)) void tile_avx512(const pa_job *j, const uint16_t *const *qr,
                                                              const int64_t *pos, const uint32_t *kp,
                                                              const uint32_t *vp, float *acc, float *m, float *l,
                                                              int64_t kend, int DIM, int dp) {
    const int64_t P = DIM / 2, NV = DIM / 16;
    for (int r = 0; r < ROWS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
        for (int64_t d = 0; d < DIM; d++) acc[r * DIM + d] = 0.f;
    }
    const __m512 sc = _mm512_set1_ps(j->scale2);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t k0 = 0; k0 < kend; k0 += KBLK) {
        __m512 s[ROWS][4];
        for (int r = 0; r < ROWS; r++)
            for (int b = 0; b < 4; b++) s[r][b] = _mm512_setzero_ps();
        const uint32_t *kb = kp + k0 * P;
        for (int64_t p = 0; p < P; p++) {
            __m512i kv[4];
            for (int b = 0; b < 4; b++) kv[b] = _mm512_loadu_si512(kb + (b * P + p) * 16);
            for (int r = 0; r < ROWS; r++) {
                const uint32_t qp = ((const uint32_t *)qr[r])[p];
                if (dp) {
#if PA_DPBF16
                    const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qp);
                    for (int b = 0; b < 4; b++) s[r][b] = _mm512_dpbf16_ps(s[r][b], qb, (__m512bh)kv[b]);
#endif
                } else {
                    const __m512 q0 = _mm512_set1_ps(bf16f((uint16_t)qp)), q1 = _mm512_set1_ps(bf16f((uint16_t)(qp >> 16)));
                    for (int b = 0; b < 4; b++) {
                        s[r][b] = _mm512_fmadd_ps(q0, even_f(kv[b]), s[r][b]);
                        s[r][b] = _mm512_fmadd_ps(q1, odd_f(kv[b]), s[r][b]);
                    }
                }
            }
        }
        const int64_t nvp = (k0 + KBLK < kend ? KBLK : kend - k0) / 2; /* key pairs in this block (kend even) */
        const uint32_t *vb = vp + (k0 / 2) * DIM;
        for (int r = 0; r < ROWS; r++) {
            const int64_t lim = pos[r] - k0; /* lanes with key offset <= lim attend */
            __m512 bm = _mm512_set1_ps(-INFINITY);
            __mmask16 valid[4];
            for (int b = 0; b < 4; b++) {
                valid[b] = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * b)),
                                                   _mm512_set1_epi32((int)(lim < 0x7fffffff ? lim : 0x7fffffff)));
                s[r][b] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid[b], s[r][b], sc);
                bm = _mm512_max_ps(bm, s[r][b]);
            }
            const float mx = _mm512_reduce_max_ps(bm);
            if (mx == -INFINITY) continue; /* every key of this block is after this row's position */
            float *a = acc + r * DIM;
            if (mx > m[r]) {
                const float alpha = m[r] == -INFINITY ? 0.f : exp2f(m[r] - mx);
                m[r] = mx;
                l[r] *= alpha;
                const __m512 al = _mm512_set1_ps(alpha);
                for (int64_t v = 0; v < NV; v++) _mm512_storeu_ps(a + 16 * v, _mm512_mul_ps(al, _mm512_loadu_ps(a + 16 * v)));
            }
            const __m512 mm = _mm512_set1_ps(m[r]);
            __m512 sum = _mm512_setzero_ps();
            uint32_t pp[KBLK / 2]; /* P as bf16 pairs (dp), or float pairs below */
            float pf[KBLK];
            for (int b = 0; b < 4; b++) {
                const __m512 e = _mm512_maskz_mov_ps(valid[b], exp2_ps(_mm512_sub_ps(s[r][b], mm)));
                sum = _mm512_add_ps(sum, e);
                if (dp) {
#if PA_DPBF16
                    _mm256_storeu_si256((__m256i *)((uint16_t *)pp + 16 * b), (__m256i)_mm512_cvtneps_pbh(e));
#endif
                } else {
                    _mm512_storeu_ps(pf + 16 * b, e);
                }
            }
            l[r] += _mm512_reduce_add_ps(sum);
            __m512 o[MAX_D / 16];
            for (int64_t v = 0; v < NV; v++) o[v] = _mm512_loadu_ps(a + 16 * v);
            for (int64_t jp = 0; jp < nvp; jp++) {
                const uint32_t *vr = vb + jp * DIM;
                if (dp) {
#if PA_DPBF16
                    const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[jp]);
                    for (int64_t v = 0; v < NV; v++)
                        o[v] = _mm512_dpbf16_ps(o[v], pb, (__m512bh)_mm512_loadu_si512(vr + 16 * v));
#endif
                } else {
                    const __m512 p0 = _mm512_set1_ps(pf[2 * jp]), p1 = _mm512_set1_ps(pf[2 * jp + 1]);
                    for (int64_t v = 0; v < NV; v++) {
                        const __m512i w = _mm512_loadu_si512(vr + 16 * v);
                        o[v] = _mm512_fmadd_ps(p0, even_f(w), o[v]);
                        o[v] = _mm512_fmadd_ps(p1, odd_f(w), o[v]);
                    }
                }
            }
            for (int64_t v = 0; v < NV; v++) _mm512_storeu_ps(a + 16 * v, o[v]);
        }
    }
}

#define TILE_FN(NAME, DIM, DP)                                                                               \
    static void NAME(const pa_job *j, const uint16_t *const *qr, const int64_t *pos, const uint32_t *kp,     \
                     const uint32_t *vp, float *acc, float *m, float *l, int64_t kend) {                     \
        tile_avx512(j, qr, pos, kp, vp, acc, m, l, kend, DIM, DP);                                            \
    }
TILE_FN(tile_f32_64, 64, 0)
TILE_FN(tile_f32_128, 128, 0)
TILE_FN(tile_f32_any, (int)j->D, 0)
#if PA_DPBF16
TILE_FN(tile_dp_64, 64, 1)
TILE_FN(tile_dp_128, 128, 1)
TILE_FN(tile_dp_any, (int)j->D, 1)
#endif
#endif /* PA_AVX512 */

/* -- portable tile: the same packed layout and algorithm, scalar code -------------------------- */
static void tile_c(const pa_job *j, const uint16_t *const *qr, const int64_t *pos, const uint32_t *kp,
                   const uint32_t *vp, float *acc, float *m, float *l, int64_t kend) {
    const int64_t D = j->D, P = D / 2;
    for (int r = 0; r < ROWS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
        for (int64_t d = 0; d < D; d++) acc[r * D + d] = 0.f;
    }
    float s[KBLK];
    for (int r = 0; r < ROWS; r++) {
        float *a = acc + r * D;
        for (int64_t k0 = 0; k0 < kend && k0 <= pos[r]; k0 += KBLK) {
            const int64_t nk = (k0 + KBLK < kend ? KBLK : kend - k0);
            float mx = -INFINITY;
            for (int64_t i = 0; i < nk; i++) {
                const int64_t t = k0 + i;
                if (t > pos[r]) {
                    s[i] = -INFINITY;
                    continue;
                }
                const uint32_t *kb = kp + (t / 16) * 16 * P + t % 16;
                float dot = 0.f;
                for (int64_t p = 0; p < P; p++) {
                    const uint32_t kk = kb[p * 16], qq = ((const uint32_t *)qr[r])[p];
                    dot += bf16f((uint16_t)qq) * bf16f((uint16_t)kk) + bf16f((uint16_t)(qq >> 16)) * bf16f((uint16_t)(kk >> 16));
                }
                s[i] = dot * j->scale2;
                mx = s[i] > mx ? s[i] : mx;
            }
            if (mx > m[r]) {
                const float alpha = m[r] == -INFINITY ? 0.f : exp2f(m[r] - mx);
                m[r] = mx;
                l[r] *= alpha;
                for (int64_t d = 0; d < D; d++) a[d] *= alpha;
            }
            for (int64_t i = 0; i < nk; i++) {
                const int64_t t = k0 + i;
                if (t > pos[r]) break;
                const float e = exp2f(s[i] - m[r]);
                l[r] += e;
                const uint32_t *vr = vp + (t / 2) * D;
                const int hi = (int)(t & 1) * 16;
                for (int64_t d = 0; d < D; d++) a[d] += e * bf16f((uint16_t)(vr[d] >> hi));
            }
        }
    }
}

/* item = (tile of ROWS positions, query head), heaviest tiles (latest positions) first */
static void tile_item(void *ctx, int64_t item) {
    const pa_job *j = (const pa_job *)ctx;
    const int64_t h = item % j->H, tile = j->ntiles - 1 - item / j->H, i0 = tile * ROWS, D = j->D;
    const int64_t kvh = h / j->G, P = D / 2;
    const uint16_t *qr[ROWS];
    int64_t pos[ROWS];
    int rows = 0;
    for (int r = 0; r < ROWS; r++) {
        const int64_t i = i0 + r < j->n ? i0 + r : j->n - 1; /* past the chunk's end: repeat its last row */
        rows += i0 + r < j->n;
        qr[r] = j->q + i * j->q_stride + h * D;
        pos[r] = j->start + i;
    }
    int64_t kend = pos[ROWS - 1] + 1;
    kend += kend & 1; /* whole key pairs (the pad key is zero and masked) */
    float acc[ROWS * MAX_D], m[ROWS], l[ROWS];
    j->tile(j, qr, pos, j->kp + kvh * j->Lp * P, j->vp + kvh * j->Lp * P, acc, m, l, kend);
    for (int r = 0; r < rows; r++) {
        uint16_t *o = j->out + ((i0 + r) * j->H + h) * D;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; d++) o[d] = f32_bf16(acc[r * D + d] * inv);
    }
}

/* -- AMX tile ------------------------------------------------------------------------------------
 * 16 query rows (consecutive positions of one head) against 32 keys per step, the products on AMX
 * tiles: S (16 x 16 keys, twice) = Q (16 rows x 32 dims, per 32 dims) times Kp's 16-key blocks,
 * which are already the B-tile layout (16 dim pairs x 16 keys); the online softmax in float32 as
 * above (per row, key blocks at absolute positions, so a row's result does not depend on the
 * chunk it came in: chunked = unchunked bit for bit); then P (rounded to bf16) times V, whose
 * key-pair rows (Vp) are the B-tile layout too, into a C tile per 16 dims that is added to the
 * row's float32 output after its rescale. */
#if PA_AMX
#define AROWS 16
#define AKEYS 32
static int g_amx = -1; /* -1: not asked; 0: refused; 1: granted (ARCH_REQ_XCOMP_PERM, per process) */
static int amx_ok(void) {
    if (g_amx < 0) g_amx = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return g_amx;
}

static void amx_config(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 7; t++) { /* 0, 1: S; 2: Q; 3: K; 4: P; 5: V; 6: P.V */
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

/* item = (tile of 16 positions, query head), heaviest tiles first */
static void amx_item(void *ctx, int64_t item) {
    const pa_job *j = (const pa_job *)ctx;
    const int64_t nt = (j->n + AROWS - 1) / AROWS, D = j->D, P = D / 2;
    const int64_t h = item % j->H, i0 = (nt - 1 - item / j->H) * AROWS, kvh = h / j->G;
    const uint32_t *kp = j->kp + kvh * j->Lp * P, *vp = j->vp + kvh * j->Lp * P;
    uint16_t qb[AROWS * MAX_D] __attribute__((aligned(64)));
    uint16_t pb[AROWS * AKEYS] __attribute__((aligned(64)));
    float sb[AROWS * AKEYS] __attribute__((aligned(64)));
    float pv[AROWS * 16] __attribute__((aligned(64)));
    float o[AROWS * MAX_D] __attribute__((aligned(64)));
    float m[AROWS], l[AROWS], alpha[AROWS];
    int64_t pos[AROWS];
    int rows = 0;
    for (int r = 0; r < AROWS; r++) { /* past the chunk's end: repeat its last row */
        const int64_t i = i0 + r < j->n ? i0 + r : j->n - 1;
        rows += i0 + r < j->n;
        memcpy(qb + r * D, j->q + i * j->q_stride + h * D, (size_t)D * 2);
        pos[r] = j->start + i;
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    memset(o, 0, sizeof(float) * (size_t)(AROWS * D));
    const int64_t kend = pos[AROWS - 1] + 1;
    const __m512 sc = _mm512_set1_ps(j->scale2);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    amx_config();
    for (int64_t k0 = 0; k0 < kend; k0 += AKEYS) { /* k0 + 32 <= Lp: Lp is a multiple of 64 */
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t dc = 0; dc < D / 32; dc++) {
            _tile_loadd(2, qb + 32 * dc, D * 2);
            _tile_loadd(3, kp + (k0 / 16) * 16 * P + 16 * dc * 16, 64);
            _tile_dpbf16ps(0, 2, 3);
            _tile_loadd(3, kp + (k0 / 16 + 1) * 16 * P + 16 * dc * 16, 64);
            _tile_dpbf16ps(1, 2, 3);
        }
        _tile_stored(0, sb, AKEYS * 4);
        _tile_stored(1, sb + 16, AKEYS * 4);
        for (int r = 0; r < AROWS; r++) {
            const int64_t lim = pos[r] - k0; /* keys at offset <= lim attend */
            if (lim < 0) { /* none in this block: no contribution, no rescale */
                memset(pb + r * AKEYS, 0, AKEYS * 2);
                alpha[r] = 1.f;
                continue;
            }
            const __m512i lv = _mm512_set1_epi32((int)(lim < AKEYS ? lim : AKEYS));
            const __mmask16 v0 = _mm512_cmple_epi32_mask(lane, lv);
            const __mmask16 v1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), lv);
            const __m512 s0 = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), v0, _mm512_loadu_ps(sb + r * AKEYS), sc);
            const __m512 s1 = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), v1, _mm512_loadu_ps(sb + r * AKEYS + 16), sc);
            const float mx = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
            alpha[r] = 1.f;
            if (mx > m[r]) {
                alpha[r] = m[r] == -INFINITY ? 0.f : exp2f(m[r] - mx);
                m[r] = mx;
                l[r] *= alpha[r];
            }
            const __m512 mm = _mm512_set1_ps(m[r]);
            const __m512 e0 = _mm512_maskz_mov_ps(v0, exp2_ps(_mm512_sub_ps(s0, mm)));
            const __m512 e1 = _mm512_maskz_mov_ps(v1, exp2_ps(_mm512_sub_ps(s1, mm)));
            l[r] += _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
            _mm512_storeu_si512((void *)(pb + r * AKEYS), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        _tile_loadd(4, pb, AKEYS * 2);
        for (int64_t v = 0; v < D / 16; v++) {
            _tile_zero(6);
            _tile_loadd(5, vp + (k0 / 2) * D + 16 * v, D * 4);
            _tile_dpbf16ps(6, 4, 5);
            _tile_stored(6, pv, 64);
            for (int r = 0; r < AROWS; r++) {
                float *orow = o + r * D + 16 * v;
                _mm512_storeu_ps(orow, _mm512_fmadd_ps(_mm512_loadu_ps(orow), _mm512_set1_ps(alpha[r]),
                                                       _mm512_loadu_ps(pv + 16 * r)));
            }
        }
    }
    _tile_release();
    for (int r = 0; r < rows; r++) {
        uint16_t *out = j->out + ((i0 + r) * j->H + h) * D;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; d++) out[d] = f32_bf16(o[r * D + d] * inv);
    }
}
#endif /* PA_AMX */

static _Thread_local pl_buf tl_pack; /* the calling thread's packed K/V */

int prefill_attend(const uint16_t *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc, const int64_t *table,
                   int64_t table_len, uint16_t *out, int64_t start, int64_t n, int64_t H, int64_t KVH, int64_t D,
                   int64_t BS, float scale, int mode) {
    if (n <= 0 || start < 0 || KVH <= 0 || H % KVH != 0 || D <= 0 || D > MAX_D || D % 32 != 0 || BS <= 0) return 1;
    if (q_stride < H * D || (start + n + BS - 1) / BS > table_len) return 1;
    tile_fn tile = tile_c;
    int amx = 0;
#if PA_AMX
    amx = mode == 4 && amx_ok(); /* opt-in for now: benchmarks/RESULTS.md, "Prefill attention on AMX" */
#endif
    if (mode == 4 && !amx) return 1;
    if (mode == 0 || mode == 1 || mode == 3) {
#if PA_AVX512
        tile = D == 64 ? tile_f32_64 : D == 128 ? tile_f32_128 : tile_f32_any;
#if PA_DPBF16
        if (mode == 0 || mode == 3) tile = D == 64 ? tile_dp_64 : D == 128 ? tile_dp_128 : tile_dp_any;
#else
        if (mode == 3) return 1;
#endif
#else
        if (mode == 1 || mode == 3) return 1;
#endif
    } else if (mode != 2 && mode != 4) {
        return 1;
    }
    const int64_t L = start + n, Lp = (L + KBLK - 1) / KBLK * KBLK;
    const size_t need = (size_t)(2 * KVH * Lp * (D / 2));
    uint32_t *pack = pl_grow(&tl_pack, need * sizeof(uint32_t));
    if (!pack) return 2;
    pa_job j = {q, kc, vc, table, out, pack, pack + KVH * Lp * (D / 2), q_stride, start, n, L, Lp, H, KVH,
                H / KVH, D, BS, (n + ROWS - 1) / ROWS, scale * LOG2E, tile};
    run(pack_item, &j, KVH * (Lp / KBLK));
#if PA_AMX
    if (amx) {
        run(amx_item, &j, (n + AROWS - 1) / AROWS * H);
        return 0;
    }
#endif
    run(tile_item, &j, j.ntiles * H);
    return 0;
}

int prefill_attn_features(void) {
#if PA_AMX
    const int amx = amx_ok();
#else
    const int amx = 0;
#endif
    return PA_AVX512 | (PA_DPBF16 << 1) | (amx << 2);
}
