/*
 * The elementwise parts of a Llama decoder layer, float32, for the CPU: RMSNorm with the residual add
 * folded in, SiLU(gate) * up, and the rotary embedding.
 *
 * In torch each of these is a chain of ops, each one reading and writing a full activation and, at decode
 * sizes, too small for torch to split across threads; together they cost about a fifth of a CPU step. Here
 * each is one pass over memory, split across the threads.
 *
 * Layouts. An activation is a [tokens, features] matrix stored one of two ways: token-major (a token's
 * features contiguous, the usual row-major tensor) or feature-major (a feature's tokens contiguous: the
 * transposed view the CPU linear returns for small batches, see kernels/cpu_backend.py). Every
 * function takes `token_stride` and `feature_stride`, one of which is 1, and loops so that the inner loop
 * runs over contiguous memory either way.
 *
 * Built at first use with the system C compiler (kernels/cpu_native.py), for the host CPU.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "parallel.h"
#include "vector_math.h"

enum { TILE = 64 };                 /* tokens per tile of a feature-major reduction: the partial sums fit in L1 */
enum { MIN_PARALLEL_ELEMENTS = 16384 }; /* below this, handing work to a second thread costs more than it saves */

static inline int threads_for(int64_t elements, int num_threads) {
    return elements >= MIN_PARALLEL_ELEMENTS ? num_threads : 1;
}

/* SiLU(g) = g * sigmoid(g), with exp taken of -|g| only: it never overflows, one division either sign. */
static inline float silu(float g) {
    const float e = exp_negative(fabsf(g));
    return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

enum { SILU_CHUNK = 2048 }; /* floats of one row a unit of work */

typedef struct {
    float *out;
    const float *gate, *up;
    int64_t run, in_stride, out_stride, pieces_per_row;
} silu_job;

static void silu_pieces(void *context, int64_t begin, int64_t end) {
    const silu_job *job = context;
    for (int64_t piece = begin; piece < end; ++piece) {
        const int64_t row = piece / job->pieces_per_row, first = (piece % job->pieces_per_row) * SILU_CHUNK;
        const int64_t n = job->run - first < SILU_CHUNK ? job->run - first : SILU_CHUNK;
        const float *g = job->gate + row * job->in_stride + first, *u = job->up + row * job->in_stride + first;
        float *o = job->out + row * job->out_stride + first;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = silu(g[i]) * u[i];
    }
}

/*
 * out = SiLU(gate) * up over a [tokens, width] block. gate, up and out are laid out alike: `rows` runs of
 * `run` contiguous floats, `in_stride` (gate, up) and `out_stride` (out) apart.
 */
void silu_and_mul_f32(float *out, const float *gate, const float *up, int64_t rows, int64_t run, int64_t in_stride,
                      int64_t out_stride, int num_threads) {
    silu_job job = {out, gate, up, run, in_stride, out_stride, (run + SILU_CHUNK - 1) / SILU_CHUNK};
    parallel_for(rows * job.pieces_per_row, 4, threads_for(rows * run, num_threads), silu_pieces, &job);
}

typedef struct {
    float *out, *hidden;
    const float *delta, *weight;
    int64_t tokens, features, stride; /* stride: token_stride (token-major) or feature_stride (feature-major) */
    int64_t tile_width;               /* feature-major: tokens a unit of work */
    float eps;
} norm_job;

/* Token-major: one token's features are contiguous, so each token is a dot product and a scaled copy. */
static void rms_norm_tokens(void *context, int64_t begin, int64_t end) {
    const norm_job *job = context;
    const int64_t features = job->features;
    for (int64_t t = begin; t < end; ++t) {
        float *h = job->hidden + t * job->stride, *o = job->out + t * job->stride;
        const float *d = job->delta ? job->delta + t * job->stride : NULL, *weight = job->weight;
        float sum = 0.0f;
        if (d) {
#pragma omp simd reduction(+ : sum)
            for (int64_t f = 0; f < features; ++f) {
                h[f] += d[f];
                sum += h[f] * h[f];
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t f = 0; f < features; ++f) sum += h[f] * h[f];
        }
        const float inverse_rms = 1.0f / sqrtf(sum / (float)features + job->eps);
#pragma omp simd
        for (int64_t f = 0; f < features; ++f) o[f] = weight[f] * (h[f] * inverse_rms);
    }
}

/* Feature-major: a feature's tokens are contiguous, so the sums of squares of a tile of tokens build up
 * feature by feature, vectorised across the tile. */
static void rms_norm_features(void *context, int64_t begin, int64_t end) {
    const norm_job *job = context;
    const int64_t features = job->features, stride = job->stride;
    for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t first = tile * job->tile_width;
        const int64_t n = job->tokens - first < job->tile_width ? job->tokens - first : job->tile_width;
        float sums[TILE] = {0.0f};
        for (int64_t f = 0; f < features; ++f) {
            float *h = job->hidden + f * stride + first;
            if (job->delta) {
                const float *d = job->delta + f * stride + first;
#pragma omp simd
                for (int64_t t = 0; t < n; ++t) h[t] += d[t];
            }
#pragma omp simd
            for (int64_t t = 0; t < n; ++t) sums[t] += h[t] * h[t];
        }
        float inverse_rms[TILE];
        for (int64_t t = 0; t < n; ++t) inverse_rms[t] = 1.0f / sqrtf(sums[t] / (float)features + job->eps);
        for (int64_t f = 0; f < features; ++f) {
            const float *h = job->hidden + f * stride + first;
            float *o = job->out + f * stride + first;
            const float w = job->weight[f];
#pragma omp simd
            for (int64_t t = 0; t < n; ++t) o[t] = w * (h[t] * inverse_rms[t]);
        }
    }
}

/*
 * hidden += delta (when delta is not NULL), then out = weight * hidden / rms(hidden), per token. hidden,
 * delta and out share one layout: token_stride and feature_stride, one of them 1.
 */
void add_rms_norm_f32(float *out, float *hidden, const float *delta, const float *weight, int64_t tokens,
                      int64_t features, int64_t token_stride, int64_t feature_stride, float eps, int num_threads) {
    const int threads = threads_for(tokens * features, num_threads);
    norm_job job = {out, hidden, delta, weight, tokens, features, token_stride, 0, eps};
    if (feature_stride == 1) {
        parallel_for(tokens, 16, threads, rms_norm_tokens, &job);
        return;
    }
    /* Tiles narrow enough that every thread gets one, at most TILE tokens (their partial sums fit in L1). */
    const int64_t width = (tokens + threads - 1) / threads;
    job.stride = feature_stride;
    job.tile_width = width < TILE ? (width + 7) / 8 * 8 : TILE;
    parallel_for((tokens + job.tile_width - 1) / job.tile_width, 1, threads, rms_norm_features, &job);
}

typedef struct {
    float *x;
    const float *cos, *sin;
    int64_t tokens, heads, head_dim, token_stride, feature_stride;
} rotary_job;

/* Token-major: tokens [begin, end), each a run of heads. */
static void rotate_tokens(void *context, int64_t begin, int64_t end) {
    const rotary_job *job = context;
    const int64_t half = job->head_dim / 2;
    for (int64_t t = begin; t < end; ++t) {
        const float *c = job->cos + t * half, *s = job->sin + t * half;
        for (int64_t h = 0; h < job->heads; ++h) {
            float *a = job->x + t * job->token_stride + h * job->head_dim, *b = a + half;
#pragma omp simd
            for (int64_t d = 0; d < half; ++d) {
                const float first = a[d], second = b[d];
                a[d] = first * c[d] - second * s[d];
                b[d] = second * c[d] + first * s[d];
            }
        }
    }
}

/* Feature-major (token_stride 1): feature pairs [begin, end), each a run of tokens. */
static void rotate_feature_pairs(void *context, int64_t begin, int64_t end) {
    const rotary_job *job = context;
    const int64_t half = job->head_dim / 2, tokens = job->tokens;
    for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t h = pair / half, d = pair % half;
        float *a = job->x + (h * job->head_dim + d) * job->feature_stride, *b = a + half * job->feature_stride;
        const float *c = job->cos + d * tokens, *s = job->sin + d * tokens;
#pragma omp simd
        for (int64_t t = 0; t < tokens; ++t) {
            const float first = a[t], second = b[t];
            a[t] = first * c[t] - second * s[t];
            b[t] = second * c[t] + first * s[t];
        }
    }
}

/*
 * Rotates x [tokens, heads, head_dim] in place by each token's angles, rotating the two halves of each head
 * against each other (the rotate_half convention of transformers' Llama). cos and sin hold half a head's
 * worth per token, laid out like x: [tokens, half] when x is token-major, [half, tokens] when it is
 * feature-major. A head's features are contiguous in feature order: feature (h, d) is h * head_dim + d.
 */
void rotary_f32(float *x, const float *cos, const float *sin, int64_t tokens, int64_t heads, int64_t head_dim,
                int64_t token_stride, int64_t feature_stride, int num_threads) {
    const int threads = threads_for(tokens * heads * head_dim, num_threads);
    rotary_job job = {x, cos, sin, tokens, heads, head_dim, token_stride, feature_stride};
    if (feature_stride == 1)
        parallel_for(tokens, 16, threads, rotate_tokens, &job);
    else
        parallel_for(heads * (head_dim / 2), 8, threads, rotate_feature_pairs, &job);
}
