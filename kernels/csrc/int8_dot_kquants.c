/*
 * Row dots of the K-quants (Q4_K, Q5_K, Q6_K; layouts in kquant_linear.c) with a token quantized to 8 bits
 * (int8_activations.h). A super-block's eight groups of 32 weights line up with eight activation blocks, so
 *   Q4_K, Q5_K:  row . x = sum_j d * sc_j * d_j * (q_j . x_j) - dmin * m_j * s_j
 *   Q6_K:        row . x = sum_j d * d_j * (sc_2j * (q - 32) . x over the group's first 16 weights
 *                                          + sc_2j+1 * (q - 32) . x over its last 16)
 * with the integer dots exact and one float multiply-add of eight lanes a group. The activations keep a scale
 * per 32 features (ggml's Q8_K keeps one per 256): closer to x, for one multiply a group.
 *
 * Weights are read in their stored byte order, which for every group is the order of its 32 features: Q4_K's
 * groups 2i and 2i + 1 are the low and high nibbles of qs[32i..32i+31]; Q5_K adds bit j of qh[l] as bit 4;
 * Q6_K assembles ql's nibble and qh's two bits.
 */
#include <stdint.h>
#include <string.h>

#include "half_float.h"
#include "int8_activations.h"
#include "kquant_scales.h"

enum { QK_K = 256, GROUPS = QK_K / Q8_BLOCK, Q4_K_BYTES = 144, Q5_K_BYTES = 176, Q6_K_BYTES = 210 };
enum format { Q4_K, Q5_K, Q6_K };

#ifdef INT8_AVX2
/* Eight bytes as eight floats. */
static inline __m256 byte_floats(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Q4_K or Q5_K: the eight groups' integer dots, each scaled by d * sc_j * d_j; the mins' term subtracted. */
static inline __attribute__((always_inline)) float row_dot_4_5(const uint8_t *row, const q8_token *x,
                                                               int64_t blocks, const enum format format) {
    const int64_t block_bytes = format == Q5_K ? Q5_K_BYTES : Q4_K_BYTES;
    __m256 acc = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * block_bytes, *qs = block + (format == Q5_K ? 48 : 16);
        const int8_t *xq = x->q + b * QK_K;
        uint8_t sc[GROUPS], m[GROUPS];
        unpack_scales(block + 4, sc, m);
        float scale[GROUPS];
        _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(half_to_float(block)), byte_floats(sc)),
                                              _mm256_loadu_ps(x->d + b * GROUPS)));
        offsets = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(half_to_float(block + 2)), byte_floats(m)),
                                  _mm256_loadu_ps(x->s + b * GROUPS), offsets);
        const __m256i high_bits = format == Q5_K ? _mm256_loadu_si256((const __m256i *)(block + 16)) : one;
#pragma GCC unroll 4
        for (int i = 0; i < GROUPS / 2; ++i) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
            __m256i even = _mm256_and_si256(packed, low_nibbles);
            __m256i odd = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
            if (format == Q5_K) { /* bit 2i of qh for the even group, bit 2i + 1 for the odd one, as bit 4 */
                const __m256i bits = _mm256_srli_epi16(high_bits, 2 * i);
                even = _mm256_or_si256(even, _mm256_slli_epi16(_mm256_and_si256(bits, one), 4));
                odd = _mm256_or_si256(odd, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits, 1), one), 4));
            }
            const __m256i x_even = _mm256_loadu_si256((const __m256i *)(xq + 64 * i));
            const __m256i x_odd = _mm256_loadu_si256((const __m256i *)(xq + 64 * i + 32));
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(scale + 2 * i), _mm256_cvtepi32_ps(dot_u8_s8(even, x_even)), acc);
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(scale + 2 * i + 1), _mm256_cvtepi32_ps(dot_u8_s8(odd, x_odd)),
                                  acc);
        }
    }
    return sum_lanes(acc) - sum_lanes(offsets);
}

/* Q6_K: each group's 6-bit values (0..63) times x, less 32 times x's sums; lanes 0-3 of the product cover the
 * group's first 16 weights and take sc_2j, lanes 4-7 sc_2j+1. */
static float row_dot_6(const uint8_t *row, const q8_token *x, int64_t blocks) {
    __m256 acc = _mm256_setzero_ps();
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F), two_bits = _mm256_set1_epi8(0x03);
    const __m256i thirty_two = _mm256_set1_epi8(32);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * Q6_K_BYTES;
        const int8_t *xq = x->q + b * QK_K, *sc = (const int8_t *)(block + 192);
        const float d = half_to_float(block + 208);
#pragma GCC unroll 8
        for (int j = 0; j < GROUPS; ++j) {
            const int half = j / 4, s = j % 4;
            const __m256i low = _mm256_loadu_si256((const __m256i *)(block + 64 * half + 32 * (s % 2)));
            const __m256i high = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * half));
            const __m256i nibble = _mm256_and_si256(s >= 2 ? _mm256_srli_epi16(low, 4) : low, low_nibbles);
            const __m256i top = _mm256_and_si256(s > 0 ? _mm256_srli_epi16(high, 2 * s) : high, two_bits);
            const __m256i value = _mm256_or_si256(nibble, _mm256_slli_epi16(top, 4));
            const __m256i xg = _mm256_loadu_si256((const __m256i *)(xq + 32 * j));
            const __m256i dot = _mm256_sub_epi32(dot_u8_s8(value, xg), dot_u8_s8(thirty_two, xg));
            const float unit = d * x->d[b * GROUPS + j];
            const __m256 scale = _mm256_set_m128(_mm_set1_ps(unit * (float)sc[2 * j + 1]), _mm_set1_ps(unit * (float)sc[2 * j]));
            acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), acc);
        }
    }
    return sum_lanes(acc);
}
#else
/* Weight l of group j of a super-block, as an integer (Q6_K's less 32). */
static inline __attribute__((always_inline)) int32_t weight_int(const uint8_t *block, int j, int l,
                                                                const enum format format) {
    if (format == Q6_K) {
        const int half = j / 4, s = j % 4;
        const int nibble = (block[64 * half + 32 * (s % 2) + l] >> (4 * (s / 2))) & 0x0F;
        return (nibble | ((block[128 + 32 * half + l] >> (2 * s)) & 3) << 4) - 32;
    }
    const uint8_t *qs = block + (format == Q5_K ? 48 : 16);
    const int nibble = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
    return format == Q5_K ? nibble | ((block[16 + l] >> j) & 1) << 4 : nibble;
}

static inline __attribute__((always_inline)) float row_dot_any(const uint8_t *row, const q8_token *x,
                                                               int64_t blocks, const enum format format) {
    const int64_t block_bytes = format == Q6_K ? Q6_K_BYTES : format == Q5_K ? Q5_K_BYTES : Q4_K_BYTES;
    float sum = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * block_bytes;
        const int8_t *xq = x->q + b * QK_K;
        uint8_t sc[GROUPS], m[GROUPS];
        if (format != Q6_K) unpack_scales(block + 4, sc, m);
        for (int j = 0; j < GROUPS; ++j) {
            int32_t dots[2] = {0, 0}; /* the group's two 16-weight halves */
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
#define row_dot_4_5 row_dot_any
static float row_dot_6(const uint8_t *row, const q8_token *x, int64_t blocks) {
    return row_dot_any(row, x, blocks, Q6_K);
}
#endif

float int8_dot_q4_k(const uint8_t *row, const q8_token *x, int64_t blocks) {
    return row_dot_4_5(row, x, blocks, Q4_K);
}

float int8_dot_q5_k(const uint8_t *row, const q8_token *x, int64_t blocks) {
    return row_dot_4_5(row, x, blocks, Q5_K);
}

float int8_dot_q6_k(const uint8_t *row, const q8_token *x, int64_t blocks) { return row_dot_6(row, x, blocks); }
