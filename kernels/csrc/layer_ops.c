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
 * transposed view the CPU linear layer returns for small batches, see engine/models/layers.py). Every
 * function takes `token_stride` and `feature_stride`, one of which is 1, and loops so that the inner loop
 * runs over contiguous memory either way.
 *
 * Built at first use with the system C compiler (kernels/cpu_native.py), for the host CPU.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vector_math.h"

enum { TILE = 64 };                 /* tokens per tile of a feature-major reduction: the partial sums fit in L1 */
enum { MIN_PARALLEL_ELEMENTS = 16384 }; /* below this, waking a second thread costs more than it saves */

/* SiLU(g) = g * sigmoid(g), with exp taken of -|g| only: it never overflows, one division either sign. */
static inline float silu(float g) {
    const float e = exp_negative(fabsf(g));
    return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

/*
 * out = SiLU(gate) * up over a [tokens, width] block. gate, up and out are laid out alike: `rows` runs of
 * `run` contiguous floats, `in_stride` (gate, up) and `out_stride` (out) apart.
 */
void silu_and_mul_f32(float *out, const float *gate, const float *up, int64_t rows, int64_t run, int64_t in_stride,
                      int64_t out_stride, int num_threads) {
    enum { CHUNK = 2048 };
    const int64_t chunks_per_row = (run + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * run >= MIN_PARALLEL_ELEMENTS)
    for (int64_t chunk = 0; chunk < rows * chunks_per_row; ++chunk) {
        const int64_t row = chunk / chunks_per_row, first = (chunk % chunks_per_row) * CHUNK;
        const int64_t n = run - first < CHUNK ? run - first : CHUNK;
        const float *g = gate + row * in_stride + first, *u = up + row * in_stride + first;
        float *o = out + row * out_stride + first;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = silu(g[i]) * u[i];
    }
}

/* Token-major: one token's features are contiguous, so each token is a dot product and a scaled copy. */
static void rms_norm_tokens(float *out, float *hidden, const float *delta, const float *weight, int64_t tokens,
                            int64_t features, int64_t token_stride, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * features >= MIN_PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < tokens; ++t) {
        float *h = hidden + t * token_stride, *o = out + t * token_stride;
        const float *d = delta ? delta + t * token_stride : NULL;
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
        const float inverse_rms = 1.0f / sqrtf(sum / (float)features + eps);
#pragma omp simd
        for (int64_t f = 0; f < features; ++f) o[f] = weight[f] * (h[f] * inverse_rms);
    }
}

/* Feature-major: a feature's tokens are contiguous, so the sums of squares of a tile of tokens build up
 * feature by feature, vectorised across the tile. Tiles are narrow enough that every thread gets one. */
static void rms_norm_features(float *out, float *hidden, const float *delta, const float *weight, int64_t tokens,
                              int64_t features, int64_t feature_stride, float eps, int num_threads) {
    const int threads = tokens * features >= MIN_PARALLEL_ELEMENTS ? num_threads : 1;
    int64_t width = (tokens + threads - 1) / threads;
    width = width < TILE ? (width + 7) / 8 * 8 : TILE;
    const int64_t tiles = (tokens + width - 1) / width;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t first = tile * width, n = tokens - first < width ? tokens - first : width;
        float sums[TILE] = {0.0f};
        for (int64_t f = 0; f < features; ++f) {
            float *h = hidden + f * feature_stride + first;
            if (delta) {
                const float *d = delta + f * feature_stride + first;
#pragma omp simd
                for (int64_t t = 0; t < n; ++t) h[t] += d[t];
            }
#pragma omp simd
            for (int64_t t = 0; t < n; ++t) sums[t] += h[t] * h[t];
        }
        float inverse_rms[TILE];
        for (int64_t t = 0; t < n; ++t) inverse_rms[t] = 1.0f / sqrtf(sums[t] / (float)features + eps);
        for (int64_t f = 0; f < features; ++f) {
            const float *h = hidden + f * feature_stride + first;
            float *o = out + f * feature_stride + first;
#pragma omp simd
            for (int64_t t = 0; t < n; ++t) o[t] = weight[f] * (h[t] * inverse_rms[t]);
        }
    }
}

/*
 * hidden += delta (when delta is not NULL), then out = weight * hidden / rms(hidden), per token. hidden,
 * delta and out share one layout: token_stride and feature_stride, one of them 1.
 */
void add_rms_norm_f32(float *out, float *hidden, const float *delta, const float *weight, int64_t tokens,
                      int64_t features, int64_t token_stride, int64_t feature_stride, float eps, int num_threads) {
    if (feature_stride == 1)
        rms_norm_tokens(out, hidden, delta, weight, tokens, features, token_stride, eps, num_threads);
    else
        rms_norm_features(out, hidden, delta, weight, tokens, features, feature_stride, eps, num_threads);
}

/*
 * Rotates x [tokens, heads, head_dim] in place by each token's angles, rotating the two halves of each head
 * against each other (the rotate_half convention of transformers' Llama). cos and sin hold half a head's
 * worth per token, laid out like x: [tokens, half] when x is token-major, [half, tokens] when it is
 * feature-major. A head's features are contiguous in feature order: feature (h, d) is h * head_dim + d.
 */
void rotary_f32(float *x, const float *cos, const float *sin, int64_t tokens, int64_t heads, int64_t head_dim,
                int64_t token_stride, int64_t feature_stride, int num_threads) {
    const int64_t half = head_dim / 2;
    const int parallel = tokens * heads * head_dim >= MIN_PARALLEL_ELEMENTS;
    if (feature_stride == 1) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
        for (int64_t t = 0; t < tokens; ++t) {
            const float *c = cos + t * half, *s = sin + t * half;
            for (int64_t h = 0; h < heads; ++h) {
                float *a = x + t * token_stride + h * head_dim, *b = a + half;
#pragma omp simd
                for (int64_t d = 0; d < half; ++d) {
                    const float first = a[d], second = b[d];
                    a[d] = first * c[d] - second * s[d];
                    b[d] = second * c[d] + first * s[d];
                }
            }
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (parallel)
    for (int64_t pair = 0; pair < heads * half; ++pair) { /* feature-major: token_stride is 1 */
        const int64_t h = pair / half, d = pair % half;
        float *a = x + (h * head_dim + d) * feature_stride, *b = a + half * feature_stride;
        const float *c = cos + d * tokens, *s = sin + d * tokens;
#pragma omp simd
        for (int64_t t = 0; t < tokens; ++t) {
            const float first = a[t], second = b[t];
            a[t] = first * c[t] - second * s[t];
            b[t] = second * c[t] + first * s[t];
        }
    }
}
