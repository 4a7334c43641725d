/*
 * What the block-format kernels (quantized_linear.c, kquant_linear.c) share: their fp16 scales.
 */
#ifndef PAGEDSERVE_HALF_FLOAT_H
#define PAGEDSERVE_HALF_FLOAT_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__) || defined(__AVX512FP16__)
#include <immintrin.h>
#endif

/* An fp16 value stored little-endian (as GGUF is, and every host this runs on), at any address: blocks are 18,
 * 20, 34 or 210 bytes long, so their scales are not 2-byte aligned. */
static inline float half_to_float(const uint8_t *p) {
#if defined(__AVX512FP16__)
    /* A scalar fp16 conversion merges into its destination register, so it waits on that register's last writer
     * unless the merge source is a zeroed one: the compiler's own _Float16 cast merged into the register the
     * previous block's scale had used, a chain through every block that doubled a tile's time at 2-3 tokens. */
    return _mm_cvtss_f32(_mm_cvtsh_ss(_mm_setzero_ps(), _mm_load_sh(p)));
#elif defined(__F16C__)
    uint16_t bits;
    memcpy(&bits, p, sizeof bits);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits))); /* a vector conversion: no merge */
#else
    uint16_t bits;
    memcpy(&bits, p, sizeof bits);
#if defined(__FLT16_MAX__)
    /* The compiler has _Float16: one instruction on ARMv8. */
    __extension__ _Float16 half; /* C23's type, an extension of C11 */
    memcpy(&half, &bits, sizeof half);
    return (float)half;
#else
    const uint32_t sign = (uint32_t)(bits & 0x8000u) << 16, exponent = (bits >> 10) & 0x1Fu, mantissa = bits & 0x3FFu;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in float */
        const float magnitude = (float)mantissa * 0x1p-24f;
        return sign ? -magnitude : magnitude;
    }
    /* Rebias the exponent (15 -> 127); infinities and NaNs keep an all-ones exponent. */
    const uint32_t exponent32 = exponent == 0x1Fu ? 0xFFu : exponent + 112u;
    const union { uint32_t bits; float value; } result = {.bits = sign | exponent32 << 23 | mantissa << 13};
    return result.value;
#endif
#endif
}

#endif
