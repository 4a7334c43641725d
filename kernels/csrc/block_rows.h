/*
 * The row driver of the block-format kernels (block_rows.c), shared by quantized_linear.c (32-weight blocks)
 * and kquant_linear.c (256-weight super-blocks). A format file keeps its own dequantization and dot products,
 * compiled into per-format row kernels (block_row_kernels.h), and describes each format by a block_format;
 * the driver does the rest, the same for all: checks, scratch for x, splitting rows across threads, token tiles
 * and the hand-off to dequantized_tiles.c.
 */
#ifndef PAGEDSERVE_BLOCK_ROWS_H
#define PAGEDSERVE_BLOCK_ROWS_H

#include <stdint.h>

#include "dequantized_tiles.h"

/* GROUP: the weights every format dequantizes at a time (four vectors). TOKENS: tokens a register tile holds. */
enum { GROUP = 32, TOKENS = 8 };

/* y = the row's dot product with one token's x (x_sums: its group sums, or NULL), + bias. */
typedef void single_kernel(float *y, const float *x, const float *x_sums, const uint8_t *row, int64_t blocks,
                           float bias);
/* y[t * ldy_token] = the row's dot product with token t's x (ldx floats apart) + bias, for each of the tile's
 * tokens. */
typedef void tile_kernel(float *y, int64_t ldy_token, const float *x, int64_t ldx, const uint8_t *row,
                         int64_t blocks, float bias);
/* One token's K activations in the order the kernels read them. */
typedef void x_orderer(float *out, const float *x, int64_t K);

/* One format: how its rows are laid out and the kernels that read them. */
typedef struct {
    int ggml_type;                /* ggml's type id, as GGUF numbers them */
    int64_t block_weights, block_bytes;
    int single_sums;              /* the single-token kernel reads x's group sums (formats with an offset) */
    x_orderer *order_x;           /* NULL where the kernels read x as it is */
    single_kernel *single;
    tile_kernel *tiles[TOKENS];   /* tiles[t - 1]: t tokens */
    row_dequantizer *dequantize_row;
} block_format;

/* The entry of `formats` for ggml type id `ggml_type`, or NULL. */
const block_format *block_format_of(const block_format *formats, int count, int ggml_type);

/* The formats of the files beside quantized_linear.c and kquant_linear.c, which their entry points also look up:
 * q5_linear.c's 32-weight blocks (Q5_0, Q5_1) and kquant_low_bits.c's super-blocks (Q2_K, Q3_K). NULL for a
 * type the file does not hold. */
const block_format *q5_format(int ggml_type);
const block_format *low_bit_kquant_format(int ggml_type);

/*
 * y[m, n] = sum_k W[n, k] * x[m, k] + bias[n] (bias may be NULL), for m < M tokens and n < N rows, W N rows of
 * K / block_weights blocks of `format`, contiguous. Returns 0; -1 (y untouched) for a NULL format or a K that
 * is not a positive multiple of its block; -2 if scratch memory ran out.
 */
int block_linear_f32(const block_format *format, float *y, int64_t ldy_token, int64_t ldy_row, const float *x,
                     int64_t ldx, const uint8_t *w, const float *bias, int64_t M, int64_t N, int64_t K,
                     int num_threads);

/* out [N, K] = W in float32, W as for block_linear_f32. Returns 0, or -1 (out untouched) as it does. */
int block_dequantize_f32(const block_format *format, float *out, const uint8_t *w, int64_t N, int64_t K,
                         int num_threads);

#endif
