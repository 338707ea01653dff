// Ceiling study, not built into the engine (docs/decisions.md#speculation-against-context-length): one layer's
// decode/verify attention of the 1.5B (H 12, Hkv 2, D 128) over n cached keys, 1-8 tokens at the end of one slot,
// the engine's kernel (attention.c, AVX-512 FMA; its time includes the new tokens' rope and cache write) against
// AMX bf16 tile products (q * scale, keys, the softmax's exponentials and values rounded to bf16, sums in float32):
// over the same float16 cache converted as it is read; over a cache already laid out as bf16 B tiles; and split
// (each operand as hi + lo bf16, three products: float32-like error at three times the tile work). Max err: against
// the engine's kernel on the same random data.
// Build and run (the compile line is the engine's flags for this kernel on an Intel AVX-512 host):
//   cc -O3 -march=native -fopenmp -ffp-contract=off -DSPECDECODE_PREFETCH_L2 -I src/specdecode/executor/kernels docs/bench/attention-amx-probe.c -o /tmp/attention-amx-probe -lm
//   OMP_NUM_THREADS=2 /tmp/attention-amx-probe 16384 15
#include "attention.c"
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define H 12
#define HKV 2
#define G 6
#define D 128
#define BLK 64
#define KB 256  // keys converted and consumed per pass
#define ARCH_REQ_XCOMP_PERM 0x1023  // Linux grants the AMX tile state on request (as lowbit.c asks)
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} cfg_t;

static void amx_config(void) {
    cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

// a[16 f32] and b[16 f32] -> 32 bf16 interleaved a0 b0 a1 b1 ...
static inline __m512i interleave_bf16(__m512 a, __m512 b) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // low 16: a, high 16: b
    return _mm512_permutexvar_epi16(idx, ab);
}

// the same, split: x = hi + lo, both bf16 (exact for a float16 x; 16 significant bits of a float32 one)
static inline void interleave_split(__m512 a, __m512 b, __m512i *hi, __m512i *lo) {
    __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    __m512 ah = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(ab)), 16);
    __m512 bh = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(ab, 1)), 16);
    *hi = interleave_bf16(a, b);
    *lo = interleave_bf16(_mm512_sub_ps(a, ah), _mm512_sub_ps(b, bh));
}

static inline __m512 h2f(const half *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }


// keys j0..j0+KB of kv head h (f16 tiles [D][16]) -> B tiles: per 16-key tile, 4 chunks of [16 d-pairs][16 keys][2]
// (hi, and lo where split)
static void convert_keys(const half *kc, const int32_t *table, int h, int j0, uint16_t *kb, uint16_t *kl) {
    for (int t = 0; t < KB / 16; t++) {
        const int j = j0 + t * 16;
        const half *tile = kc + (((size_t)table[j / BLK] * HKV + h) * BLK + j % BLK) * D;
        for (int i = 0; i < D / 2; i++) {
            const size_t at = ((size_t)t * (D / 2) + i) * 32;
            const __m512 a = h2f(tile + (2 * i) * 16), b = h2f(tile + (2 * i + 1) * 16);
            if (!kl) { _mm512_storeu_si512(kb + at, interleave_bf16(a, b)); continue; }
            __m512i hi, lo;
            interleave_split(a, b, &hi, &lo);
            _mm512_storeu_si512(kb + at, hi), _mm512_storeu_si512(kl + at, lo);
        }
    }
}

// values j0..j0+KB -> per 32-key chunk, 8 slices of [16 key-pairs][16 dims][2]
static void convert_values(const half *vc, const int32_t *table, int h, int j0, uint16_t *vb, uint16_t *vl) {
    for (int c = 0; c < KB / 32; c++)
        for (int i = 0; i < 16; i++) {
            const int j = j0 + c * 32 + 2 * i;
            const half *r0 = vc + (((size_t)table[j / BLK] * HKV + h) * BLK + j % BLK) * D, *r1 = r0 + D;
            for (int s = 0; s < D / 16; s++) {
                const size_t at = (((size_t)c * 8 + s) * 16 + i) * 32;
                const __m512 a = h2f(r0 + s * 16), b = h2f(r1 + s * 16);
                if (!vl) { _mm512_storeu_si512(vb + at, interleave_bf16(a, b)); continue; }
                __m512i hi, lo;
                interleave_split(a, b, &hi, &lo);
                _mm512_storeu_si512(vb + at, hi), _mm512_storeu_si512(vl + at, lo);
            }
        }
}

// x[n] float32 -> bf16 (hi, and lo where lo) in order
static void to_bf16(const float *x, int n, uint16_t *hi, uint16_t *lo) {
    for (int j = 0; j < n; j += 32) {
        const __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + 16);
        __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);
        _mm512_storeu_si512(hi + j, ab);
        if (lo) {
            __m512 ah = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(ab)), 16);
            __m512 bh = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(ab, 1)), 16);
            _mm512_storeu_si512(lo + j, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, bh), _mm512_sub_ps(a, ah)));
        }
    }
}

#define TDP3(C, ahi, alo, bhi, blo, lda, ldb)      \
    do {                                           \
        _tile_loadd(1, ahi, lda);                  \
        _tile_loadd(2, bhi, ldb);                  \
        _tile_dpbf16ps(C, 1, 2);                   \
        if (split) {                               \
            _tile_loadd(3, alo, lda);              \
            _tile_dpbf16ps(C, 3, 2);               \
            _tile_loadd(2, blo, ldb);              \
            _tile_dpbf16ps(C, 1, 2);               \
        }                                          \
    } while (0)

typedef struct {
    uint16_t *qh, *ql, *ph, *pl, *kb, *kl, *vb, *vl;
    float *S, *O;
} work_t;

// Where key or value j of kv head h starts in a cache of blocks placed by `table` (float16 or bf16 tiles alike).
static inline size_t cache_row(const int32_t *table, int h, int j) {
    return (((size_t)table[j / BLK] * HKV + h) * BLK + j % BLK) * D;
}

// One kv head: `tokens` tokens at positions n - tokens .. n - 1, G heads each: q [tokens][G][D] (float32), out rows
// as the engine's (token i, head g at out + i * H * D + g * D). mode 0: bf16 from f16; 1: bf16 tiles laid out
// beforehand in blocks placed as the float16 cache's; 2: split hi + lo from f16 (3 products).
static void amx_head(const float *q, int tokens, int n, const half *kc, const half *vc, const int32_t *table, int h,
                     int mode, const uint16_t *kpre, const uint16_t *vpre, float scale, work_t *w, float *out) {
    const int R = tokens * G, groups = (R + 15) / 16, split = mode == 2;
    for (int r = 0; r < R; r++) {
        float qs[D];
        for (int d = 0; d < D; d++) qs[d] = q[(size_t)r * D + d] * scale;
        to_bf16(qs, D, w->qh + (size_t)r * D, split ? w->ql + (size_t)r * D : NULL);
    }
    amx_config();
    for (int j0 = 0; j0 < n; j0 += KB) {
        const uint16_t *k = w->kb, *kl = w->kl;
        if (mode != 1) convert_keys(kc, table, h, j0, w->kb, split ? w->kl : NULL);
        for (int t = 0; t < KB / 16 && j0 + t * 16 < n; t++)
            for (int g = 0; g < groups; g++) {
                const size_t at = (size_t)t * (D / 2) * 32;
                const uint16_t *kt = mode == 1 ? kpre + cache_row(table, h, j0 + t * 16) : k + at;
                _tile_zero(0);
                for (int c = 0; c < D / 32; c++)
                    TDP3(0, w->qh + (size_t)g * 16 * D + c * 32, w->ql + (size_t)g * 16 * D + c * 32, kt + c * 16 * 32,
                         kl + at + c * 16 * 32, D * 2, 64);
                _tile_stored(0, w->S + (size_t)g * 16 * n + j0 + t * 16, n * 4);
            }
    }
    float total[64];
    for (int r = 0; r < R; r++) {
        const int seen = n - (tokens - 1 - r / G);
        float *s = w->S + (size_t)r * n;
        total[r] = attention_softmax_unnormalised(s, seen);
        for (int j = seen; j < n; j++) s[j] = 0.f;
        to_bf16(s, n, w->ph + (size_t)r * n, split ? w->pl + (size_t)r * n : NULL);
    }
    memset(w->O, 0, (size_t)groups * 16 * D * 4);
    for (int j0 = 0; j0 < n; j0 += KB) {
        const uint16_t *v = w->vb, *vl = w->vl;
        if (mode != 1) convert_values(vc, table, h, j0, w->vb, split ? w->vl : NULL);
        const int chunks = (n - j0 < KB ? n - j0 : KB) / 32;
        for (int g = 0; g < groups; g++)
            for (int s = 0; s < D / 16; s++) {
                _tile_loadd(0, w->O + (size_t)g * 16 * D + s * 16, D * 4);
                for (int c = 0; c < chunks; c++) {
                    const size_t at = ((size_t)c * 8 + s) * 16 * 32;
                    const uint16_t *vt = mode == 1 ? vpre + cache_row(table, h, j0 + c * 32) + s * 16 * 32 : v + at;
                    TDP3(0, w->ph + (size_t)g * 16 * n + j0 + c * 32, w->pl + (size_t)g * 16 * n + j0 + c * 32, vt,
                         vl + at, n * 2, 64);
                }
                _tile_stored(0, w->O + (size_t)g * 16 * D + s * 16, D * 4);
            }
    }
    _tile_release();
    for (int r = 0; r < R; r++)
        for (int d = 0; d < D; d++) out[(size_t)(r / G) * H * D + (size_t)(r % G) * D + d] = w->O[(size_t)r * D + d] / total[r];
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 16384, reps = argc > 2 ? atoi(argv[2]) : 20;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return 1;
    const int nb = n / BLK + 1;
    half *kc = aligned_alloc(64, (size_t)nb * HKV * BLK * D * 2), *vc = aligned_alloc(64, (size_t)nb * HKV * BLK * D * 2);
    for (size_t i = 0; i < (size_t)nb * HKV * BLK * D; i++) kc[i] = (half)((rand() / (float)RAND_MAX) - .5f), vc[i] = kc[i];
    int32_t *table = malloc(nb * 4);
    for (int b = 0; b < nb; b++) table[b] = (b * 7919) % nb;  // scattered blocks
    const size_t entries = (size_t)nb * HKV * BLK * D;  // bf16 tiles in the float16 cache's block placement
    uint16_t *kpre = aligned_alloc(64, entries * 2), *vpre = aligned_alloc(64, entries * 2);
    memset(kpre, 0, entries * 2), memset(vpre, 0, entries * 2);
    printf("n %d keys, 1 layer (H 12, Hkv 2, D 128), %d threads; ms per layer (x28 for a step), median of %d\n", n,
           omp_get_max_threads(), reps);
    for (int tokens = 1; tokens <= 8; tokens *= 2) {
        const int N = tokens, R = tokens * G;
        float *qkv = malloc((size_t)N * (H + 2 * HKV) * D * 4), *cs = malloc((size_t)N * D * 4), *sn = malloc((size_t)N * D * 4),
              *out = malloc((size_t)N * H * D * 4);
        int64_t slots[8] = {0}, pos[8];
        for (int i = 0; i < N; i++) pos[i] = n - N + i;
        for (size_t i = 0; i < (size_t)N * (H + 2 * HKV) * D; i++) qkv[i] = 8 * (rand() / (float)RAND_MAX - .5f);
        for (int i = 0; i < N * D; i++) cs[i] = 1, sn[i] = 0;
        double t[64], m[3][64], err[3] = {0}, ref = 0;
        float *amx_out = malloc((size_t)N * H * D * 4);
        for (int r = 0; r < reps; r++) {
            double t0 = now();
            attention(qkv, N, H, HKV, D, slots, pos, cs, sn, NULL, NULL, 1e-6f, .088f, 0, kc, vc, 1, table, 1, nb, BLK, nb,
                      out, 2);
            t[r] = now() - t0;
            for (int mode = 0; mode < 3; mode++) {
                double t1 = now();
#pragma omp parallel num_threads(2)
                {
                    const int h = omp_get_thread_num();
                    static __thread work_t w;
                    static __thread float *q;
                    if (!w.S) {
                        const size_t rows = 64, big = rows * 32768;
                        w.qh = calloc(rows * D, 2), w.ql = calloc(rows * D, 2), w.ph = calloc(big, 2), w.pl = calloc(big, 2);
                        w.kb = calloc(KB * D, 2), w.kl = calloc(KB * D, 2), w.vb = calloc(KB * D, 2), w.vl = calloc(KB * D, 2);
                        w.S = calloc(big, 4), w.O = calloc(rows * D, 4), q = calloc(rows * D, 4);
                    }
                    for (int i = 0; i < N; i++)  // the query heads of kv head h, as the engine reads them (no rope)
                        memcpy(q + (size_t)i * G * D, qkv + (size_t)i * (H + 2 * HKV) * D + h * G * D, G * D * 4);
                    amx_head(q, N, n, kc, vc, table, h, mode, kpre, vpre, .088f,
                             &w, amx_out + h * G * D);
                }
                m[mode][r] = now() - t1;
                if (r == 0 && mode != 1)
                    for (size_t i = 0; i < (size_t)N * H * D; i++) {
                        const double e = fabs(amx_out[i] - out[i]);
                        err[mode] = e > err[mode] ? e : err[mode];
                        ref = fabs(out[i]) > ref ? fabs(out[i]) : ref;
                    }
            }
        }
        int cmp(const void *x, const void *y) { return *(double *)x < *(double *)y ? -1 : 1; }
        qsort(t, reps, 8, cmp);
        for (int k = 0; k < 3; k++) qsort(m[k], reps, 8, cmp);
        printf("%d token(s) (%2d rows a kv head): FMA kernel %.3f | AMX bf16 from f16 %.3f (%.2fx, max err %.1e) | bf16 "
               "tiles laid out %.3f (%.2fx) | split hi+lo from f16 %.3f (%.2fx, max err %.1e); |out| max %.2f\n",
               tokens, R, 1e3 * t[reps / 2], 1e3 * m[0][reps / 2], t[reps / 2] / m[0][reps / 2], err[0],
               1e3 * m[1][reps / 2], t[reps / 2] / m[1][reps / 2], 1e3 * m[2][reps / 2], t[reps / 2] / m[2][reps / 2],
               err[2], ref);
    }
    return 0;
}
