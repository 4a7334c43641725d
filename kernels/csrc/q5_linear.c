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
 * A fifth bit costs one variable shift, a mask and an or per eight weights: every weight's bit is shifted to
 * bit 4 of its int32 lane from a broadcast of qh.
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
typedef uint16_t halfwords4 __attribute__((vector_size(8)));
typedef int32_t ints __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t uints __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* Where a block keeps qh (its nibbles follow). */
static inline int64_t qh_offset(const enum format format) { return format == Q5_1 ? 4 : 2; }

static inline uint32_t fifth_bits(const uint8_t *block, const enum format format) {
    uint32_t qh;
    memcpy(&qh, block + qh_offset(format), sizeof qh);
    return qh;
}

/* The high nibbles of eight bytes, shifted as 16-bit lanes: x86 has no shift of byte lanes. */
static inline bytes8 high_nibbles(bytes8 b) { return (bytes8)((halfwords4)b >> 4) & 0x0F; }

/* Weights 8i..8i+7's q as floats, less `offset`: their nibbles and bits 8i..8i+7 of qh at bit 4. */
static inline vec q_floats(bytes8 nibbles, uint32_t qh, int i, int32_t offset) {
    const uints shifts = {8 * i, 8 * i + 1, 8 * i + 2, 8 * i + 3, 8 * i + 4, 8 * i + 5, 8 * i + 6, 8 * i + 7};
    const ints fifth = (ints)(((uints){qh, qh, qh, qh, qh, qh, qh, qh} >> shifts) & 1) << 4;
    return __builtin_convertvector((__builtin_convertvector(nibbles, ints) | fifth) - offset, vec);
}

/* A block's 32 weights as d * q + m (m: Q5_1 only), the q as four vectors of eight. */
typedef struct {
    float d, m;
    vec q[4];
} unpacked_block;

static inline __attribute__((always_inline)) unpacked_block unpack_block(const uint8_t *block,
                                                                         const enum format format) {
    unpacked_block out = {.d = half_to_float(block), .m = format == Q5_1 ? half_to_float(block + 2) : 0.0f};
    const int32_t offset = format == Q5_0 ? 16 : 0;
    const uint32_t qh = fifth_bits(block, format);
    const uint8_t *qs = block + qh_offset(format) + 4;
    const bytes8 low = *(const bytes8 *)qs, high = *(const bytes8 *)(qs + 8);
    out.q[0] = q_floats(low & 0x0F, qh, 0, offset);
    out.q[1] = q_floats(high & 0x0F, qh, 1, offset);
    out.q[2] = q_floats(high_nibbles(low), qh, 2, offset);
    out.q[3] = q_floats(high_nibbles(high), qh, 3, offset);
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
 * row_single in AVX2 intrinsics, as quantized_linear.c's for Q4_0 and Q4_1 (why: see there): the nibbles widen
 * to int32 as they load, and each lane's fifth bit comes from a broadcast of qh by one variable shift.
 */

/* q . x_b for one block, as eight partial sums: q the block's integers (Q5_0's less 16). */
static inline __attribute__((always_inline)) __m256 block_dot(const uint8_t *block, const float *xb,
                                                              const enum format format) {
    const uint8_t *qs = block + qh_offset(format) + 4;
    const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    const __m256i high = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    const __m256i nibble = _mm256_set1_epi32(0x0F), bit = _mm256_set1_epi32(0x10);
    const __m256i qh = _mm256_set1_epi32((int32_t)fifth_bits(block, format));
    /* Bit 8i + lane of qh to bit 4: shifted right by 8i + lane - 4 (left by 4 - lane for i = 0, lanes 0-3). */
    const __m256i first = _mm256_sllv_epi32(qh, _mm256_setr_epi32(4, 3, 2, 1, 0, 0, 0, 0));
    const __m256i lane = _mm256_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3);
    __m256i q[4];
    q[0] = _mm256_and_si256(low, nibble);
    q[1] = _mm256_and_si256(high, nibble);
    q[2] = _mm256_srli_epi32(low, 4);
    q[3] = _mm256_srli_epi32(high, 4);
    q[0] = _mm256_or_si256(q[0], _mm256_and_si256(_mm256_srlv_epi32(first, lane), bit));
    for (int i = 1; i < 4; ++i) {
        const __m256i shifts = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * i - 4));
        q[i] = _mm256_or_si256(q[i], _mm256_and_si256(_mm256_srlv_epi32(qh, shifts), bit));
    }
    if (format == Q5_0)
        for (int i = 0; i < 4; ++i) q[i] = _mm256_sub_epi32(q[i], _mm256_set1_epi32(16));
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
