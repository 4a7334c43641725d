/*
 * Decode attention over the paged KV cache, float32, for the CPU backend.
 *
 * One query token attends over the first `context_len` cached tokens of its sequence, read in place from
 * the blocks its block table names: a decode token over all of them, a prefill token over those up to its
 * own. The torch path gathers those blocks into a contiguous copy before SDPA, which moves the whole context
 * through memory three times; this kernel reads each key and value once. Decode attention on a CPU is bound
 * by memory bandwidth, so that is the whole gain.
 *
 * Cache layout (the kernel contract): [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
 * One sequence is one unit of work; its query heads are handled together so that every key and value row
 * serves all the heads that share it (GQA) while it is in cache. Keys are scored eight at a time and values
 * accumulate into registers, in whole vectors: head_dim must be a multiple of 8 (the caller checks).
 *
 * Built at first use with the system C compiler (kernels/cpu_native.py), for the host CPU.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "parallel.h"
#include "vector_math.h"

/*
 * row[t] = scale * q . key_t for t < n, keys `stride` floats apart. Eight keys at a time: each keeps a vector
 * of partial sums over head_dim, and one transpose-and-add turns the eight into eight scores.
 */
static void block_scores(float *restrict row, const float *restrict q, const float *restrict keys, int64_t stride,
                         int n, int head_dim, float scale) {
    int t = 0;
    for (; t + LANES <= n; t += LANES) {
        const float *k = keys + t * stride;
        vec s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, s4 = {0}, s5 = {0}, s6 = {0}, s7 = {0};
        for (int d = 0; d < head_dim; d += LANES) {
            const vec qd = load(q + d);
            s0 += qd * load(k + d), s1 += qd * load(k + stride + d);
            s2 += qd * load(k + 2 * stride + d), s3 += qd * load(k + 3 * stride + d);
            s4 += qd * load(k + 4 * stride + d), s5 += qd * load(k + 5 * stride + d);
            s6 += qd * load(k + 6 * stride + d), s7 += qd * load(k + 7 * stride + d);
        }
        store(row + t, splat(scale) * transposed_sums(s0, s1, s2, s3, s4, s5, s6, s7));
    }
    for (; t < n; ++t) {
        vec s = {0};
        for (int d = 0; d < head_dim; d += LANES) s += load(q + d) * load(keys + t * stride + d);
        row[t] = scale * horizontal_sum(s);
    }
}

/*
 * Asks for part `part` of `parts` of a block (NULL: none) to be brought into L2. Called for the next block,
 * one part per query head, while the current block is computed: blocks sit at random places in the cache,
 * where the hardware prefetcher cannot follow them, and spreading the requests keeps them from queueing up
 * at once (measured: ~1.3x on a decode step's attention at batch 64, 256 tokens).
 */
static inline void prefetch_part(const float *block, int64_t floats, int part, int parts) {
    if (block == NULL) return;
    enum { LINE = 64 };
    const char *bytes = (const char *)block;
    const int64_t size = floats * (int64_t)sizeof(float), share = (size / parts + LINE - 1) / LINE * LINE;
    const int64_t end = (part + 1) * share < size ? (part + 1) * share : size;
    for (int64_t offset = part * share; offset < end; offset += LINE) __builtin_prefetch(bytes + offset, 0, 2);
}

/*
 * scores[h * n + t] = scale * q_h . k_(begin + t) for every query head h and token t < n = end - begin: the
 * tokens [begin, end) of the sequence, the first and last of their blocks possibly partial (a sliding window).
 */
static void attention_scores(float *scores, const float *query, const float *k_cache, const int32_t *table,
                             int begin, int end, int num_heads, int num_kv_heads, int head_dim, int block_size,
                             float scale) {
    const int group = num_heads / num_kv_heads, len = end - begin;
    const int64_t stride = (int64_t)num_kv_heads * head_dim;  // from one token's row to the next in a block
    const int64_t block_floats = block_size * stride;
    for (int first = begin; first < end;) {
        const int offset = first % block_size, n = end - first < block_size - offset ? end - first : block_size - offset;
        const float *block = k_cache + (int64_t)table[first / block_size] * block_floats + offset * stride;
        const int next_first = first + n;
        const float *next =
            next_first < end ? k_cache + (int64_t)table[next_first / block_size] * block_floats : NULL;
        for (int h = 0; h < num_heads; ++h) {
            prefetch_part(next, block_floats, h, num_heads);
            block_scores(scores + (int64_t)h * len + (first - begin), query + (int64_t)h * head_dim,
                         block + (h / group) * head_dim, stride, n, head_dim, scale);
        }
        first = next_first;
    }
}

/*
 * In place: score s becomes cap * tanh(s / cap), Gemma 2's soft-capping of attention logits. tanh from
 * exp_negative, which vectorises where libm's tanhf does not: tanhf added ~25% to a decode step's attention
 * at 8k tokens, this about nothing (measured on 2 shared cores).
 */
static void cap_scores(float *scores, int64_t count, float cap) {
    const float inverse = 1.0f / cap;
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) {
        const float x = scores[i] * inverse, e = exp_negative(2.0f * fabsf(x));
        const float magnitude = (1.0f - e) / (1.0f + e);
        scores[i] = cap * (x < 0.0f ? -magnitude : magnitude);
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

/*
 * acc += sum_t weight[t] * value_t for t < n, values `stride` floats apart. Eight vectors of acc (64 floats)
 * stay in registers over all n values; head_dim % 64 goes one vector at a time.
 */
static void block_values(float *restrict acc, const float *restrict weight, const float *restrict values,
                         int64_t stride, int n, int head_dim) {
    int d = 0;
    for (; d + 8 * LANES <= head_dim; d += 8 * LANES) {
        float *a = acc + d;
        vec a0 = load(a), a1 = load(a + LANES), a2 = load(a + 2 * LANES), a3 = load(a + 3 * LANES);
        vec a4 = load(a + 4 * LANES), a5 = load(a + 5 * LANES), a6 = load(a + 6 * LANES), a7 = load(a + 7 * LANES);
        for (int t = 0; t < n; ++t) {
            const float *v = values + t * stride + d;
            const vec w = splat(weight[t]);
            a0 += w * load(v), a1 += w * load(v + LANES), a2 += w * load(v + 2 * LANES);
            a3 += w * load(v + 3 * LANES), a4 += w * load(v + 4 * LANES), a5 += w * load(v + 5 * LANES);
            a6 += w * load(v + 6 * LANES), a7 += w * load(v + 7 * LANES);
        }
        store(a, a0), store(a + LANES, a1), store(a + 2 * LANES, a2), store(a + 3 * LANES, a3);
        store(a + 4 * LANES, a4), store(a + 5 * LANES, a5), store(a + 6 * LANES, a6), store(a + 7 * LANES, a7);
    }
    for (; d < head_dim; d += LANES) {
        vec a = load(acc + d);
        for (int t = 0; t < n; ++t) a += splat(weight[t]) * load(values + t * stride + d);
        store(acc + d, a);
    }
}

/* out[h] = sum_t weights[h][t] * v_(begin + t), for every query head h and token t < end - begin. */
static void weighted_values(float *out, const float *weights, const float *v_cache, const int32_t *table, int begin,
                            int end, int num_heads, int num_kv_heads, int head_dim, int block_size) {
    const int group = num_heads / num_kv_heads, len = end - begin;
    const int64_t stride = (int64_t)num_kv_heads * head_dim, block_floats = block_size * stride;
    for (int64_t i = 0; i < (int64_t)num_heads * head_dim; ++i) out[i] = 0.0f;
    for (int first = begin; first < end;) {
        const int offset = first % block_size, n = end - first < block_size - offset ? end - first : block_size - offset;
        const float *block = v_cache + (int64_t)table[first / block_size] * block_floats + offset * stride;
        const int next_first = first + n;
        const float *next =
            next_first < end ? v_cache + (int64_t)table[next_first / block_size] * block_floats : NULL;
        for (int h = 0; h < num_heads; ++h) {
            prefetch_part(next, block_floats, h, num_heads);
            block_values(out + (int64_t)h * head_dim, weights + (int64_t)h * len + (first - begin),
                         block + (h / group) * head_dim, stride, n, head_dim);
        }
        first = next_first;
    }
}

typedef struct {
    float *out;
    const float *query, *k_cache, *v_cache;
    const int32_t *block_tables, *context_lens;
    const int64_t *seq_ids, *query_rows;
    int64_t block_table_stride;
    int num_heads, num_kv_heads, head_dim, block_size;
    int window;      // > 0: a token sees only the last `window` tokens, its own included (sliding-window layers)
    float scale;
    float soft_cap;  // > 0: scores soft-capped (see cap_scores)
    _Atomic int failed;
} attention_job;

/* Query tokens [begin, end) of the work list. */
static void attend(void *context, int64_t begin, int64_t end) {
    attention_job *job = context;
    const int64_t row_floats = (int64_t)job->num_heads * job->head_dim;
    for (int64_t i = begin; i < end; ++i) {
        const int64_t seq = job->seq_ids[i];
        const int len = job->context_lens[i];
        const int begin = job->window > 0 && len > job->window ? len - job->window : 0;
        const int32_t *table = job->block_tables + seq * job->block_table_stride;
        float *out = job->out + job->query_rows[i] * row_floats;
        if (len <= 0) {  // nothing to attend to (never so for a real token): zeros, not NaN
            for (int64_t j = 0; j < row_floats; ++j) out[j] = 0.0f;
            continue;
        }
        float *scores = malloc(sizeof(float) * (size_t)job->num_heads * (size_t)(len - begin));
        if (scores == NULL) {
            atomic_store(&job->failed, 1);
            continue;
        }
        attention_scores(scores, job->query + job->query_rows[i] * row_floats, job->k_cache, table, begin, len,
                         job->num_heads, job->num_kv_heads, job->head_dim, job->block_size, job->scale);
        if (job->soft_cap > 0.0f) cap_scores(scores, (int64_t)job->num_heads * (len - begin), job->soft_cap);
        softmax_rows(scores, job->num_heads, len - begin);
        weighted_values(out, scores, job->v_cache, table, begin, len, job->num_heads, job->num_kv_heads,
                        job->head_dim, job->block_size);
        free(scores);
    }
}

/*
 * For each i < num_queries: row query_rows[i] of query/out ([rows, num_heads, head_dim], contiguous) over the
 * first context_lens[i] cached tokens of sequence seq_ids[i] (its row of block_tables), or the last `window` of
 * them where window > 0; scores soft-capped at soft_cap where it is > 0. Returns 0, or -1 if scratch memory ran
 * out (out is then partly written and must be discarded).
 */
int paged_decode_attention_f32(float *out, const float *query, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t block_table_stride, const int32_t *context_lens,
                               const int64_t *seq_ids, const int64_t *query_rows, int64_t num_queries,
                               int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                               int window, float soft_cap, int num_threads) {
    attention_job job = {.out = out,
                         .query = query,
                         .k_cache = k_cache,
                         .v_cache = v_cache,
                         .block_tables = block_tables,
                         .context_lens = context_lens,
                         .seq_ids = seq_ids,
                         .query_rows = query_rows,
                         .block_table_stride = block_table_stride,
                         .num_heads = num_heads,
                         .num_kv_heads = num_kv_heads,
                         .head_dim = head_dim,
                         .block_size = block_size,
                         .window = window,
                         .scale = scale,
                         .soft_cap = soft_cap};
    /* One query a chunk, longest first (the caller's order): the threads run out of work together. */
    parallel_for(num_queries, 1, num_threads, attend, &job);
    return atomic_load(&job.failed) ? -1 : 0;
}
