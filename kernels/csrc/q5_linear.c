/*
 * The row kernels of ggml's 5-bit formats of 32-weight blocks, Q5_0 and Q5_1, for the row driver (block_rows.c):
 * quantized_linear_f32 and dequantize_f32 (quantized_linear.c) find them through q5_format. Same calling
 * convention and register tiles as quantized_linear.c's formats, of which these are Q4_0 and Q4_1 with a fifth
 * bit:
 *   Q5_0, 22 bytes: fp16 d, uint8 qh[4], uint8 qs[16];           w[j] = d * (q[j] - 16)
 *   Q5_1, 24 bytes: fp16 d, fp16 m, uint8 qh[4], uint8 qs[16];   w[j] = d * q[j] + m
 * where q[j] = nibble j | (bit j of qh, a little-endian uint32) << 4, nibble j < 16 the low half of qs[j] and
 * nibble j + 16 the high half. d * q is exact in float32 (an 11-bit by 6-bit product), so the weights are bit
 * for bit gguf-py's, fused with the add of m or not.
 *
 * A fifth bit costs a table lookup and an or per eight weights: FIFTH_BITS[b] spreads the eight bits of a qh
 * byte to bit 4 of eight bytes, which join the eight nibbles in one 64-bit integer before they widen to
 * vector lanes. Measured with AVX2 (one thread, weights in L2, AVX-512 host): 3.05 ns a Q5_0 block, against
 * 3.6 shifting a broadcast of qh into each lane (three vector operations per eight weights) and 2.6 for Q4_0.
 */
#include <stdint.h>
#include <string.h>

#include "block_rows.h"
#include "half_float.h"
#include "vector_math.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

enum { BLOCK_WEIGHTS = 32 };
/* ggml's type ids (GGUF's tensor types). */
enum { GGML_Q5_0 = 6, GGML_Q5_1 = 7 };
/* The formats in this file's table, and each one's block size in bytes (named too, for the table's initializer). */
enum format { Q5_0, Q5_1, FORMATS };
enum { Q5_0_BYTES = 22, Q5_1_BYTES = 24 };
static const int64_t BLOCK_BYTES[FORMATS] = {Q5_0_BYTES, Q5_1_BYTES};

typedef uint8_t bytes8 __attribute__((vector_size(8), aligned(1), may_alias));
typedef int32_t ints __attribute__((vector_size(LANES * sizeof(int32_t))));

/* FIFTH_BITS[v]: bit i of the byte v at bit 4 of byte i, for every v (2 KiB, in L1 while it is used).
 * FIFTH_BITS_NOT[v]: 0xF0 in the bytes of clear bits instead, so that nibble | it is Q5_0's q - 16 as a signed
 * byte (AVX2 widens signed bytes as they load). */
#define FIFTH_OF(v)                                                                                               \
    ((((v)&1ull) << 4) | (((v)&2ull) << 11) | (((v)&4ull) << 18) | (((v)&8ull) << 25) | (((v)&16ull) << 32) |     \
     (((v)&32ull) << 39) | (((v)&64ull) << 46) | (((v)&128ull) << 53))
#define FIFTH(v) FIFTH_OF(v)
#define FIFTH4(v) FIFTH(v), FIFTH((v) + 1), FIFTH((v) + 2), FIFTH((v) + 3)
#define FIFTH16(v) FIFTH4(v), FIFTH4((v) + 4), FIFTH4((v) + 8), FIFTH4((v) + 12)
#define FIFTH64(v) FIFTH16(v), FIFTH16((v) + 16), FIFTH16((v) + 32), FIFTH16((v) + 48)
static const uint64_t FIFTH_BITS[256] = {FIFTH64(0), FIFTH64(64), FIFTH64(128), FIFTH64(192)};
#undef FIFTH
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FIFTH(v) (FIFTH_OF(255 - (v)) * 15ull) /* 0x10 * 15 = 0xF0 in the bytes of clear bits */
static const uint64_t FIFTH_BITS_NOT[256] = {FIFTH64(0), FIFTH64(64), FIFTH64(128), FIFTH64(192)};
#undef FIFTH
#endif
#undef FIFTH64
#undef FIFTH16
#undef FIFTH4
#undef FIFTH_OF
static const uint64_t LOW_NIBBLES = 0x0F0F0F0F0F0F0F0Full;

/* Where a block keeps qh (its nibbles follow). */
static inline int64_t qh_offset(const enum format format) { return format == Q5_1 ? 4 : 2; }

/* Weights 8i..8i+7's q (five bits each) as eight bytes of a 64-bit integer, in weight order: their nibbles
 * (low halves of qs[8i..8i+7] for i < 2, high halves of qs[8(i-2)..] after) and byte i of qh spread. */
static inline __attribute__((always_inline)) uint64_t q_bytes(const uint8_t *block, const enum format format,
                                                              const int i, const uint64_t *fifth_bits) {
    uint64_t qs;
    memcpy(&qs, block + qh_offset(format) + 4 + 8 * (i % 2), sizeof qs);
    return ((i < 2 ? qs : qs >> 4) & LOW_NIBBLES) | fifth_bits[block[qh_offset(format) + i]];
}

typedef uint64_t u64_vector __attribute__((vector_size(8)));

/* A block's 32 weights as d * q + m (m: Q5_1 only), the q as four vectors of eight. */
typedef struct {
    float d, m;
    vec q[4];
} unpacked_block;

static inline __attribute__((always_inline)) unpacked_block unpack_block(const uint8_t *block,
                                                                         const enum format format) {
    unpacked_block out = {.d = half_to_float(block), .m = format == Q5_1 ? half_to_float(block + 2) : 0.0f};
    const int32_t offset = format == Q5_0 ? 16 : 0;
    for (int i = 0; i < 4; ++i) {
        const bytes8 q = (bytes8)(u64_vector){q_bytes(block, format, i, FIFTH_BITS)};
        out.q[i] = __builtin_convertvector(__builtin_convertvector(q, ints) - offset, vec);
    }
    return out;
}

/* The block's weights (its one group), four vectors of eight. (Adding Q5_0's m of 0 would turn -0 into +0.) */
static inline __attribute__((always_inline)) void dequantize_group(const uint8_t *block, const unpacked_block *u,
                                                                   const enum format format, const int j,
                                                                   vec w[4]) {
    (void)block, (void)j; /* all in u */
    for (int i = 0; i < 4; ++i) w[i] = format == Q5_1 ? splat(u->d) * u->q[i] + splat(u->m) : splat(u->d) * u->q[i];
}

/* The block's weights are in order already. */
static inline void store_group(float *out, const vec w[4]) {
    for (int i = 0; i < 4; ++i) store(out + i * LANES, w[i]);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/*
 * row_single in AVX2 intrinsics, as quantized_linear.c's for Q4_0 and Q4_1 (why: see there): 1.5x the vector
 * extensions' speed here (3.05 against 4.66 ns a Q5_0 block, measured as above). Each eight q widen from one
 * 64-bit integer to int32 lanes in one instruction, signed for Q5_0.
 */

/* q . x_b for one block, as eight partial sums: q the block's integers (Q5_0's less 16: its clear fifth bits
 * set bits 4-7 of the byte instead, making it nibble - 16 as a signed byte). */
static inline __attribute__((always_inline)) __m256 block_dot(const uint8_t *block, const float *xb,
                                                              const enum format format) {
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
        const uint64_t *fifth_bits = format == Q5_0 ? FIFTH_BITS_NOT : FIFTH_BITS;
        const __m128i bytes = _mm_cvtsi64_si128((int64_t)q_bytes(block, format, i, fifth_bits));
        q[i] = format == Q5_0 ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    }
    return dot_ints_avx2(q, xb);
}

/* One token: y = sum over blocks of d * (q . x_b) + m * sum(x_b) + bias (m: Q5_1 only). */
static inline __attribute__((always_inline)) void row_single(float *y, const float *x, const float *x_sums,
                                                             const uint8_t *row, int64_t blocks, float bias,
                                                             const enum format format) {
    __m256 scaled = _mm256_setzero_ps();
    __m128 offsets = _mm_setzero_ps(); /* lane 1: the sum of m * sum(x_b) */
    const int64_t block_bytes = BLOCK_BYTES[format];
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * block_bytes;
        int32_t bits;
        memcpy(&bits, block, sizeof bits);
        const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128(bits)); /* d, then m (Q5_1) */
        scaled = _mm256_fmadd_ps(_mm256_broadcastss_ps(scales), block_dot(block, x + b * BLOCK_WEIGHTS, format),
                                 scaled);
        if (format == Q5_1) offsets = _mm_fmadd_ps(scales, _mm_broadcast_ss(x_sums + b), offsets);
    }
    const float offset = format == Q5_1 ? _mm_cvtss_f32(_mm_movehdup_ps(offsets)) : 0.0f;
    *y = horizontal_sum((vec)scaled) + offset + bias;
}
#else
/* One token: y = sum over blocks of d * (q . x_b) + m * sum(x_b) + bias (m: Q5_1 only), regrouped as
 * quantized_linear.c's row_single. */
static inline __attribute__((always_inline)) void row_single(float *y, const float *x, const float *x_sums,
                                                             const uint8_t *row, int64_t blocks, float bias,
                                                             const enum format format) {
    vec scaled = {0};
    float offsets = 0.0f;
    const int64_t block_bytes = BLOCK_BYTES[format];
    for (int64_t b = 0; b < blocks; ++b) {
        const unpacked_block u = unpack_block(row + b * block_bytes, format);
        const float *xb = x + b * BLOCK_WEIGHTS;
        const vec dot = u.q[0] * load(xb) + u.q[1] * load(xb + LANES) + u.q[2] * load(xb + 2 * LANES) +
                        u.q[3] * load(xb + 3 * LANES);
        scaled += splat(u.d) * dot;
        if (format == Q5_1) offsets += u.m * x_sums[b];
    }
    *y = horizontal_sum(scaled) + offsets + bias;
}
#endif

#include "block_row_kernels.h"

BLOCK_KERNELS(Q5_0) BLOCK_KERNELS(Q5_1)
/* Only Q5_1 has an offset m, whose single-token term takes x's block sums. */
static const block_format FORMAT_TABLE[FORMATS] = {BLOCK_FORMAT(Q5_0, GGML_Q5_0, 0, NULL),
                                                   BLOCK_FORMAT(Q5_1, GGML_Q5_1, 1, NULL)};

const block_format *q5_format(int ggml_type) { return block_format_of(FORMAT_TABLE, FORMATS, ggml_type); }
