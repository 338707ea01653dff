// The elementwise steps of a decoder layer, one call each instead of several PyTorch operations: RMSNorm
// (optionally after adding the residual branch into the residual stream), SwiGLU and GeGLU. Each row is computed
// alone, by the same operations in the same order, so a token's result does not depend on its batch.
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(SPECDECODE_SCALAR) && defined(__AVX2__) && !defined(__AVX512F__)
#define SILU_AVX2 1  // AVX-512 builds vectorise the plain loop themselves
#include <immintrin.h>
#endif

#define LANES 16  // independent partial sums: the compiler keeps them in one vector
#define PARALLEL_ROWS 16  // below this many rows one thread is faster than waking the others

static inline float mean_square(const float *x, int dim) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= dim; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[i + l] * x[i + l];
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < dim; i++) s += x[i] * x[i];
    return s / (float)dim;
}

static inline void norm_row(const float *restrict x, const float *restrict w, float *restrict out, int dim,
                            float eps) {
    float scale = 1.0f / sqrtf(mean_square(x, dim) + eps);
    for (int i = 0; i < dim; i++) out[i] = w[i] * (x[i] * scale);
}

// The entry points' error codes (executor/elementwise.py turns them into messages)
#define NORM_OK 0
#define NORM_BAD_SHAPE -1    // rows < 0, dim < 1, or eps not a positive number
#define NORM_NO_BUFFER -2    // a buffer the call reads or writes is missing

static int bad_call(int rows, int dim, float eps, const void *a, const void *b, const void *c) {
    if (rows < 0 || dim < 1 || !(eps >= 0.f)) return NORM_BAD_SHAPE;
    return rows && (!a || !b || !c) ? NORM_NO_BUFFER : NORM_OK;
}

// out[r] = w * x[r] / rms(x[r])
int rms_norm(const float *x, const float *w, float *out, int rows, int dim, float eps, int threads) {
    const int bad = bad_call(rows, dim, eps, x, w, out);
    if (bad) return bad;
#pragma omp parallel for schedule(static) num_threads(rows >= PARALLEL_ROWS ? threads : 1)
    for (int r = 0; r < rows; r++) norm_row(x + (int64_t)r * dim, w, out + (int64_t)r * dim, dim, eps);
    return NORM_OK;
}

// residual[r] += branch[r]; out[r] = w * residual[r] / rms(residual[r])
int add_rms_norm(float *residual, const float *branch, const float *w, float *out, int rows, int dim, float eps,
                 int threads) {
    int bad = bad_call(rows, dim, eps, residual, branch, w);
    if (!bad && rows && !out) bad = NORM_NO_BUFFER;
    if (bad) return bad;
#pragma omp parallel for schedule(static) num_threads(rows >= PARALLEL_ROWS ? threads : 1)
    for (int r = 0; r < rows; r++) {
        float *x = residual + (int64_t)r * dim;
        const float *b = branch + (int64_t)r * dim;
        for (int i = 0; i < dim; i++) x[i] += b[i];
        norm_row(x, w, out + (int64_t)r * dim, dim, eps);
    }
    return NORM_OK;
}

// exp(x) without a library call, so that the loop below vectorises: x = n ln2 + f with |f| <= ln2 / 2,
// exp(f) by its degree-6 Taylor polynomial, 2^n through the exponent bits. n is rounded by adding
// 1.5 * 2^23, which leaves it in the sum's low mantissa bits (floorf would not vectorise here).
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.44269504088896341f + 12582912.0f;
    float n = t - 12582912.0f;
    float f = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.66666667e-1f + f * (4.16666667e-2f
              + f * (8.33333333e-3f + f * 1.38888889e-3f)))));
    int32_t bits;
    memcpy(&bits, &t, sizeof bits);
    bits = (bits - 0x4B400000 + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(SILU_AVX2)
// exp_approx on 8 lanes, the same operations in the same order. Without AVX-512's masks GCC does not turn
// the clamps into vector code and the loop below would stay scalar (4x slower): max(-87, x) and min(88, x)
// keep a NaN x as the comparisons do (MAXPS and MINPS return their second operand when one is NaN).
static inline __m256 exp_approx8(__m256 x) {
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    const __m256 t = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic);
    const __m256 n = _mm256_sub_ps(t, magic);
    const __m256 f = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(1.42860682030941723e-6f)));
    __m256 p = _mm256_set1_ps(1.38888889e-3f);
    static const float coef[6] = {8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f, 1.0f, 1.0f};
    for (int c = 0; c < 6; c++) p = _mm256_add_ps(_mm256_set1_ps(coef[c]), _mm256_mul_ps(f, p));
    const __m256i exponent = _mm256_add_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(-0x4B400000 + 127));
    const __m256i bits = _mm256_slli_epi32(exponent, 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// GeGLU's tanh approximation as a sigmoid: 0.5 x (1 + tanh(y)) = x sigmoid(2y), y = sqrt(2/pi) (x + 0.044715 x^3),
// so both activations are x / (1 + exp(-z)), z = x (SiLU) or 2y (GELU).
#define GELU_2Y 1.5957691216057308f  // 2 sqrt(2 / pi)
#define GELU_CUBIC 0.044715f

static inline float gelu_z(float x) { return GELU_2Y * (x + GELU_CUBIC * x * x * x); }

#if defined(SILU_AVX2)
static inline __m256 gelu_z8(__m256 x) {
    const __m256 cubic = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(GELU_CUBIC), x), x), x);
    return _mm256_mul_ps(_mm256_set1_ps(GELU_2Y), _mm256_add_ps(x, cubic));
}
#endif

static void act_mul_row(const float *restrict g, const float *restrict u, float *restrict o, int n, int gelu) {
    int i = 0;
#if defined(SILU_AVX2)
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp_approx8(_mm256_xor_ps(gelu ? gelu_z8(x) : x, sign));  // -z
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    if (gelu)
        for (; i < n; i++) o[i] = g[i] / (1.0f + exp_approx(-gelu_z(g[i]))) * u[i];
    else
        for (; i < n; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
}

static int act_mul(const float *gate_up, float *out, int rows, int inter, int gelu, int threads) {
    const int bad = bad_call(rows, inter, 0.f, gate_up, out, out);
    if (bad) return bad;
#pragma omp parallel for schedule(static) num_threads(rows >= PARALLEL_ROWS ? threads : 1)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (int64_t)r * 2 * inter;
        act_mul_row(g, g + inter, out + (int64_t)r * inter, inter, gelu);
    }
    return NORM_OK;
}

// gate_up [rows, 2 * inter] (gate | up) -> out [rows, inter] = silu(gate) * up
int silu_mul(const float *gate_up, float *out, int rows, int inter, int threads) {
    return act_mul(gate_up, out, rows, inter, 0, threads);
}

// the same with GELU's tanh approximation: gelu_tanh(gate) * up
int gelu_tanh_mul(const float *gate_up, float *out, int rows, int inter, int threads) {
    return act_mul(gate_up, out, rows, inter, 1, threads);
}
