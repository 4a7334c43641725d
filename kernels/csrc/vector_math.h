/*
 * Vectorisable float32 math shared by the CPU kernels: plain arithmetic, no libm calls, so that the loops
 * calling it compile to SIMD code; and an 8-float vector type (GCC vector extensions), which compiles to
 * AVX2, AVX-512 or NEON as the host has.
 */
#ifndef PAGEDSERVE_VECTOR_MATH_H
#define PAGEDSERVE_VECTOR_MATH_H

#include <stdint.h>

#define LANES 8
/* A vector of floats that may sit at any float's address and alias plain floats. */
typedef float vec __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float)), may_alias));

static inline vec load(const float *p) { return *(const vec *)p; }

static inline void store(float *p, vec v) { *(vec *)p = v; }

static inline vec splat(float value) { return (vec){value, value, value, value, value, value, value, value}; }

/* Lanes of a and b by index (b's are LANES..2 * LANES - 1), with the builtin each compiler has. */
typedef int32_t lane_indices __attribute__((vector_size(LANES * sizeof(int32_t))));
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (lane_indices){__VA_ARGS__})
#endif

static inline float horizontal_sum(vec v) {
    const vec pairs = v + SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    const vec quads = pairs + SHUFFLE(pairs, pairs, 2, 3, 0, 1, 2, 3, 0, 1);
    return quads[0] + quads[1];
}

/* The lane sums of eight vectors, as one vector: lane j is the sum of v_j's lanes. */
static inline vec transposed_sums(vec v0, vec v1, vec v2, vec v3, vec v4, vec v5, vec v6, vec v7) {
#define PAIR_SUMS(a, b)                                                                                            \
    (SHUFFLE(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(a, b, 1, 9, 3, 11, 5, 13, 7, 15))
#define QUAD_SUMS(a, b)                                                                                            \
    (SHUFFLE(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
    /* Each step halves the vectors and doubles the lanes each partial sum covers. */
    const vec q0 = QUAD_SUMS(PAIR_SUMS(v0, v1), PAIR_SUMS(v2, v3));  /* v0..v3 over lanes 0-3, then 4-7 */
    const vec q1 = QUAD_SUMS(PAIR_SUMS(v4, v5), PAIR_SUMS(v6, v7));
#undef PAIR_SUMS
#undef QUAD_SUMS
    return SHUFFLE(q0, q1, 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(q0, q1, 4, 5, 6, 7, 12, 13, 14, 15);
}

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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* q . x for 32 integers in four int32 vectors and 32 floats at any address, as eight partial sums. */
static inline __m256 dot_ints_avx2(const __m256i q[4], const float *x) {
    __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(q[0]), _mm256_loadu_ps(x));
    for (int i = 1; i < 4; ++i) dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[i]), _mm256_loadu_ps(x + 8 * i), dot);
    return dot;
}
#endif

#endif
