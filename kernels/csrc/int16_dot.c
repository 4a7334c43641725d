/*
 * Row dots of every block format with a token quantized to 16 bits (int8_activations.h's q16_token): the sums
 * of int8_dot_blocks.c and int8_dot_kquants.c, term for term, with x's integers to 1 part in 32767 of each
 * block's largest, where 8 bits keep 1 in 127. The weights widen to int16 and meet x in pair products
 * (vpmaddwd, or VNNI's vpdpwssd): no sign trick, as both sides are signed, at a few more instructions a block.
 */
#include <stdint.h>
#include <string.h>

#include "half_float.h"
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

#ifdef INT8_AVX2
/* A 32-weight block's integers (Q4's nibbles as they are) times x's block, as eight int32 partial sums. */
static inline __attribute__((always_inline)) __m256i block_dot(const uint8_t *block, const int16_t *x,
                                                               const enum format format) {
    if (format == Q8_0) {
        const __m256i low = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 2)));
        const __m256i high = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 18)));
        return dot_i16(dot_i16(_mm256_setzero_si256(), low, x), high, x + 16);
    }
    const __m128i packed = _mm_loadu_si128((const __m128i *)(block + (format == Q4_1 ? 4 : 2)));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m256i low = _mm256_cvtepu8_epi16(_mm_and_si128(packed, nibble));
    const __m256i high = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
    return dot_i16(dot_i16(_mm256_setzero_si256(), low, x), high, x + 16);
}

static inline __attribute__((always_inline)) float row_dot_32(const uint8_t *row, const q16_token *x,
                                                              int64_t blocks, const enum format format) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float offsets = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * BLOCK_BYTES[format];
        const float dw = half_to_float(block);
        const __m256 dot = _mm256_cvtepi32_ps(block_dot(block, x->q + b * Q8_BLOCK, format));
        if (b % 2)
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(dw * x->d[b]), dot, acc1);
        else
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(dw * x->d[b]), dot, acc0);
        if (format == Q4_0) offsets -= 8.0f * dw * x->s[b];
        if (format == Q4_1) offsets += half_to_float(block + 2) * x->s[b];
    }
    return sum_lanes(_mm256_add_ps(acc0, acc1)) + offsets;
}

static inline __attribute__((always_inline)) float row_dot_k(const uint8_t *row, const q16_token *x, int64_t blocks,
                                                             const enum format format) {
    __m256 acc = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1), two_bits = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * BLOCK_BYTES[format];
        const int16_t *xq = x->q + b * QK_K;
        const float *xd = x->d + b * GROUPS;
        if (format == Q6_K) {
            const int8_t *sc = (const int8_t *)(block + 192);
            const float d = half_to_float(block + 208);
#pragma GCC unroll 8
            for (int j = 0; j < GROUPS; ++j) {
                const int half = j / 4, s = j % 4;
                const __m256i low = _mm256_loadu_si256((const __m256i *)(block + 64 * half + 32 * (s % 2)));
                const __m256i high = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * half));
                const __m256i nibble = _mm256_and_si256(s >= 2 ? _mm256_srli_epi16(low, 4) : low, low_nibbles);
                const __m256i top = _mm256_and_si256(s > 0 ? _mm256_srli_epi16(high, 2 * s) : high, two_bits);
                const __m256i value = _mm256_or_si256(nibble, _mm256_slli_epi16(top, 4));
                /* (q - 32) * scale per 16-weight half, in int16 (|.| <= 32 * 128), then times x. */
                const __m256i thirty_two = _mm256_set1_epi16(32);
                const __m256i first = _mm256_mullo_epi16(
                    _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(value)), thirty_two),
                    _mm256_set1_epi16(sc[2 * j]));
                const __m256i second = _mm256_mullo_epi16(
                    _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(value, 1)), thirty_two),
                    _mm256_set1_epi16(sc[2 * j + 1]));
                const __m256i dot = dot_i16(dot_i16(_mm256_setzero_si256(), first, xq + 32 * j), second, xq + 32 * j + 16);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[j]), _mm256_cvtepi32_ps(dot), acc);
            }
            continue;
        }
        const uint8_t *qs = block + (format == Q5_K ? 48 : 16);
        uint8_t sc[GROUPS], m[GROUPS];
        unpack_scales(block + 4, sc, m);
        float scale[GROUPS];
        const __m256 sc_floats = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
        const __m256 m_floats = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m)));
        _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(half_to_float(block)), sc_floats),
                                              _mm256_loadu_ps(xd)));
        offsets = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(half_to_float(block + 2)), m_floats),
                                  _mm256_loadu_ps(x->s + b * GROUPS), offsets);
        const __m256i high_bits = format == Q5_K ? _mm256_loadu_si256((const __m256i *)(block + 16)) : one;
#pragma GCC unroll 4
        for (int i = 0; i < GROUPS / 2; ++i) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
            __m256i even = _mm256_and_si256(packed, low_nibbles);
            __m256i odd = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
            if (format == Q5_K) {
                const __m256i bits = _mm256_srli_epi16(high_bits, 2 * i);
                even = _mm256_or_si256(even, _mm256_slli_epi16(_mm256_and_si256(bits, one), 4));
                odd = _mm256_or_si256(odd, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 1), one), 4));
            }
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(scale + 2 * i),
                                  _mm256_cvtepi32_ps(dot_u8_s16(even, xq + 64 * i)), acc);
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(scale + 2 * i + 1),
                                  _mm256_cvtepi32_ps(dot_u8_s16(odd, xq + 64 * i + 32)), acc);
        }
    }
    return sum_lanes(acc) - sum_lanes(offsets);
}
#else
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
        for (int l = 0; l < Q8_BLOCK; ++l) dot += weight_int(block, 0, l, format) * x->q[b * Q8_BLOCK + l];
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
#endif

float int16_dot_q8_0(const uint8_t *row, const q16_token *x, int64_t blocks) { return row_dot_32(row, x, blocks, Q8_0); }
float int16_dot_q4_0(const uint8_t *row, const q16_token *x, int64_t blocks) { return row_dot_32(row, x, blocks, Q4_0); }
float int16_dot_q4_1(const uint8_t *row, const q16_token *x, int64_t blocks) { return row_dot_32(row, x, blocks, Q4_1); }
float int16_dot_q4_k(const uint8_t *row, const q16_token *x, int64_t blocks) { return row_dot_k(row, x, blocks, Q4_K); }
float int16_dot_q5_k(const uint8_t *row, const q16_token *x, int64_t blocks) { return row_dot_k(row, x, blocks, Q5_K); }
float int16_dot_q6_k(const uint8_t *row, const q16_token *x, int64_t blocks) { return row_dot_k(row, x, blocks, Q6_K); }
