// A LoRA adapter's update of a linear layer's output, y += B(Ax), in one call where PyTorch takes several small ones
// (models/lora.py). A's rows are every adapter of every part of the layer stacked; each block's B adds to its own
// output rows from its own ranks of Ax. Each row of x is computed alone, by the same operations in the same order,
// so a token's update does not depend on its batch (a GEMM's does: docs/decisions.md#lora-adapters-beside-the-weights).
#include <stdint.h>
#include <string.h>

#if !defined(SPECDECODE_SCALAR) && defined(__F16C__)
#define WIDEN_F16C 1  // the compiler does not vectorise float16's widening itself
#endif
#if !defined(SPECDECODE_SCALAR) && (defined(__F16C__) || defined(__AVX512F__))
#include <immintrin.h>
#endif

#define PARALLEL_WORK 65536  // below this many multiply-adds a call one thread is faster than waking the others
#define MAX_RANK 1024
#define CHUNK 256  // outputs a thread sums at a time
// TILE: rows whose products share each read (and widening) of a matrix row; WIDE: vectors of outputs a row sums at
// once. Their partial sums fill half the registers: 16 of AVX-512's 32, 8 of AVX2's 16.
#if defined(__AVX512F__)
#define TILE 4
#define WIDE 4
#else
#define TILE 2
#define WIDE 2
#endif
#define INLINE static inline __attribute__((always_inline))

// Sixteen partial sums (lanes), whatever the build: one AVX-512 vector, two AVX ones or four of SSE or NEON, the
// same operations lane by lane, so that every build gives the same bits.
#define LANES 16
#if defined(__AVX512F__)
#define VLEN 16
#elif defined(__AVX__)
#define VLEN 8
#else
#define VLEN 4
#endif
#define PARTS (LANES / VLEN)  // vectors of a row's LANES
typedef float vec __attribute__((vector_size(4 * VLEN)));
typedef uint16_t hvec __attribute__((vector_size(2 * VLEN)));
typedef uint32_t wvec __attribute__((vector_size(4 * VLEN)));

INLINE vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void add_to(float *p, vec v) {
    vec sum = load(p) + v;
    memcpy(p, &sum, sizeof sum);
}

// The matrices' element formats: an adapter is kept as stored where that is 16 bits (half the bytes a step reads),
// each element widened exactly to float32 as it is read, so a format computes the bits float32 copies of its values
// would.
#define FORMAT_F32 0
#define FORMAT_F16 1
#define FORMAT_BF16 2

INLINE float widened_f16(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
}

INLINE float widened_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

// One element of the matrix m (of `format`) at `at`, as float32.
INLINE float widened(int format, const void *m, int64_t at) {
    if (format == FORMAT_F16) return widened_f16(((const uint16_t *)m)[at]);
    if (format == FORMAT_BF16) return widened_bf16(((const uint16_t *)m)[at]);
    return ((const float *)m)[at];
}

// VLEN elements of the matrix m from `at`, as float32.
INLINE vec widen_part(int format, const void *m, int64_t at) {
    if (format == FORMAT_F32) return load((const float *)m + at);
    const uint16_t *h = (const uint16_t *)m + at;
    vec v;
    if (format == FORMAT_BF16) {
#if !defined(SPECDECODE_SCALAR) && defined(__AVX512F__)
        const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16);
#elif !defined(SPECDECODE_SCALAR) && defined(__AVX2__)
        const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16);
#else
        hvec bits;
        memcpy(&bits, h, sizeof bits);
        const wvec wide = __builtin_convertvector(bits, wvec) << 16;
#endif
        memcpy(&v, &wide, sizeof v);
    } else {
#if defined(WIDEN_F16C) && defined(__AVX512F__)
        const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
        memcpy(&v, &wide, sizeof v);
#elif defined(WIDEN_F16C)
        const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        memcpy(&v, &wide, sizeof v);
#else
        for (int l = 0; l < VLEN; l++) v[l] = widened_f16(h[l]);
#endif
    }
    return v;
}

// LANES elements of the matrix m from `at`, as float32, in PARTS vectors.
INLINE void widen(int format, const void *m, int64_t at, vec out[PARTS]) {
    for (int p = 0; p < PARTS; p++) out[p] = widen_part(format, m, at + p * VLEN);
}

// u[m * stride] = scale * (row k of A) . (row m of x) for the n rows of a tile, each block of A widened once for all
// of them. A row's partial sums are two sets of lanes (even and odd blocks of LANES), summed lane by lane in order,
// then the elements past the last block: the same operations whatever n.
INLINE void reduce(int format, const void *A, int k, const float *restrict x, int in, int n, float scale,
                   float *restrict u, int stride) {
    vec even[TILE][PARTS] = {0}, odd[TILE][PARTS] = {0}, a[PARTS], b[PARTS];
    const int64_t row = (int64_t)k * in;
    int i = 0;
    for (; i + 2 * LANES <= in; i += 2 * LANES) {
        widen(format, A, row + i, a);
        widen(format, A, row + i + LANES, b);
        for (int m = 0; m < n; m++)
            for (int p = 0; p < PARTS; p++) {
                even[m][p] += a[p] * load(x + (int64_t)m * in + i + p * VLEN);
                odd[m][p] += b[p] * load(x + (int64_t)m * in + i + LANES + p * VLEN);
            }
    }
    if (i + LANES <= in) {
        widen(format, A, row + i, a);
        for (int m = 0; m < n; m++)
            for (int p = 0; p < PARTS; p++) even[m][p] += a[p] * load(x + (int64_t)m * in + i + p * VLEN);
        i += LANES;
    }
    for (int m = 0; m < n; m++) {
        float s = 0.f;
        for (int p = 0; p < PARTS; p++)
            for (int l = 0; l < VLEN; l++) s += even[m][p][l] + odd[m][p][l];
        for (int j = i; j < in; j++) s += widened(format, A, row + j) * x[(int64_t)m * in + j];
        u[m * stride] = s * scale;
    }
}

// y[m][o] += sum over r of Bt[r][o] u[m][r] for the chunk of outputs from o0 and the n rows of a tile: Bt is a
// block's B transposed ([rank, width]), so the sum runs down its rows, WIDE sets of LANES outputs at a time, each
// read widened once for all n rows; every output's terms in the order of r, their sum then added to y.
INLINE void add_block(int format, const void *bt, int width, const float *restrict u, int stride, int rank, int o0,
                      int n, float *restrict y, int out) {
    const int end = width - o0 < CHUNK ? width : o0 + CHUNK;
    int o = o0;
    for (; o + WIDE * LANES <= end; o += WIDE * LANES) {
        vec acc[TILE][WIDE * PARTS] = {0}, b[WIDE * PARTS];
        for (int r = 0; r < rank; r++) {
            for (int v = 0; v < WIDE; v++) widen(format, bt, (int64_t)r * width + o + v * LANES, b + v * PARTS);
            for (int m = 0; m < n; m++)
                for (int q = 0; q < WIDE * PARTS; q++) acc[m][q] += b[q] * u[m * stride + r];
        }
        for (int m = 0; m < n; m++)
            for (int q = 0; q < WIDE * PARTS; q++) add_to(y + (int64_t)m * out + o + q * VLEN, acc[m][q]);
    }
    for (; o < end; o++)  // outputs short of WIDE sets: one at a time, the same terms in the same order
        for (int m = 0; m < n; m++) {
            float s = 0.f;
            for (int r = 0; r < rank; r++) s += widened(format, bt, (int64_t)r * width + o) * u[m * stride + r];
            y[(int64_t)m * out + o] += s;
        }
}

// A layer's adapter set, as lora_update is given it.
typedef struct {
    const void *A;
    const float *scales;
    const int *spans;
    const void *const *B;
    int format, in, rank, blocks, out;
} adapters_t;

static int chunks_of(const int *spans, int p) { return (spans[4 * p + 1] + CHUNK - 1) / CHUNK; }

// One tile's update, for one format and n rows (constants where inlined, so that each has its own loops, the
// partial sums in registers). The threads share Ax's ranks, then every block's chunks of outputs at once.
INLINE void update_tile(int format, int n, const adapters_t *a, const float *xt, float *u, float *yt) {
#pragma omp for schedule(static)
    for (int k = 0; k < a->rank; k++) reduce(format, a->A, k, xt, a->in, n, a->scales[k], u + k, a->rank);
    int chunks = 0;
    for (int p = 0; p < a->blocks; p++) chunks += chunks_of(a->spans, p);
#pragma omp for schedule(static)
    for (int c = 0; c < chunks; c++) {
        int p = 0, chunk = c;
        for (; chunk >= chunks_of(a->spans, p); p++) chunk -= chunks_of(a->spans, p);
        const int *s = a->spans + 4 * p;
        add_block(format, a->B[p], s[1], u + s[2], a->rank, s[3], chunk * CHUNK, n, yt + s[0], a->out);
    }
}

// The same for a format and n given at run time: each its own loops.
INLINE void update_rows(int format, int n, const adapters_t *a, const float *xt, float *u, float *yt) {
    if (n == 1) update_tile(format, 1, a, xt, u, yt);
    else if (n == 2) update_tile(format, 2, a, xt, u, yt);
#if TILE == 4
    else if (n == 3) update_tile(format, 3, a, xt, u, yt);
    else update_tile(format, 4, a, xt, u, yt);
#endif
}

static void update(const adapters_t *a, int n, const float *xt, float *u, float *yt) {
    if (a->format == FORMAT_F16) update_rows(FORMAT_F16, n, a, xt, u, yt);
    else if (a->format == FORMAT_BF16) update_rows(FORMAT_BF16, n, a, xt, u, yt);
    else update_rows(FORMAT_F32, n, a, xt, u, yt);
}

// The entry point's error codes (executor/lora_kernel.py turns them into messages)
// (apart from the low-bit kernel's, whose steps in kernels/decoder.c it shares)
#define LORA_OK 0
#define LORA_BAD_SHAPE -31  // rows < 0, a width < 1, a rank above MAX_RANK, a block outside the layer, or no format
#define LORA_NO_BUFFER -32  // a buffer the call reads or writes is missing

// x [rows, in], A [rank, in], y [rows, out] (updated); rank r of Ax is scaled by scales[r] (its adapter's scale);
// block p adds B_p times the ranks spans[4p+2] .. +spans[4p+3] of Ax to the output rows spans[4p] .. +spans[4p+1],
// B_p given transposed: [spans[4p+3], spans[4p+1]]. A and the B's are of `format`.
int lora_update(const float *x, int rows, int in, const void *A, int format, const float *scales, int rank,
                int blocks, const int *spans, const void *const *B, float *y, int out, int threads) {
    if (rows < 0 || in < 1 || out < 1 || rank < 1 || rank > MAX_RANK || blocks < 1) return LORA_BAD_SHAPE;
    if (format != FORMAT_F32 && format != FORMAT_F16 && format != FORMAT_BF16) return LORA_BAD_SHAPE;
    if (rows && (!x || !A || !scales || !spans || !B || !y)) return LORA_NO_BUFFER;
    for (int p = 0; p < blocks; p++) {
        const int *s = spans + 4 * p;
        if (s[0] < 0 || s[1] < 1 || s[0] + s[1] > out || s[2] < 0 || s[3] < 1 || s[2] + s[3] > rank)
            return LORA_BAD_SHAPE;
        if (!B[p]) return LORA_NO_BUFFER;
    }
    int64_t work = (int64_t)rank * in;
    for (int p = 0; p < blocks; p++) work += (int64_t)spans[4 * p + 1] * spans[4 * p + 3];
    const int team = rows * work >= PARALLEL_WORK ? threads : 1;
    const adapters_t a = {A, scales, spans, B, format, in, rank, blocks, out};
    float u[TILE * MAX_RANK];  // a tile's Ax
    // Rows go in tiles, each matrix row read once a tile; the threads share a tile's products.
#pragma omp parallel num_threads(team)
    for (int first = 0; first < rows; first += TILE)
        update(&a, rows - first < TILE ? rows - first : TILE, x + (int64_t)first * in, u, y + (int64_t)first * out);
    return LORA_OK;
}
