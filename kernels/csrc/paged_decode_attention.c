/*
 * Decode attention over the paged KV cache, float32, for the CPU backend.
 *
 * One new query token per sequence attends over all of its cached tokens, read in place from the blocks
 * its block table names. The torch path gathers those blocks into a contiguous copy before SDPA, which
 * moves the whole context through memory three times; this kernel reads each key and value once. Decode
 * attention on a CPU is bound by memory bandwidth, so that is the whole gain.
 *
 * Cache layout (the kernel contract): [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
 * One sequence is one unit of work; its query heads are handled together so that every key and value row
 * serves all the heads that share it (GQA) while it is in cache.
 *
 * Built at first use with the system C compiler (kernels/cpu_native.py), for the host CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

/* Rows a, b, c, d of keys (stride apart) against one query: four independent sums keep the FMA units busy. */
static inline void dot4(float *restrict out, const float *restrict query, const float *restrict key, int64_t stride,
                        int n, float scale) {
    const float *k0 = key, *k1 = key + stride, *k2 = key + 2 * stride, *k3 = key + 3 * stride;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int i = 0; i < n; ++i) {
        s0 += query[i] * k0[i];
        s1 += query[i] * k1[i];
        s2 += query[i] * k2[i];
        s3 += query[i] * k3[i];
    }
    out[0] = scale * s0, out[1] = scale * s1, out[2] = scale * s2, out[3] = scale * s3;
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
}

/* acc += sum of weight[j] * row j (rows stride apart), four rows per pass over acc. */
static inline void add_weighted_rows(float *restrict acc, const float *restrict weight, const float *restrict row,
                                     int64_t stride, int rows, int n) {
    int j = 0;
    for (; j + 4 <= rows; j += 4) {
        const float *r0 = row + j * stride, *r1 = r0 + stride, *r2 = r1 + stride, *r3 = r2 + stride;
        const float w0 = weight[j], w1 = weight[j + 1], w2 = weight[j + 2], w3 = weight[j + 3];
#pragma omp simd
        for (int i = 0; i < n; ++i) acc[i] += w0 * r0[i] + w1 * r1[i] + w2 * r2[i] + w3 * r3[i];
    }
    for (; j < rows; ++j) {
        const float *r = row + j * stride;
        const float w = weight[j];
#pragma omp simd
        for (int i = 0; i < n; ++i) acc[i] += w * r[i];
    }
}

/* scores[h * len + t] = scale * q_h . k_t for every query head h and token t < len. */
static void attention_scores(float *scores, const float *query, const float *k_cache, const int32_t *table,
                             int len, int num_heads, int num_kv_heads, int head_dim, int block_size,
                             float scale) {
    const int group = num_heads / num_kv_heads;
    const int64_t stride = (int64_t)num_kv_heads * head_dim;  // from one token's row to the next in a block
    for (int first = 0; first < len; first += block_size) {
        const float *block = k_cache + (int64_t)table[first / block_size] * block_size * stride;
        const int n = len - first < block_size ? len - first : block_size;
        for (int h = 0; h < num_heads; ++h) {
            const float *q = query + (int64_t)h * head_dim, *keys = block + (h / group) * head_dim;
            float *row = scores + (int64_t)h * len + first;
            int t = 0;
            for (; t + 4 <= n; t += 4) dot4(row + t, q, keys + t * stride, stride, head_dim, scale);
            for (; t < n; ++t) row[t] = scale * dot(q, keys + t * stride, head_dim);
        }
    }
}

/* In place: each head's row of scores becomes its softmax weights. */
static void softmax_rows(float *scores, int num_heads, int len) {
    for (int h = 0; h < num_heads; ++h) {
        float *row = scores + (int64_t)h * len;
        float max = row[0];
#pragma omp simd reduction(max : max)
        for (int t = 1; t < len; ++t) max = row[t] > max ? row[t] : max;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; ++t) {
            row[t] = exp_negative(max - row[t]);
            sum += row[t];
        }
        const float inverse = 1.0f / sum;
        for (int t = 0; t < len; ++t) row[t] *= inverse;
    }
}

/* out[h] = sum_t weights[h][t] * v_t, for every query head h. */
static void weighted_values(float *out, const float *weights, const float *v_cache, const int32_t *table, int len,
                            int num_heads, int num_kv_heads, int head_dim, int block_size) {
    const int group = num_heads / num_kv_heads;
    const int64_t stride = (int64_t)num_kv_heads * head_dim;
    for (int64_t i = 0; i < (int64_t)num_heads * head_dim; ++i) out[i] = 0.0f;
    for (int first = 0; first < len; first += block_size) {
        const float *block = v_cache + (int64_t)table[first / block_size] * block_size * stride;
        const int n = len - first < block_size ? len - first : block_size;
        for (int h = 0; h < num_heads; ++h)
            add_weighted_rows(out + (int64_t)h * head_dim, weights + (int64_t)h * len + first,
                              block + (h / group) * head_dim, stride, n, head_dim);
    }
}

/*
 * For each i < num_decodes: sequence seq_ids[i], whose query token is row query_rows[i] of query/out
 * ([rows, num_heads, head_dim], contiguous), over its seq_lens[seq] cached tokens. Returns 0, or -1 if
 * scratch memory ran out (out is then partly written and must be discarded).
 */
int paged_decode_attention_f32(float *out, const float *query, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t block_table_stride, const int32_t *seq_lens,
                               const int64_t *seq_ids, const int64_t *query_rows, int64_t num_decodes,
                               int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                               int num_threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t i = 0; i < num_decodes; ++i) {
        const int64_t seq = seq_ids[i];
        const int len = seq_lens[seq];
        const int32_t *table = block_tables + seq * block_table_stride;
        const int64_t row = query_rows[i] * num_heads * head_dim;
        if (len <= 0) {  // nothing to attend to (never so for a decode token): zeros, not NaN
            for (int64_t j = 0; j < (int64_t)num_heads * head_dim; ++j) out[row + j] = 0.0f;
            continue;
        }
        float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)len);
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        attention_scores(scores, query + row, k_cache, table, len, num_heads, num_kv_heads, head_dim, block_size,
                         scale);
        softmax_rows(scores, num_heads, len);
        weighted_values(out + row, scores, v_cache, table, len, num_heads, num_kv_heads, head_dim, block_size);
        free(scores);
    }
    return failed ? -1 : 0;
}
