/*
 * Products of a block-format weight with many tokens by float32 tiles (dequantized_tiles.c), for the
 * block-format kernels: quantized_linear.c and kquant_linear.c.
 */
#ifndef PAGEDSERVE_DEQUANTIZED_TILES_H
#define PAGEDSERVE_DEQUANTIZED_TILES_H

#include <stdint.h>

/* Tokens from which the block-format kernels multiply by dequantized tiles (see dequantized_tiles.c). */
#define TILE_TOKENS 16

/* One row of W (K weights in the format of ggml type id `ggml_type`) as float32, into out [K]. */
typedef void row_dequantizer(float *out, const uint8_t *row, int64_t K, int ggml_type);

/*
 * y[m, n] = sum_k W[n, k] * x[m, k] + bias[n], as the block-format kernels define it (x token-major, `ldx`
 * floats apart; y written with strides ldy_token and ldy_row), W N rows of `row_bytes` bytes that
 * `dequantize_row` reads. Returns 0, or -2 if memory ran out (y then not to be used).
 */
int linear_by_tiles(float *y, int64_t ldy_token, int64_t ldy_row, const float *x, int64_t ldx, const uint8_t *w,
                    const float *bias, int64_t M, int64_t N, int64_t K, int ggml_type, int64_t row_bytes,
                    row_dequantizer *dequantize_row, int num_threads);

#endif
