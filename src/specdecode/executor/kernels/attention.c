// Decode and verify attention in one call per layer: rotary embedding of q and k, the KV-cache write, and
// for every new token attention over exactly the keys it may see (its slot's positions 0..its own).
// Each (token, query head) is computed by the same operations in the same order whatever else is in the
// call, so a token's output is identical whether it is decoded alone or verified beside drafts; and every
// vector lane holds its own key (scores) or its own dimension (values), each a chain of fused
// multiply-adds in a fixed order, so every build (scalar, AVX2, AVX-512) gives the same bits.
//
//   qkv [N, (H + 2 Hkv) D]  q | k | v of each new token (projection output, bias added)
//   cos, sin [N, D]         rotary factors of each token's position (NeoX: halves rotated)
//   kcache, vcache [S, Hkv, L, D] of this layer, float32 or float16; slots, positions [N]
//   out [N, H D]            query head h reads kv head h / (H / Hkv)
//
// Over a long context this streams the cache, so it is read once per kv head: a block of keys is
// widened to float32 and transposed once (lanes over keys: no dot product ends in a horizontal sum) and
// every query head of the group reads it; a block of values likewise. exp is a polynomial that
// vectorises.
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
#define HEADS 4    // query heads scored together (their accumulators stay in registers)
#define VALUES 32  // keys whose values are weighed together (a block that stays in L1)
#define MAX_DIM 256
#define MAX_GROUP 64  // query heads per KV head

#ifdef __FLT16_MAX__
typedef _Float16 half;
#define HAVE_HALF 1
#else
typedef uint16_t half;  // storage only: the float16 entry point reports itself unavailable
#define HAVE_HALF 0
#endif

// Scratch memory kept per thread between calls (memory freed to glibc can go back to the OS and fault in
// again on the next of the ~30 calls per step).
static __thread float *scratch_buf;
static __thread size_t scratch_floats;

static float *scratch(size_t floats) {
    if (floats > scratch_floats) {
        free(scratch_buf);
        scratch_buf = malloc(floats * sizeof(float));
        scratch_floats = floats;
    }
    return scratch_buf;
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
// exp(r) by its Taylor polynomial to degree 7, times 2^n built in the exponent bits.
static inline float exp_nonpositive(float x) {
    const float magic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer kept in the low bits
    x = x < -87.f ? -87.f : x;       // below, 2^n would not be a normal float; exp(-87) ~ 1.6e-38 anyway
    float t = x * 1.44269504f + magic, n = t - magic;
    float r = x - n * 0.693145752f;
    r = r - n * 1.42860677e-6f;  // ln 2 in two parts: n * the first is exact
    float p = 1.f / 5040;
    p = p * r + 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    int32_t bits, shift;
    memcpy(&bits, &t, sizeof bits);
    shift = (bits - 0x4B400000 + 127) << 23;  // n + 127 in the exponent field
    float scale;
    memcpy(&scale, &shift, sizeof scale);
    return p * scale;
}

// `count` rows of D cache entries from row `row` on, as float32: the rows themselves, or float16 widened
// into buf (exact).
static const float *cache_rows(const void *cache, int is_half, size_t row, int count, int D, float *buf) {
    if (!is_half) return (const float *)cache + row * D;
    const half *src = (const half *)cache + row * D;
    int i = 0;
#ifdef ATTENTION_SIMD
    for (; i + 8 <= count * D; i += 8)
        _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < count * D; i++) buf[i] = (float)src[i];
    return buf;
}

#ifdef ATTENTION_SIMD
// 8 rows of 8 floats -> 8 columns (stride `to`).
static inline void transpose8x8(const __m256 r[8], float *dst, int to) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + (size_t)i * to, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(dst + (size_t)(i + 4) * to, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

// A full block of KEYS keys from the cache, widened and transposed in registers.
static void transpose_full_block(const void *cache, int is_half, size_t row, int D, float *kt) {
    __m256 r[8];
    for (int l = 0; l < KEYS; l += 8)
        for (int d = 0; d < D; d += 8) {
            for (int i = 0; i < 8; i++) {
                const size_t at = (row + l + i) * D + d;
                r[i] = is_half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const half *)cache + at)))
                               : _mm256_loadu_ps((const float *)cache + at);
            }
            transpose8x8(r, kt + d * KEYS + l, KEYS);
        }
}
#endif

// kt[d * KEYS + l] = key (row + l)'s d-th value as float32, for count <= KEYS keys, the rest zero (data
// movement and exact widening: every path gives the same bits). rows: scratch for count * D floats.
static void keys_block(const void *cache, int is_half, size_t row, int count, int D, float *rows, float *kt) {
#ifdef ATTENTION_SIMD
    if (count == KEYS) {
        transpose_full_block(cache, is_half, row, D, kt);
        return;
    }
#endif
    const float *keys = cache_rows(cache, is_half, row, count, D, rows);
    for (int d = 0; d < D; d++)
        for (int l = 0; l < KEYS; l++) kt[d * KEYS + l] = l < count ? keys[(size_t)l * D + d] : 0.f;
}

// s[g * stride + l] = scale * sum_d q_g[d] kt[d][l] (one fused multiply-add per d, in order) for `heads`
// <= HEADS query heads (rows of q, D apart) and the first `count` of KEYS keys. Inlined with a constant
// `heads`, so the accumulators stay in registers.
static inline __attribute__((always_inline)) void score_block(const float *q, int heads, const float *kt, int D,
                                                              int count, float scale, float *s, size_t stride) {
#ifdef ATTENTION_SIMD
    __m256 acc[HEADS][2];
    for (int g = 0; g < heads; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        const __m256 k0 = _mm256_loadu_ps(kt + d * KEYS), k1 = _mm256_loadu_ps(kt + d * KEYS + 8);
        for (int g = 0; g < heads; g++) {
            const __m256 qd = _mm256_broadcast_ss(q + (size_t)g * D + d);
            acc[g][0] = _mm256_fmadd_ps(qd, k0, acc[g][0]);
            acc[g][1] = _mm256_fmadd_ps(qd, k1, acc[g][1]);
        }
    }
    float row[KEYS];
    for (int g = 0; g < heads; g++) {
        _mm256_storeu_ps(row, _mm256_mul_ps(acc[g][0], _mm256_set1_ps(scale)));
        _mm256_storeu_ps(row + 8, _mm256_mul_ps(acc[g][1], _mm256_set1_ps(scale)));
        memcpy(s + g * stride, row, count * sizeof(float));
    }
#else
    for (int g = 0; g < heads; g++)
        for (int l = 0; l < count; l++) {
            float acc = 0.f;
            for (int d = 0; d < D; d++) acc = fmaf(q[(size_t)g * D + d], kt[d * KEYS + l], acc);
            s[g * stride + l] = acc * scale;
        }
#endif
}

// score_block for the G heads of a group, HEADS at a time.
static void score_heads(const float *q, int G, const float *kt, int D, int count, float scale, float *s, size_t stride) {
    for (int g = 0; g < G; g += HEADS) {
        const float *qg = q + (size_t)g * D;
        float *sg = s + g * stride;
        switch (G - g < HEADS ? G - g : HEADS) {
            case 4: score_block(qg, 4, kt, D, count, scale, sg, stride); break;
            case 3: score_block(qg, 3, kt, D, count, scale, sg, stride); break;
            case 2: score_block(qg, 2, kt, D, count, scale, sg, stride); break;
            default: score_block(qg, 1, kt, D, count, scale, sg, stride);
        }
    }
}

// o[g][d] += sum_j p[g * stride + j] vb[j][d] for `count` keys, one fused multiply-add per key in order.
static void weigh_block(const float *p, size_t stride, const float *vb, int D, int count, int G, float *o) {
    for (int g = 0; g < G; g++) {
        const float *w = p + g * stride;
        float *og = o + (size_t)g * D;
#ifdef ATTENTION_SIMD
        for (int d0 = 0; d0 < D; d0 += 32) {  // D is a multiple of LANES (16); 32 keeps 4 chains going
            const int wide = D - d0 >= 32;
            __m256 a0 = _mm256_loadu_ps(og + d0), a1 = _mm256_loadu_ps(og + d0 + 8), a2, a3;
            a2 = wide ? _mm256_loadu_ps(og + d0 + 16) : a0;
            a3 = wide ? _mm256_loadu_ps(og + d0 + 24) : a1;
            for (int j = 0; j < count; j++) {
                const __m256 wj = _mm256_broadcast_ss(w + j);
                const float *v = vb + (size_t)j * D + d0;
                a0 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v), a0);
                a1 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + 8), a1);
                if (wide) {
                    a2 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + 16), a2);
                    a3 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + 24), a3);
                }
            }
            _mm256_storeu_ps(og + d0, a0);
            _mm256_storeu_ps(og + d0 + 8, a1);
            if (wide) {
                _mm256_storeu_ps(og + d0 + 16, a2);
                _mm256_storeu_ps(og + d0 + 24, a3);
            }
        }
#else
        for (int j = 0; j < count; j++)
            for (int d = 0; d < D; d++) og[d] = fmaf(w[j], vb[(size_t)j * D + d], og[d]);
#endif
    }
}

// Scores -> exp(score - max) in place, for one query head's n scores; returns their sum (the output is
// divided by it once, instead of every weight).
static float softmax_unnormalised(float *p, int n) {
    float top_lane[LANES], sum_lane[LANES] = {0};
    for (int l = 0; l < LANES; l++) top_lane[l] = p[0];
    int j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) top_lane[l] = p[j + l] > top_lane[l] ? p[j + l] : top_lane[l];
    for (; j < n; j++) top_lane[0] = p[j] > top_lane[0] ? p[j] : top_lane[0];
    float top = top_lane[0];
    for (int l = 1; l < LANES; l++) top = top_lane[l] > top ? top_lane[l] : top;
    for (j = 0; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) sum_lane[l] += (p[j + l] = exp_nonpositive(p[j + l] - top));
    for (; j < n; j++) sum_lane[0] += (p[j] = exp_nonpositive(p[j] - top));
    float total = 0.f;
    for (int l = 0; l < LANES; l++) total += sum_lane[l];
    return total;
}

int attention_dim_ok(int D) { return D % LANES == 0 && D <= MAX_DIM; }

int attention_group_ok(int G) { return G >= 1 && G <= MAX_GROUP; }

int attention_half_ok(void) { return HAVE_HALF; }

// Token t's rotated k and its v into the cache at its slot and position, for kv head h.
static void write_kv(const float *row, const float *cos, const float *sin, int H, int Hkv, int h, int D,
                     void *kcache, void *vcache, int is_half, size_t at) {
    float k[MAX_DIM];
    const float *v = row + (H + Hkv + h) * D;
    rope(row + (H + h) * D, cos, sin, k, D);
    if (!is_half) {
        memcpy((float *)kcache + at, k, D * sizeof(float));
        memcpy((float *)vcache + at, v, D * sizeof(float));
        return;
    }
    for (int i = 0; i < D; i++) {
        ((half *)kcache)[at + i] = (half)k[i];
        ((half *)vcache)[at + i] = (half)v[i];
    }
}

// out[G][D] = attention of one token's G query heads (rotated, in q) over n cached keys and values from
// row `first` on.
static void attend(const float *q, int G, int D, int n, const void *kcache, const void *vcache,
                   int is_half, size_t first, float *work, float *out) {
    const float scale = 1.f / sqrtf((float)D);
    float *kt = work, *rows = kt + (size_t)D * KEYS, *p = rows + (size_t)VALUES * D;
    for (int j0 = 0; j0 < n; j0 += KEYS) {
        const int count = n - j0 < KEYS ? n - j0 : KEYS;
        keys_block(kcache, is_half, first + j0, count, D, rows, kt);
        score_heads(q, G, kt, D, count, scale, p + j0, n);
    }
    float total[MAX_GROUP];
    for (int g = 0; g < G; g++) total[g] = softmax_unnormalised(p + (size_t)g * n, n);
    memset(out, 0, (size_t)G * D * sizeof(float));
    for (int j0 = 0; j0 < n; j0 += VALUES) {
        const int count = n - j0 < VALUES ? n - j0 : VALUES;
        weigh_block(p + j0, n, cache_rows(vcache, is_half, first + j0, count, D, rows), D, count, G, out);
    }
    for (int g = 0; g < G; g++) {
        const float inv = 1.f / total[g];
        for (int d = 0; d < D; d++) out[(size_t)g * D + d] *= inv;
    }
}

static void attention(const float *qkv, int N, int H, int Hkv, int D, const int64_t *slots,
                      const int64_t *positions, const float *cos, const float *sin, void *kcache, void *vcache,
                      int is_half, int L, float *out, int threads) {
    const int G = H / Hkv, width = (H + 2 * Hkv) * D;
    // every token's k and v into the cache first: a verified token attends to the drafts before it
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int task = 0; task < N * Hkv; task++) {
        const int t = task / Hkv, h = task % Hkv;
        write_kv(qkv + (size_t)t * width, cos + (size_t)t * D, sin + (size_t)t * D, H, Hkv, h, D, kcache, vcache,
                 is_half, (((size_t)slots[t] * Hkv + h) * L + positions[t]) * D);
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int task = 0; task < N * Hkv; task++) {
        const int t = task / Hkv, h = task % Hkv, n = (int)positions[t] + 1;
        const size_t first = ((size_t)slots[t] * Hkv + h) * L;
        float *q = scratch((size_t)G * D + (size_t)D * KEYS + (size_t)VALUES * D + (size_t)G * n);
        for (int g = 0; g < G; g++)
            rope(qkv + (size_t)t * width + (h * G + g) * D, cos + (size_t)t * D, sin + (size_t)t * D,
                 q + (size_t)g * D, D);
        attend(q, G, D, n, kcache, vcache, is_half, first, q + (size_t)G * D,
               out + (size_t)t * H * D + (size_t)h * G * D);
    }
}

void rowwise_attention(const float *qkv, int N, int H, int Hkv, int D, const int64_t *slots,
                       const int64_t *positions, const float *cos, const float *sin, float *kcache, float *vcache,
                       int L, float *out, int threads) {
    attention(qkv, N, H, Hkv, D, slots, positions, cos, sin, kcache, vcache, 0, L, out, threads);
}

// The same over a float16 cache (half the bytes to stream; entries rounded to nearest on write).
void rowwise_attention_f16(const float *qkv, int N, int H, int Hkv, int D, const int64_t *slots,
                           const int64_t *positions, const float *cos, const float *sin, half *kcache,
                           half *vcache, int L, float *out, int threads) {
    attention(qkv, N, H, Hkv, D, slots, positions, cos, sin, kcache, vcache, 1, L, out, threads);
}
