/*
 * Byte planes, the order in which the K-quant kernels (kquant_linear.c, kquant_low_bits.c) read a group of 32
 * weights: the group's 32 bytes (its quantized values, once assembled) are read as eight 32-bit words, and
 * vector k of the group holds byte k of every word: weights k, k + 4, ..., k + 28. Extracting a plane is a
 * shift and a mask of whole words, where widening bytes in their stored order would take a shuffle each (and
 * GCC 12 widens all but the lowest eight bytes of a register one lane at a time). So x is permuted the same way
 * once per call (permute_x), and every dot product runs in plane order. Lanes 0-3 of a plane hold weights of
 * the group's first 16, lanes 4-7 of its last 16: formats with scales per 16 weights scale the halves apart.
 */
#ifndef PAGEDSERVE_BYTE_PLANES_H
#define PAGEDSERVE_BYTE_PLANES_H

#include <stdint.h>

#include "block_rows.h"
#include "vector_math.h"

/* A group's 32 bytes as eight words, and eight bytes, from any address. */
typedef uint32_t words __attribute__((vector_size(32), aligned(1), may_alias));
typedef uint8_t bytes8 __attribute__((vector_size(8), aligned(1), may_alias));
typedef int8_t signed_bytes32 __attribute__((vector_size(32)));
typedef int32_t ints __attribute__((vector_size(LANES * sizeof(int32_t))));

/* Byte k of each word as floats, unsigned or signed (shifted to the top, then arithmetically down). */
static inline vec byte_plane(words v, int k) { return __builtin_convertvector((ints)((v >> (8 * k)) & 0xFF), vec); }
static inline vec signed_byte_plane(words v, int k) {
    return __builtin_convertvector((ints)(v << (24 - 8 * k)) >> 24, vec);
}

/* The four bytes of `low`, then of `high`, as eight floats: one variable shift of broadcast words (GCC 12 would
 * move eight bytes into a vector one at a time). */
static inline vec bytes_of_words(uint32_t low, uint32_t high) {
    const words v = {low, low, low, low, high, high, high, high}, shifts = {0, 8, 16, 24, 0, 8, 16, 24};
    return __builtin_convertvector((ints)((v >> shifts) & 0xFF), vec);
}

/* Eight bytes as floats, read unsigned less `offset` (GCC 12 converts a byte vector one lane at a time when it
 * is signed or comes straight from memory: see quantized_linear.c). */
static inline vec bytes_to_floats(bytes8 b, int32_t offset) {
    return __builtin_convertvector(__builtin_convertvector(b, ints) - offset, vec);
}

/*
 * A group's four byte planes as its 32 weights in order: weight 4 * lane + k is plane k's lane, so floats
 * 8m..8m+7 are lanes 2m and 2m + 1 of the four planes (a 4 x 8 transpose, in three rounds of shuffles).
 */
static inline void store_group(float *out, const vec plane[4]) {
    const vec low01 = SHUFFLE(plane[0], plane[1], 0, 8, 1, 9, 4, 12, 5, 13);
    const vec low23 = SHUFFLE(plane[2], plane[3], 0, 8, 1, 9, 4, 12, 5, 13);
    const vec high01 = SHUFFLE(plane[0], plane[1], 2, 10, 3, 11, 6, 14, 7, 15);
    const vec high23 = SHUFFLE(plane[2], plane[3], 2, 10, 3, 11, 6, 14, 7, 15);
    const vec lanes04 = SHUFFLE(low01, low23, 0, 1, 8, 9, 4, 5, 12, 13); /* lane 0's four weights, then lane 4's */
    const vec lanes15 = SHUFFLE(low01, low23, 2, 3, 10, 11, 6, 7, 14, 15);
    const vec lanes26 = SHUFFLE(high01, high23, 0, 1, 8, 9, 4, 5, 12, 13);
    const vec lanes37 = SHUFFLE(high01, high23, 2, 3, 10, 11, 6, 7, 14, 15);
    store(out, SHUFFLE(lanes04, lanes15, 0, 1, 2, 3, 8, 9, 10, 11));
    store(out + LANES, SHUFFLE(lanes26, lanes37, 0, 1, 2, 3, 8, 9, 10, 11));
    store(out + 2 * LANES, SHUFFLE(lanes04, lanes15, 4, 5, 6, 7, 12, 13, 14, 15));
    store(out + 3 * LANES, SHUFFLE(lanes26, lanes37, 4, 5, 6, 7, 12, 13, 14, 15));
}

/* One token's K activations in plane order: within each group of 32, vector k holds features k, k + 4, ...,
 * k + 28, as byte plane k holds those weights. */
static inline void permute_x(float *out, const float *x, int64_t K) {
    for (int64_t g = 0; g < K; g += GROUP)
        for (int k = 0; k < 4; ++k)
            for (int lane = 0; lane < LANES; ++lane) out[g + k * LANES + lane] = x[g + 4 * lane + k];
}

#endif
