/*
 * A Llama-family model's decoder layers for a small batch of tokens, on the CPU, in one call.
 *
 * At one stream a decode step multiplies each weight once and does little else: with the projections kept as
 * ggml blocks (quantized_linear.c) the arithmetic of a 135M-parameter model takes about 10 ms, and calling the
 * dozen kernels of each of its 30 layers from Python, one at a time, took as long again. This file runs the
 * same kernels in the same order from C: the Python side (engine/worker/native_decoder.py) describes the layers'
 * weights and caches once, then each step is one call.
 *
 * It composes the library's kernels and computes nothing of its own. Activations are token-major ([tokens,
 * features], each token's features contiguous). The Python path keeps a batch of a few tokens feature-major,
 * where the norms sum each token's squares in another order: the two differ by float32 rounding.
 *
 * Per layer:  h = RMSNorm(residual += mlp)                     (the first layer: h = RMSNorm(residual))
 *             qkv = h @ Wqkv^T + b; rotary on q and k; k and v into the paged cache
 *             attention of q over the cache; residual += attention @ Wo^T; h = RMSNorm(residual)
 *             mlp = (SiLU(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T
 * and at the end out = RMSNorm(residual += mlp) with the final norm's weight.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rows8.h"


/* The library's kernels (layer_ops.c, quantized_linear.c, kquant_linear.c, write_kv.c,
 * paged_decode_attention.c). */
void add_rms_norm_f32(float *out, float *hidden, const float *delta, const float *weight, int64_t tokens,
                      int64_t features, int64_t token_stride, int64_t feature_stride, float eps, int num_threads);
void rotary_f32(float *x, const float *cos, const float *sin, int64_t tokens, int64_t heads, int64_t head_dim,
                int64_t token_stride, int64_t feature_stride, int num_threads);
void silu_and_mul_f32(float *out, const float *gate, const float *up, int64_t rows, int64_t run, int64_t in_stride,
                      int64_t out_stride, int num_threads);
int quantized_linear_f32(float *y, int64_t ldy_token, int64_t ldy_row, const float *x, int64_t ldx,
                         const uint8_t *w, const float *bias, int64_t M, int64_t N, int64_t K, int ggml_type,
                         int num_threads);
int kquant_linear_f32(float *y, int64_t ldy_token, int64_t ldy_row, const float *x, int64_t ldx, const uint8_t *w,
                      const float *bias, int64_t M, int64_t N, int64_t K, int ggml_type, int num_threads);
int int8_linear_f32(float *y, int64_t ldy_token, int64_t ldy_row, const float *x, int64_t ldx, const uint8_t *w,
                    const float *bias, int64_t M, int64_t N, int64_t K, int ggml_type, int num_threads);
int int16_linear_f32(float *y, int64_t ldy_token, int64_t ldy_row, const float *x, int64_t ldx, const uint8_t *w,
                     const float *bias, int64_t M, int64_t N, int64_t K, int ggml_type, int num_threads);
int write_kv_f32(float *k_cache, float *v_cache, const float *key, const float *value, const int64_t *slots,
                 int64_t tokens, int64_t features, int64_t token_stride, int64_t feature_stride, int64_t num_slots);
int paged_decode_attention_f32(float *out, const float *query, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t block_table_stride, const int32_t *context_lens,
                               const int64_t *seq_ids, const int64_t *query_rows, int64_t num_queries,
                               int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                               int window, float soft_cap, int num_threads);

/* A projection's weight as ggml blocks: [out, in] rows of in / 32 blocks of ggml type `type`. */
typedef struct {
    const uint8_t *blocks;
    int32_t type;
} block_weight;

/* q, k and v: one weight of all their rows (qkv_parts = 1, in qkv[0]), or, where a file stores them in different
 * formats (a Q4_K_M file's v in Q6_K, q and k in Q4_K), three weights multiplied one after another into their
 * columns of the same output (qkv_parts = 3). */
enum { QKV_PARTS = 3 };

/* One decoder layer: its norms' weights, projections, q/k/v bias (NULL if none) and the layer's caches. */
typedef struct {
    const float *input_norm, *post_attention_norm;
    block_weight qkv[QKV_PARTS], o, gate_up, down;
    int32_t qkv_parts;
    const float *qkv_bias;
    float *k_cache, *v_cache;
} decoder_layer;

/* The model's shapes and layers (fixed at load). */
typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t block_size, num_slots; /* each cache: num_slots = blocks * block_size rows of kv_heads * head_dim */
    float eps, scale;
    const decoder_layer *layers;
    const float *final_norm;
    int64_t int8_max_tokens; /* steps of fewer tokens quantize activations (int8_linear.c); 0: never */
    int64_t activation_bits; /* to 8 or 16 bits */
} decoder_model;

/* One step's positions and attention work, as the CPU backend plans it (kernels/cpu_attention.py). */
typedef struct {
    int64_t tokens;
    const float *cos, *sin; /* [tokens, head_dim / 2] */
    const int64_t *slots;   /* [tokens] cache rows for the new keys and values */
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *context_lens;
    const int64_t *seq_ids, *query_rows;
    int64_t num_queries; /* must be every token: rows the kernel does not take are not computed here */
} decoder_step;

/* Activations of one step, carved from one allocation. */
typedef struct {
    float *normed, *qkv, *query, *attention, *projected, *gate_up, *activated, *mlp;
} scratch;

static float *carve(float **next, int64_t floats) {
    float *begin = *next;
    *next += floats;
    return begin;
}

static float *scratch_alloc(scratch *s, const decoder_model *m, int64_t tokens) {
    const int64_t q = m->num_heads * m->head_dim, qkv = q + 2 * m->num_kv_heads * m->head_dim;
    const int64_t total = tokens * (3 * m->hidden + qkv + 2 * q + 3 * m->intermediate);
    float *memory = malloc(sizeof(float) * (size_t)total), *next = memory;
    if (memory == NULL) return NULL;
    s->normed = carve(&next, tokens * m->hidden);
    s->qkv = carve(&next, tokens * qkv);
    s->query = carve(&next, tokens * q);
    s->attention = carve(&next, tokens * q);
    s->projected = carve(&next, tokens * m->hidden);
    s->gate_up = carve(&next, tokens * 2 * m->intermediate);
    s->activated = carve(&next, tokens * m->intermediate);
    s->mlp = carve(&next, tokens * m->hidden);
    return memory;
}

/* y [tokens, out] (rows ldy floats apart) = x [tokens, in] @ W^T (+ bias), token-major, by the kernel that reads
 * W's type: each returns -1, having done nothing, for a type it does not read. `int8`: by int8_linear.c's where
 * it reads the type, with x quantized to 8 bits (int8 = 8) or 16 (int8 = 16); interleaved rows always so. */
static int project_into(float *y, int64_t ldy, const float *x, block_weight w, const float *bias, int64_t tokens,
                        int64_t out, int64_t in, int threads, int int8) {
    if (w.type >= ROWS8_Q4_0_TYPE) int8 = 16; /* layouts for 16-bit tokens alone, at every count (rows8.h) */
    if (int8) {
        const int status = (int8 == 16 ? int16_linear_f32 : int8_linear_f32)(y, ldy, 1, x, in, w.blocks, bias, tokens,
                                                                             out, in, w.type, threads);
        if (status != -1) return status;
    }
    const int status = quantized_linear_f32(y, ldy, 1, x, in, w.blocks, bias, tokens, out, in, w.type, threads);
    if (status != -1) return status;
    return kquant_linear_f32(y, ldy, 1, x, in, w.blocks, bias, tokens, out, in, w.type, threads);
}

static int project(float *y, const float *x, block_weight w, const float *bias, int64_t tokens, int64_t out,
                   int64_t in, int threads, int int8) {
    return project_into(y, out, x, w, bias, tokens, out, in, threads, int8);
}

/* qkv [tokens, q + 2 kv] = x @ [Wq; Wk; Wv]^T + bias, from one weight or three (decoder_layer). */
static int project_qkv(const decoder_model *m, const decoder_layer *layer, float *qkv, const float *x,
                       int64_t tokens, int threads, int int8) {
    const int64_t q_size = m->num_heads * m->head_dim, kv_size = m->num_kv_heads * m->head_dim;
    const int64_t width = q_size + 2 * kv_size;
    if (layer->qkv_parts == 1)
        return project(qkv, x, layer->qkv[0], layer->qkv_bias, tokens, width, m->hidden, threads, int8);
    const int64_t rows[QKV_PARTS] = {q_size, kv_size, kv_size};
    int64_t first = 0;
    for (int part = 0; part < QKV_PARTS; first += rows[part++]) {
        const float *bias = layer->qkv_bias == NULL ? NULL : layer->qkv_bias + first;
        const int status = project_into(qkv + first, width, x, layer->qkv[part], bias, tokens, rows[part], m->hidden,
                                        threads, int8);
        if (status) return status;
    }
    return 0;
}

/* Attention of the layer: rotary on q and k in place, k and v into the cache, q over the cache. */
static int attend(const decoder_model *m, const decoder_layer *layer, const decoder_step *step, scratch *s,
                  int threads) {
    const int64_t tokens = step->tokens, q_size = m->num_heads * m->head_dim;
    const int64_t kv_size = m->num_kv_heads * m->head_dim, width = q_size + 2 * kv_size;
    float *q = s->qkv, *k = s->qkv + q_size, *v = k + kv_size;
    rotary_f32(q, step->cos, step->sin, tokens, m->num_heads, m->head_dim, width, 1, threads);
    rotary_f32(k, step->cos, step->sin, tokens, m->num_kv_heads, m->head_dim, width, 1, threads);
    if (write_kv_f32(layer->k_cache, layer->v_cache, k, v, step->slots, tokens, kv_size, width, 1, m->num_slots))
        return -3;
    const float *query = q;
    if (tokens > 1) { /* the kernel reads contiguous query rows; each token's q is followed by its k and v */
        for (int64_t t = 0; t < tokens; ++t) memcpy(s->query + t * q_size, q + t * width, sizeof(float) * q_size);
        query = s->query;
    }
    const int status = paged_decode_attention_f32(
        s->attention, query, layer->k_cache, layer->v_cache, step->block_tables, step->block_table_stride,
        step->context_lens, step->seq_ids, step->query_rows, step->num_queries, (int)m->num_heads,
        (int)m->num_kv_heads, (int)m->head_dim, (int)m->block_size, m->scale, 0, 0.0f, threads);
    return status ? -2 : 0;
}

static int layer_forward(const decoder_model *m, const decoder_layer *layer, const decoder_step *step,
                         float *residual, const float *delta, scratch *s, int threads) {
    const int64_t tokens = step->tokens, hidden = m->hidden, inter = m->intermediate;
    const int64_t q_size = m->num_heads * m->head_dim;
    const int int8 = tokens < m->int8_max_tokens ? (int)m->activation_bits : 0;
    int status;
    add_rms_norm_f32(s->normed, residual, delta, layer->input_norm, tokens, hidden, hidden, 1, m->eps, threads);
    if ((status = project_qkv(m, layer, s->qkv, s->normed, tokens, threads, int8))) return status;
    if ((status = attend(m, layer, step, s, threads))) return status;
    if ((status = project(s->projected, s->attention, layer->o, NULL, tokens, hidden, q_size, threads, int8)))
        return status;
    add_rms_norm_f32(s->normed, residual, s->projected, layer->post_attention_norm, tokens, hidden, hidden, 1,
                     m->eps, threads);
    if ((status = project(s->gate_up, s->normed, layer->gate_up, NULL, tokens, 2 * inter, hidden, threads, int8)))
        return status;
    silu_and_mul_f32(s->activated, s->gate_up, s->gate_up + inter, tokens, inter, 2 * inter, inter, threads);
    return project(s->mlp, s->activated, layer->down, NULL, tokens, hidden, inter, threads, int8);
}

/*
 * out [tokens, hidden] = the final norm of the residual stream after every layer. `residual` [tokens, hidden]
 * holds the token embeddings on entry and is overwritten. Returns 0; -1 for a block type no linear kernel
 * reads, -2 if memory ran out, -3 if a slot is past the cache (out is then not to be used).
 */
int decoder_forward_f32(float *out, float *residual, const decoder_model *model, const decoder_step *step,
                        int num_threads) {
    if (step->tokens <= 0) return 0;
    scratch s;
    float *memory = scratch_alloc(&s, model, step->tokens);
    if (memory == NULL) return -2;
    int status = 0;
    const float *delta = NULL; /* the previous layer's MLP output, added to the residual by the next norm */
    for (int64_t l = 0; l < model->num_layers && status == 0; ++l) {
        status = layer_forward(model, &model->layers[l], step, residual, delta, &s, num_threads);
        delta = s.mlp;
    }
    if (status == 0)
        add_rms_norm_f32(out, residual, delta, model->final_norm, step->tokens, model->hidden, model->hidden, 1,
                         model->eps, num_threads);
    free(memory);
    return status;
}
