// Decode and verify attention in one call per layer: the per-head RMSNorm of q and k where the family has
// one, rotary embedding of q and k, the KV-cache write, and for every new token attention over exactly the
// keys it may see (its slot's positions 0..its own, or the last `window` of them in a sliding layer).
// Each (token, query head) is computed by the same operations in the same order whatever else is in the
// call, so a token's output is identical whether it is decoded alone or verified beside drafts; and every
// vector lane holds its own key (scores) or its own dimension (values), each a chain of fused
// multiply-adds in a fixed order, so every build (scalar, AVX2, AVX-512) gives the same bits.
//
//   qkv [N, (H + 2 Hkv) D]  q | k | v of each new token (projection output, bias added)
//   cos, sin [N, D]         rotary factors of each token's position (NeoX: halves rotated)
//   vcache [blocks, Hkv, B, D] of this layer, float32 or float16: B tokens a block; slots, positions [N]
//   kcache [blocks, Hkv, B / 16, D, 16] the same, keys in tiles of 16 (KEYS) with the dimension outermost: row r's
//                           d-th entry is entry d * 16 + r % 16 of tile r / 16
//   tables [S, MB]          each slot's blocks in order: position p of slot s is row p % B of block
//                           tables[s][p / B]
//   out [N, H D]            query head h reads kv head h / (H / Hkv)
//   q_norm, k_norm [D]      RMSNorm weights of each query and key head, or NULL (no norm)
//   scale                   of the query-key scores; window: keys a token sees, itself included (0: all)
//   softcap                 each scaled score becomes softcap * tanh(score / softcap) (Gemma 2; 0: none)
//   sinks [H]               a logit per query head in its softmax's denominator, weighing no value (gpt-oss), or
//                           NULL (none)
//
// Over a long context this streams the cache, so it is read once per kv head, a chunk of keys at a time (scored,
// folded into each head's running softmax, weighed): a tile of keys is already laid out with lanes over keys (no
// dot product ends in a horizontal sum, and nothing to transpose), widened in registers as it is loaded and
// scored for up to 16 query heads at once (their queries stored dimension-major, so a pass broadcasts from one
// pointer); each value likewise is widened in registers and weighed for up to 8 query heads at once, the heads of
// every token that sees the whole block of values together. exp is a polynomial in fused multiply-adds.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(SPECDECODE_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ATTENTION_SIMD 1  // every AVX2 CPU has FMA and F16C
#include <immintrin.h>
#endif

#define LANES 16   // independent partial sums of the softmax's max and total
#define KEYS 16    // keys scored together
#define VALUES 32  // keys whose values are weighed together (their rows stay in L1 while every token and
                   // group of query heads reads them)
#define MAX_DIM 256
#define MAX_GROUP 64  // query heads per KV head
#define MAX_TOKENS 8  // a slot's consecutive tokens that attend together
#define CHUNK 256     // keys scored, folded into the softmaxes and weighed at a time (a multiple of VALUES): the
                      // scores of 8 tokens' 6 heads stay in L2

// One vector of WIDTH floats: a zmm register where AVX-512 is there, else a ymm. Each lane runs the same
// chain of operations at either width, so the width changes the speed, never the bits.
#if defined(ATTENTION_SIMD) && defined(__AVX512F__)
#define WIDTH 16
#define HEADS 16  // query heads scored together at most (16 accumulators of the 32 registers)
#define WEIGH_HEADS 8  // query heads weighed together at most (2 accumulators each: 16 of the 32 registers)
#define EVEN_PASSES 1  // a group's heads in passes of equal size (see heads_a_pass)
#define WEIGH_VECS(h) 2  // vectors of dimensions a pass for h heads (see the AVX2 build)
typedef __m512 vec;
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmax _mm512_max_ps
#define vbits _mm512_castps_si512
#define vfloats _mm512_castsi512_ps
#define vadd_i32 _mm512_add_epi32
#define vset1_i32 _mm512_set1_epi32
#define vshl_i32 _mm512_slli_epi32
#define vdiv _mm512_div_ps
#define vand_i32 _mm512_and_si512
#define vor_i32 _mm512_or_si512
#elif defined(ATTENTION_SIMD)
#define WIDTH 8
#define HEADS 6  // query heads scored together at most: 12 accumulators, 2 keys' vectors and a broadcast
                 // fill 15 of the 16 registers
#define WEIGH_HEADS 6  // 12 of the 16 registers
#define EVEN_PASSES 0
// Vectors of dimensions weighed a pass for h query heads: the one or two heads left over (7 = 6 + 1) take
// 4, so that their chains of FMAs cover more of the FMA latency than 2 would
#define WEIGH_VECS(h) ((h) <= 2 ? 4 : 2)
typedef __m256 vec;
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmax _mm256_max_ps
#define vbits _mm256_castps_si256
#define vfloats _mm256_castsi256_ps
#define vadd_i32 _mm256_add_epi32
#define vset1_i32 _mm256_set1_epi32
#define vshl_i32 _mm256_slli_epi32
#define vdiv _mm256_div_ps
#define vand_i32 _mm256_and_si256
#define vor_i32 _mm256_or_si256
#else
#define HEADS 4
#define EVEN_PASSES 0
#endif
// How the cache is asked for ahead of its use: keys 16 and values 32 ahead, a line at a time among the loads in use,
// kept the stream fullest on every AVX2 and AVX-512 core measured, AMD's and Intel's (decisions.md#avx2-attention);
// into L2 on Intel's AVX-512 cores (SPECDECODE_PREFETCH_L2: a decode row's stream measured faster there, verify runs
// level; their AVX2 build's 2-row runs slower), into L1 elsewhere (AMD's measured so; Zen 4 is reported to drop some
// prefetches into L2). The scalar build asks for a block's lines at once: its loops make no calls between.
#ifdef SPECDECODE_PREFETCH_L2
#define PREFETCH_LOCALITY 1  // prefetcht2
#else
#define PREFETCH_LOCALITY 3  // prefetcht0
#endif
#ifdef ATTENTION_SIMD
#define KEYS_AHEAD 16    // keys prefetched this far ahead of the ones in use
#define VALUES_AHEAD 32  // values, the same
#define SPREAD_AHEAD 1   // a line at each of the block's calls of prefetch_next, spread evenly
#else
#define KEYS_AHEAD 64
#define VALUES_AHEAD 64
#define SPREAD_AHEAD 0  // a block's prefetches at once, before its arithmetic
#endif
#define KEY_VECS (KEYS / WIDTH)

#ifdef __FLT16_MAX__
typedef _Float16 half;
#define HAVE_HALF 1
#else
typedef uint16_t half;  // storage only: the float16 entry point reports itself unavailable
#define HAVE_HALF 0
#endif

// The cache lines of a span of rows still to ask for into L1 (see rows_ahead), a line every `every` calls: called
// among the loads of the rows in use, the requests run beside the arithmetic instead of queueing ahead of it.
typedef struct {
    const char *at, *end;
    int every, wait;
} ahead_t;

static inline __attribute__((always_inline)) void prefetch_next(ahead_t *a) {
    if (--a->wait) return;
    a->wait = a->every;
    if (a->at < a->end) {
        __builtin_prefetch(a->at, 0, PREFETCH_LOCALITY);
        a->at += 64;
    }
}

// Scratch memory kept per thread between calls (memory freed to glibc can go back to the OS and fault in
// again on the next of the ~30 calls per step).
static __thread float *scratch_buf;
static __thread size_t scratch_floats;

static float *scratch(size_t floats) {
    if (floats > scratch_floats) {
        free(scratch_buf);
        scratch_buf = malloc(floats * sizeof(float));
        scratch_floats = scratch_buf ? floats : 0;
    }
    return scratch_buf;
}

// y = x / sqrt(mean(x^2) + eps) * w over D values (a head's RMSNorm), or y = x without w.
static inline void norm_head(const float *x, const float *w, float eps, int D, float *y) {
    if (!w) {
        memcpy(y, x, D * sizeof(float));
        return;
    }
    float ss = 0.f;
    for (int i = 0; i < D; i++) ss = fmaf(x[i], x[i], ss);
    const float inv = 1.f / sqrtf(ss / (float)D + eps);
    for (int i = 0; i < D; i++) y[i] = x[i] * inv * w[i];
}

// x * cos + rotate_half(x) * sin, rounded as the separate products and sum are in PyTorch.
static inline void rope(const float *x, const float *c, const float *s, float *y, int D) {
    const int mid = D / 2;
    for (int i = 0; i < mid; i++) {
        float a = x[i] * c[i], b = -x[i + mid] * s[i];
        y[i] = a + b;
    }
    for (int i = mid; i < D; i++) {
        float a = x[i] * c[i], b = x[i - mid] * s[i];
        y[i] = a + b;
    }
}

// exp(x) for x <= 0 (a score minus the row's maximum) to within 2 ulp: x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by its Taylor polynomial to degree 7 (Horner's rule in fused multiply-adds), times 2^n built in the
// exponent bits.
static inline float exp_nonpositive(float x) {
    const float magic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer kept in the low bits
    x = x < -87.f ? -87.f : x;       // below, 2^n would not be a normal float; exp(-87) ~ 1.6e-38 anyway
    float t = fmaf(x, 1.44269504f, magic), n = t - magic;
    float r = fmaf(n, -0.693145752f, x);
    r = fmaf(n, -1.42860677e-6f, r);  // ln 2 in two parts: n * the first is exact
    float p = 1.f / 5040;
    p = fmaf(p, r, 1.f / 720);
    p = fmaf(p, r, 1.f / 120);
    p = fmaf(p, r, 1.f / 24);
    p = fmaf(p, r, 1.f / 6);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.f);
    p = fmaf(p, r, 1.f);
    int32_t bits, shift;
    memcpy(&bits, &t, sizeof bits);
    shift = (bits - 0x4B400000 + 127) << 23;  // n + 127 in the exponent field
    float scale;
    memcpy(&scale, &shift, sizeof scale);
    return p * scale;
}

#ifdef ATTENTION_SIMD
// exp_nonpositive, lane by lane: the same operations in the same order.
static inline vec vexp_nonpositive(vec x) {
    const vec magic = vset1(12582912.f);
    x = vmax(vset1(-87.f), x);  // (-87, NaN) is NaN, as in the scalar clamp
    const vec t = vfma(x, vset1(1.44269504f), magic), n = vsub(t, magic);
    vec r = vfma(n, vset1(-0.693145752f), x);
    r = vfma(n, vset1(-1.42860677e-6f), r);
    vec p = vset1(1.f / 5040);
    p = vfma(p, r, vset1(1.f / 720));
    p = vfma(p, r, vset1(1.f / 120));
    p = vfma(p, r, vset1(1.f / 24));
    p = vfma(p, r, vset1(1.f / 6));
    p = vfma(p, r, vset1(0.5f));
    p = vfma(p, r, vset1(1.f));
    p = vfma(p, r, vset1(1.f));
    const vec scale = vfloats(vshl_i32(vadd_i32(vbits(t), vset1_i32(-0x4B400000 + 127)), 23));
    return vmul(p, scale);
}
#endif

// cap * tanh(x / cap), Gemma 2's soft cap of a score: tanh |y| = (1 - e) / (1 + e) with e = exp(-2 |y|), the sign
// put back. Its error is a few ulp of 1 (not of tanh: near zero, 1 - e cancels), times the cap.
static inline float softcap(float x, float cap) {
    const float y = x / cap, e = exp_nonpositive(-2.f * fabsf(y));
    return copysignf((1.f - e) / (1.f + e), y) * cap;
}

#ifdef ATTENTION_SIMD
// softcap, lane by lane: the same operations in the same order (the sign bit masked off and put back).
static inline vec vsoftcap(vec x, float cap) {
    const vec y = vdiv(x, vset1(cap));
    const vec sign = vfloats(vand_i32(vbits(y), vset1_i32((int32_t)0x80000000)));
    const vec e = vexp_nonpositive(vmul(vset1(-2.f), vfloats(vand_i32(vbits(y), vset1_i32(0x7fffffff)))));
    const vec t = vdiv(vsub(vset1(1.f), e), vadd(vset1(1.f), e));
    return vmul(vfloats(vor_i32(vbits(t), vbits(sign))), vset1(cap));
}
#endif

// p[j] <- softcap(p[j], cap) for j = a .. b - 1.
static void capped(float *p, int a, int b, float cap) {
    int j = a;
#ifdef ATTENTION_SIMD
    for (; j + WIDTH <= b; j += WIDTH) vstore(p + j, vsoftcap(vload(p + j), cap));
#endif
    for (; j < b; j++) p[j] = softcap(p[j], cap);
}

#ifdef ATTENTION_SIMD
// WIDTH cached values from entry `at` on, as float32 (float16 widened exactly).
static inline __attribute__((always_inline)) vec load_values(const void *v, int is_half, size_t at) {
    if (!is_half) return vload((const float *)v + at);
#if WIDTH == 16
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const half *)v + at)));
#else
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const half *)v + at)));
#endif
}
#endif

// Entry i of a float32 or float16 cache, as float32 (exact).
static inline float entry(const void *cache, int is_half, size_t i) {
    return is_half ? (float)((const half *)cache)[i] : ((const float *)cache)[i];
}

// s[g * stride + l] = scale * sum_d q_g[d] kt[d][l] (one fused multiply-add per d, in order) for `heads`
// <= HEADS query heads (q_g[d] at q[d * qstride + g]: a pass's broadcasts from one pointer) and the first `count`
// keys of the tile kt (float32, or float16 widened exactly as it is loaded), asking for `ahead`'s lines among them.
// Inlined with a constant `heads` and `is_half`, so the accumulators stay in registers.
static inline __attribute__((always_inline)) void score_block(const float *q, size_t qstride, int heads,
                                                              const void *kt, int is_half, int D, int count,
                                                              float scale, float *s, size_t stride, ahead_t *ahead) {
#ifdef ATTENTION_SIMD
    ahead_t next = *ahead;  // in registers over the loop
    vec acc[HEADS][KEY_VECS];
#pragma GCC unroll 16
    for (int g = 0; g < heads; g++)
#pragma GCC unroll 2
        for (int v = 0; v < KEY_VECS; v++) acc[g][v] = vzero();
    for (int d = 0; d < D; d++) {
        prefetch_next(&next);
        vec k[KEY_VECS];
#pragma GCC unroll 2
        for (int v = 0; v < KEY_VECS; v++) k[v] = load_values(kt, is_half, d * KEYS + v * WIDTH);
#pragma GCC unroll 16
        for (int g = 0; g < heads; g++) {
            const vec qd = vset1(q[d * qstride + g]);
#pragma GCC unroll 2
            for (int v = 0; v < KEY_VECS; v++) acc[g][v] = vfma(qd, k[v], acc[g][v]);
        }
    }
    float row[KEYS];
#pragma GCC unroll 16
    for (int g = 0; g < heads; g++) {
        float *dst = count == KEYS ? s + g * stride : row;  // a partial block goes through row
#pragma GCC unroll 2
        for (int v = 0; v < KEY_VECS; v++) vstore(dst + v * WIDTH, vmul(acc[g][v], vset1(scale)));
        if (count < KEYS) memcpy(s + g * stride, row, count * sizeof(float));
    }
    *ahead = next;
#else
    (void)ahead;  // the scalar build asks for a block's lines at once (rows_ahead)
    for (int g = 0; g < heads; g++)
        for (int l = 0; l < count; l++) {
            float acc = 0.f;
            for (int d = 0; d < D; d++) acc = fmaf(q[d * qstride + g], entry(kt, is_half, d * KEYS + l), acc);
            s[g * stride + l] = acc * scale;
        }
#endif
}

#define SCORE_CASE(h) \
    case h: \
        if (is_half) score_block(qg, qstride, h, kt, 1, D, count, scale, sg, stride, ahead); \
        else score_block(qg, qstride, h, kt, 0, D, count, scale, sg, stride, ahead); \
        break;

// How many of `left` heads the next pass takes, at most `most`. Each pass runs one chain of FMAs per head and
// vector, and a pass with few chains leaves the FMA units waiting on their latency: on AVX-512 the passes are of
// equal size (24 heads as 12 + 12, not 16 + 8; 18 as 9 + 9, not 16 + 2); on AVX2, whose passes are smaller, the
// most a pass takes, except that none takes a lone head (7 as 5 + 2, measured faster than 6 + 1 and 4 + 3).
static inline int heads_a_pass(int left, int most) {
    if (EVEN_PASSES) {
        const int passes = (left + most - 1) / most;
        return (left + passes - 1) / passes;
    }
    const int heads = left < most ? left : most;
    return left - heads == 1 ? heads - 1 : heads;
}

// score_block for G heads, in passes of heads_a_pass. Each head's scores are the same chains whatever pass
// computes them.
static void score_heads(const float *q, size_t qstride, int G, const void *kt, int is_half, int D, int count,
                        float scale, float *s, size_t stride, ahead_t *ahead) {
    for (int g = 0; g < G;) {
        const int heads = heads_a_pass(G - g, HEADS);
        const float *qg = q + g;
        float *sg = s + g * stride;
        switch (heads) {
            SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4)
#if HEADS > 4
            SCORE_CASE(5) SCORE_CASE(6)
#endif
#if HEADS > 6
            SCORE_CASE(7) SCORE_CASE(8) SCORE_CASE(9) SCORE_CASE(10) SCORE_CASE(11) SCORE_CASE(12)
            SCORE_CASE(13) SCORE_CASE(14) SCORE_CASE(15) SCORE_CASE(16)
#endif
        }
        g += heads;
    }
}

#ifdef ATTENTION_SIMD
// weigh_block's inner loop for `heads` (<= WEIGH_HEADS) query heads and `vecs` (<= WEIGH_VECS(heads))
// vectors of dimensions from d0: each value is widened once, in registers, and feeds heads * vecs
// independent chains of fused multiply-adds (enough to run at the FMA units' throughput rather than
// their latency).
static inline __attribute__((always_inline)) void weigh_heads(const float *w, size_t stride, int heads,
                                                              const void *vb, int is_half, int D, int d0,
                                                              int vecs, int count, float *o, ahead_t *ahead) {
    ahead_t next = *ahead;  // in registers over the loop
    vec acc[WEIGH_HEADS * 2];  // heads * vecs never exceeds it: WEIGH_VECS gives 4 only below 3 heads
#pragma GCC unroll 8
    for (int g = 0; g < heads; g++)
#pragma GCC unroll 4
        for (int i = 0; i < vecs; i++) acc[g * vecs + i] = vload(o + (size_t)g * D + d0 + i * WIDTH);
    for (int j = 0; j < count; j++) {
        prefetch_next(&next);
        vec x[4];
#pragma GCC unroll 4
        for (int i = 0; i < vecs; i++) x[i] = load_values(vb, is_half, (size_t)j * D + d0 + i * WIDTH);
#pragma GCC unroll 8
        for (int g = 0; g < heads; g++) {
            const vec wg = vset1(w[g * stride + j]);
#pragma GCC unroll 4
            for (int i = 0; i < vecs; i++) acc[g * vecs + i] = vfma(wg, x[i], acc[g * vecs + i]);
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < heads; g++)
#pragma GCC unroll 4
        for (int i = 0; i < vecs; i++) vstore(o + (size_t)g * D + d0 + i * WIDTH, acc[g * vecs + i]);
    *ahead = next;
}

#define WEIGH_VECS_CASE(v) \
    case v: \
        if (v <= WEIGH_VECS(heads)) {  /* constant: the cases a head count never takes are not built */ \
            if (is_half) weigh_heads(w, stride, heads, vb, 1, D, d0, v, count, o, ahead); \
            else weigh_heads(w, stride, heads, vb, 0, D, d0, v, count, o, ahead); \
        } \
        break;

// One pass of weigh_heads from d0 on, with constant arguments (so that each call inlines into a loop of
// its own): as many vectors as WEIGH_VECS gives `heads`, fewer where D ends first. Returns the dimensions
// it weighed.
static inline __attribute__((always_inline)) int weigh_pass(const float *w, size_t stride, int heads,
                                                            const void *vb, int is_half, int D, int d0,
                                                            int count, float *o, ahead_t *ahead) {
    int vecs = WEIGH_VECS(heads);
    while (vecs * WIDTH > D - d0) vecs /= 2;  // D is a multiple of WIDTH
    switch (vecs) {
        WEIGH_VECS_CASE(4) WEIGH_VECS_CASE(2) WEIGH_VECS_CASE(1)
    }
    return vecs * WIDTH;
}

#define WEIGH_CASE(h) \
    case h: d0 += weigh_pass(w, stride, h, vb, is_half, D, d0, count, og, ahead); break;
#endif

// o[g][d] += sum_j p[g * stride + j] v[j][d] for `count` cached values from vb (float32, or float16
// widened exactly), one fused multiply-add per value in order, asking for `ahead`'s lines among them.
static void weigh_block(const float *p, size_t stride, const void *vb, int is_half, int D, int count, int G,
                        float *o, ahead_t *ahead) {
#ifdef ATTENTION_SIMD
    for (int g = 0, heads; g < G; g += heads) {
        const float *w = p + g * stride;
        float *og = o + (size_t)g * D;
        heads = EVEN_PASSES ? heads_a_pass(G - g, WEIGH_HEADS) : G - g < WEIGH_HEADS ? G - g : WEIGH_HEADS;
        for (int d0 = 0; d0 < D;)
            switch (heads) {
                WEIGH_CASE(1) WEIGH_CASE(2) WEIGH_CASE(3) WEIGH_CASE(4) WEIGH_CASE(5) WEIGH_CASE(6)
#if WEIGH_HEADS > 6
                WEIGH_CASE(7) WEIGH_CASE(8)
#endif
            }
    }
#else
    (void)ahead;
    for (int g = 0; g < G; g++) {
        const float *w = p + g * stride;
        float *og = o + (size_t)g * D;
        for (int j = 0; j < count; j++)
            for (int d = 0; d < D; d++) {
                og[d] = fmaf(w[j], entry(vb, is_half, (size_t)j * D + d), og[d]);
            }
    }
#endif
}

// The softmax of one query head over the chunks of keys folded so far: the largest score, and the sum of
// exp(score - top) in LANES partial sums, key j's in lane j % LANES (where a chunk starts changes no lane's chain).
typedef struct {
    float top, sum[LANES];
} running_t;

// p[j] <- exp(p[j] - s->top) for keys a .. b - 1 (p indexed by key), each added to its lane of s->sum.
static void exponentials(float *p, int a, int b, running_t *s) {
    const float top = s->top;
    int j = a;
    for (; j < b && j % LANES; j++) s->sum[j % LANES] += (p[j] = exp_nonpositive(p[j] - top));
#ifdef ATTENTION_SIMD
    vec sums[LANES / WIDTH];
    for (int v = 0; v < LANES / WIDTH; v++) sums[v] = vload(s->sum + v * WIDTH);
    for (; j + LANES <= b; j += LANES)
        for (int v = 0; v < LANES / WIDTH; v++) {
            const vec e = vexp_nonpositive(vsub(vload(p + j + v * WIDTH), vset1(top)));
            vstore(p + j + v * WIDTH, e);
            sums[v] = vadd(sums[v], e);
        }
    for (int v = 0; v < LANES / WIDTH; v++) vstore(s->sum + v * WIDTH, sums[v]);
#else
    for (; j + LANES <= b; j += LANES)
        for (int l = 0; l < LANES; l++) s->sum[l] += (p[j + l] = exp_nonpositive(p[j + l] - top));
#endif
    for (; j < b; j++) s->sum[j % LANES] += (p[j] = exp_nonpositive(p[j] - top));
}

// The largest of p[a .. b - 1] (b > a; exact in any order).
static float largest(const float *p, int a, int b) {
    int j = a;
    float top = p[a];
#ifdef ATTENTION_SIMD
    if (b - a >= WIDTH) {
        vec tops = vload(p + a);
        for (j = a + WIDTH; j + WIDTH <= b; j += WIDTH) tops = vmax(tops, vload(p + j));
        float lanes[WIDTH];
        vstore(lanes, tops);
        for (int l = 0; l < WIDTH; l++) top = lanes[l] > top ? lanes[l] : top;
    }
#endif
    for (; j < b; j++) top = p[j] > top ? p[j] : top;
    return top;
}

// Folds the scores of keys a .. b - 1 of one query head (p indexed by key) into its softmax s, turning them into
// their exponentials (soft-capped first where cap > 0): a larger score than any before rescales what came before (the
// sum, and the values weighed so far, o[D]) by exp(old top - new top). Before the first chunk s->top is -inf, and the
// factor exp(-87) meets zeros.
static void fold_chunk(float *p, int a, int b, float cap, running_t *s, float *o, int D) {
    if (cap > 0.f) capped(p, a, b, cap);
    const float top = largest(p, a, b);
    if (top > s->top) {
        const float factor = exp_nonpositive(s->top - top);
        for (int l = 0; l < LANES; l++) s->sum[l] *= factor;
        for (int d = 0; d < D; d++) o[d] *= factor;
        s->top = top;
    }
    exponentials(p, a, b, s);
}

// The softmax's exponentials alone, for tests: p[j] <- exp(p[j] - max p) (soft-capped first where cap > 0), returns
// their sum.
float attention_softmax_unnormalised(float *p, int n, float cap) {
    running_t s = {-INFINITY, {0}};
    fold_chunk(p, 0, n, cap, &s, NULL, 0);
    float total = 0.f;
    for (int l = 0; l < LANES; l++) total += s.sum[l];
    return total;
}

int attention_dim_ok(int D) { return D % LANES == 0 && D <= MAX_DIM; }

int attention_group_ok(int G) { return G >= 1 && G <= MAX_GROUP; }

int attention_half_ok(void) { return HAVE_HALF; }

// Token t's rotated k and its v into the cache at row `row` (its slot's block, kv head h and position): the value
// as the row, the key as lane row % KEYS of its tile.
static void write_kv(const float *row, const float *cos, const float *sin, int H, int Hkv, int h, int D,
                     const float *k_norm, float eps, void *kcache, void *vcache, int is_half, size_t at) {
    float k[MAX_DIM], normed[MAX_DIM];
    const float *v = row + (H + Hkv + h) * D;
    norm_head(row + (H + h) * D, k_norm, eps, D, normed);
    rope(normed, cos, sin, k, D);
    const size_t key = (at - at % KEYS) * D + at % KEYS;
    for (int i = 0; i < D; i++) {
        if (is_half) {
            ((half *)kcache)[key + (size_t)i * KEYS] = (half)k[i];
            ((half *)vcache)[at * D + i] = (half)v[i];
        } else {
            ((float *)kcache)[key + (size_t)i * KEYS] = k[i];
            ((float *)vcache)[at * D + i] = v[i];
        }
    }
}

// Where the rows of one slot and KV head lie: key j is row ((blocks[j / B] * Hkv + h) * B + j % B) of the cache.
typedef struct {
    const int32_t *blocks;  // the slot's table row
    int h, Hkv, B;
} rows_t;

static inline size_t row_of(const rows_t *r, int j) {
    return ((size_t)r->blocks[j / r->B] * r->Hkv + r->h) * r->B + j % r->B;
}

// The calls of prefetch_next that weighing a block of values makes for `tokens` tokens of G query heads.
static inline int weigh_steps(int tokens, int G, int D) {
#ifdef ATTENTION_SIMD
    return (tokens * G + WEIGH_HEADS - 1) / WEIGH_HEADS * D / (2 * WIDTH) * VALUES;  // 2 vectors a pass, mostly
#else
    (void)tokens, (void)G, (void)D;
    return 1;  // the scalar build asks for a block's lines at once
#endif
}

// Rows j .. j + count - 1 of the cache (not past row n, nor the end of j's block: a block's rows are contiguous,
// the next block's elsewhere) as the lines to ask for ahead of their use: the hardware prefetcher alone leaves a
// long context's stream at a third of the memory's bandwidth, as the loads wait behind the arithmetic on the rows
// before them. Where SPREAD_AHEAD, they are asked for evenly over the `steps` calls of prefetch_next that the
// arithmetic on the block in use makes; else here, all at once.
static inline ahead_t rows_ahead(const void *cache, size_t bytes, const rows_t *r, int j, int count, int n, int D,
                                 int steps) {
    const int end = j + count < n ? j + count : n, stop = (j / r->B + 1) * r->B < end ? (j / r->B + 1) * r->B : end;
    if (j >= stop) return (ahead_t){NULL, NULL, 1, 1};
    const char *at = (const char *)cache + row_of(r, j) * D * bytes;
    const size_t length = (size_t)(stop - j) * D * bytes;
    if (!SPREAD_AHEAD) {
        for (const char *line = at; line < at + length; line += 64) __builtin_prefetch(line);
        return (ahead_t){NULL, NULL, 1, 1};
    }
    const int lines = (int)((length + 63) / 64), every = steps > lines ? steps / lines : 1;
    return (ahead_t){at, at + length, every, every};
}

// o[i] += the values of keys j0 .. end - 1 (a block) weighed by token i's exponentials (its G rows of p, span apart,
// from key base), for the tokens from `from` on: those that see the whole block in one call, their rows being
// consecutive (more heads a pass), and any that see part of it (the last keys of a run, the first of a window) alone.
static void weigh_tokens(const float *p, size_t span, int base, int j0, int end, int from, int tokens, const int *los,
                         const int *ns, const void *vcache, int is_half, size_t bytes, const rows_t *r, int G, int D,
                         float *o, ahead_t *ahead) {
    int whole = from;  // tokens whole .. past - 1 see keys j0 .. end - 1 (ns, los nondecreasing)
    while (whole < tokens && ns[whole] < end) whole++;
    int past = whole;
    while (past < tokens && los[past] <= j0) past++;
    if (past > whole)
        weigh_block(p + (size_t)whole * G * span + (j0 - base), span, (const char *)vcache + row_of(r, j0) * D * bytes,
                    is_half, D, end - j0, (past - whole) * G, o + (size_t)whole * G * D, ahead);
    for (int i = from; i < tokens; i++) {
        const int a = j0 > los[i] ? j0 : los[i], b = end < ns[i] ? end : ns[i];
        if ((i >= whole && i < past) || a >= b) continue;
        weigh_block(p + (size_t)i * G * span + (a - base), span, (const char *)vcache + row_of(r, a) * D * bytes,
                    is_half, D, b - a, G, o + (size_t)i * G * D, ahead);
    }
}

// Scores of keys j .. c1 - 1 (tiles from a multiple of KEYS, within the chunk from c0) for every token that sees
// each tile (q [D][tokens * G]), into p [tokens * G][CHUNK] at the key's place from c0.
static void score_chunk(const float *q, int tokens, int G, int D, const int *ns, float scale, const void *kcache,
                        int is_half, const rows_t *r, int j, int c0, int c1, int n, float *p) {
    const size_t bytes = is_half ? sizeof(half) : sizeof(float);
    for (int j0 = j, from = 0; j0 < c1; j0 += KEYS) {
        const int count = c1 - j0 < KEYS ? c1 - j0 : KEYS;
        while (ns[from] <= j0) from++;
        const int key_steps = ((tokens - from) * G + HEADS - 1) / HEADS * D;  // of score_block's loop
        ahead_t keys_ahead = rows_ahead(kcache, bytes, r, j0 + KEYS_AHEAD, KEYS, n, D, key_steps);
        const char *kt = (const char *)kcache + row_of(r, j0) * D * bytes;  // the tile of keys j0 ..
        score_heads(q + (size_t)from * G, (size_t)tokens * G, (tokens - from) * G, kt, is_half, D, count, scale,
                    p + (size_t)from * G * CHUNK + (j0 - c0), CHUNK, &keys_ahead);
    }
}

// Attention of `tokens` consecutive tokens of one slot, each with G query heads (rotated, q [D][tokens][G]),
// over the slot's cached keys and values (rows r): token i sees keys los[i] .. ns[i] - 1 (both nondecreasing).
// Keys are taken a chunk at a time, chunks starting at multiples of CHUNK: its tiles of keys are scored for
// every token that sees them, each head's scores folded into its running softmax, and its values weighed, so
// the scores stay in cache and every key and value is read from memory once for all the tokens. Each token's
// heads are computed exactly as if it were alone: a key's score is a chain over its own lane, its chunks are the
// same, and its values are weighed in key order. Tiles (KEYS) and blocks of values (VALUES) start at multiples of
// their size, so none crosses a KV block (B is a multiple of VALUES) or a chunk. Scores of keys a token does not
// see are computed and left unread. p: scratch for a chunk's scores [tokens * G][CHUNK], o for the outputs
// [tokens * G][D], soft for the softmaxes; out: token i's G heads at out + i * out_stride.
static void attend(const float *q, int tokens, int G, int D, const int *los, const int *ns, float scale, float cap,
                   const float *sinks, const void *kcache, const void *vcache, int is_half, const rows_t *r, float *p,
                   float *o, running_t *soft, float *out, size_t out_stride) {
    const int first = los[0] / VALUES * VALUES, n = ns[tokens - 1], heads = tokens * G;
    const size_t bytes = is_half ? sizeof(half) : sizeof(float);
    memset(o, 0, (size_t)heads * D * sizeof(float));
    for (int h = 0; h < heads; h++) soft[h] = (running_t){-INFINITY, {0}};
    for (int c0 = first / CHUNK * CHUNK; c0 < n; c0 += CHUNK) {
        const int c1 = n - c0 < CHUNK ? n : c0 + CHUNK, j = c0 > first ? c0 : first;
        score_chunk(q, tokens, G, D, ns, scale, kcache, is_half, r, j, c0, c1, n, p);
        for (int h = 0; h < heads; h++) {
            const int i = h / G, a = los[i] > j ? los[i] : j, b = ns[i] < c1 ? ns[i] : c1;
            if (a < b) fold_chunk(p + (size_t)h * CHUNK, a - c0, b - c0, cap, &soft[h], o + (size_t)h * D, D);
        }
        for (int j0 = j, from = 0; j0 < c1; j0 += VALUES) {
            const int end = c1 - j0 < VALUES ? c1 : j0 + VALUES;
            while (ns[from] <= j0) from++;
            ahead_t values_ahead = rows_ahead(vcache, bytes, r, j0 + VALUES_AHEAD, VALUES, n, D,
                                              weigh_steps(tokens - from, G, D));
            weigh_tokens(p, CHUNK, c0, j0, end, from, tokens, los, ns, vcache, is_half, bytes, r, G, D, o,
                         &values_ahead);
        }
    }
    for (int h = 0; h < heads; h++) {
        float total = 0.f;
        for (int l = 0; l < LANES; l++) total += soft[h].sum[l];
        if (sinks) total += expf(sinks[h % G] - soft[h].top);  // libm's: every build the same bits
        const float inv = 1.f / total;
        float *dst = out + (h / G) * out_stride + (size_t)(h % G) * D;
        for (int d = 0; d < D; d++) dst[d] = o[(size_t)h * D + d] * inv;
    }
}

// Runs of the batch that attend together: up to MAX_TOKENS consecutive tokens of one slot at consecutive
// positions (a sequence's verified drafts). Returns the number of runs; with r >= 0, stops at run r and
// sets *start and *end to its tokens.
static int find_runs(int N, const int64_t *slots, const int64_t *positions, int r, int *start, int *end) {
    int runs = 0, begin = 0;
    for (int t = 1; t <= N; t++)
        if (t == N || slots[t] != slots[t - 1] || positions[t] != positions[t - 1] + 1 || t - begin == MAX_TOKENS) {
            if (runs++ == r) {
                *start = begin, *end = t;
                return runs;
            }
            begin = t;
        }
    return runs;
}

// The entry points' error codes (kernels/__init__.py turns them into messages)
#define ATTENTION_OK 0
#define ATTENTION_BAD_SHAPE -1   // a head size, group or window the kernel does not take
#define ATTENTION_NO_MEMORY -2   // scratch memory could not be allocated
#define ATTENTION_BAD_TOKEN -3   // a slot or position outside the cache

static int attention(const float *qkv, int N, int H, int Hkv, int D, const int64_t *slots, const int64_t *positions,
                     const float *cos, const float *sin, const float *q_norm, const float *k_norm, float eps,
                     float scale, int window, float cap, const float *sinks, void *kcache, void *vcache, int is_half,
                     const int32_t *tables, int S, int MB, int B, int num_blocks, float *out, int threads) {
    if (N < 0 || Hkv < 1 || H % Hkv || !attention_group_ok(H / Hkv) || !attention_dim_ok(D) || window < 0 || S < 1
        || !(cap >= 0.f)
        || MB < 1 || B < VALUES || B % VALUES || num_blocks < 1)
        return ATTENTION_BAD_SHAPE;
    for (int t = 0; t < N; t++) {
        if (slots[t] < 0 || slots[t] >= S || positions[t] < 0 || positions[t] >= (int64_t)MB * B)
            return ATTENTION_BAD_TOKEN;
        for (int b = 0; b <= positions[t] / B; b++)
            if (tables[slots[t] * MB + b] < 0 || tables[slots[t] * MB + b] >= num_blocks) return ATTENTION_BAD_TOKEN;
    }
    const int G = H / Hkv, width = (H + 2 * Hkv) * D;
    // every token's k and v into the cache first: a verified token attends to the drafts before it
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int task = 0; task < N * Hkv; task++) {
        const int t = task / Hkv, h = task % Hkv;
        const rows_t r = {tables + slots[t] * MB, h, Hkv, B};
        write_kv(qkv + (size_t)t * width, cos + (size_t)t * D, sin + (size_t)t * D, H, Hkv, h, D, k_norm, eps, kcache,
                 vcache, is_half, row_of(&r, (int)positions[t]));
    }
    const int runs = find_runs(N, slots, positions, -1, NULL, NULL);
    int failed = 0;
    // Tasks one at a time: their costs differ with their contexts (a verify beside a long prompt's chunk).
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : failed)
    for (int task = 0; task < runs * Hkv; task++) {
        const int h = task % Hkv;
        int t0 = 0, t_end = 0;  // set by find_runs: task / Hkv < runs
        find_runs(N, slots, positions, task / Hkv, &t0, &t_end);
        const int tokens = t_end - t0;
        int ns[MAX_TOKENS], los[MAX_TOKENS];
        for (int i = 0; i < tokens; i++) {
            ns[i] = (int)positions[t0 + i] + 1;
            los[i] = window && ns[i] > window ? ns[i] - window : 0;
        }
        const rows_t r = {tables + slots[t0] * MB, h, Hkv, B};
        const size_t heads = (size_t)tokens * G;
        float *q = scratch(heads * (2 * D + CHUNK) + heads * sizeof(running_t) / sizeof(float));
        if (!q) {
            failed = 1;
            continue;
        }
        for (int i = 0; i < tokens; i++) {
            const int t = t0 + i;
            for (int g = 0; g < G; g++) {
                float normed[MAX_DIM], rotated[MAX_DIM];
                norm_head(qkv + (size_t)t * width + (h * G + g) * D, q_norm, eps, D, normed);
                rope(normed, cos + (size_t)t * D, sin + (size_t)t * D, rotated, D);
                for (int d = 0; d < D; d++) q[d * heads + (size_t)i * G + g] = rotated[d];
            }
        }
        float *o = q + heads * D, *p = o + heads * D;  // the outputs, a chunk's scores, the softmaxes
        attend(q, tokens, G, D, los, ns, scale, cap, sinks ? sinks + h * G : NULL, kcache, vcache, is_half, &r, p, o,
               (running_t *)(p + heads * CHUNK), out + (size_t)t0 * H * D + (size_t)h * G * D, (size_t)H * D);
    }
    return failed ? ATTENTION_NO_MEMORY : ATTENTION_OK;
}

int rowwise_attention(const float *qkv, int N, int H, int Hkv, int D, const int64_t *slots, const int64_t *positions,
                      const float *cos, const float *sin, const float *q_norm, const float *k_norm, float eps,
                      float scale, int window, float cap, const float *sinks, float *kcache, float *vcache,
                      const int32_t *tables, int S, int MB, int B, int num_blocks, float *out, int threads) {
    return attention(qkv, N, H, Hkv, D, slots, positions, cos, sin, q_norm, k_norm, eps, scale, window, cap, sinks,
                     kcache, vcache, 0, tables, S, MB, B, num_blocks, out, threads);
}

// The same over a float16 cache (half the bytes to stream; entries rounded to nearest on write).
int rowwise_attention_f16(const float *qkv, int N, int H, int Hkv, int D, const int64_t *slots,
                          const int64_t *positions, const float *cos, const float *sin, const float *q_norm,
                          const float *k_norm, float eps, float scale, int window, float cap, const float *sinks,
                          half *kcache, half *vcache, const int32_t *tables, int S, int MB, int B, int num_blocks,
                          float *out, int threads) {
    if (!HAVE_HALF) return ATTENTION_BAD_SHAPE;
    return attention(qkv, N, H, Hkv, D, slots, positions, cos, sin, q_norm, k_norm, eps, scale, window, cap, sinks,
                     kcache, vcache, 1, tables, S, MB, B, num_blocks, out, threads);
}
