/*
 * The float32 register tile of skinny_linear.c, for callers that bring their own weight rows: quantized_linear.c
 * dequantizes a few rows of blocks at a time and multiplies them here.
 */
#ifndef PAGEDSERVE_SKINNY_LINEAR_H
#define PAGEDSERVE_SKINNY_LINEAR_H

#include <stdint.h>

/* Weight rows a tile holds. */
#define SKINNY_ROWS 6

/*
 * out[r * ldo + m * ldo_token] = sum_k w[r * K + k] * xt[k * ldx + m] + bias[r] (bias may be NULL), r < rows <=
 * SKINNY_ROWS, m < M: feature-major out (ldo_token 1) is stored a vector at a time, any other layout (token-major,
 * ldo 1) through a small stack tile. tail_x: the last M % 8 token columns, zero-padded (skinny_tail_f32).
 */
void skinny_row_block_f32(float *out, int64_t ldo, int64_t ldo_token, const float *xt, int64_t ldx, const float *w,
                          int64_t K, const float *bias, int64_t M, int rows, const float *tail_x);

/* *tail_x = xt's last M % 8 columns in a zero-padded [K, 8] copy (NULL when M % 8 == 0; free() it). Returns 0,
 * or -1 if memory ran out. */
int skinny_tail_f32(float **tail_x, const float *xt, int64_t ldx, int64_t M, int64_t K);

#endif
