/*
 * Row dots of the 32-weight formats (Q8_0, Q4_0, Q4_1; layouts in quantized_linear.c) with a token quantized to
 * 8 bits (int8_activations.h). Each weight block lines up with one activation block b, so
 *   row . x = sum_b dw_b * d_b * (qw . q_b) + offset_b * s_b
 * where qw are the block's stored integers (Q4's nibbles 0..15, as they are), offset = -8 dw for Q4_0, m for
 * Q4_1 and none for Q8_0, and s_b = d_b * sum(q_b). The integer dot is exact; each block adds one float
 * multiply-add of eight lanes and one scalar one.
 *
 * AVX2: a Q4 block's 16 bytes become 32 nibbles in one 256-bit register (low nibbles, then high ones: weights
 * 0-15 then 16-31, the order of x), multiplied as unsigned bytes by x's signed ones (maddubs, or VNNI's
 * vpdpbusd). Q8_0's signed weights go through the sign trick: |w| times x with w's sign.
 */
#include <stdint.h>

#include "half_float.h"
#include "int8_activations.h"

enum { Q8_0_BYTES = 34, Q4_0_BYTES = 18, Q4_1_BYTES = 20 };
enum format { Q8_0, Q4_0, Q4_1 };

#ifdef INT8_AVX2
/* The block's integers times x's block b, as eight int32 partial sums. */
static inline __attribute__((always_inline)) __m256i block_dot(const uint8_t *block, const int8_t *xq,
                                                               const enum format format) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    if (format == Q8_0) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(block + 2));
        return dot_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    }
    const __m128i packed = _mm_loadu_si128((const __m128i *)(block + (format == Q4_1 ? 4 : 2)));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return dot_u8_s8(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)), x);
}

/* One block's terms: its scaled integer dot into `acc`, its offset term's product into `offsets`. */
static inline __attribute__((always_inline)) void block_terms(__m256 *acc, float *offsets, const uint8_t *block,
                                                              const q8_token *x, int64_t b, const enum format format) {
    const float dw = half_to_float(block);
    const __m256i dot = block_dot(block, x->q + b * Q8_BLOCK, format);
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * x->d[b]), _mm256_cvtepi32_ps(dot), *acc);
    if (format == Q4_0) *offsets += dw * x->s[b];
    if (format == Q4_1) *offsets += half_to_float(block + 2) * x->s[b];
}

/* Two blocks a step into two accumulators: the multiply-adds' latency, not their count, bounds one chain. */
static inline __attribute__((always_inline)) float row_dot(const uint8_t *row, const q8_token *x, int64_t blocks,
                                                           const int64_t block_bytes, const enum format format) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float offsets0 = 0.0f, offsets1 = 0.0f;
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        block_terms(&acc0, &offsets0, row + b * block_bytes, x, b, format);
        block_terms(&acc1, &offsets1, row + (b + 1) * block_bytes, x, b + 1, format);
    }
    if (b < blocks) block_terms(&acc0, &offsets0, row + b * block_bytes, x, b, format);
    const float offsets = offsets0 + offsets1;
    return sum_lanes(_mm256_add_ps(acc0, acc1)) + (format == Q4_0 ? -8.0f * offsets : offsets);
}
#else
/* The block's integers (Q4's nibbles as they are) times x's block b. */
static inline __attribute__((always_inline)) int32_t block_dot(const uint8_t *block, const int8_t *xq,
                                                               const enum format format) {
    int32_t dot = 0;
    if (format == Q8_0) {
        const int8_t *w = (const int8_t *)(block + 2);
        for (int k = 0; k < Q8_BLOCK; ++k) dot += w[k] * xq[k];
        return dot;
    }
    const uint8_t *qs = block + (format == Q4_1 ? 4 : 2);
    for (int k = 0; k < Q8_BLOCK / 2; ++k) dot += (qs[k] & 0x0F) * xq[k] + (qs[k] >> 4) * xq[k + Q8_BLOCK / 2];
    return dot;
}

static inline __attribute__((always_inline)) float row_dot(const uint8_t *row, const q8_token *x, int64_t blocks,
                                                           const int64_t block_bytes, const enum format format) {
    float sum = 0.0f, offsets = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * block_bytes;
        const float dw = half_to_float(block);
        sum += dw * x->d[b] * (float)block_dot(block, x->q + b * Q8_BLOCK, format);
        if (format == Q4_0) offsets -= 8.0f * dw * x->s[b];
        if (format == Q4_1) offsets += half_to_float(block + 2) * x->s[b];
    }
    return sum + offsets;
}
#endif

float int8_dot_q8_0(const uint8_t *row, const q8_token *x, int64_t blocks) {
    return row_dot(row, x, blocks, Q8_0_BYTES, Q8_0);
}

float int8_dot_q4_0(const uint8_t *row, const q8_token *x, int64_t blocks) {
    return row_dot(row, x, blocks, Q4_0_BYTES, Q4_0);
}

float int8_dot_q4_1(const uint8_t *row, const q8_token *x, int64_t blocks) {
    return row_dot(row, x, blocks, Q4_1_BYTES, Q4_1);
}
