/*
 * The row driver of the block-format kernels (block_rows.h): output rows split across threads, each row's blocks
 * read once from memory and then, for every further tile of TOKENS tokens, from L1. The per-format work is in
 * the kernels a block_format points to; calling them through its table costs one indirect call a row, as the
 * format files' own tables did.
 */
#include <stdint.h>
#include <stdlib.h>

#include "block_rows.h"
#include "parallel.h"
#include "vector_math.h"

/* Weights a unit of parallel work holds at least: a few microseconds of work (1024 32-weight blocks). */
enum { GRAIN_WEIGHTS = 32768 };

const block_format *block_format_of(const block_format *formats, int count, int ggml_type) {
    for (int i = 0; i < count; ++i)
        if (formats[i].ggml_type == ggml_type) return formats + i;
    return NULL;
}

/* Rows a unit of parallel work: GRAIN_WEIGHTS weights' work, counting a row once per pass over it, so that the
 * threads still finish together when many tokens make each row slow. */
static int64_t grain_rows(int64_t K, int64_t passes) {
    const int64_t work = K * (passes > 1 ? passes : 1);
    return work >= GRAIN_WEIGHTS ? 1 : GRAIN_WEIGHTS / work;
}

static int valid_width(const block_format *format, int64_t K) {
    return format != NULL && K > 0 && K % format->block_weights == 0;
}

typedef struct {
    const block_format *format;
    float *y;
    int64_t ldy_token, ldy_row;
    const float *x, *x_sums; /* x as the kernels read it; x_sums: a single token's group sums, or NULL */
    int64_t ldx;
    const uint8_t *w;
    const float *bias;
    int64_t M, blocks, row_bytes;
} linear_job;

/* Output rows [begin, end). */
static void linear_rows(void *context, int64_t begin, int64_t end) {
    const linear_job *job = context;
    const block_format *format = job->format;
    for (int64_t n = begin; n < end; ++n) {
        const uint8_t *row = job->w + n * job->row_bytes;
        const float bias = job->bias ? job->bias[n] : 0.0f;
        if (job->M == 1) {
            format->single(job->y + n * job->ldy_row, job->x, job->x_sums, row, job->blocks, bias);
            continue;
        }
        for (int64_t m = 0; m < job->M; m += TOKENS) {
            const int tokens = job->M - m < TOKENS ? (int)(job->M - m) : TOKENS;
            format->tiles[tokens - 1](job->y + m * job->ldy_token + n * job->ldy_row, job->ldy_token,
                                      job->x + m * job->ldx, job->ldx, row, job->blocks, bias);
        }
    }
}

int block_linear_f32(const block_format *format, float *y, int64_t ldy_token, int64_t ldy_row, const float *x,
                     int64_t ldx, const uint8_t *w, const float *bias, int64_t M, int64_t N, int64_t K,
                     int num_threads) {
    if (!valid_width(format, K)) return -1;
    if (M <= 0) return 0;
    const int64_t blocks = K / format->block_weights, row_bytes = blocks * format->block_bytes;
    if (M >= TILE_TOKENS)
        return linear_by_tiles(y, ldy_token, ldy_row, x, ldx, w, bias, M, N, K, format->ggml_type, row_bytes,
                               format->dequantize_row, num_threads);
    /* Scratch: x reordered (M x K) where the kernels want it so; then, for one token, its group sums where the
     * single-token kernel reads them. None at all for most calls. */
    const int64_t ordered = format->order_x ? M * K : 0, sums = M == 1 && format->single_sums ? K / GROUP : 0;
    float *scratch = NULL;
    if (ordered + sums > 0) {
        scratch = malloc(sizeof(float) * (size_t)(ordered + sums));
        if (scratch == NULL) return -2;
    }
    if (ordered) {
        for (int64_t m = 0; m < M; ++m) format->order_x(scratch + m * K, x + m * ldx, K);
        x = scratch;
        ldx = K;
    }
    float *x_sums = sums ? scratch + ordered : NULL;
    for (int64_t g = 0; g < sums; ++g) {
        const float *xg = x + g * GROUP;
        x_sums[g] = horizontal_sum(load(xg) + load(xg + LANES) + load(xg + 2 * LANES) + load(xg + 3 * LANES));
    }
    linear_job job = {format, y, ldy_token, ldy_row, x, x_sums, ldx, w, bias, M, blocks, row_bytes};
    /* One token streams its rows in two runs a thread (sequential_runs_grain); more take GRAIN_WEIGHTS a pass. */
    const int64_t grain = M == 1 ? sequential_runs_grain(N, grain_rows(K, 1), num_threads)
                                 : grain_rows(K, (M + TOKENS - 1) / TOKENS);
    parallel_for(N, grain, num_threads, linear_rows, &job);
    free(scratch);
    return 0;
}

typedef struct {
    const block_format *format;
    float *out;
    const uint8_t *w;
    int64_t K;
} dequantize_job;

/* Rows [begin, end) of W into out's rows, one call of the format's row dequantizer each. */
static void dequantize_rows(void *context, int64_t begin, int64_t end) {
    const dequantize_job *job = context;
    const block_format *format = job->format;
    const int64_t K = job->K, row_bytes = K / format->block_weights * format->block_bytes;
    for (int64_t n = begin; n < end; ++n)
        format->dequantize_row(job->out + n * K, job->w + n * row_bytes, K, format->ggml_type);
}

int block_dequantize_f32(const block_format *format, float *out, const uint8_t *w, int64_t N, int64_t K,
                         int num_threads) {
    if (!valid_width(format, K)) return -1;
    dequantize_job job = {format, out, w, K};
    parallel_for(N, grain_rows(K, 1), num_threads, dequantize_rows, &job);
    return 0;
}
