// Decode and verify attention in one call per layer: rotary embedding of q and k, the KV-cache write, and
// for every new token attention over exactly the keys it may see (its slot's positions 0..its own).
// Each (token, query head) is computed by the same operations in the same order whatever else is in the
// call, so a token's output is identical whether it is decoded alone or verified beside drafts.
//
//   qkv [N, (H + 2 Hkv) D]  q | k | v of each new token (projection output, bias added)
//   cos, sin [N, D]         rotary factors of each token's position (NeoX: halves rotated)
//   kcache, vcache [S, Hkv, L, D] of this layer; slots, positions [N]
//   out [N, H D]            query head h reads kv head h / (H / Hkv)
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16  // independent partial sums: the compiler keeps them in one vector

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

static inline float dot(const float *a, const float *b, int D) {
    float acc[LANES] = {0};
    for (int i = 0; i < D; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

// x * cos + rotate_half(x) * sin, rounded as the separate products and sum are in PyTorch.
static inline void rope(const float *x, const float *c, const float *s, float *y, int D) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i] * c[i], b = -x[i + half] * s[i];
        y[i] = a + b;
    }
    for (int i = half; i < D; i++) {
        float a = x[i] * c[i], b = x[i - half] * s[i];
        y[i] = a + b;
    }
}

int attention_dim_ok(int D) { return D % LANES == 0; }

void rowwise_attention(const float *qkv, int N, int H, int Hkv, int D, const int64_t *slots,
                       const int64_t *positions, const float *cos, const float *sin, float *kcache, float *vcache,
                       int L, float *out, int threads) {
    const int G = H / Hkv, width = (H + 2 * Hkv) * D;
    const float scale = 1.f / sqrtf((float)D);
    // every token's k and v into the cache first: a verified token attends to the drafts before it
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int task = 0; task < N * Hkv; task++) {
        const int t = task / Hkv, h = task % Hkv;
        const size_t at = (((size_t)slots[t] * Hkv + h) * L + positions[t]) * D;
        const float *row = qkv + (size_t)t * width;
        rope(row + (H + h) * D, cos + (size_t)t * D, sin + (size_t)t * D, kcache + at, D);
        memcpy(vcache + at, row + (H + Hkv + h) * D, D * sizeof(float));
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int task = 0; task < N * Hkv; task++) {
        const int t = task / Hkv, h = task % Hkv, n = (int)positions[t] + 1;
        const float *K = kcache + ((size_t)slots[t] * Hkv + h) * L * D;
        const float *V = vcache + ((size_t)slots[t] * Hkv + h) * L * D;
        float *q = scratch((size_t)G * (D + n)), *p = q + (size_t)G * D;
        for (int g = 0; g < G; g++)
            rope(qkv + (size_t)t * width + (h * G + g) * D, cos + (size_t)t * D, sin + (size_t)t * D, q + g * D, D);
        for (int j = 0; j < n; j++)  // each key read once for the G query heads that share it
            for (int g = 0; g < G; g++) p[g * n + j] = dot(q + g * D, K + (size_t)j * D, D) * scale;
        for (int g = 0; g < G; g++) {
            float *pg = p + (size_t)g * n, top = pg[0], total = 0.f;
            for (int j = 1; j < n; j++) top = fmaxf(top, pg[j]);
            for (int j = 0; j < n; j++) total += (pg[j] = expf(pg[j] - top));
            for (int j = 0; j < n; j++) pg[j] /= total;
        }
        float *o = out + (size_t)t * H * D + (size_t)h * G * D;
        memset(o, 0, (size_t)G * D * sizeof(float));
        for (int j = 0; j < n; j++)
            for (int g = 0; g < G; g++) {
                const float w = p[g * n + j], *v = V + (size_t)j * D;
                float *og = o + g * D;
                for (int d = 0; d < D; d++) og[d] += w * v[d];
            }
    }
}
