/*
 * Q4_K with its rows interleaved eight at a time (kernels/interleaved_rows.py's "q4_k_r8"), times tokens quantized
 * to 16 bits: q4_0_rows8.c's product for the K-quant most files hold. One vector holds a pair of weights of each
 * of eight rows and meets one broadcast pair of x's integers; a 32-weight group's dots then take the eight rows'
 * scales as one vector (lane r: row r), so no lane sum is ever taken.
 *
 * Layout: a group of eight rows is one run of super-blocks (super-block b of the group at b * 1152 bytes):
 *   bytes 0-15      the eight rows' fp16 d, row 0 first
 *   bytes 16-31     their fp16 dmin
 *   bytes 32-127    their 12 bytes of packed 6-bit scales and mins as three 32-byte vectors: vector i holds word
 *                   i (bytes 4i..4i+3) of each row's 12, row 0 first, so kquant_scales.h's word arithmetic
 *                   unpacks all eight rows at once, a row a lane
 *   bytes 128-1151  64 chunks of 16 bytes: chunk 16j + k holds bytes 2k and 2k + 1 of each row's 32 packed bytes
 *                   of weights 64j..64j + 63, row 0 first: low nibbles weights 64j + 2k and 64j + 2k + 1 (group 2j),
 *                   high nibbles 64j + 32 + 2k and the next (group 2j + 1)
 * The same bytes as the eight Q4_K rows, in another order.
 */
#include <stdint.h>
#include <string.h>

#include "half_float.h"
#include "int8_activations.h"
#include "kquant_scales.h"
#include "rows8.h"

enum { GROUPS = 8, SEGMENTS = 4, SEGMENT_CHUNKS = 16, QUANTS_AT = 128 };

#ifdef INT8_AVX2
/* Byte `lane_byte` (0-3) of each 32-bit lane of `words`, as eight floats: one group's scale (or min) of each row. */
static inline __attribute__((always_inline)) __m256 lane_bytes(__m256i words, const int lane_byte) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, 8 * lane_byte), _mm256_set1_epi32(0xFF)));
}

/*
 * sums[t * ROW_GROUP + r] = row r . x[t] for T (1..4) tokens. Per super-block the eight rows' scales and mins
 * unpack as vectors (kquant_scales.h's words, a row a lane) and each 32-weight group's exact int32 dots become
 * floats once: d sc (d_x dot) - dmin m s_x, where s_x is x's block sum (int8_activations.h), with d and dmin
 * taken out of the super-block's sums (two multiplies a super-block where there were 16: 10% less time a token).
 */
static inline __attribute__((always_inline)) void group_tile(const uint8_t *group, int64_t blocks, const q16_token *x,
                                                             float *sums, const int T) {
    __m256 acc[4];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi16(0x0F);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = group + b * ROWS8_Q4_K_BLOCK;
        const __m256i packed0 = _mm256_loadu_si256((const __m256i *)(block + 32));
        const __m256i packed1 = _mm256_loadu_si256((const __m256i *)(block + 64));
        const __m256i packed2 = _mm256_loadu_si256((const __m256i *)(block + 96));
        const __m256i six = _mm256_set1_epi32(0x3F3F3F3F), low = _mm256_set1_epi32(0x0F0F0F0F);
        const __m256i two = _mm256_set1_epi32(0x03030303);
        const __m256i words[4] = { /* scales 0-3, scales 4-7, mins 0-3, mins 4-7 (kquant_scales.h), a row a lane */
            _mm256_and_si256(packed0, six),
            _mm256_or_si256(_mm256_and_si256(packed2, low),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(packed0, 6), two), 4)),
            _mm256_and_si256(packed1, six),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(packed2, 4), low),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(packed1, 6), two), 4)),
        };
        /* Per token: the super-block's sum of sc d_x dot, and of m s_x; d and dmin apply once, at its end. */
        __m256 scaled[4], mins[4];
        for (int t = 0; t < T; ++t) scaled[t] = mins[t] = _mm256_setzero_ps();
        for (int segment = 0; segment < SEGMENTS; ++segment) {
            const uint8_t *chunks = block + QUANTS_AT + 16 * SEGMENT_CHUNKS * segment;
            prefetch_ahead(chunks, 16 * SEGMENT_CHUNKS);
            __m256i low_dots[4], high_dots[4];
            for (int t = 0; t < T; ++t) low_dots[t] = high_dots[t] = _mm256_setzero_si256();
#pragma GCC unroll 16
            for (int k = 0; k < SEGMENT_CHUNKS; ++k) {
                const __m256i chunk = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(chunks + 16 * k)));
                const __m256i low_w = _mm256_and_si256(chunk, nibble), high_w = _mm256_srli_epi16(chunk, 4);
#pragma GCC unroll 4
                for (int t = 0; t < T; ++t) {
                    const int16_t *q = x[t].q + 256 * b + 64 * segment + 2 * k;
                    low_dots[t] = pair_products(low_dots[t], low_w, q);
                    high_dots[t] = pair_products(high_dots[t], high_w, q + 32);
                }
            }
            const int g = 2 * segment; /* groups g (low nibbles) and g + 1 (high) */
            const __m256 scale_low = lane_bytes(words[g / 4], g % 4);
            const __m256 scale_high = lane_bytes(words[(g + 1) / 4], (g + 1) % 4);
            const __m256 min_low = lane_bytes(words[2 + g / 4], g % 4);
            const __m256 min_high = lane_bytes(words[2 + (g + 1) / 4], (g + 1) % 4);
#pragma GCC unroll 4
            for (int t = 0; t < T; ++t) {
                const float *dx = x[t].d + GROUPS * b + g, *sx = x[t].s + GROUPS * b + g;
                scaled[t] = _mm256_fmadd_ps(_mm256_mul_ps(scale_low, _mm256_set1_ps(dx[0])),
                                            _mm256_cvtepi32_ps(low_dots[t]), scaled[t]);
                scaled[t] = _mm256_fmadd_ps(_mm256_mul_ps(scale_high, _mm256_set1_ps(dx[1])),
                                            _mm256_cvtepi32_ps(high_dots[t]), scaled[t]);
                mins[t] = _mm256_fmadd_ps(min_low, _mm256_set1_ps(sx[0]), mins[t]);
                mins[t] = _mm256_fmadd_ps(min_high, _mm256_set1_ps(sx[1]), mins[t]);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)block));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16)));
        for (int t = 0; t < T; ++t) acc[t] = _mm256_fnmadd_ps(dmin, mins[t], _mm256_fmadd_ps(d, scaled[t], acc[t]));
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(sums + t * ROW_GROUP, acc[t]);
}

ROWS8_TILE(q4_k)
#else
/* Without AVX2 the same sums a weight at a time (rows8_available in rows8_layout.c says which build this is). */
void q4_k_rows8_tile(const uint8_t *group, int64_t blocks, const q16_token *x, int tokens, float *sums) {
    for (int t = 0; t < tokens; ++t)
        for (int r = 0; r < ROW_GROUP; ++r) {
            float sum = 0.0f;
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t *block = group + b * ROWS8_Q4_K_BLOCK;
                uint8_t packed[12], scales[GROUPS], mins[GROUPS];
                for (int word = 0; word < 3; ++word) memcpy(packed + 4 * word, block + 32 + 32 * word + 4 * r, 4);
                unpack_scales(packed, scales, mins);
                const float d = half_to_float(block + 2 * r), dmin = half_to_float(block + 16 + 2 * r);
                for (int g = 0; g < GROUPS; ++g) {
                    const int segment = g / 2, shift = 4 * (g % 2);
                    int32_t dot = 0;
                    for (int k = 0; k < SEGMENT_CHUNKS; ++k)
                        for (int i = 0; i < 2; ++i) {
                            const uint8_t byte = block[QUANTS_AT + 16 * (SEGMENT_CHUNKS * segment + k) + 2 * r + i];
                            dot += ((byte >> shift) & 0x0F) * x[t].q[256 * b + 32 * g + 2 * k + i];
                        }
                    const int64_t at = GROUPS * b + g;
                    sum += d * scales[g] * x[t].d[at] * (float)dot - dmin * mins[g] * x[t].s[at];
                }
            }
            sums[t * ROW_GROUP + r] = sum;
        }
}
#endif
