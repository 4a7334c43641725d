/*
 * Q4_0 with its rows interleaved eight at a time (kernels/interleaved_rows.py's "q4_0_r8"), times tokens
 * quantized to 16 bits: the int16 product of int16_dot.c, laid out so that no lane sum is ever taken.
 *
 * int16_dot.c multiplies a row at a time: a block's 32 products land in eight int32 lanes that must be summed
 * across the vector before the block's scale applies, and the scalar scale is broadcast per block. Here a vector
 * holds one pair of weights of each of eight rows, and meets the same pair of x's integers in every row's lanes
 * (one broadcast 32-bit load): lane r accumulates row r's dot, the block's eight fp16 scales load as one vector,
 * and a block costs its products plus two multiply-adds. With AVX2 (Zen 3, one thread, weights in cache), one
 * token takes 1.13 ns per 32 weights where int16_dot.c's row kernel takes 1.85, and 2-4 tokens 0.92 ns each
 * where its tiles take 1.4.
 *
 * Layout: a group of eight rows is one run of blocks (block b of the group at b * 144 bytes):
 *   bytes 0-15     the eight rows' fp16 scales d, row 0 first
 *   bytes 16-143   eight chunks of 16 bytes: chunk k holds bytes 2k and 2k + 1 of each row's 16 packed bytes,
 *                  row 0 first
 * so chunk k widened to 16 int16 lanes holds, for row r, lanes 2r and 2r + 1: the low nibbles are weights 2k and
 * 2k + 1, the high nibbles weights 2k + 16 and 2k + 17. The same bytes as the eight Q4_0 rows, in another order.
 */
#include <stdint.h>
#include <string.h>

#include "half_float.h"
#include "int8_activations.h"
#include "rows8.h"

enum { CHUNKS = 8 };

#ifdef INT8_AVX2

/*
 * sums[t * ROW_GROUP + r] = row r of the group . x[t] for T (1..4) tokens. A block's integer dots, exact in int32
 * (|nibble| <= 15, |q| <= Q16_MAX, 32 products), become floats once: d_w (d_x dot - 8 s_x), where the -8 of
 * every nibble is x's block sum s (int8_activations.h). Four tokens is the most whose int32 and float
 * accumulators stay in AVX2's 16 registers with a chunk's weights; eight spill, and run 15% slower a token.
 */
static inline __attribute__((always_inline)) void group_tile(const uint8_t *group, int64_t blocks, const q16_token *x,
                                                             float *sums, const int T) {
    __m256 acc[4];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi16(0x0F);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = group + b * ROWS8_Q4_0_BLOCK;
        prefetch_ahead(block, ROWS8_Q4_0_BLOCK);
        __m256i dots[4];
        for (int t = 0; t < T; ++t) dots[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int k = 0; k < CHUNKS; ++k) {
            const __m256i chunk = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(block + 16 + 16 * k)));
            const __m256i low = _mm256_and_si256(chunk, nibble), high = _mm256_srli_epi16(chunk, 4);
#pragma GCC unroll 4
            for (int t = 0; t < T; ++t) {
                const int16_t *q = x[t].q + Q8_BLOCK * b + 2 * k;
                dots[t] = pair_products(pair_products(dots[t], low, q), high, q + 16);
            }
        }
        const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) {
            const __m256 terms = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[t]), _mm256_set1_ps(x[t].d[b]),
                                                 _mm256_set1_ps(-8.0f * x[t].s[b]));
            acc[t] = _mm256_fmadd_ps(scales, terms, acc[t]);
        }
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(sums + t * ROW_GROUP, acc[t]);
}

ROWS8_TILE(q4_0)
#else
/* Without AVX2 the same sums a weight at a time (correct everywhere; the engine lays weights out so only where
 * rows8_available says the vector kernels are built). */
void q4_0_rows8_tile(const uint8_t *group, int64_t blocks, const q16_token *x, int tokens, float *sums) {
    for (int t = 0; t < tokens; ++t)
        for (int r = 0; r < ROW_GROUP; ++r) {
            float sum = 0.0f;
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t *block = group + b * ROWS8_Q4_0_BLOCK;
                int32_t dot = 0;
                for (int k = 0; k < CHUNKS; ++k)
                    for (int i = 0; i < 2; ++i) {
                        const uint8_t byte = block[16 + 16 * k + 2 * r + i];
                        dot += (byte & 0x0F) * x[t].q[Q8_BLOCK * b + 2 * k + i] +
                               (byte >> 4) * x[t].q[Q8_BLOCK * b + 16 + 2 * k + i];
                    }
                sum += half_to_float(block + 2 * r) * (x[t].d[b] * (float)dot - 8.0f * x[t].s[b]);
            }
            sums[t * ROW_GROUP + r] = sum;
        }
}
#endif
