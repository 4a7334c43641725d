/*
 * What int16_dot.c (AVX2) and int16_dot_portable.c (without AVX2) share: the formats' block layouts and the
 * exported tile dots, each file defining `tile` for its instruction set.
 */
#ifndef PAGEDSERVE_INT16_FORMATS_H
#define PAGEDSERVE_INT16_FORMATS_H

#include <stdint.h>
#include <string.h>

#include "int8_activations.h"
#include "kquant_scales.h"

enum { QK_K = 256, GROUPS = QK_K / Q8_BLOCK };
enum format { Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K };
static const int64_t BLOCK_BYTES[] = {34, 18, 20, 144, 176, 210};

/* The feature of a 32-block that position p of a token in nibble order (nibble_order_q16) holds. */
static inline int nibble_order_feature(int p) {
    const int i = p % 16;
    return p - i + (i < 8 ? 2 * i : 2 * (i - 8) + 1);
}

/* The exported tile dots of every format (int8_activations.h), from a file's `tile`. */
#define INT16_TILE_KERNELS                                                                                           \
    FORMAT_KERNELS(q8_0, Q8_0)                                                                                       \
    FORMAT_KERNELS(q4_0, Q4_0)                                                                                       \
    FORMAT_KERNELS(q4_1, Q4_1)                                                                                       \
    FORMAT_KERNELS(q4_k, Q4_K)                                                                                       \
    FORMAT_KERNELS(q5_k, Q5_K)                                                                                       \
    FORMAT_KERNELS(q6_k, Q6_K)

#define FORMAT_KERNELS(name, format)                                                                                 \
    void int16_tile_##name(const uint8_t *row, int64_t row_bytes, int rows, const q16_token *x, int tokens,          \
                           int64_t blocks, float *sums) {                                                            \
        tile(row, row_bytes, rows, x, tokens, blocks, sums, format);                                                 \
    }

#endif
