// y = x @ W^T for low-bit GGUF weights as stored, with x quantized to int8 with a scale per 32 values
// (as fine as the weights' sub-blocks, like llama.cpp's 8-bit activation blocks). Two formats:
//
// w4a8: 4-bit weights with an 8-bit scale and min per 32 weights and float d, dmin per S such sub-blocks
//   (GGUF Q4_K is S = 8 with 6-bit scales, repacked without changing a value: w = d * sc * q - dmin * mn).
// w6a8: 6-bit weights with a signed 8-bit scale per 16 weights and float d per 256 (GGUF Q6_K, repacked
//   without changing a value: w = d * sc * (q - 32)).
//
// Layout: output rows in groups of 16, one vector lane per output row, each lane holding 4 consecutive
// weights of its row. A row of x is then broadcast 4 values at a time and one u8 x s8 dot-product
// instruction advances 16 output rows by 4 weights. The unpacked weights are shared by every row of x,
// so verifying a few tokens costs about what decoding one does, and every output element is computed
// by the same operations whatever the number of rows: results do not depend on the batch.
//
// w4a8  q[g][K/8][16][4]   64 bytes per 8 weights of 16 rows: low nibble = weight e, high nibble = weight 4+e
//       sc[g][K/32][16], mn[g][K/32][16]   (uint8)      d[g][K/32/S][16], dmin[g][K/32/S][16]   (float)
// w6a8  lo[g][K/8][16][4]  the low 4 bits of each weight, as w4a8's q
//       hi[g][K/8][32]     their top 2 bits: byte i holds lanes i and 32 + i of lo's 64 bytes, 2 bits per
//                          weight in the order (e, 4+e) of lane i, then (e, 4+e) of lane 32 + i
//       sc[g][K/16][16] (int8)   d[g][K/256][16] (float)
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 16
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ROW_TILE 8  // 3 accumulators per row of x in 32 vector registers
#else
#define ROW_TILE 4  // in 16
#endif
// Independent integer accumulators per row of x: with few rows, one chain of dependent dot products
// would leave the CPU waiting on each one's latency.
#define NACC(rows) ((rows) >= 4 ? 1 : (rows) >= 2 ? 2 : 4)
// Packed weights are requested this many bytes ahead of use: the hardware prefetcher alone leaves
// bandwidth unused on a weight stream read once per step (docs/decisions.md).
#define PREFETCH_AHEAD 1024

// The 256 bytes of packed weights that group g's sub-block j + PREFETCH_AHEAD / 256 will read.
static inline void prefetch_weights(const uint8_t *qg, int j) {
    const char *p = (const char *)(qg + (size_t)j * 256 + PREFETCH_AHEAD);
    _mm_prefetch(p, _MM_HINT_T0);
    _mm_prefetch(p + 64, _MM_HINT_T0);
    _mm_prefetch(p + 128, _MM_HINT_T0);
    _mm_prefetch(p + 192, _MM_HINT_T0);
}

// Per block of 32: int8 values, their scale, and their sum times the scale (for w4a8's mins); with isum16,
// also the integer sum of every 16 values (for w6a8's offset of 32).
static void quantize_blocks(const float *x, int M, int K, int8_t *xq, float *sx, float *xsum, int32_t *isum16) {
    for (int m = 0; m < M; m++) {
        for (int j = 0; j < K / 32; j++) {
            const size_t at = (size_t)m * K + j * 32, b = (size_t)m * (K / 32) + j;
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[at + i]));
            float scale = amax > 0.f ? amax / 127.f : 1.f;
            float inv = 1.f / scale;
            int s[2] = {0, 0};
            for (int i = 0; i < 32; i++) {
                int v = (int)nearbyintf(x[at + i] * inv);
                xq[at + i] = (int8_t)v;
                s[i / 16] += v;
            }
            sx[b] = scale;
            xsum[b] = (float)(s[0] + s[1]) * scale;
            if (isum16) {
                isum16[2 * b] = s[0];
                isum16[2 * b + 1] = s[1];
            }
        }
    }
}

// Scratch memory kept per thread between calls: a decode step makes ~100 kernel calls, and memory freed
// to glibc can go back to the OS and fault in again on the next call.
static __thread void *scratch_buf;
static __thread size_t scratch_size;

static void *scratch(size_t bytes) {
    if (bytes > scratch_size) {
        free(scratch_buf);
        scratch_buf = malloc(bytes);
        scratch_size = bytes;
    }
    return scratch_buf;
}

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// 16 output rows (group g) against `rows` rows of x starting at m0.
static inline __attribute__((always_inline)) void group_dot(int g, int m0, const int rows, int K, int N, int S,
        const uint8_t *q, const uint8_t *sc, const uint8_t *mn, const float *d, const float *dmin,
        const int8_t *xq, const float *sx, const float *xsum, float *y) {
    const int nsub = K / 32;
    const uint8_t *qg = q + (size_t)g * (K / 2) * GROUP;
    __m512 accf[ROW_TILE], minf[ROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) accf[r] = minf[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < nsub; j++) {
        const size_t at = ((size_t)g * nsub + j) * GROUP, sb = ((size_t)g * (nsub / S) + j / S) * GROUP;
        __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(d + sb),
                                     _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + at)))));
        __m512 min = _mm512_mul_ps(_mm512_loadu_ps(dmin + sb),
                                   _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mn + at)))));
        __m512i acc[ROW_TILE][4];
        prefetch_weights(qg, j);
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
            _Pragma("GCC unroll 4") for (int a = 0; a < NACC(rows); a++) acc[r][a] = _mm512_setzero_si512();
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {  // 8 weights per output row
            __m512i packed = _mm512_loadu_si512((const void *)(qg + ((size_t)j * 4 + t) * 64));
            __m512i w0 = _mm512_and_si512(packed, low), w1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            const int k = j * 32 + t * 8;
            _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
                const int8_t *xr = xq + (size_t)(m0 + r) * K + k;
                __m512i *a0 = &acc[r][(2 * t) % NACC(rows)], *a1 = &acc[r][(2 * t + 1) % NACC(rows)];
                *a0 = _mm512_dpbusd_epi32(*a0, w0, _mm512_set1_epi32(load4(xr)));
                *a1 = _mm512_dpbusd_epi32(*a1, w1, _mm512_set1_epi32(load4(xr + 4)));
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
            __m512i total = acc[r][0];
            _Pragma("GCC unroll 4") for (int a = 1; a < NACC(rows); a++) total = _mm512_add_epi32(total, acc[r][a]);
            const size_t b = (size_t)(m0 + r) * nsub + j;
            accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(scale, _mm512_set1_ps(sx[b])), accf[r]);
            minf[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(xsum[b]), minf[r]);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(y + (size_t)(m0 + r) * N + (size_t)g * GROUP, _mm512_sub_ps(accf[r], minf[r]));
    }
}
#else
// AVX2: the 16 rows of a group as two halves of 8; u8 x s8 products summed in pairs (int16), then in
// fours (int32). With 4-bit weights a pair is at most 2 * 15 * 127: no int16 saturation.
static inline __attribute__((always_inline)) void group_dot(int g, int m0, const int rows, int K, int N, int S,
        const uint8_t *q, const uint8_t *sc, const uint8_t *mn, const float *d, const float *dmin,
        const int8_t *xq, const float *sx, const float *xsum, float *y) {
    const int nsub = K / 32;
    const uint8_t *qg = q + (size_t)g * (K / 2) * GROUP;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; half++) {
        __m256 accf[ROW_TILE], minf[ROW_TILE];
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) accf[r] = minf[r] = _mm256_setzero_ps();
        for (int j = 0; j < nsub; j++) {
            const size_t at = ((size_t)g * nsub + j) * GROUP + half * 8;
            const size_t sb = ((size_t)g * (nsub / S) + j / S) * GROUP + half * 8;
            __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(d + sb),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + at)))));
            __m256 min = _mm256_mul_ps(_mm256_loadu_ps(dmin + sb),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn + at)))));
            __m256i acc[ROW_TILE][4];
            if (half == 0) prefetch_weights(qg, j);
            _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++)
                _Pragma("GCC unroll 4") for (int a = 0; a < NACC(rows); a++) acc[r][a] = _mm256_setzero_si256();
            _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(qg + ((size_t)j * 4 + t) * 64 + half * 32));
                __m256i w0 = _mm256_and_si256(packed, low), w1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                const int k = j * 32 + t * 8;
                _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) {
                    const int8_t *xr = xq + (size_t)(m0 + r) * K + k;
                    __m256i p0 = _mm256_maddubs_epi16(w0, _mm256_set1_epi32(load4(xr)));
                    __m256i p1 = _mm256_maddubs_epi16(w1, _mm256_set1_epi32(load4(xr + 4)));
                    __m256i *a = &acc[r][t % NACC(rows)];
                    *a = _mm256_add_epi32(*a, _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
                }
            }
            _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) {
                __m256i total = acc[r][0];
                _Pragma("GCC unroll 4") for (int a = 1; a < NACC(rows); a++) total = _mm256_add_epi32(total, acc[r][a]);
                const size_t b = (size_t)(m0 + r) * nsub + j;
                accf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(scale, _mm256_set1_ps(sx[b])),
                                          accf[r]);
                minf[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(xsum[b]), minf[r]);
            }
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) {
            _mm256_storeu_ps(y + (size_t)(m0 + r) * N + (size_t)g * GROUP + half * 8, _mm256_sub_ps(accf[r], minf[r]));
        }
    }
}
#endif


// ---- w6a8 ----------------------------------------------------------------------------------------------
// The 128 bytes of top bits that sub-block j + PREFETCH_AHEAD / 256 will read (half the low nibbles' rate).
static inline void prefetch_top_bits(const uint8_t *hig, int j) {
    const char *p = (const char *)(hig + (size_t)j * 128 + PREFETCH_AHEAD / 2);
    _mm_prefetch(p, _MM_HINT_T0);
    _mm_prefetch(p + 64, _MM_HINT_T0);
}

// Per row of x and 32 weights: int32 sums of q * x per 16 (sub-blocks a and b), less 32 times the sums of
// x (exact in int32), then each times d * sc * sx in float.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
// The two 64-byte vectors of weights e and 4+e: low nibbles from lo, top bits from hi (see the layout).
static inline void unpack6(const uint8_t *lo, const uint8_t *hi, __m512i *w0, __m512i *w1) {
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    __m512i packed = _mm512_loadu_si512((const void *)lo);
    const __m256i h256 = _mm256_loadu_si256((const __m256i *)hi);  // lanes 32..63 take bits 4..7 of hi
    __m512i h = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(h256), _mm256_srli_epi16(h256, 4), 1), low);
    *w0 = _mm512_or_si512(_mm512_and_si512(packed, low), _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
    *w1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low),
                          _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
}

static inline __attribute__((always_inline)) void group_dot6(int g, int m0, const int rows, int K, int N,
        const uint8_t *lo, const uint8_t *hi, const int8_t *sc, const float *d,
        const int8_t *xq, const float *sx, const int32_t *isum16, float *y) {
    const int nsub = K / 32;
    const uint8_t *log = lo + (size_t)g * (K / 2) * GROUP, *hig = hi + (size_t)g * (K / 4) * GROUP;
    __m512 accf[ROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) accf[r] = _mm512_setzero_ps();
    for (int j = 0; j < nsub; j++) {
        const __m512 dg = _mm512_loadu_ps(d + ((size_t)g * (K / 256) + j / 8) * GROUP);
        const int8_t *scg = sc + ((size_t)g * (K / 16) + 2 * j) * GROUP;
        const __m512 scale_a = _mm512_mul_ps(dg, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)scg))));
        const __m512 scale_b = _mm512_mul_ps(dg, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                     _mm_loadu_si128((const __m128i *)(scg + GROUP)))));
        prefetch_weights(log, j);
        prefetch_top_bits(hig, j);
        __m512i acc[ROW_TILE][2];  // sub-blocks a (weights 0..15 of the 32) and b (16..31)
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {  // 8 weights per output row
            __m512i w0, w1;
            unpack6(log + ((size_t)j * 4 + t) * 64, hig + ((size_t)j * 4 + t) * 32, &w0, &w1);
            const int k = j * 32 + t * 8;
            _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
                const int8_t *xr = xq + (size_t)(m0 + r) * K + k;
                __m512i *a = &acc[r][t / 2];
                *a = _mm512_dpbusd_epi32(*a, w0, _mm512_set1_epi32(load4(xr)));
                *a = _mm512_dpbusd_epi32(*a, w1, _mm512_set1_epi32(load4(xr + 4)));
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
            const size_t b = (size_t)(m0 + r) * nsub + j;
            __m512i ia = _mm512_sub_epi32(acc[r][0], _mm512_set1_epi32(32 * isum16[2 * b]));
            __m512i ib = _mm512_sub_epi32(acc[r][1], _mm512_set1_epi32(32 * isum16[2 * b + 1]));
            const __m512 s = _mm512_set1_ps(sx[b]);
            accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(scale_a, s), accf[r]);
            accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_mul_ps(scale_b, s), accf[r]);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(y + (size_t)(m0 + r) * N + (size_t)g * GROUP, accf[r]);
}
#else
// AVX2: rows 0..7 of the group from the low 32 bytes of each lo vector and bits 0..3 of hi, rows 8..15
// from the high ones and bits 4..7. A pair of u8 x s8 products is at most 2 * 63 * 127 and two pairs
// are summed in int16: 32004, no saturation.
static inline __attribute__((always_inline)) void group_dot6(int g, int m0, const int rows, int K, int N,
        const uint8_t *lo, const uint8_t *hi, const int8_t *sc, const float *d,
        const int8_t *xq, const float *sx, const int32_t *isum16, float *y) {
    const int nsub = K / 32;
    const uint8_t *log = lo + (size_t)g * (K / 2) * GROUP, *hig = hi + (size_t)g * (K / 4) * GROUP;
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; half++) {
        __m256 accf[ROW_TILE];
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) accf[r] = _mm256_setzero_ps();
        for (int j = 0; j < nsub; j++) {
            const __m256 dg = _mm256_loadu_ps(d + ((size_t)g * (K / 256) + j / 8) * GROUP + half * 8);
            const int8_t *scg = sc + ((size_t)g * (K / 16) + 2 * j) * GROUP + half * 8;
            const __m256 scale_a = _mm256_mul_ps(dg, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)scg))));
            const __m256 scale_b = _mm256_mul_ps(dg, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                         _mm_loadl_epi64((const __m128i *)(scg + GROUP)))));
            if (half == 0) {
                prefetch_weights(log, j);
                prefetch_top_bits(hig, j);
            }
            __m256i acc[ROW_TILE][2];
            _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
            _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(log + ((size_t)j * 4 + t) * 64 + half * 32));
                __m256i h = _mm256_loadu_si256((const __m256i *)(hig + ((size_t)j * 4 + t) * 32));
                h = _mm256_and_si256(half ? _mm256_srli_epi16(h, 4) : h, low);
                __m256i w0 = _mm256_or_si256(_mm256_and_si256(packed, low), _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
                __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low),
                                             _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
                const int k = j * 32 + t * 8;
                _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) {
                    const int8_t *xr = xq + (size_t)(m0 + r) * K + k;
                    __m256i p0 = _mm256_maddubs_epi16(w0, _mm256_set1_epi32(load4(xr)));
                    __m256i p1 = _mm256_maddubs_epi16(w1, _mm256_set1_epi32(load4(xr + 4)));
                    __m256i *a = &acc[r][t / 2];
                    *a = _mm256_add_epi32(*a, _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
                }
            }
            _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) {
                const size_t b = (size_t)(m0 + r) * nsub + j;
                __m256i ia = _mm256_sub_epi32(acc[r][0], _mm256_set1_epi32(32 * isum16[2 * b]));
                __m256i ib = _mm256_sub_epi32(acc[r][1], _mm256_set1_epi32(32 * isum16[2 * b + 1]));
                const __m256 s = _mm256_set1_ps(sx[b]);
                accf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(scale_a, s), accf[r]);
                accf[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), _mm256_mul_ps(scale_b, s), accf[r]);
            }
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++)
            _mm256_storeu_ps(y + (size_t)(m0 + r) * N + (size_t)g * GROUP + half * 8, accf[r]);
    }
}
#endif

// Output-row groups split across threads; rows of x in tiles, each tile size a compile-time constant
// (the group kernels unroll over it). CALL(R) computes group g for rows m0 .. m0 + R - 1.
#if ROW_TILE == 8
#define ROW_TILE_CASES(CALL) case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; \
                             case 8: CALL(8); break;
#else
#define ROW_TILE_CASES(CALL)
#endif
#define FOR_EACH_GROUP_AND_ROW_TILE(CALL)                                                              \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                 \
    for (int g = 0; g < N / GROUP; g++)                                                                \
        for (int m0 = 0; m0 < M; m0 += ROW_TILE)                                                       \
            switch (M - m0 < ROW_TILE ? M - m0 : ROW_TILE) {                                           \
                case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break;                \
                case 4: CALL(4); break; ROW_TILE_CASES(CALL)                                           \
            }

int w4a8_isa(void) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return 512;
#elif defined(__AVX2__) && defined(__FMA__)
    return 256;
#else
    return 0;
#endif
}

// x [M, K] float, y [M, N] float; N a multiple of 16, K a multiple of 32 * S; `threads` as the caller's
// (torch's) setting.
void w4a8_linear(const float *x, int M, int K, int N, int S, const uint8_t *q, const uint8_t *sc, const uint8_t *mn,
                 const float *d, const float *dmin, float *y, int threads) {
#if defined(__AVX2__) && defined(__FMA__)
    float *sx = (float *)scratch((size_t)M * (K / 32) * 2 * sizeof(float) + (size_t)M * K);
    float *xsum = sx + (size_t)M * (K / 32);
    int8_t *xq = (int8_t *)(xsum + (size_t)M * (K / 32));
    quantize_blocks(x, M, K, xq, sx, xsum, NULL);
#define GROUP_DOT(R) group_dot(g, m0, R, K, N, S, q, sc, mn, d, dmin, xq, sx, xsum, y)
    FOR_EACH_GROUP_AND_ROW_TILE(GROUP_DOT)
#undef GROUP_DOT
#endif
}

// x [M, K] float, y [M, N] float; N a multiple of 16, K a multiple of 256.
void w6a8_linear(const float *x, int M, int K, int N, const uint8_t *lo, const uint8_t *hi, const int8_t *sc,
                 const float *d, float *y, int threads) {
#if defined(__AVX2__) && defined(__FMA__)
    float *sx = (float *)scratch((size_t)M * (K / 32) * 2 * sizeof(float) + (size_t)M * (K / 16) * sizeof(int32_t)
                                 + (size_t)M * K);
    float *xsum = sx + (size_t)M * (K / 32);
    int32_t *isum16 = (int32_t *)(xsum + (size_t)M * (K / 32));
    int8_t *xq = (int8_t *)(isum16 + (size_t)M * (K / 16));
    quantize_blocks(x, M, K, xq, sx, xsum, isum16);
#define GROUP_DOT(R) group_dot6(g, m0, R, K, N, lo, hi, sc, d, xq, sx, isum16, y)
    FOR_EACH_GROUP_AND_ROW_TILE(GROUP_DOT)
#undef GROUP_DOT
#endif
}
