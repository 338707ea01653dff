// A LoRA adapter's update of a linear layer's output, y += B(Ax), in one call where PyTorch takes several small ones
// (models/lora.py). A's rows are every adapter of every part of the layer stacked; each block's B adds to its own
// output rows from its own ranks of Ax. Each row of x is computed alone, by the same operations in the same order,
// so a token's update does not depend on its batch (a GEMM's does: docs/decisions.md#lora-adapters-beside-the-weights).
#include <stdint.h>

#define LANES 16          // independent partial sums: the compiler keeps them in one vector
#define PARALLEL_WORK 65536  // below this many multiply-adds a call one thread is faster than waking the others
#define MAX_RANK 1024
#define TILE 8  // rows whose products share each read of a matrix row
#define CHUNK 256  // outputs a thread sums at a time

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

// y[o] += sum over r of Bt[r][o] u[r] for the chunk of outputs from o0: Bt is a block's B transposed ([rank, width]),
// so the sum runs along its rows, a vector of outputs at a time, every output's terms in the order of r.
static void add_block(const float *restrict bt, int width, const float *restrict u, int rank, int o0,
                      float *restrict y) {
    const int w = width - o0 < CHUNK ? width - o0 : CHUNK;
    float acc[CHUNK] = {0};
    for (int r = 0; r < rank; r++) {
        const float *row = bt + (int64_t)r * width + o0;
        const float ur = u[r];
        for (int o = 0; o < w; o++) acc[o] += row[o] * ur;
    }
    for (int o = 0; o < w; o++) y[o0 + o] += acc[o];
}

// The entry point's error codes (executor/lora_kernel.py turns them into messages)
// (apart from the low-bit kernel's, whose steps in kernels/decoder.c it shares)
#define LORA_OK 0
#define LORA_BAD_SHAPE -31  // rows < 0, a width < 1, a rank above MAX_RANK, or a block outside the layer
#define LORA_NO_BUFFER -32  // a buffer the call reads or writes is missing

// x [rows, in], A [rank, in], y [rows, out] (updated); block p adds B_p times the ranks spans[4p+2] .. +spans[4p+3]
// of Ax to the output rows spans[4p] .. +spans[4p+1], B_p given transposed: [spans[4p+3], spans[4p+1]].
int lora_update(const float *x, int rows, int in, const float *A, int rank, int blocks, const int *spans,
                const float *const *B, float *y, int out, int threads) {
    if (rows < 0 || in < 1 || out < 1 || rank < 1 || rank > MAX_RANK || blocks < 1) return LORA_BAD_SHAPE;
    if (rows && (!x || !A || !spans || !B || !y)) return LORA_NO_BUFFER;
    for (int p = 0; p < blocks; p++) {
        const int *s = spans + 4 * p;
        if (s[0] < 0 || s[1] < 1 || s[0] + s[1] > out || s[2] < 0 || s[3] < 1 || s[2] + s[3] > rank)
            return LORA_BAD_SHAPE;
        if (!B[p]) return LORA_NO_BUFFER;
    }
    int64_t work = (int64_t)rank * in;
    for (int p = 0; p < blocks; p++) work += (int64_t)spans[4 * p + 1] * spans[4 * p + 3];
    const int team = rows * work >= PARALLEL_WORK ? threads : 1;
    float u[TILE * MAX_RANK];  // a tile's Ax
    // Rows go in tiles, each matrix row read once a tile; the threads share a tile's products.
#pragma omp parallel num_threads(team)
    for (int first = 0; first < rows; first += TILE) {
        const int n = rows - first < TILE ? rows - first : TILE;
        const float *xt = x + (int64_t)first * in;
        float *yt = y + (int64_t)first * out;
#pragma omp for schedule(static)
        for (int k = 0; k < rank; k++)
            for (int m = 0; m < n; m++) u[m * rank + k] = dot(A + (int64_t)k * in, xt + (int64_t)m * in, in);
        for (int p = 0; p < blocks; p++) {
            const int *s = spans + 4 * p;
            const int chunks = (s[1] + CHUNK - 1) / CHUNK;
#pragma omp for schedule(static)
            for (int c = 0; c < chunks; c++)
                for (int m = 0; m < n; m++)
                    add_block(B[p], s[1], u + m * rank + s[2], s[3], c * CHUNK, yt + (int64_t)m * out + s[0]);
        }
    }
    return LORA_OK;
}
