/*
 * A token's activations quantized to 8 or 16 bits in blocks of 32 (the layouts in int8_activations.h), once per
 * call of int8_linear.c: O(K) work against the O(N * K) of the product it serves.
 *
 * The arithmetic is fixed so that a torch reference reproduces it bit for bit (kernels/int8_reference.py):
 * d = amax / 127 (16 bits: / Q16_MAX) and id = 1 / d, both rounded to float32; q = x * id rounded to float32, then to the nearest
 * integer, ties to even (the default rounding of cvtps2dq and of rintf); s = d * (float)(sum of q).
 */
#include <math.h>
#include <stdint.h>

#include "int8_activations.h"

#ifdef INT8_AVX2
static void quantize_block(int8_t *q, float *d, float *s, const float *x) {
    __m256 v[4];
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float scale = _mm_cvtss_f32(m) / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    __m256i ints[4];
    for (int i = 0; i < 4; ++i) ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
    /* int32 -> int16 -> int8 packs interleave the 128-bit lanes; a permute of dwords puts them back in order. */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
    *d = scale;
    *s = scale * (float)_mm_cvtsi128_si32(t);
}
#else
static void quantize_block(int8_t *q, float *d, float *s, const float *x) {
    float amax = 0.0f;
    for (int k = 0; k < Q8_BLOCK; ++k) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    const float scale = amax / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    int32_t sum = 0;
    for (int k = 0; k < Q8_BLOCK; ++k) {
        const float scaled = x[k] * inverse; /* a statement of its own: no multiply-add may fuse across it */
        q[k] = (int8_t)rintf(scaled);
        sum += q[k];
    }
    *d = scale;
    *s = scale * (float)sum;
}
#endif

void quantize_q8(int8_t *q, float *d, float *s, const float *x, int64_t K) {
    for (int64_t b = 0; b < K / Q8_BLOCK; ++b) quantize_block(q + b * Q8_BLOCK, d + b, s + b, x + b * Q8_BLOCK);
}

/* The same with 16-bit integers: d = amax / Q16_MAX. */
#ifdef INT8_AVX2
static void quantize_block16(int16_t *q, float *d, float *s, const float *x) {
    __m256 v[4];
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float scale = _mm_cvtss_f32(m) / (float)Q16_MAX, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    __m256i ints[4];
    for (int i = 0; i < 4; ++i) ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
    /* int32 -> int16 packs interleave the 128-bit lanes' quarters; a permute of quadwords restores the order. */
    for (int i = 0; i < 2; ++i)
        _mm256_storeu_si256((__m256i *)(q + 16 * i),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[2 * i], ints[2 * i + 1]), 0xD8));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
    *d = scale;
    *s = scale * (float)_mm_cvtsi128_si32(t);
}
#else
static void quantize_block16(int16_t *q, float *d, float *s, const float *x) {
    float amax = 0.0f;
    for (int k = 0; k < Q8_BLOCK; ++k) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    const float scale = amax / (float)Q16_MAX, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    int32_t sum = 0;
    for (int k = 0; k < Q8_BLOCK; ++k) {
        const float scaled = x[k] * inverse;
        q[k] = (int16_t)rintf(scaled);
        sum += q[k];
    }
    *d = scale;
    *s = scale * (float)sum;
}
#endif

void quantize_q16(int16_t *q, float *d, float *s, const float *x, int64_t K) {
    for (int64_t b = 0; b < K / Q8_BLOCK; ++b) quantize_block16(q + b * Q8_BLOCK, d + b, s + b, x + b * Q8_BLOCK);
}

void sums_of_16_q16(int32_t *sums, const int16_t *q, int64_t K) {
    for (int64_t i = 0; i < K / 16; ++i) {
        int32_t sum = 0;
        for (int k = 0; k < 16; ++k) sum += q[16 * i + k];
        sums[i] = sum;
    }
}

/* Each half block's 16 integers: evens, then odds. AVX2: a byte shuffle within each 128-bit lane (its four even
 * integers, then its four odd ones), then a permute of quadwords puts both lanes' evens first. */
#ifdef INT8_AVX2
void nibble_order_q16(int16_t *q, int64_t K) {
    const __m256i evens_first = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8,
                                                 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (int64_t k = 0; k < K; k += 16) {
        const __m256i lanes = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(q + k)), evens_first);
        _mm256_storeu_si256((__m256i *)(q + k), _mm256_permute4x64_epi64(lanes, 0xD8));
    }
}
#else
void nibble_order_q16(int16_t *q, int64_t K) {
    for (int64_t k = 0; k < K; k += 16) {
        int16_t half[16];
        for (int i = 0; i < 16; ++i) half[i] = q[k + (i < 8 ? 2 * i : 2 * (i - 8) + 1)];
        for (int i = 0; i < 16; ++i) q[k + i] = half[i];
    }
}
#endif
