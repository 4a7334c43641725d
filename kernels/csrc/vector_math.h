/*
 * Vectorisable float32 math shared by the CPU kernels: plain arithmetic, no libm calls, so that the loops
 * calling it compile to SIMD code.
 */
#ifndef PAGEDSERVE_VECTOR_MATH_H
#define PAGEDSERVE_VECTOR_MATH_H

#include <stdint.h>

/*
 * exp(-a) for a >= 0, in plain arithmetic so that loops calling it vectorise (libm's expf, floorf and
 * fminf do not): Cephes' range reduction and polynomial, within 2 ulp of expf. Past a = 87 the result
 * flushes to 2^-126 instead of underflowing further, which no caller can tell from zero.
 */
static inline float exp_negative(float a) {
    const float x = -a, round = 12582912.0f; /* adding 1.5 * 2^23 rounds to the nearest integer */
    const float n = (x * 1.44269504088896341f + round) - round;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t exponent = (int32_t)n; /* an integer clamp: float min/max would not vectorise */
    exponent = exponent < -126 ? -126 : exponent;
    const union { int32_t bits; float value; } scale = {.bits = (exponent + 127) << 23}; /* 2^n */
    return p * scale.value;
}

#endif
