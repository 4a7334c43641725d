/*
 * The row kernels of one block-format file, from its format-specific pieces: a template, included (once) by
 * quantized_linear.c and kquant_linear.c after they define
 *   enum format, BLOCK_WEIGHTS (weights a block), BLOCK_BYTES[format] and, for each format F, F##_BYTES, the
 *   same as a constant expression (which BLOCK_BYTES[F] is not, in C) for its block_format;
 *   unpack_block(block, format): what a block's groups share (scales), once per block;
 *   dequantize_group(block, &unpacked, format, j, w): group j's 32 weights in the order x is read;
 *   store_group(out, w): such a group in weight order;
 *   row_single(y, x, x_sums, row, blocks, bias, format): a single_kernel, for one constant format;
 *   and optionally UNROLL_GROUPS (below).
 * Every piece is always inlined with a constant format (and here a constant token count), so that each
 * instance keeps only its format's code and its vectors in registers; BLOCK_KERNELS(format) instantiates
 * them, and BLOCK_FORMAT(...) is that format's block_format.
 */
#include "block_rows.h"
#include "vector_math.h"

/* The format file's pragma for the loop over a block's groups, if any: a block of one group takes none, which
 * would only move GCC's loop increments around. */
#ifndef UNROLL_GROUPS
#define UNROLL_GROUPS
#endif

/*
 * y[t * ldy_token] = sum_k w[k] * x[t * ldx + k] + bias, t < tokens, for one weight row of `blocks` blocks,
 * dequantizing each group once for all the tokens.
 */
static inline __attribute__((always_inline)) void row_tile(float *y, int64_t ldy_token, const float *x, int64_t ldx,
                                                           const uint8_t *row, int64_t blocks, float bias,
                                                           const enum format format, const int tokens) {
    /* Named accumulators, not an array: GCC keeps these in registers through the block loop. */
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * BLOCK_BYTES[format];
        const __auto_type unpacked = unpack_block(block, format);
        UNROLL_GROUPS
        for (int j = 0; j < BLOCK_WEIGHTS / GROUP; ++j) {
            vec w[4];
            dequantize_group(block, &unpacked, format, j, w);
            const float *xg = x + b * BLOCK_WEIGHTS + j * GROUP;
            /* One or two tokens: the four products summed first, so that each group adds one dependent
             * operation, not four, to the accumulator's chain. From three tokens the chains interleave and one
             * fused multiply-add per product is faster (measured: 7-11% at 3-8 tokens, Zen 3). */
#define ACCUMULATE(t)                                                                                             \
    if (tokens > t) {                                                                                             \
        const float *xt = xg + t * ldx;                                                                           \
        if (tokens >= 3) {                                                                                        \
            a##t += w[0] * load(xt);                                                                              \
            a##t += w[1] * load(xt + LANES);                                                                      \
            a##t += w[2] * load(xt + 2 * LANES);                                                                  \
            a##t += w[3] * load(xt + 3 * LANES);                                                                  \
        } else {                                                                                                  \
            a##t += w[0] * load(xt) + w[1] * load(xt + LANES) + w[2] * load(xt + 2 * LANES) +                     \
                    w[3] * load(xt + 3 * LANES);                                                                  \
        }                                                                                                         \
    }
            ACCUMULATE(0) ACCUMULATE(1) ACCUMULATE(2) ACCUMULATE(3) ACCUMULATE(4) ACCUMULATE(5) ACCUMULATE(6)
            ACCUMULATE(7)
#undef ACCUMULATE
        }
    }
    const vec sums = transposed_sums(a0, a1, a2, a3, a4, a5, a6, a7); /* lane t: token t's dot product */
    for (int t = 0; t < tokens; ++t) y[t * ldy_token] = sums[t] + bias;
}

/* One row of K weights as float32, in order. */
static inline __attribute__((always_inline)) void dequantize_row_of(float *out, const uint8_t *row, int64_t K,
                                                                    const enum format format) {
    const uint8_t *block = row;
    for (const float *end = out + K; out < end; out += BLOCK_WEIGHTS, block += BLOCK_BYTES[format]) {
        const __auto_type unpacked = unpack_block(block, format);
        UNROLL_GROUPS
        for (int j = 0; j < BLOCK_WEIGHTS / GROUP; ++j) {
            vec w[4];
            dequantize_group(block, &unpacked, format, j, w);
            store_group(out + j * GROUP, w);
        }
    }
}

/* A format's kernels, as plain functions for its block_format. */
#define TILE_KERNEL(format, tokens)                                                                               \
    static void tile_##format##_##tokens(float *y, int64_t ldy_token, const float *x, int64_t ldx,                \
                                         const uint8_t *row, int64_t blocks, float bias) {                        \
        row_tile(y, ldy_token, x, ldx, row, blocks, bias, format, tokens);                                        \
    }
#define BLOCK_KERNELS(format)                                                                                     \
    static void single_##format(float *y, const float *x, const float *x_sums, const uint8_t *row, int64_t blocks, \
                                float bias) {                                                                     \
        row_single(y, x, x_sums, row, blocks, bias, format);                                                      \
    }                                                                                                             \
    static void dequantize_row_##format(float *out, const uint8_t *row, int64_t K, int ggml_type) {               \
        (void)ggml_type;                                                                                          \
        dequantize_row_of(out, row, K, format);                                                                   \
    }                                                                                                             \
    TILE_KERNEL(format, 1) TILE_KERNEL(format, 2) TILE_KERNEL(format, 3) TILE_KERNEL(format, 4)                   \
    TILE_KERNEL(format, 5) TILE_KERNEL(format, 6) TILE_KERNEL(format, 7) TILE_KERNEL(format, 8)

/* The block_format of a format BLOCK_KERNELS instantiated: its ggml type id, whether its single-token kernel
 * reads x's group sums, and how it orders x (NULL: as it is). */
#define BLOCK_FORMAT(format, ggml_type, single_sums, order_x)                                                     \
    {ggml_type, BLOCK_WEIGHTS, format##_BYTES, single_sums, order_x, single_##format,                             \
     {tile_##format##_1, tile_##format##_2, tile_##format##_3, tile_##format##_4,                                 \
      tile_##format##_5, tile_##format##_6, tile_##format##_7, tile_##format##_8},                                \
     dequantize_row_##format}
