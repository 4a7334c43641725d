/*
 * int16_dot.c's tile dots without AVX2: integer sums a weight at a time, one token after another.
 */
#include "half_float.h"
#include "int16_formats.h"

#ifndef INT8_AVX2
/* Weight l of a 32-weight block, or of group j of a super-block, as an integer (Q6_K's less 32). */
static inline __attribute__((always_inline)) int32_t weight_int(const uint8_t *block, int j, int l,
                                                                const enum format format) {
    switch (format) {
    case Q8_0:
        return ((const int8_t *)(block + 2))[l];
    case Q4_0:
    case Q4_1: {
        const uint8_t byte = block[(format == Q4_1 ? 4 : 2) + l % 16];
        return l < 16 ? byte & 0x0F : byte >> 4;
    }
    case Q6_K: {
        const int half = j / 4, s = j % 4;
        const int nibble = (block[64 * half + 32 * (s % 2) + l] >> (4 * (s / 2))) & 0x0F;
        return (nibble | ((block[128 + 32 * half + l] >> (2 * s)) & 3) << 4) - 32;
    }
    default: {
        const uint8_t *qs = block + (format == Q5_K ? 48 : 16);
        const int nibble = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
        return format == Q5_K ? nibble | ((block[16 + l] >> j) & 1) << 4 : nibble;
    }
    }
}

static inline __attribute__((always_inline)) float row_dot_32(const uint8_t *row, const q16_token *x,
                                                              int64_t blocks, const enum format format) {
    float sum = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * BLOCK_BYTES[format];
        int32_t dot = 0;
        for (int p = 0; p < Q8_BLOCK; ++p) { /* the Q4 formats' x in nibble order, as int16_dot.c reads it */
            const int l = format == Q8_0 ? p : nibble_order_feature(p);
            dot += weight_int(block, 0, l, format) * x->q[b * Q8_BLOCK + p];
        }
        const float dw = half_to_float(block);
        sum += dw * x->d[b] * (float)dot;
        if (format == Q4_0) sum -= 8.0f * dw * x->s[b];
        if (format == Q4_1) sum += half_to_float(block + 2) * x->s[b];
    }
    return sum;
}

static inline __attribute__((always_inline)) float row_dot_k(const uint8_t *row, const q16_token *x, int64_t blocks,
                                                             const enum format format) {
    float sum = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * BLOCK_BYTES[format];
        const int16_t *xq = x->q + b * QK_K;
        uint8_t sc[GROUPS], m[GROUPS];
        if (format != Q6_K) unpack_scales(block + 4, sc, m);
        for (int j = 0; j < GROUPS; ++j) {
            int32_t dots[2] = {0, 0};
            for (int l = 0; l < Q8_BLOCK; ++l) dots[l / 16] += weight_int(block, j, l, format) * xq[32 * j + l];
            const float dx = x->d[b * GROUPS + j];
            if (format == Q6_K) {
                const int8_t *scales = (const int8_t *)(block + 192);
                sum += half_to_float(block + 208) * dx * (float)(scales[2 * j] * dots[0] + scales[2 * j + 1] * dots[1]);
            } else {
                sum += half_to_float(block) * (float)sc[j] * dx * (float)(dots[0] + dots[1]);
                sum -= half_to_float(block + 2) * (float)m[j] * x->s[b * GROUPS + j];
            }
        }
    }
    return sum;
}

static inline __attribute__((always_inline)) float row_dot(const uint8_t *row, const q16_token *x, int64_t blocks,
                                                           const enum format format) {
    return format >= Q4_K ? row_dot_k(row, x, blocks, format) : row_dot_32(row, x, blocks, format);
}

/* Without SIMD a block's unpacking is a weight's own: nothing to share between tokens. */
static inline __attribute__((always_inline)) void tile(const uint8_t *row, int64_t row_bytes, int rows,
                                                       const q16_token *x, int tokens, int64_t blocks, float *sums,
                                                       const enum format format) {
    for (int r = 0; r < rows; ++r)
        for (int t = 0; t < tokens; ++t) sums[r * TILE_TOKENS + t] = row_dot(row + r * row_bytes, x + t, blocks, format);
}
INT16_TILE_KERNELS
#endif
