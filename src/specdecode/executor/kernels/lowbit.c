// y = x @ W^T for GGUF block-quantized weights as stored, with x quantized to int8 with a scale per 32
// values (llama.cpp's 8-bit activation blocks). Every format is an integer q per weight, a float scale
// per sub-block (d, times an integer sc for the K formats) and either an integer zero point or a float
// min per sub-block:
//
//   format  bits  sub  w =                        format  bits  sub  w =
//   Q4_0    4     32   d * (q - 8)                Q8_0    8     32   d * q             (q signed)
//   Q4_1    4     32   d * q + m                  Q4_K    4     32   d*sc * q - dmin*mn (d per 8 sub)
//   Q5_0    5     32   d * (q - 16)               Q5_K    5     32   d*sc * q - dmin*mn (d per 8 sub)
//   Q5_1    5     32   d * q + m                  Q6_K    6     16   d*sc * (q - 32)    (d per 16 sub)
//                                                 Q3_K    3     16   d*sc * (q - 4)     (d per 16 sub)
//
// Per output row and block of 32: integer sums of q * x (exact in int32), less the zero point times the
// sums of x, then in float: acc += I * (scale * sx); mins: minacc += min * (sx * sum x); y = acc - minacc.
// Sub-blocks of 16 (Q6_K, Q3_K) weigh their two sums by their integer scales first, T = sc_a * I_a + sc_b * I_b
// (exact, below 2^24), then acc += T * (d * sx): one float step per block, and on AVX2 the scales ride
// along the widening of the int16 sums (vpmaddwd by the scale instead of by 1).
// The scalar path is the reference; each SIMD path performs the same float operations in the same order
// on the same exact integers, so every path gives the same bits (tested).
//
// Layout: output rows in groups of 16, one 4-byte lane per output row holding 4 consecutive weights of
// its row. A row of x is then broadcast 4 values at a time and one u8 x s8 dot-product instruction
// advances 16 output rows by 4 weights. The unpacked weights are shared by every row of x in a tile, so
// verifying a few tokens costs little more than decoding one, and an output element is computed by the
// same operations whatever the number of rows: results do not depend on the batch.
//
//   bits 3 to 6   lo[g][K/8][16][4]  low nibbles: byte (row, e) = weight e | weight 4+e << 4 (3-bit values
//                                    take 4-bit's layout)
//   bits 5, 6     hi[g][K/8][32]     top 2 bits: byte i holds lanes i and 32 + i of lo's 64 bytes, 2 bits
//                                    per weight in the order (e, 4+e) of lane i, then of lane 32 + i
//                                    (5-bit values use 6-bit's layout with the upper bit 0)
//   bits 8        lo[g][K/4][16][4]  the int8 values
//   sc [g][K/sub][16] (u8, i8 for Q6_K; K formats only)    mn [g][K/32][16] (u8; Q4_K, Q5_K)
//   d [g][K/sub/S][16], dmin [g][K/32/S][16] (float)       S: sub-blocks per d (1 for Q4_0 .. Q8_0)
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(SPECDECODE_SCALAR) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define HAVE_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define HAVE_AMX 1   // tiles of 16 rows of x, where the OS grants the tile state (amx_permitted)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif
#endif

#define GROUP 16
#if defined(HAVE_VNNI)
#define ROW_TILE 8  // 3 accumulators per row of x in 32 vector registers
#else
#define ROW_TILE 4  // in 16
#endif
// Packed weights are requested this many bytes ahead of use: the hardware prefetcher alone leaves
// bandwidth unused on a weight stream read once per step
// (docs/decisions.md#linear-layers-gguf-block-formats-as-stored).
#define PREFETCH_AHEAD 1024
// Rows of x per cache block in long calls (prefill): each group's weights are read once per block while
// the block's activations stay in L2, instead of every activation row streaming past every group.
#define ROW_BLOCK 64

enum { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q3_K, NUM_FORMATS };
enum { SC_NONE, SC_U8, SC_I8 };         // the integer scale per sub-block
enum { MIN_NONE, MIN_D, MIN_D_MN };     // the min per sub-block: none, dmin, dmin * mn

typedef struct {
    const uint8_t *lo, *hi, *mn;
    const void *sc;
    const float *d, *dmin;
    int S;           // sub-blocks per scale of d
    uint64_t recip;  // ceil(2^32 / S)
} weights_t;

// i / S, the index of the scale of d that sub-block i takes, as a product and a shift: an integer division
// per block costs more than the block's arithmetic on one row. Exact while i * (recip * S - 2^32) < 2^32,
// which check() ensures (i < 2^20, S < 2^12).
static inline int super_of(int i, const weights_t *w) { return (int)(((uint64_t)(unsigned)i * w->recip) >> 32); }

typedef struct {  // x quantized per block of 32: values, scale, sum * scale, integer sums per 16
    const int8_t *xq;
    const float *sx, *xsum;
    const int32_t *isum16;
} acts_t;

// ---- activations ---------------------------------------------------------------------------------------
// The largest |x| of 32 values. max is exact in any order; a NaN is skipped as fmaxf skips it (MAXPS returns
// its second operand, the running maximum, when the first is NaN).
static inline float block_amax(const float *x) {
#if defined(HAVE_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 32; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m);
    float lanes[8], amax = 0.f;
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, lanes[i]);
    return amax;
#else
    float amax = 0.f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    return amax;
#endif
}

// q[i] = x[i] * inv rounded to the nearest integer (ties to even, as nearbyintf in the default rounding mode);
// returns the sums of q over each half of the block.
static inline void block_round(const float *x, float inv, int8_t *q, int s[2]) {
#if defined(HAVE_AVX2)
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int h = 0; h < 2; h++) {
        __m256i sum = _mm256_setzero_si256();
        for (int i = 16 * h; i < 16 * h + 16; i += 8) {
            const __m256i v = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv),
                                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            sum = _mm256_add_epi32(sum, v);
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(w, w));
        }
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, sum);
        s[h] = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
    }
#else
    s[0] = s[1] = 0;
    for (int i = 0; i < 32; i++) {
        const int v = (int)nearbyintf(x[i] * inv);
        q[i] = (int8_t)v;
        s[i / 16] += v;
    }
#endif
}

static void quantize_row(const float *x, int K, int8_t *xq, float *sx, float *xsum, int32_t *isum16) {
    for (int j = 0; j < K / 32; j++) {
        const float amax = block_amax(x + j * 32);
        const float scale = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / scale;
        int s[2];
        block_round(x + j * 32, inv, xq + j * 32, s);
        sx[j] = scale;
        xsum[j] = (float)(s[0] + s[1]) * scale;
        isum16[2 * j] = s[0];
        isum16[2 * j + 1] = s[1];
    }
}

// Scratch memory kept per thread between calls: a decode step makes ~100 kernel calls, and memory freed
// to glibc can go back to the OS and fault in again on the next call.
// The quantized activations; two-pass rows before they are summed; a group's weights unpacked for AMX tiles.
enum { ACTS, PASS_OUTPUT, UNPACKED, NUM_SCRATCH };
static __thread void *scratch_buf[NUM_SCRATCH];
static __thread size_t scratch_size[NUM_SCRATCH];

static void *scratch(int which, size_t bytes) {
    if (bytes > scratch_size[which]) {
        free(scratch_buf[which]);
        scratch_buf[which] = malloc(bytes);
        scratch_size[which] = scratch_buf[which] ? bytes : 0;
    }
    return scratch_buf[which];
}

// What row x's int8 blocks miss: x - q * scale, quantized again for a second pass.
static void residual_row(const float *x, int K, const int8_t *xq, const float *sx, float *r) {
    for (int k = 0; k < K; k++) r[k] = x[k] - (float)xq[k] * sx[k / 32];
}

// passes 1: row m of x is quantized row m. passes 2: quantized rows 2m and 2m + 1 are row m of x and its
// residual, so that x ~ q0 * s0 + q1 * s1 holds ~15 significant bits and a tile unpacks each weight block
// once for both.
static int quantize_acts(const float *x, int M, int K, int passes, int threads, acts_t *a) {
    const int Q = M * passes;
    const size_t blocks = (size_t)Q * (K / 32);
    float *sx = (float *)scratch(ACTS, blocks * (2 * sizeof(float) + 2 * sizeof(int32_t)) + (size_t)Q * K
                                           + (passes > 1 ? (size_t)M * K * sizeof(float) : 0));
    if (!sx) return -1;
    float *xsum = sx + blocks;
    int32_t *isum16 = (int32_t *)(xsum + blocks);
    int8_t *xq = (int8_t *)(isum16 + 2 * blocks);
    float *residual = (float *)(xq + (size_t)Q * K);
#pragma omp parallel for schedule(static) num_threads(M >= 16 ? threads : 1)
    for (int m = 0; m < M; m++)
        for (int p = 0; p < passes; p++) {
            const size_t q = (size_t)m * passes + p;
            const float *row = p == 0 ? x + (size_t)m * K : residual + (size_t)m * K;
            quantize_row(row, K, xq + q * K, sx + q * (K / 32), xsum + q * (K / 32), isum16 + q * (K / 16));
            if (p + 1 < passes) residual_row(row, K, xq + q * K, sx + q * (K / 32), residual + (size_t)m * K);
        }
    *a = (acts_t){xq, sx, xsum, isum16};
    return 0;
}

// ---- the scalar reference --------------------------------------------------------------------------------
// Weight k of output row r (0..15) of group g, as stored (unsigned for 4 to 6 bits, signed for 8).
static inline int weight_at(const weights_t *w, int bits, int K, int g, int r, int k) {
    if (bits == 8) return ((const int8_t *)w->lo)[(((size_t)g * (K / 4) + k / 4) * GROUP + r) * 4 + k % 4];
    const int e = k % 8, lane = r * 4 + (e & 3);
    const size_t chunk = (size_t)g * (K / 8) + k / 8;
    const uint8_t b = w->lo[chunk * 64 + lane];
    int v = e < 4 ? (b & 15) : (b >> 4);
    if (bits > 4) {
        const uint8_t h = w->hi[chunk * 32 + (lane & 31)];
        const int pairs = lane < 32 ? (h & 15) : (h >> 4);
        v |= (e < 4 ? (pairs & 3) : (pairs >> 2)) << 4;
    }
    return v;
}

static inline float int_scale(const weights_t *w, int sck, size_t at) {
    return sck == SC_U8 ? (float)((const uint8_t *)w->sc)[at] : (float)((const int8_t *)w->sc)[at];
}

// The signed integer scale of sub-block `sub_index` of 16 weights (Q6_K, Q3_K) of group g, lane r.
static inline int int_scale16(const weights_t *w, int K, int g, int r, int sub_index) {
    return ((const int8_t *)w->sc)[((size_t)g * (K / 16) + sub_index) * GROUP + r];
}

// The scale of sub-block `sub_index` (of `sub` weights) of group g, lane r; and the min of block j.
static inline float scale_at(const weights_t *w, int sck, int sub, int K, int g, int r, int sub_index) {
    const int nsub = K / sub;
    const float d = w->d[((size_t)g * super_of(nsub, w) + super_of(sub_index, w)) * GROUP + r];
    return sck == SC_NONE ? d : d * int_scale(w, sck, ((size_t)g * nsub + sub_index) * GROUP + r);
}

static inline float min_at(const weights_t *w, int mink, int K, int g, int r, int j) {
    const float dmin = w->dmin[((size_t)g * super_of(K / 32, w) + super_of(j, w)) * GROUP + r];
    return mink == MIN_D ? dmin : dmin * (float)w->mn[((size_t)g * (K / 32) + j) * GROUP + r];
}

static void group_scalar(int fmt_bits, int sub, int zero, int sck, int mink, int g, int m0, int rows, int K, int N,
                         const weights_t *w, const acts_t *a, float *y) {
    for (int r = 0; r < GROUP; r++)
        for (int m = m0; m < m0 + rows; m++) {
            const int8_t *xq = a->xq + (size_t)m * K;
            float acc = 0.f, minacc = 0.f;
            for (int j = 0; j < K / 32; j++) {
                int32_t half[2] = {0, 0};
                for (int i = 0; i < 32; i++) half[i / 16] += weight_at(w, fmt_bits, K, g, r, j * 32 + i) * xq[j * 32 + i];
                const size_t b = (size_t)m * (K / 32) + j;
                if (sub == 16) {
                    int32_t T = 0;
                    for (int h = 0; h < 2; h++)
                        T += int_scale16(w, K, g, r, 2 * j + h) * (half[h] - zero * a->isum16[2 * b + h]);
                    acc = fmaf((float)T, scale_at(w, SC_NONE, 16, K, g, r, 2 * j) * a->sx[b], acc);
                } else {
                    const int32_t I = half[0] + half[1] - zero * (a->isum16[2 * b] + a->isum16[2 * b + 1]);
                    acc = fmaf((float)I, scale_at(w, sck, 32, K, g, r, j) * a->sx[b], acc);
                    if (mink != MIN_NONE) minacc = fmaf(min_at(w, mink, K, g, r, j), a->xsum[b], minacc);
                }
            }
            y[(size_t)m * N + (size_t)g * GROUP + r] = mink != MIN_NONE ? acc - minacc : acc;
        }
}

#define PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)

// Block j of a group (`bytes` of low bits: 256 for 3 to 6 bits, 512 for 8; and 128 of top bits where hi is
// given, for 5 and 6 bits) requested ahead of use.
static inline void prefetch_block(const uint8_t *lo, const uint8_t *hi, int j, int bytes) {
    for (int o = 0; o < bytes; o += 64) PREFETCH(lo + (size_t)j * bytes + PREFETCH_AHEAD + o);
    if (hi) {
        PREFETCH(hi + (size_t)j * 128 + PREFETCH_AHEAD / 2);
        PREFETCH(hi + (size_t)j * 128 + PREFETCH_AHEAD / 2 + 64);
    }
}

#if defined(HAVE_AVX2)
// ---- AVX2: the 16 rows of a group as two halves of 8 --------------------------------------------------------
static inline __m256 cvt_u8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline __m256 cvt_i8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

static inline __m256 scale8(const weights_t *w, int sck, int sub, int K, int g, int half, int sub_index) {
    const int nsub = K / sub;
    const size_t at_d = ((size_t)g * super_of(nsub, w) + super_of(sub_index, w)) * GROUP + half * 8;
    const __m256 d = _mm256_loadu_ps(w->d + at_d);
    if (sck == SC_NONE) return d;
    const size_t at = ((size_t)g * nsub + sub_index) * GROUP + half * 8;
    return _mm256_mul_ps(d, sck == SC_U8 ? cvt_u8((const uint8_t *)w->sc + at) : cvt_i8((const int8_t *)w->sc + at));
}

static inline __m256 min8(const weights_t *w, int mink, int K, int g, int half, int j) {
    const size_t at = ((size_t)g * super_of(K / 32, w) + super_of(j, w)) * GROUP + half * 8;
    const __m256 dmin = _mm256_loadu_ps(w->dmin + at);
    return mink == MIN_D ? dmin : _mm256_mul_ps(dmin, cvt_u8(w->mn + ((size_t)g * (K / 32) + j) * GROUP + half * 8));
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// Weights e and 4+e of the 8 rows of `half`, 32 bytes each, from one 64-byte chunk (bits 4 to 6).
static inline void unpack8(int bits, const uint8_t *lo, const uint8_t *hi, int half, __m256i *w0, __m256i *w1) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(lo + half * 32));
    *w0 = _mm256_and_si256(packed, low);
    *w1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    if (bits > 4) {
        // a weight's top bit pair moved to bits 4-5 of its byte: half 0 reads the low nibbles (pairs of e at
        // bits 0-1, of 4+e at 2-3), half 1 the high ones (at 4-5 and 6-7); bits shifted across bytes are
        // masked off
        const __m256i top = _mm256_set1_epi8(0x30), h = _mm256_loadu_si256((const __m256i *)hi);
        *w0 = _mm256_or_si256(*w0, _mm256_and_si256(half ? h : _mm256_slli_epi16(h, 4), top));
        *w1 = _mm256_or_si256(*w1, _mm256_and_si256(half ? _mm256_srli_epi16(h, 2) : _mm256_slli_epi16(h, 2), top));
    }
}

// Chunk t (8 weights per row) of block j into the sums: int16 (s16) for 4 bits in sub-blocks of 32, int32 (I)
// otherwise, widened by vpmaddwd with mult (1, or for sub-blocks of 16 the chunk's integer scale).
static inline __attribute__((always_inline)) void chunk_dots(int bits, int sub, int t, size_t chunk, int j, int half,
        int m0, const int rows, int K, const weights_t *w, const acts_t *a, const __m256i mult[2],
        __m256i s16[ROW_TILE], __m256i I[ROW_TILE]) {
    __m256i w0, w1;
    unpack8(bits, w->lo + (chunk + t) * 64, bits > 4 ? w->hi + (chunk + t) * 32 : NULL, half, &w0, &w1);
    const __m256i m = mult[sub == 16 ? t / 2 : 0];
    _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) {
        const int8_t *xr = a->xq + (size_t)(m0 + r) * K + j * 32 + t * 8;
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, bcast4(xr)), _mm256_maddubs_epi16(w1, bcast4(xr + 4)));
        if (bits == 4 && sub == 32)
            s16[r] = _mm256_add_epi16(s16[r], p);
        else
            I[r] = _mm256_add_epi32(I[r], _mm256_madd_epi16(p, m));
    }
}

// int16 pairs (lo, hi) in each 4-byte lane from the low halves of two int32 vectors, for vpmaddwd.
static inline __m256i int16_pairs(__m256i lo, __m256i hi) {
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(hi, 16));
}

// Integer sums of block j for `rows` rows of x: per row, I[r] over the block's 32 weights (for sub 16, each
// half times its integer scale, at most 2 * 16 * 63 * 127 * 128 in magnitude). u8 x s8 products are summed
// in pairs (int16) by maddubs: 4-bit pairs
// (at most 2 * 15 * 127) add up over the whole block in int16 (for sub 32), 3- to 6-bit pairs otherwise over
// 8 weights (4 * 63 * 127 = 32004), 8-bit pairs (2 * 127 * 127, signs moved onto x) one at a time.
static inline __attribute__((always_inline)) void block_dots(int bits, int sub, int g, int j, int half, int m0,
        const int rows, int K, const weights_t *w, const acts_t *a, const __m256i mult[2], __m256i I[ROW_TILE]) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (bits == 8) {
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) I[r] = _mm256_setzero_si256();
        const uint8_t *lo = w->lo + ((size_t)g * (K / 4) + (size_t)j * 8) * 64 + half * 32;
        _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(lo + t * 64)), aw = _mm256_abs_epi8(wv);
            _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) {
                const __m256i xs = _mm256_sign_epi8(bcast4(a->xq + (size_t)(m0 + r) * K + j * 32 + t * 4), wv);
                I[r] = _mm256_add_epi32(I[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
            }
        }
        return;
    }
    const size_t chunk = (size_t)g * (K / 8) + (size_t)j * 4;
    __m256i s16[ROW_TILE];
    _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) s16[r] = I[r] = _mm256_setzero_si256();
    // Unrolled for one or two rows of x; beyond, four chunks in flight would spill the 16 ymm registers.
    if (rows <= 2) {
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++)
            chunk_dots(bits, sub, t, chunk, j, half, m0, rows, K, w, a, mult, s16, I);
    } else {
        _Pragma("GCC unroll 1") for (int t = 0; t < 4; t++)
            chunk_dots(bits, sub, t, chunk, j, half, m0, rows, K, w, a, mult, s16, I);
    }
    if (bits == 4 && sub == 32)
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) I[r] = _mm256_madd_epi16(s16[r], ones);
}

static inline __attribute__((always_inline)) void min_sums(int mink, int g, int half, int m0, const int rows,
        int K, const weights_t *w, const acts_t *a, __m256 minacc[ROW_TILE]) {
    _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) minacc[r] = _mm256_setzero_ps();
    for (int j = 0; j < K / 32; j++) {
        const __m256 min = min8(w, mink, K, g, half, j);
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++)
            minacc[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(a->xsum[(size_t)(m0 + r) * (K / 32) + j]), minacc[r]);
    }
}

// Block j of one half (8 output rows) into the sums of `rows` rows of x: acc, and minacc where the mins are
// summed inline.
static inline __attribute__((always_inline)) void half_block(int bits, int sub, int zero, int sck, int mink,
        int inline_mins, int g, int half, int j, int m0, const int rows, int K, const weights_t *w,
        const acts_t *a, __m256 acc[ROW_TILE], __m256 minacc[ROW_TILE]) {
    __m256i I[ROW_TILE];
    if (sub == 16) {
        // each sub-block's sums weighted by its integer scale as they are widened (T of the header), less the
        // zero point times the scales and x sums: (zero * sc_a, zero * sc_b) . (sum_a, sum_b)
        const int8_t *sc = (const int8_t *)w->sc + ((size_t)g * (K / 16) + 2 * j) * GROUP + half * 8;
        const __m256i va = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
        const __m256i vb = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + GROUP)));
        const __m256i mult[2] = {int16_pairs(va, va), int16_pairs(vb, vb)};
        const __m256i zsc = _mm256_mullo_epi16(int16_pairs(va, vb), _mm256_set1_epi16((short)zero));
        const __m256 d = scale8(w, SC_NONE, 16, K, g, half, 2 * j);
        block_dots(bits, sub, g, j, half, m0, rows, K, w, a, mult, I);
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) {
            const size_t b = (size_t)(m0 + r) * (K / 32) + j;
            const uint32_t sum_a = (uint32_t)a->isum16[2 * b] & 0xFFFF, sum_b = (uint32_t)a->isum16[2 * b + 1];
            const __m256i sums = _mm256_set1_epi32((int)(sum_a | sum_b << 16));
            const __m256i T = _mm256_sub_epi32(I[r], _mm256_madd_epi16(zsc, sums));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(T), _mm256_mul_ps(d, _mm256_set1_ps(a->sx[b])), acc[r]);
        }
    } else {
        const __m256i ones = _mm256_set1_epi16(1), mult[2] = {ones, ones};
        block_dots(bits, sub, g, j, half, m0, rows, K, w, a, mult, I);
        const __m256 scale = scale8(w, sck, 32, K, g, half, j);
        const __m256 min = inline_mins ? min8(w, mink, K, g, half, j) : _mm256_setzero_ps();
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) {
            const size_t b = (size_t)(m0 + r) * (K / 32) + j;
            __m256i I32 = I[r];
            if (zero) I32 = _mm256_sub_epi32(I32, _mm256_set1_epi32(zero * (a->isum16[2 * b] + a->isum16[2 * b + 1])));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I32), _mm256_mul_ps(scale, _mm256_set1_ps(a->sx[b])), acc[r]);
            if (inline_mins) minacc[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(a->xsum[b]), minacc[r]);
        }
    }
}

// The 16 rows of group g as two halves of 8, both in one pass over K: each 64-byte chunk of weights is used
// whole while it is in L1 (a pass per half read every chunk twice: a third of a decode step on this path).
static inline __attribute__((always_inline)) void group_avx2(int bits, int sub, int zero, int sck, int mink, int g,
        int m0, const int rows, int K, int N, const weights_t *w, const acts_t *a, float *y) {
    const int block_bytes = bits == 8 ? 512 : 256;  // low bits of a block of 32 weights of the group's 16 rows
    const uint8_t *log = w->lo + (size_t)g * (K / 32) * block_bytes;
    const uint8_t *hig = bits > 4 && bits < 8 ? w->hi + (size_t)g * (K / 4) * GROUP : NULL;
    const int inline_mins = mink != MIN_NONE && rows <= 2;
    __m256 acc[2][ROW_TILE], minacc[2][ROW_TILE];
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) acc[h][r] = minacc[h][r] = _mm256_setzero_ps();
    for (int j = 0; j < K / 32; j++) {
        prefetch_block(log, hig, j, block_bytes);
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)
            half_block(bits, sub, zero, sck, mink, inline_mins, g, h, j, m0, rows, K, w, a, acc[h], minacc[h]);
    }
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        if (mink != MIN_NONE) {
            if (!inline_mins) min_sums(mink, g, h, m0, rows, K, w, a, minacc[h]);
            _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++) acc[h][r] = _mm256_sub_ps(acc[h][r], minacc[h][r]);
        }
        _Pragma("GCC unroll 4") for (int r = 0; r < rows; r++)
            _mm256_storeu_ps(y + (size_t)(m0 + r) * N + (size_t)g * GROUP + h * 8, acc[h][r]);
    }
}
#endif

#if defined(HAVE_VNNI)
// ---- AVX-512 VNNI: 16 rows per vector, u8 x s8 sums of 4 in int32 ------------------------------------------
static inline __m512 cvt16_u8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline __m512 cvt16_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }

static inline __m512i bcast4_512(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// Weights e and 4+e of the 16 rows, 64 bytes each, from one 64-byte chunk: the low nibbles, and where hi is
// given (5 and 6 bits) the top bit pairs from its 32 bytes.
static inline void unpack16(const uint8_t *lo, const uint8_t *hi, __m512i *w0, __m512i *w1) {
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    const __m512i packed = _mm512_loadu_si512((const void *)lo);
    *w0 = _mm512_and_si512(packed, low);
    *w1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    if (hi) {
        const __m256i h256 = _mm256_loadu_si256((const __m256i *)hi);
        const __m512i h = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(h256), _mm256_srli_epi16(h256, 4), 1), low);
        *w0 = _mm512_or_si512(*w0, _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
        *w1 = _mm512_or_si512(*w1, _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
    }
}

// Sub-blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K): the AVX2 path's sums and float steps, 16 lanes
// wide; 5-bit weights take their top bits from hi as Q6_K's do.
static inline __attribute__((always_inline)) void group_k32_vnni(int bits, int zero, int sck, int mink, int g,
        int m0, const int rows, int K, int N, const weights_t *w, const acts_t *a, float *y) {
    const int nsub = K / 32;
    const uint8_t *qg = w->lo + (size_t)g * (K / 2) * GROUP;
    const uint8_t *hig = bits > 4 ? w->hi + (size_t)g * (K / 4) * GROUP : NULL;
    __m512 acc[ROW_TILE], minacc[ROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) acc[r] = minacc[r] = _mm512_setzero_ps();
    for (int j = 0; j < nsub; j++) {
        const size_t at = ((size_t)g * nsub + j) * GROUP, sb = ((size_t)g * super_of(nsub, w) + super_of(j, w)) * GROUP;
        __m512 scale = _mm512_loadu_ps(w->d + sb), min = _mm512_setzero_ps();
        if (sck == SC_U8) scale = _mm512_mul_ps(scale, cvt16_u8((const uint8_t *)w->sc + at));
        if (mink != MIN_NONE) min = _mm512_loadu_ps(w->dmin + sb);
        if (mink == MIN_D_MN) min = _mm512_mul_ps(min, cvt16_u8(w->mn + at));
        prefetch_block(qg, hig, j, 256);
        __m512i I[ROW_TILE];
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) I[r] = _mm512_setzero_si512();
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
            __m512i w0, w1;
            unpack16(qg + ((size_t)j * 4 + t) * 64, hig ? hig + ((size_t)j * 4 + t) * 32 : NULL, &w0, &w1);
            _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
                const int8_t *xr = a->xq + (size_t)(m0 + r) * K + j * 32 + t * 8;
                I[r] = _mm512_dpbusd_epi32(I[r], w0, bcast4_512(xr));
                I[r] = _mm512_dpbusd_epi32(I[r], w1, bcast4_512(xr + 4));
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
            const size_t b = (size_t)(m0 + r) * nsub + j;
            __m512i I32 = I[r];
            if (zero) I32 = _mm512_sub_epi32(I32, _mm512_set1_epi32(zero * (a->isum16[2 * b] + a->isum16[2 * b + 1])));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I32), _mm512_mul_ps(scale, _mm512_set1_ps(a->sx[b])), acc[r]);
            if (mink != MIN_NONE) minacc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(a->xsum[b]), minacc[r]);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(y + (size_t)(m0 + r) * N + (size_t)g * GROUP,
                         mink != MIN_NONE ? _mm512_sub_ps(acc[r], minacc[r]) : acc[r]);
}

// Q6_K and Q3_K: a signed scale and a zero point (32, 4) per 16 weights; 6-bit weights from the low nibbles
// and top bit pairs, 3-bit ones from the low nibbles alone.
static inline __attribute__((always_inline)) void group_k16_vnni(int bits, int zero, int g, int m0, const int rows,
        int K, int N, const weights_t *w, const acts_t *a, float *y) {
    const int nsub = K / 32;
    const uint8_t *log = w->lo + (size_t)g * (K / 2) * GROUP;
    const uint8_t *hig = bits > 4 ? w->hi + (size_t)g * (K / 4) * GROUP : NULL;
    const int8_t *sc = (const int8_t *)w->sc;
    __m512 acc[ROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int j = 0; j < nsub; j++) {
        const __m512 dg = _mm512_loadu_ps(w->d + ((size_t)g * super_of(K / 16, w) + super_of(2 * j, w)) * GROUP);
        const int8_t *scg = sc + ((size_t)g * (K / 16) + 2 * j) * GROUP;
        const __m512 sa = cvt16_i8(scg), sb = cvt16_i8(scg + GROUP);
        prefetch_block(log, hig, j, 256);
        __m512i I[ROW_TILE][2];
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) I[r][0] = I[r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {
            __m512i w0, w1;
            unpack16(log + ((size_t)j * 4 + t) * 64, hig ? hig + ((size_t)j * 4 + t) * 32 : NULL, &w0, &w1);
            _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
                const int8_t *xr = a->xq + (size_t)(m0 + r) * K + j * 32 + t * 8;
                __m512i *s = &I[r][t / 2];
                *s = _mm512_dpbusd_epi32(*s, w0, bcast4_512(xr));
                *s = _mm512_dpbusd_epi32(*s, w1, bcast4_512(xr + 4));
            }
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
            const size_t b = (size_t)(m0 + r) * nsub + j;
            const __m512i ia = _mm512_sub_epi32(I[r][0], _mm512_set1_epi32(zero * a->isum16[2 * b]));
            const __m512i ib = _mm512_sub_epi32(I[r][1], _mm512_set1_epi32(zero * a->isum16[2 * b + 1]));
            // T = sc_a * ia + sc_b * ib in float: each product is exact (< 2^23) and the fma rounds their exact
            // sum, which is below 2^24, so T is the scalar path's integer exactly
            const __m512 T = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), sa, _mm512_mul_ps(_mm512_cvtepi32_ps(ib), sb));
            acc[r] = _mm512_fmadd_ps(T, _mm512_mul_ps(dg, _mm512_set1_ps(a->sx[b])), acc[r]);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(y + (size_t)(m0 + r) * N + (size_t)g * GROUP, acc[r]);
}
// Q8_0: vpdpbusd takes weights only as its unsigned operand, so each signed weight goes in with its sign bit
// flipped (w + 128, one XOR per 64 bytes) and 128 times the block's sum of x comes off: the exact integer sum of
// w * x the other paths take, then their float step.
static inline __attribute__((always_inline)) void group_q8_vnni(int g, int m0, const int rows, int K, int N,
        const weights_t *w, const acts_t *a, float *y) {
    const int nsub = K / 32;
    const uint8_t *qg = w->lo + (size_t)g * K * GROUP;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[ROW_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int j = 0; j < nsub; j++) {
        const __m512 scale = _mm512_loadu_ps(w->d + ((size_t)g * super_of(nsub, w) + super_of(j, w)) * GROUP);
        prefetch_block(qg, NULL, j, 512);
        __m512i I[ROW_TILE];
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) I[r] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) {
            const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512((const void *)(qg + ((size_t)j * 8 + t) * 64)), flip);
            _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
                I[r] = _mm512_dpbusd_epi32(I[r], wu, bcast4_512(a->xq + (size_t)(m0 + r) * K + j * 32 + t * 4));
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) {
            const size_t b = (size_t)(m0 + r) * nsub + j;
            const __m512i I32 = _mm512_sub_epi32(I[r], _mm512_set1_epi32(128 * (a->isum16[2 * b] + a->isum16[2 * b + 1])));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I32), _mm512_mul_ps(scale, _mm512_set1_ps(a->sx[b])), acc[r]);
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(y + (size_t)(m0 + r) * N + (size_t)g * GROUP, acc[r]);
}
#endif


#if defined(HAVE_AMX)
// ---- AMX: tiles of 16 rows of x for calls of many rows (prefill, batched verification) -------------------------
// A tile product C[m][r] += sum_k x[m][k] * w[r][k] over one block of 32 (s8 activations times u8 weights, or
// s8 times s8 for Q8_0) gives the VNNI path's integer sums for 16 rows of x and the group's 16 output rows at
// once; row m of C is then the VNNI path's vector for row m of x and takes the same float steps in the same
// order. The unpacked weights of 8 consecutive k per row are a VNNI path operand pair (w0, w1) and exactly
// two rows of a tile's B operand, so a group is unpacked once per call into B rows and read by every tile of x.
// Each block's C tile goes through memory to be scaled, which bounds the gain: 1.1-1.3x the VNNI path for the
// 4- and 5-bit formats, more for Q8_0 (no unpacking; the tile takes signed weights as they are). Q6_K and
// Q3_K, scaled per 16 weights, would need twice the tiles and measured no faster: they stay on the VNNI path
// (docs/decisions.md#amx-int8-tiles-for-calls-of-16-rows).
#define AMX_ROWS 16
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// Linux hands a process the 8 KB tile state only on request; where it refuses, the VNNI path runs.
static int amx_permitted(void) {
    static int permitted = -1;  // a benign race: every thread computes the same answer
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

// Tiles 0-1: C (16 x 16 int32) for two consecutive blocks; 2-3: their x rows (16 x 32 bytes); 4-5: their
// weights (8 rows of 16 lanes x 4 bytes).
static void amx_configure(void) {
    tile_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; t++) {
        cfg.rows[t] = t < 4 ? AMX_ROWS : 8;
        cfg.colsb[t] = t < 2 || t >= 4 ? 64 : 32;
    }
    _tile_loadconfig(&cfg);
}

// Block j of x rows m0.. and its B rows, into C tile `c` (a compile-time constant).
#define AMX_PRODUCT(c, ta, tb, j, signed_weights, bq, xq, K)                      \
    do {                                                                           \
        _tile_zero(c);                                                             \
        _tile_loadd(ta, (xq) + (size_t)(j) * 32, K);                               \
        _tile_loadd(tb, (bq) + (size_t)(j) * 512, 64);                             \
        if (signed_weights) _tile_dpbssd(c, ta, tb); else _tile_dpbsud(c, ta, tb); \
    } while (0)

// acc[m] += (I[m] - zero * xs[m]) * (scale * sx[m]) for the 16 rows of x in C: the VNNI path's step per block.
static inline __attribute__((always_inline)) void amx_accumulate(const int32_t *c, __m512 scale, int zero,
        const int32_t *isum, int isum_step, const float *sx, int sx_step, __m512 acc[AMX_ROWS]) {
    _Pragma("GCC unroll 16") for (int m = 0; m < AMX_ROWS; m++) {
        __m512i I = _mm512_loadu_si512((const void *)(c + m * 16));
        if (zero) I = _mm512_sub_epi32(I, _mm512_set1_epi32(zero * isum[m * isum_step]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(scale, _mm512_set1_ps(sx[m * sx_step])), acc[m]);
    }
}

// Block j's C tile (stored at c) into acc: the block's scale per output row, then amx_accumulate.
static inline __attribute__((always_inline)) void amx_scale_block(int zero, int sck, int g, int j, int K,
        const weights_t *w, const int32_t *isum, const float *sx, const int32_t *c, __m512 acc[AMX_ROWS]) {
    const int nsub = K / 32;
    __m512 scale = _mm512_loadu_ps(w->d + ((size_t)g * super_of(nsub, w) + super_of(j, w)) * GROUP);
    if (sck == SC_U8) scale = _mm512_mul_ps(scale, cvt16_u8((const uint8_t *)w->sc + ((size_t)g * nsub + j) * GROUP));
    int32_t xs[AMX_ROWS];  // the zero point multiplies the block's sum: its two halves' sums added first
    for (int m = 0; zero && m < AMX_ROWS; m++) {
        const int32_t *halves = isum + (size_t)m * 2 * nsub + 2 * j;
        xs[m] = halves[0] + halves[1];
    }
    amx_accumulate(c, scale, zero, xs, 1, sx + j, nsub, acc);
}

// Blocks j and j + 1 (where there is one) of the group's weights requested ahead, and unpacked into B rows
// (8-bit weights are B rows as stored).
static inline __attribute__((always_inline)) void amx_unpack_pair(int bits, int j, int nsub, const uint8_t *lo,
                                                                  const uint8_t *hi, uint8_t *rows) {
    const int end = j + 2 < nsub ? j + 2 : nsub;
    for (int b = j; b < end; b++) {
        prefetch_block(lo, hi, b, bits == 8 ? 512 : 256);
        if (bits == 8) continue;
        for (int t = 4 * b; t < 4 * b + 4; t++) {
            __m512i w0, w1;
            unpack16(lo + (size_t)t * 64, hi ? hi + (size_t)t * 32 : NULL, &w0, &w1);
            _mm512_storeu_si512((void *)(rows + (size_t)t * 128), w0);
            _mm512_storeu_si512((void *)(rows + (size_t)t * 128 + 64), w1);
        }
    }
}

// The group's 16 output rows for rows m0..m0+16 of x. `rows`: the group's B rows (K / 4 of 64 bytes); with
// `first`, this tile unpacks them from lo / hi as it goes, so that the weights stream in while the tile unit
// computes (unpacking the whole group first left the two in turn). Blocks go in pairs, so that the second
// product runs while the first is stored.
static inline __attribute__((always_inline)) void tile_amx(int bits, int zero, int sck, int mink, int g, int m0,
        int K, int N, const weights_t *w, const acts_t *a, int first, const uint8_t *lo, const uint8_t *hi,
        uint8_t *rows, float *y) {
    const int nsub = K / 32;
    const int8_t *xq = a->xq + (size_t)m0 * K;
    const int32_t *isum = a->isum16 + (size_t)m0 * 2 * nsub;
    const float *sx = a->sx + (size_t)m0 * nsub;
    int32_t c[2][AMX_ROWS * 16] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS];
    _Pragma("GCC unroll 16") for (int m = 0; m < AMX_ROWS; m++) acc[m] = _mm512_setzero_ps();
    for (int j = 0; j < nsub; j += 2) {
        const int pair = j + 1 < nsub;
        if (first) amx_unpack_pair(bits, j, nsub, lo, hi, rows);
        AMX_PRODUCT(0, 2, 4, j, bits == 8, rows, xq, K);
        if (pair) AMX_PRODUCT(1, 3, 5, j + 1, bits == 8, rows, xq, K);
        _tile_stored(0, c[0], 64);
        if (pair) _tile_stored(1, c[1], 64);
        for (int i = 0; i <= pair; i++) amx_scale_block(zero, sck, g, j + i, K, w, isum, sx, c[i], acc);
    }
    float *yt = y + (size_t)m0 * N + (size_t)g * GROUP;
    _Pragma("GCC unroll 16") for (int m = 0; m < AMX_ROWS; m++) _mm512_storeu_ps(yt + (size_t)m * N, acc[m]);
    if (mink == MIN_NONE) return;
    __m512 minacc[AMX_ROWS];  // the VNNI path's second sum, in its order, then acc - minacc
    _Pragma("GCC unroll 16") for (int m = 0; m < AMX_ROWS; m++) minacc[m] = _mm512_setzero_ps();
    for (int j = 0; j < nsub; j++) {
        __m512 min = _mm512_loadu_ps(w->dmin + ((size_t)g * super_of(nsub, w) + super_of(j, w)) * GROUP);
        if (mink == MIN_D_MN) min = _mm512_mul_ps(min, cvt16_u8(w->mn + ((size_t)g * nsub + j) * GROUP));
        _Pragma("GCC unroll 16") for (int m = 0; m < AMX_ROWS; m++)
            minacc[m] = _mm512_fmadd_ps(min, _mm512_set1_ps(a->xsum[(size_t)(m0 + m) * nsub + j]), minacc[m]);
    }
    _Pragma("GCC unroll 16") for (int m = 0; m < AMX_ROWS; m++)
        _mm512_storeu_ps(yt + (size_t)m * N, _mm512_sub_ps(_mm512_loadu_ps(yt + (size_t)m * N), minacc[m]));
}

// Rows m0.. of x in whole tiles of 16 for group g; returns the first row left for the VNNI path (m0 where the
// scratch memory is not there).
static inline __attribute__((always_inline)) int group_amx(int bits, int zero, int sck, int mink, int g, int m0,
        int m_end, int K, int N, const weights_t *w, const acts_t *a, float *y) {
    const uint8_t *lo, *hi = NULL;
    uint8_t *rows;
    if (bits == 8) {  // 8-bit weights are B rows as stored
        lo = w->lo + (size_t)g * (K / 4) * 64;
        rows = (uint8_t *)lo;
    } else {
        lo = w->lo + (size_t)g * (K / 2) * GROUP;
        hi = bits > 4 ? w->hi + (size_t)g * (K / 4) * GROUP : NULL;
        rows = (uint8_t *)scratch(UNPACKED, (size_t)K * GROUP);
        if (!rows) return m0;
    }
    amx_configure();
    for (int first = 1; m0 + AMX_ROWS <= m_end; m0 += AMX_ROWS, first = 0)
        tile_amx(bits, zero, sck, mink, g, m0, K, N, w, a, first, lo, hi, rows, y);
    _tile_release();
    return m0;
}
#endif

// ---- dispatch ------------------------------------------------------------------------------------------------
// One group of 16 output rows for `rows` rows of x (a compile-time constant in the SIMD paths, which unroll
// over it), in format FMT's constants.
#if defined(HAVE_AVX2)
#define SIMD_GROUP(bits, sub, zero, sck, mink, R) group_avx2(bits, sub, zero, sck, mink, g, m0, R, K, N, w, a, y)
#else
#define SIMD_GROUP(bits, sub, zero, sck, mink, R) group_scalar(bits, sub, zero, sck, mink, g, m0, R, K, N, w, a, y)
#endif

#if ROW_TILE == 8
#define TILE_CASES(CALL) case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; case 8: CALL(8); break;
#else
#define TILE_CASES(CALL)
#endif
#define BY_TILE(CALL)                                                                                   \
    switch (m_end - m0 < ROW_TILE ? m_end - m0 : ROW_TILE) {                                           \
        case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
        TILE_CASES(CALL)                                                                                \
    }

// Each format's group call for R rows: its bits in memory, sub-block size, zero point, scale and min kinds
// (with VNNI, each has its 512-bit code).
#if defined(HAVE_VNNI)
#define GROUP_Q8_0(R) group_q8_vnni(g, m0, R, K, N, w, a, y)
#define GROUP_Q4_0(R) group_k32_vnni(4, 8, SC_NONE, MIN_NONE, g, m0, R, K, N, w, a, y)
#define GROUP_Q4_1(R) group_k32_vnni(4, 0, SC_NONE, MIN_D, g, m0, R, K, N, w, a, y)
#define GROUP_Q5_0(R) group_k32_vnni(6, 16, SC_NONE, MIN_NONE, g, m0, R, K, N, w, a, y)
#define GROUP_Q5_1(R) group_k32_vnni(6, 0, SC_NONE, MIN_D, g, m0, R, K, N, w, a, y)
#define GROUP_Q4_K(R) group_k32_vnni(4, 0, SC_U8, MIN_D_MN, g, m0, R, K, N, w, a, y)
#define GROUP_Q5_K(R) group_k32_vnni(6, 0, SC_U8, MIN_D_MN, g, m0, R, K, N, w, a, y)
#define GROUP_Q6_K(R) group_k16_vnni(6, 32, g, m0, R, K, N, w, a, y)
#define GROUP_Q3_K(R) group_k16_vnni(4, 4, g, m0, R, K, N, w, a, y)
#else
#define GROUP_Q8_0(R) SIMD_GROUP(8, 32, 0, SC_NONE, MIN_NONE, R)
#define GROUP_Q4_0(R) SIMD_GROUP(4, 32, 8, SC_NONE, MIN_NONE, R)
#define GROUP_Q4_1(R) SIMD_GROUP(4, 32, 0, SC_NONE, MIN_D, R)
#define GROUP_Q5_0(R) SIMD_GROUP(6, 32, 16, SC_NONE, MIN_NONE, R)
#define GROUP_Q5_1(R) SIMD_GROUP(6, 32, 0, SC_NONE, MIN_D, R)
#define GROUP_Q4_K(R) SIMD_GROUP(4, 32, 0, SC_U8, MIN_D_MN, R)
#define GROUP_Q5_K(R) SIMD_GROUP(6, 32, 0, SC_U8, MIN_D_MN, R)
#define GROUP_Q6_K(R) SIMD_GROUP(6, 16, 32, SC_I8, MIN_NONE, R)
#define GROUP_Q3_K(R) SIMD_GROUP(4, 16, 4, SC_I8, MIN_NONE, R)
#endif
#define FORMAT_CASE(FMT) case FMT: BY_TILE(GROUP_##FMT) break;

#if defined(HAVE_AMX)
// Whether `rows` rows of x go to AMX tiles: whole tiles pay from 16 rows, but the rows left over for the VNNI
// path unpack the weights again, which loses where they are more than a quarter of the call (24 rows: 16 + 8).
// Q8_0 has no unpacking to repeat, so any whole tile pays there.
static inline int amx_pays(int rows, int bits) {
    return rows >= AMX_ROWS && (bits == 8 || rows % AMX_ROWS <= rows / 4);
}

#define AMX_CASE(FMT, bits, zero, sck, mink) \
    case FMT: if (amx_pays(m_end - m0, bits)) m0 = group_amx(bits, zero, sck, mink, g, m0, m_end, K, N, w, a, y); break;
#endif

// Rows m0..m_end of x for group g: in whole tiles of 16 on AMX where `amx` (and it pays), the rest in tiles of
// ROW_TILE.
static inline __attribute__((always_inline)) void run_group(int fmt, int g, int m0, int m_end, int K, int N,
                                                            const weights_t *w, const acts_t *a, float *y, int amx) {
#if defined(HAVE_AMX)
    if (amx) {
        switch (fmt) {
            AMX_CASE(Q4_0, 4, 8, SC_NONE, MIN_NONE) AMX_CASE(Q4_1, 4, 0, SC_NONE, MIN_D)
            AMX_CASE(Q5_0, 6, 16, SC_NONE, MIN_NONE) AMX_CASE(Q5_1, 6, 0, SC_NONE, MIN_D)
            AMX_CASE(Q4_K, 4, 0, SC_U8, MIN_D_MN) AMX_CASE(Q5_K, 6, 0, SC_U8, MIN_D_MN)
            AMX_CASE(Q8_0, 8, 0, SC_NONE, MIN_NONE)
        }
    }
#else
    (void)amx;
#endif
    for (; m0 < m_end; m0 += ROW_TILE) {
        switch (fmt) {
            FORMAT_CASE(Q4_0) FORMAT_CASE(Q4_1) FORMAT_CASE(Q5_0) FORMAT_CASE(Q5_1)
            FORMAT_CASE(Q8_0) FORMAT_CASE(Q4_K) FORMAT_CASE(Q5_K) FORMAT_CASE(Q6_K) FORMAT_CASE(Q3_K)
        }
    }
}

// The instruction set this build computes with: 1024 (as 512, and AMX tiles for calls of many rows), 512
// (AVX-512 VNNI), 256 (AVX2 + FMA) or 0 (the portable scalar path).
int lowbit_isa(void) {
#if defined(HAVE_AMX)
    if (amx_permitted()) return 1024;
#endif
#if defined(HAVE_VNNI)
    return 512;
#elif defined(HAVE_AVX2)
    return 256;
#else
    return 0;
#endif
}

// Weights per sub-block (32, or 16 for Q6_K and Q3_K); 0 for an unknown format.
static int sub_of(int fmt) { return fmt == Q6_K || fmt == Q3_K ? 16 : (fmt >= 0 && fmt < NUM_FORMATS ? 32 : 0); }

// Preconditions shared by the entry points: 0, or a negative code that lowbit.py turns into a message.
static int check(int fmt, int K, int N, int S, const weights_t *w) {
    const int sub = sub_of(fmt);
    if (!sub) return -1;                                   // unknown format
    if (K <= 0 || K % 32 || K >= 1 << 24 || N <= 0 || N % GROUP) return -2;  // K a multiple of 32, N of 16
    if (S <= 0 || S >= 1 << 12 || (K / sub) % S) return -3;  // whole super-blocks
    if (!w->lo || !w->d) return -4;
    if ((fmt == Q5_0 || fmt == Q5_1 || fmt == Q5_K || fmt == Q6_K) && !w->hi) return -4;
    if ((fmt >= Q4_K) && !w->sc) return -4;
    if ((fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K) && !w->dmin) return -4;
    if ((fmt == Q4_K || fmt == Q5_K) && !w->mn) return -4;
    return 0;
}

// x [M, K] float, y [M, N] float; passes 1 (x in int8 blocks) or 2 (x and its residual, each in int8 blocks,
// their products summed in that order). Returns 0, or a negative code (check(); -5: out of memory; -7: passes).
int lowbit_linear(int fmt, const float *x, int M, int K, int N, int S, const uint8_t *lo, const uint8_t *hi,
                  const void *sc, const uint8_t *mn, const float *d, const float *dmin, float *y, int passes,
                  int threads) {
    const weights_t weights = {lo, hi, mn, sc, d, dmin, S, S > 0 ? ((1ull << 32) + S - 1) / S : 0}, *w = &weights;
    const int bad = check(fmt, K, N, S, w);
    if (bad) return bad;
    if (passes < 1 || passes > 2) return -7;
    if (M <= 0) return M == 0 ? 0 : -2;
    if (!x || !y) return -4;
    acts_t acts, *a = &acts;
    if (quantize_acts(x, M, K, passes, threads, a)) return -5;
    const int Q = M * passes;
    float *out = passes == 1 ? y : (float *)scratch(PASS_OUTPUT, (size_t)Q * N * sizeof(float));
    if (!out) return -5;
    const int groups = N / GROUP, tail = Q % ROW_BLOCK;
    // A short tail joins the block before it (a verify's rows beside a prompt's chunk of 64): a block of its own
    // would take one more pass over every weight for a few rows.
    const int row_blocks = Q / ROW_BLOCK + (tail > ROW_BLOCK / 4 || Q < ROW_BLOCK);
#if defined(HAVE_AMX)
    const int amx = Q >= AMX_ROWS && amx_permitted();
#else
    const int amx = 0;
#endif
    // The threads share each block's groups: split by blocks, a call of 65 rows would give one thread 64 of them.
#pragma omp parallel num_threads(threads)
    for (int rb = 0; rb < row_blocks; rb++) {
        const int m_end = rb + 1 < row_blocks ? (rb + 1) * ROW_BLOCK : Q;
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) run_group(fmt, g, rb * ROW_BLOCK, m_end, K, N, w, a, out, amx);
    }
    if (passes == 2)
        for (size_t m = 0; m < (size_t)M; m++)
            for (int n = 0; n < N; n++) y[m * N + n] = out[2 * m * N + n] + out[(2 * m + 1) * N + n];
    return 0;
}

// out [n, K] = the float weights of output rows ids[0..n) (an embedding lookup): as the format defines them,
// in float32 with the same products as gguf's dequantization.
int lowbit_dequantize_rows(int fmt, int K, int N, int S, const uint8_t *lo, const uint8_t *hi, const void *sc,
                           const uint8_t *mn, const float *d, const float *dmin, const int64_t *ids, int n, float *out) {
    const weights_t weights = {lo, hi, mn, sc, d, dmin, S, S > 0 ? ((1ull << 32) + S - 1) / S : 0}, *w = &weights;
    const int bad = check(fmt, K, N, S, w);
    if (bad) return bad;
    static const int bits[NUM_FORMATS] = {4, 4, 6, 6, 8, 4, 6, 6, 4}, zero[NUM_FORMATS] = {8, 0, 16, 0, 0, 0, 0, 32, 4};
    const int sub = sub_of(fmt);
    const int sck = fmt == Q6_K || fmt == Q3_K ? SC_I8 : fmt >= Q4_K ? SC_U8 : SC_NONE;
    const int mink = (fmt == Q4_K || fmt == Q5_K) ? MIN_D_MN : (fmt == Q4_1 || fmt == Q5_1) ? MIN_D : MIN_NONE;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= N) return -6;
        const int g = (int)(ids[i] / GROUP), r = (int)(ids[i] % GROUP);
        for (int k = 0; k < K; k++) {
            const float q = (float)(weight_at(w, bits[fmt], K, g, r, k) - zero[fmt]);
            float v = scale_at(w, sck, sub, K, g, r, k / sub) * q;
            if (mink != MIN_NONE) v -= min_at(w, mink, K, g, r, k / 32);
            out[(size_t)i * K + k] = v;
        }
    }
    return 0;
}

// ---- mixtures of experts --------------------------------------------------------------------------------
// One expert's layer: the 6 buffer addresses of lowbit_linear, as the table rows Python passes.
static weights_t expert_weights(const uint64_t *at, int S) {
    return (weights_t){(const uint8_t *)at[0], (const uint8_t *)at[1], (const uint8_t *)at[3], (const void *)at[2],
                       (const float *)at[4], (const float *)at[5], S, S > 0 ? ((1ull << 32) + S - 1) / S : 0};
}

// out [R, N] = the routed rows' products with their experts' weights: rows first[e] .. first[e + 1] of the
// quantized activations go to expert e (table[e]), every expert's weights read once for all its rows. The
// chosen experts' groups are one parallel loop, split statically: each thread streams a contiguous run of
// weights. passes 2: out holds two rows per routed row (summed by the caller).
static int expert_products(int fmt, int S, int E, const int *first, const uint64_t *table, const acts_t *a, int K,
                           int N, int passes, float *out, int threads) {
    int used[E > 0 ? E : 1], n_used = 0;
    for (int e = 0; e < E; e++) {
        if (first[e + 1] == first[e]) continue;
        const weights_t w = expert_weights(table + 6 * (size_t)e, S);
        const int bad = check(fmt, K, N, S, &w);
        if (bad) return bad;
        used[n_used++] = e;
    }
    const int groups = N / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int task = 0; task < n_used * groups; task++) {
        const int e = used[task / groups], g = task % groups;
        const int q0 = first[e] * passes, q1 = first[e + 1] * passes;
        const weights_t w = expert_weights(table + 6 * (size_t)e, S);
#if defined(HAVE_AMX)
        const int amx = q1 - q0 >= AMX_ROWS && amx_permitted();
#else
        const int amx = 0;
#endif
        for (int m0 = q0; m0 < q1; m0 += ROW_BLOCK)
            run_group(fmt, g, m0, m0 + ROW_BLOCK < q1 ? m0 + ROW_BLOCK : q1, K, N, &w, a, out, amx);
    }
    return 0;
}

// The two passes' rows summed in place: rows 2r and 2r + 1 of out [2R, N] into row r.
static void sum_passes(float *out, int R, int N) {
    for (size_t r = 0; r < (size_t)R; r++)
        for (int n = 0; n < N; n++) out[r * N + n] = out[2 * r * N + n] + out[(2 * r + 1) * N + n];
}

static inline float silu(float x) { return x / (1.f + expf(-x)); }

// How a router scores each expert's logit: a softmax over all of them, or each one's own sigmoid (GLM-4.5's).
enum { SCORE_SOFTMAX = 0, SCORE_SIGMOID = 1 };

// Row x's router: the E experts' logits (router [E, K] . x) scored by `scoring`; the `top` best by score, plus a
// bias of each expert's where `bias` is given (ERNIE 4.5's, GLM-4.5's), kept (ties to the lower id), weighed by
// their scores, rescaled to sum to 1 where `normalize`, then multiplied by `scale`. p, choice: scratch of E.
// Of `groups` equal groups of experts, only the best `kept` stay choosable (the others' choice at -inf): a group
// scored by its best choice, or by its best two summed (top2; DeepSeek-V2's and V3's, models/layers.py's
// Router.within_kept_groups). A group taken first on ties, as a lower expert is.
static void keep_best_groups(float *choice, int E, int groups, int kept, int top2) {
    const int size = E / groups;
    float score[groups];
    for (int g = 0; g < groups; g++) {
        float best = -INFINITY, second = -INFINITY;
        for (int e = g * size; e < (g + 1) * size; e++) {
            if (choice[e] > best) second = best, best = choice[e];
            else if (choice[e] > second) second = choice[e];
        }
        score[g] = top2 ? best + second : best;
    }
    for (int j = 0; j < kept; j++) {  // the kept groups' scores marked +inf, then the others' experts masked
        int best = -1;
        for (int g = 0; g < groups; g++)
            if (score[g] < INFINITY && (best < 0 || score[g] > score[best])) best = g;
        score[best] = INFINITY;
    }
    for (int g = 0; g < groups; g++)
        if (score[g] < INFINITY)
            for (int e = g * size; e < (g + 1) * size; e++) choice[e] = -INFINITY;
}

static void route(const float *router, const float *x, int K, int E, int top, int normalize, int scoring,
                  const float *bias, float scale, const int *grouping, int64_t *chosen, float *weight, float *p,
                  float *choice) {
    float peak = -INFINITY, total = 0.f;
    for (int e = 0; e < E; e++) {
        float lanes[16] = {0}, logit = 0.f;  // 16 independent sums (K is a multiple of 32): vectorised, same bits
        for (int k = 0; k < K; k += 16)
            for (int l = 0; l < 16; l++) lanes[l] += router[(size_t)e * K + k + l] * x[k + l];
        for (int l = 0; l < 16; l++) logit += lanes[l];
        p[e] = logit;
        peak = logit > peak ? logit : peak;
    }
    if (scoring == SCORE_SIGMOID)
        for (int e = 0; e < E; e++) p[e] = 1.f / (1.f + expf(-p[e]));
    else {
        for (int e = 0; e < E; e++) total += (p[e] = expf(p[e] - peak));
        for (int e = 0; e < E; e++) p[e] /= total;
    }
    for (int e = 0; e < E; e++) choice[e] = bias ? p[e] + bias[e] : p[e];
    if (grouping[0] > 1) keep_best_groups(choice, E, grouping[0], grouping[1], grouping[2]);
    float kept = 0.f;
    for (int j = 0; j < top; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (choice[e] > -INFINITY && (best < 0 || choice[e] > choice[best])) best = e;
        chosen[j] = best;
        weight[j] = p[best];
        kept += weight[j];
        choice[best] = -INFINITY;  // taken
    }
    for (int j = 0; j < top; j++) weight[j] = (normalize ? weight[j] / kept : weight[j]) * scale;
}

// A mixture of experts' MLP over M rows of x [M, K]: y[m] = the sum over row m's `top` chosen experts
// (chosen [M, top], weight [M, top]; or, given the router's weights [E, K], routed here, into chosen and weight, as
// route() says with scoring, selection_bias (NULL: none), scale and grouping: groups, groups kept, scored by their
// best two (1) or best one (0); groups 1: none)
// of weight * down_e(silu(gate_e(x_m)) * up_e(x_m)), added in ascending expert order. gate_up_table[e] and down_table[e] hold expert e's 6 buffer addresses: its gate and up layers
// stacked ([gate; up], 2 * I output rows over K inputs, format fmt_gu) and its down layer (K rows over I,
// format fmt_down). The rows routed to each expert are computed together, so each expert's weights are read
// once per call, and every row's result is the same whatever other rows are in the call. Returns 0 or a
// negative code (check(); -5 out of memory; -6 an expert id outside 0..E-1; -7 passes).
int lowbit_moe(int fmt_gu, int S_gu, int fmt_down, int S_down, const float *x, int M, int K, int I, int E,
               const float *router, int normalize, int scoring, const float *selection_bias, float scale,
               const int *grouping, int64_t *chosen, float *weight, int top, const uint64_t *gate_up_table,
               const uint64_t *down_table, float *y, int passes, int threads) {
    if (passes < 1 || passes > 2) return -7;
    if (M <= 0 || top <= 0 || top > E || E <= 0 || I % 32) return M == 0 ? 0 : -2;
    const int groups = grouping[0], kept = grouping[1];
    if (groups < 1 || E % groups || (groups > 1 && (kept < 1 || kept > groups || top > kept * (E / groups))))
        return -2;
    const int R = M * top;
    if (router) {
        float *p = malloc((size_t)2 * E * sizeof(float));
        if (!p) return -5;
        for (int m = 0; m < M; m++)
            route(router, x + (size_t)m * K, K, E, top, normalize, scoring, selection_bias, scale, grouping,
                  chosen + (size_t)m * top, weight + (size_t)m * top, p, p + E);
        free(p);
    }
    int *first = calloc((size_t)E + 1, sizeof(int)), *row_of = malloc((size_t)R * sizeof(int));
    float *w_of = malloc((size_t)R * sizeof(float)), *routed = malloc((size_t)R * (K > I ? K : I) * sizeof(float));
    float *hidden = malloc((size_t)R * passes * 2 * I * sizeof(float)), *out = malloc((size_t)R * passes * K * sizeof(float));
    int code = !first || !row_of || !w_of || !routed || !hidden || !out ? -5 : 0;
    for (int i = 0; !code && i < R; i++)
        if (chosen[i] < 0 || chosen[i] >= E) code = -6;
    if (!code) {
        // the routed rows in ascending expert order, each expert's in row order
        for (int i = 0; i < R; i++) first[chosen[i] + 1]++;
        for (int e = 0; e < E; e++) first[e + 1] += first[e];
        int *fill = calloc((size_t)E, sizeof(int));
        if (!fill) code = -5;
        for (int i = 0; !code && i < R; i++) {
            const int e = (int)chosen[i], r = first[e] + fill[e]++;
            row_of[r] = i / top;
            w_of[r] = weight[i];
            memcpy(routed + (size_t)r * K, x + (size_t)(i / top) * K, (size_t)K * sizeof(float));
        }
        free(fill);
    }
    acts_t acts;
    if (!code) code = quantize_acts(routed, R, K, passes, threads, &acts) ? -5 : 0;
    if (!code) code = expert_products(fmt_gu, S_gu, E, first, gate_up_table, &acts, K, 2 * I, passes, hidden, threads);
    if (!code) {
        if (passes == 2) sum_passes(hidden, R, 2 * I);
        for (size_t r = 0; r < (size_t)R; r++) {  // silu(gate) * up in routed's place, rows of I
            const float *h = hidden + r * 2 * I;
            for (int i = 0; i < I; i++) routed[r * I + i] = silu(h[i]) * h[I + i];
        }
        code = quantize_acts(routed, R, I, passes, threads, &acts) ? -5 : 0;
    }
    if (!code) code = expert_products(fmt_down, S_down, E, first, down_table, &acts, I, K, passes, out, threads);
    if (!code) {
        if (passes == 2) sum_passes(out, R, K);
        memset(y, 0, (size_t)M * K * sizeof(float));
        for (size_t r = 0; r < (size_t)R; r++)  // ascending experts: each row's terms in expert order
            for (int k = 0; k < K; k++) y[(size_t)row_of[r] * K + k] += w_of[r] * out[r * K + k];
    }
    free(first); free(row_of); free(w_of); free(routed); free(hidden); free(out);
    return code;
}
