/*
 * y = x @ W^T + bias for a few tokens with W in a block format and x quantized to 8 bits, for the CPU: the
 * product llama.cpp computes (ggml's vec_dot of a weight type with Q8_0 / Q8_K activations).
 *
 * quantized_linear.c and kquant_linear.c keep x in float32 and turn each weight block into floats: per weight,
 * a conversion and a multiply-add, which at one token is more work than the memory system needs to deliver the
 * block (one stream of a 1B-parameter Q4_0 model read ~10.5 GB/s of weights where llama.cpp reads ~17). Here
 * each token's x is quantized once per call (q8_activations.c) and a block meets it in byte dot products:
 * 32 weights in a few instructions, integer and exact, scaled once per 32 (int8_dot_blocks.c,
 * int8_dot_kquants.c). The price is x's rounding to 8 bits per block of 32 (a relative error of about 0.4% a
 * feature), so results differ from the float32 path's by more than rounding: engine/config.py's
 * activation_dtype chooses.
 *
 * Same calling convention as quantized_linear_f32. Rows split across threads as there (two sequential runs a
 * thread for one token); each row is read from memory once and, for further tokens, from L1.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "int8_activations.h"
#include "parallel.h"
#include "rows8.h"

/* One weight format: ggml's type id, its block, its row dots with 8-bit activations and its tile dots with
 * 16-bit ones, and whether those read x in nibble order (nibble_order_q16); or a layout of rows interleaved eight
 * at a time (rows8.h), which only its group tiles read, with 16-bit tokens, and whether they read the tokens'
 * sums of 16 (q16_token's sums16). */
typedef struct {
    int ggml_type;
    int64_t block_weights, block_bytes;
    int8_row_dot *dot8;
    int16_tile_dot *tile16;
    int nibble_order;
    rows8_tile *group_tile;
    int sums16;
} int8_format;

static const int8_format FORMATS[] = {
    {8, 32, 34, int8_dot_q8_0, int16_tile_q8_0, 0},    {2, 32, 18, int8_dot_q4_0, int16_tile_q4_0, 1},
    {3, 32, 20, int8_dot_q4_1, int16_tile_q4_1, 1},    {12, 256, 144, int8_dot_q4_k, int16_tile_q4_k, 0},
    {13, 256, 176, int8_dot_q5_k, int16_tile_q5_k, 0}, {14, 256, 210, int8_dot_q6_k, int16_tile_q6_k, 0},
    {ROWS8_Q4_0_TYPE, 32, 18, NULL, NULL, 0, q4_0_rows8_tile},
    {ROWS8_Q4_K_TYPE, 256, 144, NULL, NULL, 0, q4_k_rows8_tile},
    {ROWS8_Q6_K_TYPE, 256, 210, NULL, NULL, 0, q6_k_rows8_tile, 1},
};

/* Weights a unit of parallel work holds at least when many tokens share each row (as block_rows.c). */
enum { GRAIN_WEIGHTS = 32768 };

static const int8_format *format_of(int ggml_type) {
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; ++i)
        if (FORMATS[i].ggml_type == ggml_type) return FORMATS + i;
    return NULL;
}

typedef struct {
    const int8_format *format;
    float *y;
    int64_t ldy_token, ldy_row;
    const q8_token *tokens8;   /* one of these two: the tokens quantized to 8 or to 16 bits */
    const q16_token *tokens16;
    const int8_t *pairs; /* the 16-bit tokens for the tile unit (amx_pair_tokens), AMX_TOKENS a group; or NULL */
    const uint8_t *w;
    const float *bias;
    int64_t M, blocks, row_bytes;
} int8_job;

/* y for rows [n, n + rows) and tokens [m, m + tokens) from a tile's sums (row r, token t at r * row_stride +
 * t * token_stride), plus the bias. Where a token's sums and its y are both runs of `rows` floats (the vector
 * tiles' sums, a token-major y), each run is one copy: read a float at a time, every load waited on the tile's
 * vector store (4.9% of an 8-token product's time on the interleaved layouts, under 1% so). */
static void store_sums(const int8_job *job, int64_t n, int rows, int64_t m, int tokens, const float *sums,
                       int row_stride, int token_stride) {
    if (row_stride == 1 && job->ldy_row == 1) {
        for (int t = 0; t < tokens; ++t) {
            float *y = job->y + (m + t) * job->ldy_token + n;
            memcpy(y, sums + t * token_stride, sizeof(float) * (size_t)rows);
            if (job->bias)
                for (int r = 0; r < rows; ++r) y[r] += job->bias[n + r];
        }
        return;
    }
    for (int r = 0; r < rows; ++r)
        for (int t = 0; t < tokens; ++t)
            job->y[(n + r) * job->ldy_row + (m + t) * job->ldy_token] =
                sums[r * row_stride + t * token_stride] + (job->bias ? job->bias[n + r] : 0.0f);
}

static int tokens_from(const int8_job *job, int64_t m, int most) {
    return job->M - m < most ? (int)(job->M - m) : most;
}

/* The most tokens a 16-bit tile takes here. With AVX2's 16 vector registers a tile of TILE_TOKENS spills (Zen 3,
 * in cache: 1.07-1.41x the time a token of the same format's best tile of 4-6); AVX-512's 32 hold it. */
#if defined(__AVX512VL__)
enum { WIDEST_TILE = TILE_TOKENS };
#else
enum { WIDEST_TILE = TILE_TOKENS - 1 };
#endif

/* Tokens of the next 16-bit tile with `left` tokens to go: as even a split as tiles of at most WIDEST_TILE allow
 * (with 7: 8 as 4 + 4, 12 as 6 + 6). */
static int next_tile_tokens(int64_t left) {
    const int64_t tiles = (left + WIDEST_TILE - 1) / WIDEST_TILE;
    return (int)((left + tiles - 1) / tiles);
}

/* Rows [n, n + rows) times every 16-bit token, a tile at a time (a row is read from L1 for every tile but the
 * first). */
static void int16_rows(const int8_job *job, int64_t n, int rows) {
    float sums[2 * TILE_TOKENS];
    for (int64_t m = 0, tokens; m < job->M; m += tokens) {
        tokens = next_tile_tokens(job->M - m);
        job->format->tile16(job->w + n * job->row_bytes, job->row_bytes, rows, job->tokens16 + m, tokens, job->blocks,
                            sums);
        store_sums(job, n, rows, m, tokens, sums, TILE_TOKENS, 1);
    }
}

/* Row groups [begin, end) of AMX_ROWS rows times every 16-bit token, AMX_TOKENS at a time, on the tile unit. */
static void tile_unit_rows(void *context, int64_t begin, int64_t end) {
    const int8_job *job = context;
    float sums[AMX_TOKENS * AMX_ROWS];
    amx_begin();
    for (int64_t m = 0; m < job->M; m += AMX_TOKENS) {
        const int tokens = tokens_from(job, m, AMX_TOKENS);
        const int8_t *pairs = job->pairs + m / AMX_TOKENS * job->blocks * AMX_PAIR_BYTES;
        for (int64_t n = begin * AMX_ROWS; n < end * AMX_ROWS; n += AMX_ROWS) {
            amx_tile_dot(job->format->ggml_type, job->w + n * job->row_bytes, job->row_bytes, pairs,
                         job->tokens16 + m, tokens, job->blocks, sums);
            store_sums(job, n, AMX_ROWS, m, tokens, sums, 1, AMX_ROWS);
        }
    }
    amx_end();
}

/* Output rows [begin, end), every token: 16-bit tokens two rows at a time, 8-bit ones a row and token at a time. */
static void int8_rows(void *context, int64_t begin, int64_t end) {
    const int8_job *job = context;
    if (job->tokens16) {
        for (int64_t n = begin; n < end; n += 2) int16_rows(job, n, end - n >= 2 ? 2 : 1);
        return;
    }
    for (int64_t n = begin; n < end; ++n) {
        const uint8_t *row = job->w + n * job->row_bytes;
        const float bias = job->bias ? job->bias[n] : 0.0f;
        for (int64_t m = 0; m < job->M; ++m)
            job->y[n * job->ldy_row + m * job->ldy_token] = job->format->dot8(row, job->tokens8 + m, job->blocks) + bias;
    }
}

/* Tokens a group tile takes at once (rows8.h). */
enum { ROWS8_TOKENS = 4 };

/* Row groups [begin, end) of a layout of ROW_GROUP interleaved rows, every 16-bit token ROWS8_TOKENS at a time (a
 * group's rows read from L1 or L2 for every tile but the first). */
static void rows8_groups(void *context, int64_t begin, int64_t end) {
    const int8_job *job = context;
    float sums[ROWS8_TOKENS * ROW_GROUP];
    for (int64_t g = begin; g < end; ++g)
        for (int64_t m = 0; m < job->M; m += ROWS8_TOKENS) {
            const int tokens = tokens_from(job, m, ROWS8_TOKENS);
            job->format->group_tile(job->w + g * ROW_GROUP * job->row_bytes, job->blocks, job->tokens16 + m, tokens,
                                    sums);
            store_sums(job, g * ROW_GROUP, ROW_GROUP, m, tokens, sums, 1, ROW_GROUP);
        }
}

/* Tokens of group g (AMX_TOKENS a group) of M. */
static int tokens_of_group(int64_t M, int64_t g) {
    return M - g * AMX_TOKENS < AMX_TOKENS ? (int)(M - g * AMX_TOKENS) : AMX_TOKENS;
}

/* Whether int8_linear_f32 multiplies weights of ggml type `ggml_type` (interleaved rows only meet 16 bits). */
int int8_linear_supports(int ggml_type) {
    const int8_format *format = format_of(ggml_type);
    return format != NULL && format->group_tile == NULL;
}

/* int8_linear_f32 (below) with x quantized to `bits` (8 or 16) bits. */
static int integer_linear(int bits, float *y, int64_t ldy_token, int64_t ldy_row, const float *x, int64_t ldx,
                          const uint8_t *w, const float *bias, int64_t M, int64_t N, int64_t K, int ggml_type,
                          int num_threads) {
    const int8_format *format = format_of(ggml_type);
    if (format == NULL || K <= 0 || K % format->block_weights != 0) return -1;
    const int rows8 = format->group_tile != NULL;
    if (rows8 && (bits != 16 || N % ROW_GROUP != 0)) return -1;
    if (M <= 0) return 0;
    const int64_t blocks = K / Q8_BLOCK, value_bytes = bits / 8;
    /* From two tokens, the tile unit where it takes the format and the rows come in its groups. */
    const int tile_unit = bits == 16 && M >= 2 && N % AMX_ROWS == 0 && amx_tiles_for(ggml_type);
    const int64_t token_groups = (M + AMX_TOKENS - 1) / AMX_TOKENS;
    /* Scratch: each token's description, scales and sums (floats first, for their alignment), the sums of 16 where
     * the format reads them, then integers; the tile unit's byte pairs of them apart. */
    const size_t token_bytes = sizeof(q8_token) > sizeof(q16_token) ? sizeof(q8_token) : sizeof(q16_token);
    const int64_t sums16 = format->sums16 ? K / 16 : 0;
    void *scratch = malloc((size_t)M * (token_bytes + (size_t)blocks * 2 * sizeof(float) + (size_t)sums16 * 4 +
                                        (size_t)(K * value_bytes)));
    int8_t *pairs = tile_unit ? aligned_alloc(64, (size_t)(token_groups * blocks * AMX_PAIR_BYTES)) : NULL;
    if (scratch == NULL || (tile_unit && pairs == NULL)) {
        free(scratch);
        free(pairs);
        return -2;
    }
    float *scales = (float *)((char *)scratch + (size_t)M * token_bytes);
    int32_t *sums_of_16 = (int32_t *)(scales + 2 * M * blocks);
    char *ints = (char *)(sums_of_16 + M * sums16);
    q8_token *tokens8 = bits == 8 ? scratch : NULL;
    q16_token *tokens16 = bits == 16 ? scratch : NULL;
    for (int64_t m = 0; m < M; ++m) {
        float *d = scales + 2 * m * blocks, *s = d + blocks;
        void *q = ints + m * K * value_bytes;
        if (tokens16) {
            quantize_q16(q, d, s, x + m * ldx, K);
            if (format->nibble_order && !tile_unit) nibble_order_q16(q, K);
            int32_t *sums = sums16 ? sums_of_16 + m * sums16 : NULL;
            if (sums) sums_of_16_q16(sums, q, K);
            tokens16[m] = (q16_token){q, d, s, sums};
        } else {
            quantize_q8(q, d, s, x + m * ldx, K);
            tokens8[m] = (q8_token){q, d, s};
        }
    }
    for (int64_t g = 0; tile_unit && g < token_groups; ++g)
        amx_pair_tokens(pairs + g * blocks * AMX_PAIR_BYTES, tokens16 + g * AMX_TOKENS,
                        tokens_of_group(M, g), blocks);
    const int64_t row_bytes = K / format->block_weights * format->block_bytes;
    int8_job job = {format, y,    ldy_token, ldy_row, tokens8, tokens16, pairs, w, bias, M, K / format->block_weights,
                    row_bytes};
    const int64_t work = K * M, least = work >= GRAIN_WEIGHTS ? 1 : GRAIN_WEIGHTS / work;
    if (rows8)
        parallel_for(N / ROW_GROUP,
                     M == 1 ? sequential_runs_grain(N / ROW_GROUP, 1 + least / ROW_GROUP, num_threads)
                            : 1 + least / ROW_GROUP,
                     num_threads, rows8_groups, &job);
    else if (tile_unit) /* each thread's share of the row groups in two sequential runs: one tile configuration each */
        parallel_for(N / AMX_ROWS, sequential_runs_grain(N / AMX_ROWS, 1, num_threads), num_threads,
                     tile_unit_rows, &job);
    else
        parallel_for(N, M == 1 ? sequential_runs_grain(N, least, num_threads) : least, num_threads, int8_rows, &job);
    free(scratch);
    free(pairs);
    return 0;
}

/*
 * y[m, n] = sum_k W[n, k] * x8[m, k] + bias[n] (bias may be NULL), x8 = x quantized to 8 bits a block of 32
 * (int8_activations.h), for m < M tokens and n < N rows, W in the format of ggml type id `ggml_type`, N rows of
 * K / block weights blocks each, contiguous. x token-major (rows ldx floats apart); y written with strides
 * ldy_token and ldy_row. Returns 0; -1 (y untouched) for a type without an int8 kernel or a K that is not a
 * positive multiple of its block; -2 if scratch memory ran out.
 */
int int8_linear_f32(float *y, int64_t ldy_token, int64_t ldy_row, const float *x, int64_t ldx, const uint8_t *w,
                    const float *bias, int64_t M, int64_t N, int64_t K, int ggml_type, int num_threads) {
    return integer_linear(8, y, ldy_token, ldy_row, x, ldx, w, bias, M, N, K, ggml_type, num_threads);
}

/* int8_linear_f32 with x quantized to 16 bits a block of 32 (q16_token). */
int int16_linear_f32(float *y, int64_t ldy_token, int64_t ldy_row, const float *x, int64_t ldx, const uint8_t *w,
                     const float *bias, int64_t M, int64_t N, int64_t K, int ggml_type, int num_threads) {
    return integer_linear(16, y, ldy_token, ldy_row, x, ldx, w, bias, M, N, K, ggml_type, num_threads);
}

/* The 8-bit quantization of x [M, K] (rows ldx floats apart) that int8_linear_f32 multiplies by, into q [M, K],
 * d and s [M, K / 32], for tests to check against a reference. Returns 0, or -1 for a K not a multiple of 32. */
int quantize_q8_f32(int8_t *q, float *d, float *s, const float *x, int64_t ldx, int64_t M, int64_t K) {
    if (K <= 0 || K % Q8_BLOCK != 0) return -1;
    for (int64_t m = 0; m < M; ++m)
        quantize_q8(q + m * K, d + m * (K / Q8_BLOCK), s + m * (K / Q8_BLOCK), x + m * ldx, K);
    return 0;
}

/* The instruction set this build's int8 kernels use: 2 AVX-512 VNNI, 1 AVX2, 0 portable C. */
int int8_kernel_path(void) {
#if defined(INT8_VNNI)
    return 2;
#elif defined(INT8_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* quantize_q8_f32 to 16 bits. */
int quantize_q16_f32(int16_t *q, float *d, float *s, const float *x, int64_t ldx, int64_t M, int64_t K) {
    if (K <= 0 || K % Q8_BLOCK != 0) return -1;
    for (int64_t m = 0; m < M; ++m)
        quantize_q16(q + m * K, d + m * (K / Q8_BLOCK), s + m * (K / Q8_BLOCK), x + m * ldx, K);
    return 0;
}
