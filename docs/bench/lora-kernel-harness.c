// Times kernels/lora.c, or the kernel before its 16-bit formats (float32 only), over one step's updates of the 1.5B
// with a rank-16 adapter on all 112 projections, reading 8 copies of the adapter in turn (from memory, not cache).
//
//   K=src/specdecode/executor/kernels/lora.c
//   gcc -O3 -march=native -fopenmp -ffp-contract=off -DKERNEL="\"$PWD/$K\"" docs/bench/lora-kernel-harness.c -o /tmp/new
//   git show 985fea1:$K > /tmp/old.c
//   gcc -O3 -march=native -fopenmp -ffp-contract=off -DKERNEL='"/tmp/old.c"' -DOLD docs/bench/lora-kernel-harness.c \
//       -o /tmp/old
//   for rows in 1 4 8; do /tmp/old 0 $rows 2 8; /tmp/new 0 $rows 2 8; done   # format rows threads copies
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifdef OLD
#define lora_update lora_update_old
#include KERNEL
#undef lora_update
int lora_update(const float *x, int rows, int in, const void *A, int format, const float *scales, int rank,
                int blocks, const int *spans, const void *const *B, float *y, int out, int threads) {
    (void)format, (void)scales;
    return lora_update_old(x, rows, in, A, rank, blocks, spans, (const float *const *)B, y, out, threads);
}
#else
#include KERNEL
#endif

typedef struct {  // a projection: its input width and its parts' output widths and ranks
    int in, parts, width[3], rank[3];
} shape_t;
static const shape_t SHAPES[4] = {
    {1536, 3, {1536, 256, 256}, {16, 16, 16}}, {1536, 1, {1536}, {16}}, {1536, 2, {8960, 8960}, {16, 16}},
    {8960, 1, {1536}, {16}}};

typedef struct {
    void *A, *B[3];
    float *scales;
    int rank, blocks, spans[12], out;
} set_t;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void *filled(size_t elements, int size) {  // small values of either width (their bits as float16 near 1)
    uint16_t *m = malloc(elements * size);
    for (size_t i = 0; i < elements * size / 2; i++) m[i] = 0x3c00 + i % 7;
    return m;
}

int main(int argc, char **argv) {
    if (argc != 5) return fprintf(stderr, "usage: %s FORMAT ROWS THREADS COPIES\n", argv[0]), 2;
    const int format = atoi(argv[1]), rows = atoi(argv[2]), threads = atoi(argv[3]), sets = 28 * 4 * atoi(argv[4]);
    const int size = format ? 2 : 4;
    set_t *s = calloc(sets, sizeof *s);
    for (int i = 0; i < sets; i++) {
        const shape_t *shape = &SHAPES[i % 4];
        s[i].blocks = shape->parts;
        for (int p = 0; p < shape->parts; p++) {
            int *span = s[i].spans + 4 * p;
            span[0] = s[i].out, span[1] = shape->width[p], span[2] = s[i].rank, span[3] = shape->rank[p];
            s[i].B[p] = filled((size_t)shape->width[p] * shape->rank[p], size);
            s[i].out += shape->width[p], s[i].rank += shape->rank[p];
        }
        s[i].A = filled((size_t)s[i].rank * shape->in, size);
        s[i].scales = malloc(sizeof(float) * s[i].rank);
        for (int r = 0; r < s[i].rank; r++) s[i].scales[r] = 1.f;
    }
    float *x = calloc((size_t)rows * 8960, sizeof(float)), *y = calloc((size_t)rows * 17920, sizeof(float));
    double best = 1e9;
    for (int repeat = 0; repeat < 20; repeat++) {
        const double started = now();
        for (int i = 0; i < sets; i++) {
            const int rc = lora_update(x, rows, SHAPES[i % 4].in, s[i].A, format, s[i].scales, s[i].rank, s[i].blocks,
                                       s[i].spans, (const void *const *)s[i].B, y, s[i].out, threads);
            if (rc) return fprintf(stderr, "error %d\n", rc), 1;
        }
        const double took = now() - started;
        best = took < best ? took : best;
    }
    printf("format %d, %d rows, %d threads: %.2f ms a step\n", format, rows, threads, best * 1e3 * 28 * 4 / sets);
    return 0;
}
