/*
 * What int16_dot.c (AVX2) and int16_dot_portable.c (without AVX2) share: the formats' block layouts, Q4_K's and
 * Q5_K's scales, and the exported tile dots, each file defining `tile` for its instruction set.
 */
#ifndef PAGEDSERVE_INT16_FORMATS_H
#define PAGEDSERVE_INT16_FORMATS_H

#include <stdint.h>
#include <string.h>

#include "int8_activations.h"

enum { QK_K = 256, GROUPS = QK_K / Q8_BLOCK };
enum format { Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K };
static const int64_t BLOCK_BYTES[] = {34, 18, 20, 144, 176, 210};

/* Q4_K's and Q5_K's 6-bit scales and mins (int8_dot_kquants.c's unpack_scales). */
static inline void unpack_scales(const uint8_t *packed_bytes, uint8_t scales[GROUPS], uint8_t mins[GROUPS]) {
    uint32_t packed[3];
    memcpy(packed, packed_bytes, sizeof packed);
    const uint32_t six = 0x3F3F3F3Fu, nibble = 0x0F0F0F0Fu, two = 0x03030303u;
    const uint32_t words[4] = {packed[0] & six, (packed[2] & nibble) | ((packed[0] >> 6) & two) << 4,
                               packed[1] & six, ((packed[2] >> 4) & nibble) | ((packed[1] >> 6) & two) << 4};
    memcpy(scales, words, GROUPS);
    memcpy(mins, words + 2, GROUPS);
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
