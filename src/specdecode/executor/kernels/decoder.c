// A decoder's layers for one packed forward (decode and verify: each row a new token of some sequence) in one
// call. Per layer: the residual add and RMSNorm, q/k/v, attention, o_proj, the add and norm, then gate/up, the
// activation (SiLU or GELU) times up and down, or a mixture of experts; with sandwich norms (Gemma) the attention
// and MLP outputs are normed before they join the residual stream. Each step is the kernel Python would call for
// it (passed in as function pointers), in the same order on the same values, so the result is the same bit for
// bit. What it saves is the interpreter between the ~250 small calls a step makes, which at a short context cost
// more than a tenth of the step.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*linear_fn)(int, const float *, int, int, int, int, const void *, const void *, const void *,
                         const void *, const void *, const void *, float *, int, int);
typedef int (*norm_fn)(const float *, const float *, float *, int, int, float, int);
typedef int (*add_norm_fn)(float *, const float *, const float *, float *, int, int, float, int);
typedef int (*act_mul_fn)(const float *, float *, int, int, int);
typedef int (*moe_fn)(int, int, int, int, const float *, int, int, int, int, const float *, int, int, const float *,
                      float, const int *, int64_t *, float *, int, const uint64_t *, const uint64_t *, float *, int,
                      int);
typedef int (*lora_fn)(const float *, int, int, const void *, int, const float *, int, int, const int32_t *,
                       const void *const *, float *, int, int);
typedef int (*attention_fn)(const float *, int, int, int, int, const int64_t *, const int64_t *, const float *,
                            const float *, const float *, const float *, float, float, int, float, const float *,
                            void *, void *, const int32_t *, int, int, int, int, float *, int);

#define MAX_PARTS 3  // a projection's parts in different formats (a Q6_K v beside Q4_K q and k)

typedef struct {  // one BlockLinear: executor/quant.py
    int32_t format, in_features, rows, out_features, S, passes;
    const void *lo, *hi, *sc, *mn, *d, *dmin;
} block_t;

typedef struct {  // one adapter set's update of a projection's output (rank 0: none): executor/lora_kernel.py
    int32_t rank, blocks, format;
    const void *A;
    const float *scales;
    const int32_t *spans;
    const void *const *B;
} lora_t;

typedef struct {  // the parts' outputs side by side, then the bias (ConcatLinear, or one BlockLinear), then LoRA's
    int32_t parts, out_features;
    block_t part[MAX_PARTS];
    const float *bias;  // NULL: none
    const lora_t *lora;  // NULL: none; else its `sets` adapter sets' (models/lora.py's LowRankAdded around it)
    int32_t sets;
} projection_t;

typedef struct {  // a mixture of experts in place of gate_up and down: executor/experts.py
    int32_t experts, top, normalize, inter, passes, gate_up_format, gate_up_S, down_format, down_S;
    const float *router;                          // [experts, hidden]
    const uint64_t *gate_up_table, *down_table;  // each expert's block buffers' addresses
} experts_t;

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm;  // q_norm, k_norm NULL: the family has none
    const float *pre_ff_norm, *post_ff_norm;               // NULL but with sandwich norms
    const float *sinks;                                    // [heads] (gpt-oss), or NULL
    float eps, qk_eps, scale, softcap;  // softcap: of the attention scores (0: none)
    int32_t window, local_rope;  // local_rope: the layer reads the second rotary table
    projection_t qkv, o, gate_up, down;
    experts_t moe;  // moe.experts 0: a dense MLP
} layer_t;

typedef struct {
    linear_fn linear;
    norm_fn norm;
    add_norm_fn add_norm;
    act_mul_fn act_mul;
    attention_fn attention;
    moe_fn moe;
    lora_fn lora;  // NULL where no projection is adapted
    int32_t layers, hidden, heads, kv_heads, head_dim;
    const layer_t *layer;
} decoder_t;

typedef struct {  // one call's tokens: where they are and what they read
    int32_t rows;
    const int64_t *slots, *positions;  // [rows]
    const float *cos[2], *sin[2];      // [rows, head_dim] of the global and the local rotary tables
    void *const *kcache, *const *vcache;  // each layer's
    const int32_t *tables;
    int32_t num_slots, max_blocks, block_size, num_blocks;
    const int32_t *runs;  // adapter runs, (first row, rows, set) each; NULL: every row set 0
    int32_t num_runs;
} tokens_t;

// Which step failed, for the caller's message: the kernel's own code is the return value.
enum { AT_INPUT_NORM = 1, AT_QKV, AT_ATTENTION, AT_O, AT_POST_NORM, AT_GATE_UP, AT_ACT_MUL, AT_DOWN, AT_PRE_FF_NORM,
       AT_POST_FF_NORM, AT_EXPERTS };
#define DECODER_BAD_CALL -100
#define DECODER_NO_MEMORY -101
#define DECODER_BAD_RUN -102  // an adapter run outside the call's rows or the projection's sets

// Whether a projection's output goes through a buffer of its own: several parts side by side, or a part whose
// output rows are padded to whole groups beyond its out_features.
static int needs_tmp(const projection_t *p) { return p->parts > 1 || p->part[0].rows != p->part[0].out_features; }

static int block_product(const decoder_t *m, const block_t *b, const float *x, int n, float *y, int threads) {
    return m->linear(b->format, x, n, b->in_features, b->rows, b->S, b->lo, b->hi, b->sc, b->mn, b->d, b->dmin, y,
                     b->passes, threads);
}

// Each run of rows' adapter set's update of y, where the projection is adapted.
static int add_adapters(const decoder_t *m, const projection_t *p, const tokens_t *t, const float *x, int in,
                        float *y, int threads) {
    const int32_t whole[3] = {0, t->rows, 0};
    const int32_t *runs = t->runs ? t->runs : whole;
    for (int i = 0; i < (t->runs ? t->num_runs : 1); i++) {
        const int32_t first = runs[3 * i], rows = runs[3 * i + 1], set = runs[3 * i + 2];
        if (set < 0 || set >= p->sets || first < 0 || first + rows > t->rows) return DECODER_BAD_RUN;
        const lora_t *a = p->lora + set;
        if (!a->rank) continue;
        int rc = m->lora(x + (int64_t)first * in, rows, in, a->A, a->format, a->scales, a->rank, a->blocks, a->spans,
                         a->B, y + (int64_t)first * p->out_features, p->out_features, threads);
        if (rc) return rc;
    }
    return 0;
}

static int project(const decoder_t *m, const projection_t *p, const tokens_t *t, const float *x, int n, float *y,
                   float *tmp, int threads) {
    const block_t *b = p->part;
    if (!needs_tmp(p)) {
        int rc = block_product(m, b, x, n, y, threads);
        if (rc) return rc;
    } else {
        for (int i = 0, col = 0; i < p->parts; col += b[i].out_features, i++) {
            int rc = block_product(m, &b[i], x, n, tmp, threads);
            if (rc) return rc;
            for (int r = 0; r < n; r++)
                memcpy(y + (int64_t)r * p->out_features + col, tmp + (int64_t)r * b[i].rows,
                       b[i].out_features * sizeof(float));
        }
    }
    if (p->bias)
        for (int r = 0; r < n; r++)
            for (int c = 0; c < p->out_features; c++) y[(int64_t)r * p->out_features + c] += p->bias[c];
    return p->lora ? add_adapters(m, p, t, x, b->in_features, y, threads) : 0;
}

static int64_t tmp_width(const projection_t *p) {
    int64_t w = 0;
    if (!needs_tmp(p)) return 0;
    for (int i = 0; i < p->parts; i++)
        if (p->part[i].rows > w) w = p->part[i].rows;
    return w;
}

// The buffers of a call, carved from one allocation. Buffers never live at once share memory: the normed input
// (read by q/k/v and by the MLP) with attention's output (written after q/k/v, read by o_proj before the next
// norm), and q/k/v with gate/up and with a sandwiched MLP's output (normed into x after gate/up is consumed). The
// experts chosen for each row and their weights come first, for the int64 ids' alignment.
typedef struct {
    int64_t *chosen;
    float *expert_weights, *normed, *attended, *qkv, *gate_up, *mlp_out, *act, *branch, *tmp;
} scratch_t;

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static float *carve(const decoder_t *m, int n, scratch_t *s) {
    int64_t tmp = 0, wide = m->hidden, act = m->hidden, routes = 0;
    for (int l = 0; l < m->layers; l++) {
        const layer_t *L = m->layer + l;
        const projection_t *all[] = {&L->qkv, &L->o, &L->gate_up, &L->down};
        for (int i = 0; i < 4; i++) tmp = max64(tmp, tmp_width(all[i]));
        wide = max64(wide, max64(L->qkv.out_features, L->gate_up.out_features));
        act = max64(act, L->down.part[0].in_features);
        routes = max64(routes, L->moe.top);
    }
    const int64_t narrow = max64(m->hidden, (int64_t)m->heads * m->head_dim);
    float *base = malloc(max64((3 * routes + narrow + wide + act + tmp) * n, 1) * sizeof(float));
    if (!base) return NULL;
    s->chosen = (int64_t *)base;
    s->expert_weights = base + 2 * routes * n;
    s->normed = s->attended = s->expert_weights + routes * n;
    s->qkv = s->gate_up = s->mlp_out = s->normed + narrow * n;
    s->act = s->branch = s->qkv + wide * n;
    s->tmp = s->act + act * n;
    return base;
}

// The input norm through o_proj: x becomes the attention output.
static int attention_block(const decoder_t *m, int l, const tokens_t *t, float *x, float *residual, scratch_t *s,
                           int threads, int *step) {
    const layer_t *L = m->layer + l;
    const int n = t->rows, hidden = m->hidden;
    int rc;
    *step = AT_INPUT_NORM;
    if (l == 0) {  // x: the embeddings, which start the residual stream
        memcpy(residual, x, (size_t)n * hidden * sizeof(float));
        rc = m->norm(residual, L->input_norm, s->normed, n, hidden, L->eps, threads);
    } else {
        rc = m->add_norm(residual, x, L->input_norm, s->normed, n, hidden, L->eps, threads);
    }
    if (rc) return rc;
    if ((*step = AT_QKV, rc = project(m, &L->qkv, t, s->normed, n, s->qkv, s->tmp, threads))) return rc;
    *step = AT_ATTENTION;
    rc = m->attention(s->qkv, n, m->heads, m->kv_heads, m->head_dim, t->slots, t->positions, t->cos[L->local_rope],
                      t->sin[L->local_rope], L->q_norm, L->k_norm, L->qk_eps, L->scale, L->window, L->softcap,
                      L->sinks, t->kcache[l],
                      t->vcache[l], t->tables, t->num_slots, t->max_blocks, t->block_size, t->num_blocks,
                      s->attended, threads);
    if (rc) return rc;
    *step = AT_O;
    return project(m, &L->o, t, s->attended, n, x, s->tmp, threads);
}

static int experts(const decoder_t *m, const experts_t *e, const float *in, int n, float *y, scratch_t *s,
                   int threads) {
    static const int ungrouped[3] = {1, 1, 0};
    return m->moe(e->gate_up_format, e->gate_up_S, e->down_format, e->down_S, in, n, m->hidden, e->inter,
                  e->experts, e->router, e->normalize, 0, NULL, 1.f,  // a plain router: softmax, unbiased, unscaled,
                  ungrouped, s->chosen, s->expert_weights, e->top, e->gate_up_table, e->down_table, y, e->passes, threads);
}

// The MLP (or experts) of the normed input into y.
static int mlp(const decoder_t *m, const layer_t *L, const tokens_t *t, int n, float *y, scratch_t *s, int threads,
               int *step) {
    int rc;
    if (L->moe.experts) return (*step = AT_EXPERTS, experts(m, &L->moe, s->normed, n, y, s, threads));
    if ((*step = AT_GATE_UP, rc = project(m, &L->gate_up, t, s->normed, n, s->gate_up, s->tmp, threads))) return rc;
    if ((*step = AT_ACT_MUL, rc = m->act_mul(s->gate_up, s->act, n, L->gate_up.out_features / 2, threads))) return rc;
    *step = AT_DOWN;
    return project(m, &L->down, t, s->act, n, y, s->tmp, threads);
}

// x: the attention output in, the MLP output out (normed first with sandwich norms).
static int mlp_block(const decoder_t *m, const layer_t *L, const tokens_t *t, float *x, float *residual,
                     scratch_t *s, int threads, int *step) {
    const int n = t->rows;
    const int hidden = m->hidden;
    int rc;
    *step = AT_POST_NORM;
    if (!L->post_ff_norm) {
        if ((rc = m->add_norm(residual, x, L->post_norm, s->normed, n, hidden, L->eps, threads))) return rc;
        return mlp(m, L, t, n, x, s, threads, step);
    }
    if ((rc = m->norm(x, L->post_norm, s->branch, n, hidden, L->eps, threads))) return rc;
    *step = AT_PRE_FF_NORM;
    if ((rc = m->add_norm(residual, s->branch, L->pre_ff_norm, s->normed, n, hidden, L->eps, threads))) return rc;
    if ((rc = mlp(m, L, t, n, s->mlp_out, s, threads, step))) return rc;
    *step = AT_POST_FF_NORM;
    return m->norm(s->mlp_out, L->post_ff_norm, x, n, hidden, L->eps, threads);
}

static int layer_forward(const decoder_t *m, int l, const tokens_t *t, float *x, float *residual, scratch_t *s,
                         int threads, int *step) {
    const int rc = attention_block(m, l, t, x, residual, s, threads, step);
    return rc ? rc : mlp_block(m, m->layer + l, t, x, residual, s, threads, step);
}

// x [rows, hidden]: the embeddings in, the last layer's MLP output out; residual [rows, hidden]: the residual
// stream before it (the final norm adds the two). failed[0], failed[1]: the layer and step that failed.
int decoder_layers(const decoder_t *m, const tokens_t *t, float *x, float *residual, int threads, int32_t *failed) {
    failed[0] = failed[1] = -1;
    if (!m || !t || !x || !residual || t->rows < 1 || m->layers < 1) return DECODER_BAD_CALL;
    scratch_t s;
    float *base = carve(m, t->rows, &s);
    if (!base) return DECODER_NO_MEMORY;
    int rc = 0;
    for (int l = 0; l < m->layers && !rc; l++) {
        rc = layer_forward(m, l, t, x, residual, &s, threads, &failed[1]);
        if (rc) failed[0] = l;
    }
    free(base);
    return rc;
}
