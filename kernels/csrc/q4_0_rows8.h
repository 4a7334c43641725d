/*
 * Q4_0 with its rows interleaved eight at a time (q4_0_rows8.c): the layout, and its product with 16-bit tokens.
 */
#ifndef PAGEDSERVE_Q4_0_ROWS8_H
#define PAGEDSERVE_Q4_0_ROWS8_H

#include <stdint.h>

#include "int8_activations.h"

/* The layout's type id where the kernels take a ggml type (kernels/block_formats.py's KERNEL_LAYOUTS): past any
 * ggml type, as no file stores it. */
enum { ROWS8_GGML_TYPE = 1002, ROW_GROUP = 8, ROWS8_BLOCK_BYTES = ROW_GROUP * 18 };

/* out = `num_rows` Q4_0 rows of `row_bytes` bytes each, interleaved (the same number of bytes). Returns 0, or -1
 * (out untouched) where num_rows is not a multiple of ROW_GROUP or row_bytes not of a block. */
int q4_0_rows8_interleave(uint8_t *out, const uint8_t *rows, int64_t num_rows, int64_t row_bytes);

/* sums[t * ROW_GROUP + r] = row r of the group at `group` (`blocks` blocks a row) . x[t], for t < tokens (1..4). */
void q4_0_rows8_tile(const uint8_t *group, int64_t blocks, const q16_token *x, int tokens, float *sums);

/* Whether this build has the vector kernel (AVX2); without it q4_0_rows8_tile is scalar, correct but slow. */
int q4_0_rows8_available(void);

#endif
