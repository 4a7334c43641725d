/*
 * y = x @ W^T + bias for a block-format W and many tokens, by float32 tiles.
 *
 * From TILE_TOKENS tokens the block-format kernels (quantized_linear.c, kquant_linear.c) come here, whatever
 * the count, prefill steps included: SKINNY_ROWS rows at a time are dequantized into a float32 scratch tile and
 * multiplied with skinny_linear.c's register tile, which broadcasts each weight to two vectors of tokens. The
 * tokens go in blocks whose activations stay in L2 (block_tokens); each block dequantizes the weight again,
 * which at 64 tokens costs under a tenth of the products. Below TILE_TOKENS, dequantizing in registers for
 * each pass over a few tokens costs less than the scratch round trip. Measured
 * (benchmarks/quantized_linear.py, Q4_1, SmolLM2's projections, 2 cores, AVX2): the tiles 0.7-0.75x as fast at
 * 8 tokens, 1.2-1.5x at 16, 1.5-2.3x at 32; and from 128 to 2048 tokens, where dequantizing 256 rows at a time
 * into torch's matmul ran at 40-115 GFLOP/s, varying from run to run, these ran at 85-125.
 */
#include <stdint.h>
#include <stdlib.h>

#include "dequantized_tiles.h"
#include "parallel.h"
#include "skinny_linear.h"

/* Tokens of one register tile's pass: two vectors of eight. */
enum { LANES_PER_PASS = 16 };

typedef struct {
    float *y;
    int64_t ldy_token, ldy_row;
    const float *xt, *tail_x; /* xt: the block's activations, [K, M] */
    const uint8_t *w;
    const float *bias;
    int64_t M, N, K, row_bytes;
    int ggml_type;
    row_dequantizer *dequantize_row;
    int failed; /* a thread could not get its scratch tile */
} tiles_job;

/* This thread's scratch of at least `floats`, kept between calls (the pool's threads live as long as the
 * process); NULL if memory ran out. */
static float *thread_scratch(int64_t floats) {
    static _Thread_local float *scratch = NULL;
    static _Thread_local int64_t capacity = 0;
    if (floats > capacity) {
        float *grown = realloc(scratch, sizeof(float) * (size_t)floats);
        if (grown == NULL) return NULL;
        scratch = grown;
        capacity = floats;
    }
    return scratch;
}

/* Row tiles [begin, end) of SKINNY_ROWS rows: dequantized into a scratch tile, then multiplied in float32 and
 * written straight into y, whichever its layout. */
static void dequantized_tiles(void *context, int64_t begin, int64_t end) {
    tiles_job *job = context;
    float *tile = thread_scratch(SKINNY_ROWS * job->K);
    if (tile == NULL) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t * SKINNY_ROWS;
        const int rows = job->N - n < SKINNY_ROWS ? (int)(job->N - n) : SKINNY_ROWS;
        for (int r = 0; r < rows; ++r)
            job->dequantize_row(tile + r * job->K, job->w + (n + r) * job->row_bytes, job->K, job->ggml_type);
        skinny_row_block_f32(job->y + n * job->ldy_row, job->ldy_row, job->ldy_token, job->xt, job->M, tile,
                             job->K, job->bias ? job->bias + n : NULL, job->M, rows, job->tail_x);
    }
}

typedef struct {
    float *xt;
    const float *x;
    int64_t ldx, M;
} transpose_job;

/* Input features [begin, end) of x into xt [K, M]: each token's run of them is read once, in order. */
static void transpose_features(void *context, int64_t begin, int64_t end) {
    const transpose_job *job = context;
    for (int64_t m = 0; m < job->M; ++m)
        for (int64_t k = begin; k < end; ++k) job->xt[k * job->M + m] = job->x[m * job->ldx + k];
}

/* Features a thread transposes at a time: a run of each token's row, and as many rows of xt in cache. */
enum { TRANSPOSE_GRAIN = 64 };
/* Tokens multiplied per pass over W: a block's activations stay in L2 (512 KiB a core and more) while every
 * row tile streams past them; fewer than 64 tokens only for inputs wider than 2048 features. */
enum { BLOCK_TOKENS = 64, BLOCK_BYTES_IN_L2 = 512 * 1024 };

static int64_t block_tokens(int64_t K) {
    int64_t tokens = BLOCK_BYTES_IN_L2 / ((int64_t)sizeof(float) * K) / LANES_PER_PASS * LANES_PER_PASS;
    if (tokens > BLOCK_TOKENS) tokens = BLOCK_TOKENS;
    return tokens < LANES_PER_PASS ? LANES_PER_PASS : tokens;
}

int linear_by_tiles(float *y, int64_t ldy_token, int64_t ldy_row, const float *x, int64_t ldx, const uint8_t *w,
                    const float *bias, int64_t M, int64_t N, int64_t K, int ggml_type, int64_t row_bytes,
                    row_dequantizer *dequantize_row, int num_threads) {
    const int64_t block = block_tokens(K), step = block < M ? block : M;
    /* One block's activations, compact: rows of a slice of an [K, M] copy would lie M floats apart, and at
     * M >= 1024 their stride maps every row to the same few cache sets (measured: half the speed). */
    float *xt = malloc(sizeof(float) * (size_t)(K * step));
    if (xt == NULL) return -2;
    int failed = 0;
    for (int64_t m = 0; m < M && !failed; m += step) {
        const int64_t tokens = M - m < step ? M - m : step;
        /* On every thread: done on the caller alone, the copy left the other threads idle for a tenth of a step. */
        transpose_job transpose = {xt, x + m * ldx, ldx, tokens};
        parallel_for(K, TRANSPOSE_GRAIN, num_threads, transpose_features, &transpose);
        float *tail_x = NULL;
        if (skinny_tail_f32(&tail_x, xt, tokens, tokens, K)) {
            failed = 1;
            break;
        }
        tiles_job job = {y + m * ldy_token, ldy_token, ldy_row, xt, tail_x, w, bias, tokens, N, K, row_bytes,
                         ggml_type, dequantize_row, 0};
        parallel_for((N + SKINNY_ROWS - 1) / SKINNY_ROWS, 2, num_threads, dequantized_tiles, &job);
        failed = job.failed;
        free(tail_x);
    }
    free(xt);
    return failed ? -2 : 0;
}
