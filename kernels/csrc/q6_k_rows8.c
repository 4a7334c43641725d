/*
 * Q6_K with its rows interleaved eight at a time (kernels/interleaved_rows.py's "q6_k_r8"), times tokens quantized
 * to 16 bits: q4_0_rows8.c's product for the format of most files' LM head (and of a Q4_K_M file's wider layers).
 * One vector holds a pair of 6-bit weights of each of eight rows, put together from a chunk of low nibbles and one
 * of high bits, and meets one broadcast pair of x's integers; every 16 weights' dots take the eight rows' scales
 * as one vector (lane r: row r).
 *
 * Q6_K's block (ggml): weight 128h + 32s + l (half h, run s, l < 32) is ql[64h + l + 32 (s % 2)]'s low nibble
 * (s < 2) or high nibble (s >= 2), with bits 2s..2s+1 of qh[32h + l] above them, less 32; its scale is
 * scales[8h + 2s + l / 16] (int8), times d.
 * Layout: a group of eight rows is one run of super-blocks (super-block b of the group at b * 1680 bytes):
 *   bytes 0-15      the eight rows' fp16 d, row 0 first
 *   bytes 16-143    scale i of each row at 16 + 8i + r
 *   bytes 144-911   half 0: 16 chunks of ql[2p..2p+1] of each row (runs 0 and 2), 16 of ql[32 + 2p..] (runs 1
 *                   and 3), 16 of qh[2p..2p+1]; chunk p of each kind holds 16 bytes, row 0 first
 *   bytes 912-1679  half 1, the same from ql[64..] and qh[32..]
 * The same bytes as the eight Q6_K rows, in another order (rows8_layout.c).
 */
#include <stdint.h>
#include <string.h>

#include "half_float.h"
#include "int8_activations.h"
#include "rows8.h"

enum { GROUPS = 8, PAIRS = 16, HALF_BYTES = 768, SCALES_AT = 16, HALVES_AT = 144 };

#ifdef INT8_AVX2
/* Scale i of the eight rows times d, as eight floats. */
static inline __attribute__((always_inline)) __m256 row_scales(const uint8_t *block, int i, __m256 d) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(block + SCALES_AT + 8 * i));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
}

/*
 * sums[t * ROW_GROUP + r] = row r . x[t] for T (1 or 2) tokens. A pass over a half reads one kind of ql chunk: runs
 * `run` (low nibbles) and run + 2 (high nibbles), their top bits from the qh chunk at bits 2 run and 2 run + 4.
 * The weights meet x as stored, 0..63: every 16 weights a row (eight chunks) the offset of 32 comes off the exact
 * int32 dots at once, as 32 times x's sum of those 16 integers (q16_token's sums16: one token takes 16% less time
 * than with the offset off each weight), and the dots become floats: d sc d_x dot.
 */
static inline __attribute__((always_inline)) void group_tile(const uint8_t *group, int64_t blocks, const q16_token *x,
                                                             float *sums, const int T) {
    __m256 acc[2];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi16(0x0F), top_bits = _mm256_set1_epi16(0x30);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = group + b * ROWS8_Q6_K_BLOCK;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        for (int h = 0; h < 2; ++h) {
            const uint8_t *half = block + HALVES_AT + HALF_BYTES * h;
            prefetch_ahead(half, HALF_BYTES);
#pragma GCC unroll 2
            for (int run = 0; run < 2; ++run)
#pragma GCC unroll 2
                for (int sixteen = 0; sixteen < 2; ++sixteen) {
                    __m256i low_dots[2], high_dots[2];
                    for (int t = 0; t < T; ++t) low_dots[t] = high_dots[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
                    for (int p = 8 * sixteen; p < 8 * sixteen + 8; ++p) {
                        const __m128i ql_bytes = _mm_loadu_si128((const __m128i *)(half + 256 * run + 16 * p));
                        const __m128i qh_bytes = _mm_loadu_si128((const __m128i *)(half + 512 + 16 * p));
                        const __m256i ql = _mm256_cvtepu8_epi16(ql_bytes), qh = _mm256_cvtepu8_epi16(qh_bytes);
                        /* run's top bits to bits 4-5 for the low nibbles, run + 2's (at 2 run + 4) as they are */
                        const __m256i low_top = _mm256_and_si256(_mm256_slli_epi16(qh, 4 - 2 * run), top_bits);
                        const __m256i high_top = _mm256_and_si256(run ? _mm256_srli_epi16(qh, 2) : qh, top_bits);
                        const __m256i low_w = _mm256_or_si256(_mm256_and_si256(ql, nibble), low_top);
                        const __m256i high_w = _mm256_or_si256(_mm256_srli_epi16(ql, 4), high_top);
#pragma GCC unroll 4
                        for (int t = 0; t < T; ++t) {
                            const int16_t *q = x[t].q + 256 * b + 128 * h + 32 * run + 2 * p;
                            low_dots[t] = pair_products(low_dots[t], low_w, q);
                            high_dots[t] = pair_products(high_dots[t], high_w, q + 64);
                        }
                    }
                    const __m256 low_scales = row_scales(block, 8 * h + 2 * run + sixteen, d);
                    const __m256 high_scales = row_scales(block, 8 * h + 2 * (run + 2) + sixteen, d);
#pragma GCC unroll 4
                    for (int t = 0; t < T; ++t) {
                        const float *dx = x[t].d + GROUPS * b + 4 * h + run;
                        const int32_t *sums16 = x[t].sums16 + 16 * b + 8 * h + 2 * run + sixteen;
                        const __m256i low_dot = _mm256_sub_epi32(low_dots[t], _mm256_set1_epi32(32 * sums16[0]));
                        const __m256i high_dot = _mm256_sub_epi32(high_dots[t], _mm256_set1_epi32(32 * sums16[4]));
                        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(low_scales, _mm256_set1_ps(dx[0])),
                                                 _mm256_cvtepi32_ps(low_dot), acc[t]);
                        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(high_scales, _mm256_set1_ps(dx[2])),
                                                 _mm256_cvtepi32_ps(high_dot), acc[t]);
                    }
                }
        }
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(sums + t * ROW_GROUP, acc[t]);
}

/* At most two tokens a pass: with a half's passes unrolled (their shifts constants) the accumulators of four would
 * not fit in AVX2's registers, and a second pass reads the group from L1. Four tokens in two passes take 0.78x the
 * time of one unrolled pass, which spills, and 1.05-1.1x that of one pass left rolled; one token 0.84x, two 0.91x. */
void q6_k_rows8_tile(const uint8_t *group, int64_t blocks, const q16_token *x, int tokens, float *sums) {
    switch (tokens) {
    case 1:
        group_tile(group, blocks, x, sums, 1);
        return;
    case 2:
        group_tile(group, blocks, x, sums, 2);
        return;
    case 3:
        group_tile(group, blocks, x, sums, 2);
        group_tile(group, blocks, x + 2, sums + 2 * ROW_GROUP, 1);
        return;
    default:
        group_tile(group, blocks, x, sums, 2);
        group_tile(group, blocks, x + 2, sums + 2 * ROW_GROUP, 2);
    }
}
#else
/* Without AVX2 the same sums a weight at a time (rows8_available in rows8_layout.c says which build this is). */
void q6_k_rows8_tile(const uint8_t *group, int64_t blocks, const q16_token *x, int tokens, float *sums) {
    for (int t = 0; t < tokens; ++t)
        for (int r = 0; r < ROW_GROUP; ++r) {
            float sum = 0.0f;
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t *block = group + b * ROWS8_Q6_K_BLOCK;
                const float d = half_to_float(block + 2 * r);
                for (int h = 0; h < 2; ++h)
                    for (int s = 0; s < 4; ++s)
                        for (int sixteen = 0; sixteen < 2; ++sixteen) {
                            int32_t dot = 0;
                            for (int l = 16 * sixteen; l < 16 * sixteen + 16; ++l) {
                                const uint8_t *half = block + HALVES_AT + HALF_BYTES * h;
                                const uint8_t ql = half[256 * (s % 2) + 16 * (l / 2) + 2 * r + l % 2];
                                const uint8_t qh = half[512 + 16 * (l / 2) + 2 * r + l % 2];
                                const int q = ((s < 2 ? ql & 0x0F : ql >> 4) | ((qh >> (2 * s)) & 3) << 4) - 32;
                                dot += q * x[t].q[256 * b + 128 * h + 32 * s + l];
                            }
                            const int8_t scale = (int8_t)block[SCALES_AT + 8 * (8 * h + 2 * s + sixteen) + r];
                            sum += d * scale * x[t].d[GROUPS * b + 4 * h + s] * (float)dot;
                        }
            }
            sums[t * ROW_GROUP + r] = sum;
        }
}
#endif
