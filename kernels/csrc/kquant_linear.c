/*
 * y = x @ W^T + bias for a few tokens, with W in one of ggml's K-quant formats (Q4_K, Q5_K, Q6_K: what
 * llama.cpp's Q4_K_M, Q5_K_M and Q6_K files store most tensors in) and x, y and the sums in float32, for the CPU.
 *
 * The companion of quantized_linear.c (same calling convention, same reasons): a decode step reads every
 * weight once, so W is read as stored and each block is dequantized in registers as it streams past.
 *
 * Formats (ggml's; super-blocks of QK_K = 256 consecutive weights of a row, a row of W is K / 256 super-blocks
 * in a row). Each super-block holds eight groups of 32 weights, group j weights 32j..32j+31:
 *   Q4_K, 144 bytes: fp16 d, fp16 dmin, uint8 scales[12], uint8 qs[128]
 *       w = d * sc[j] * q - dmin * m[j], q a 4-bit nibble; sc[j], m[j] are 6-bit, packed in scales[12]:
 *       j < 4: sc = scales[j] & 63, m = scales[j + 4] & 63; j >= 4: low four bits in scales[j + 4] (sc low
 *       nibble, m high nibble), top two in bits 6-7 of scales[j - 4] (sc) and scales[j] (m).
 *       Groups 2i and 2i + 1 share qs[32i..32i+31]: group 2i in their low nibbles, 2i + 1 in their high ones.
 *   Q5_K, 176 bytes: fp16 d, fp16 dmin, uint8 scales[12], uint8 qh[32], uint8 qs[128]
 *       as Q4_K, with a fifth bit: q of weight l of group j = nibble | (bit j of qh[l]) << 4.
 *   Q6_K, 210 bytes: uint8 ql[128], uint8 qh[64], int8 scales[16], fp16 d
 *       w = d * scales[i] * (q - 32), i = weight / 16; q 6-bit. Halves of 128 weights (h = 0, 1) each own
 *       ql[64h..64h+63] and qh[32h..32h+31]; weight 32s + l of a half (s < 4, l < 32) has its low four bits
 *       in ql[64h + 32(s % 2) + l] (low nibble for s < 2, high for s >= 2), its top two in bits 2s, 2s + 1 of
 *       qh[32h + l].
 * They are chosen by ggml's type id, as GGUF numbers them.
 *
 * Every product d * sc * q is exact in float32 (11-bit d, 6- or 8-bit sc, 4- to 6-bit q: at most 23 bits), so
 * the weights dequantized here are bit for bit gguf-py's, fused multiply-add or not.
 *
 * Layout: x is token-major, [M, K] with rows `ldx` floats apart; y is [M, N], written with strides `ldy_token`
 * and `ldy_row`, so the caller picks token-major (ldy_row = 1) or feature-major (ldy_token = 1) output.
 *
 * Byte planes (byte_planes.h): a group's 32 bytes (its nibbles, or its 6-bit values once assembled) are read as
 * eight 32-bit words, and vector k of the group holds byte k of every word: weights k, k + 4, ..., k + 28. So x is
 * permuted the same way once per call (permute_x), and every dot product runs in plane order. Each plane of a
 * Q6_K group holds weights of both its 16-weight sub-blocks: lanes 0-3 the first's, 4-7 the second's.
 *
 * Register tile, as in quantized_linear.c: one weight row x up to TOKENS tokens. Each super-block's scales are
 * unpacked once; each group of 32 weights is dequantized into four vectors and every token of the tile adds
 * their products with its 32 activations. A single token takes the product regrouped (row_single): the integer
 * q times x, scaled once per group, with the mins' term from x's group sums; for Q4_K and Q5_K in AVX2
 * intrinsics where the host has them. The row driver is quantized_linear.c's (block_rows.c,
 * block_row_kernels.h).
 *
 * kquant_dequantize_f32 writes W out in float32 (each group's planes transposed back to its weights' order) for
 * prefill, where a float32 matmul of a few rows at a time beats this kernel.
 *
 * Built at first use with the system C compiler (kernels/cpu_native.py), for the host CPU.
 */
#include <stdint.h>
#include <string.h>

#include "block_rows.h"
#include "byte_planes.h"
#include "half_float.h"
#include "kquant_scales.h"
#include "vector_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

enum { QK_K = 256, BLOCK_WEIGHTS = QK_K, GROUPS = QK_K / GROUP };
/* For block_row_kernels.h: a super-block's groups unrolled, so that each one's shifts and masks are constants. */
#define UNROLL_GROUPS _Pragma("GCC unroll 8")
/* ggml's type ids (GGUF's tensor types). */
enum { GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };
/* The formats in this file's table, and each one's super-block size in bytes (named too, for the table's
 * initializer). */
enum format { Q4_K, Q5_K, Q6_K, FORMATS };
enum { Q4_K_BYTES = 144, Q5_K_BYTES = 176, Q6_K_BYTES = 210 };
static const int64_t BLOCK_BYTES[FORMATS] = {Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES};

/*
 * A super-block's scales as floats: Q4_K and Q5_K subtract min[j] from d * sc[j] * q in group j, scale[j] =
 * d * sc[j]; Q6_K's scale[i] multiplies weights 16i..16i+15.
 */
typedef struct {
    float scale[QK_K / 16];
    float min[GROUPS];
} super_scales;

static inline __attribute__((always_inline)) super_scales unpack_block(const uint8_t *block,
                                                                       const enum format format) {
    super_scales out;
    if (format == Q6_K) {
        const vec d = splat(half_to_float(block + 208));
        store(out.scale, d * bytes_to_floats(*(const bytes8 *)(block + 192) ^ 0x80, 128));
        store(out.scale + LANES, d * bytes_to_floats(*(const bytes8 *)(block + 200) ^ 0x80, 128));
        return out;
    }
    uint32_t words[4];
    unpack_scale_words(block + 4, words);
    const vec scales = bytes_of_words(words[0], words[1]);
    const vec mins = bytes_of_words(words[2], words[3]);
    store(out.scale, splat(half_to_float(block)) * scales);
    store(out.min, splat(half_to_float(block + 2)) * mins);
    return out;
}

/*
 * Group j's 32 quantized values q (Q6_K's less 32) as its four byte planes, floats. Always inlined with a
 * constant format and, in unrolled loops, a constant j, so only that group's shifts and masks remain.
 */
static inline __attribute__((always_inline)) void group_q(const uint8_t *block, const enum format format,
                                                          const int j, vec q[4]) {
    if (format == Q6_K) {
        const int half = j / 4, s = j % 4;
        const words low = *(const words *)(block + 64 * half + 32 * (s % 2));
        const words high = *(const words *)(block + 128 + 32 * half);
        words value = ((low >> (4 * (s / 2))) & 0x0F0F0F0Fu) | ((high >> (2 * s)) & 0x03030303u) << 4;
        value = (words)((signed_bytes32)value - 32); /* byte lanes: no borrow crosses into the next weight */
        for (int k = 0; k < 4; ++k) q[k] = signed_byte_plane(value, k);
        return;
    }
    const words packed = *(const words *)(block + (format == Q5_K ? 48 : 16) + 32 * (j / 2));
    words value = (packed >> (4 * (j % 2))) & 0x0F0F0F0Fu;
    if (format == Q5_K) value |= ((*(const words *)(block + 16) >> j) & 0x01010101u) << 4;
    for (int k = 0; k < 4; ++k) q[k] = byte_plane(value, k);
}

/* Group j's scale, lane by lane (Q6_K: the first sub-block's in lanes 0-3, the second's in 4-7). */
static inline __attribute__((always_inline)) vec group_scale(const super_scales *u, const enum format format,
                                                             const int j) {
    if (format != Q6_K) return splat(u->scale[j]);
    const float first = u->scale[2 * j], second = u->scale[2 * j + 1];
    return (vec){first, first, first, first, second, second, second, second};
}

/* Group j's weights as its four byte planes: scale * q - min (exact product, one rounding: gguf-py's). */
static inline __attribute__((always_inline)) void dequantize_group(const uint8_t *block, const super_scales *u,
                                                                   const enum format format, const int j,
                                                                   vec w[4]) {
    vec q[4];
    group_q(block, format, j, q);
    const vec scale = group_scale(u, format, j);
    for (int k = 0; k < 4; ++k) w[k] = format == Q6_K ? scale * q[k] : scale * q[k] - splat(u->min[j]);
}

#if defined(__AVX2__) && defined(__FMA__)
/*
 * row_single for Q4_K and Q5_K in AVX2 intrinsics, for x86 since Haswell and Zen: 1.15x (Q4_K) and 1.05x (Q5_K)
 * the vector extensions' speed (Zen 3). Each plane is one shift and one mask of the group's words, with
 * neither where the other already did its work (GCC masks Q4_K's odd groups twice and the top nibble once
 * more than needed), and each group's scale is broadcast from the super-block's scales in memory. Q6_K is
 * no faster so (its planes are already one or two shifts each) and keeps the vector extensions.
 */

/* Bits [shift, shift + width) of each 32-bit lane of v, at the bottom: one shift and one mask at most. */
static inline __attribute__((always_inline)) __m256i lane_bits(__m256i v, const int shift, const int width) {
    if (shift > 0) v = _mm256_srli_epi32(v, shift);
    return shift + width >= 32 ? v : _mm256_and_si256(v, _mm256_set1_epi32((1 << width) - 1));
}

/* q . x_group for group j of a Q4_K or Q5_K super-block, as eight partial sums, x_group in plane order. */
static inline __attribute__((always_inline)) __m256 group_dot(const uint8_t *block, const float *xg,
                                                              const enum format format, const int j) {
    __m256i q[4];
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + (format == Q5_K ? 48 : 16) + 32 * (j / 2)));
    if (format == Q4_K) {
        for (int k = 0; k < 4; ++k) q[k] = lane_bits(packed, 8 * k + 4 * (j % 2), 4);
    } else {
        const __m256i high = _mm256_loadu_si256((const __m256i *)(block + 16));
        const __m256i low = _mm256_and_si256(j % 2 ? _mm256_srli_epi32(packed, 4) : packed, _mm256_set1_epi8(0x0F));
        const __m256i fifth = _mm256_and_si256(j > 0 ? _mm256_srli_epi32(high, j) : high, _mm256_set1_epi8(0x01));
        const __m256i value = _mm256_or_si256(low, _mm256_slli_epi32(fifth, 4));
        for (int k = 0; k < 4; ++k) q[k] = lane_bits(value, 8 * k, 8);
    }
    return dot_ints_avx2(q, xg);
}

/* row_single (below) for Q4_K or Q5_K. */
static inline __attribute__((always_inline)) void row_single_avx2(float *y, const float *x, const float *x_sums,
                                                                  const uint8_t *row, int64_t blocks, float bias,
                                                                  const enum format format) {
    __m256 scaled = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * BLOCK_BYTES[format];
        const super_scales u = unpack_block(block, format);
#pragma GCC unroll 8
        for (int j = 0; j < GROUPS; ++j)
            scaled = _mm256_fmadd_ps(_mm256_broadcast_ss(u.scale + j),
                                     group_dot(block, x + b * QK_K + j * GROUP, format, j), scaled);
        offsets = _mm256_fmadd_ps(_mm256_loadu_ps(u.min), _mm256_loadu_ps(x_sums + b * GROUPS), offsets);
    }
    *y = horizontal_sum((vec)scaled) - horizontal_sum((vec)offsets) + bias;
}
#endif

/*
 * One token: y = sum over groups of scale * (q . x_group) - sum over groups of min * sum(x_group) + bias, with
 * x in plane order and its group sums (Q4_K and Q5_K; Q6_K has no mins) computed once per call. The same
 * product as row_tile's (block_row_kernels.h), regrouped: nothing shares a dequantized group, and this skips the
 * multiply-adds that dequantize it.
 */
static inline __attribute__((always_inline)) void row_single(float *y, const float *x, const float *x_sums,
                                                             const uint8_t *row, int64_t blocks, float bias,
                                                             const enum format format) {
#if defined(__AVX2__) && defined(__FMA__)
    if (format != Q6_K) {
        row_single_avx2(y, x, x_sums, row, blocks, bias, format);
        return;
    }
#endif
    vec scaled = {0}, offsets = {0};
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * BLOCK_BYTES[format];
        const super_scales u = unpack_block(block, format);
#pragma GCC unroll 8
        for (int j = 0; j < GROUPS; ++j) {
            vec q[4];
            group_q(block, format, j, q);
            const float *xg = x + b * QK_K + j * GROUP;
            const vec dot = q[0] * load(xg) + q[1] * load(xg + LANES) + q[2] * load(xg + 2 * LANES) +
                            q[3] * load(xg + 3 * LANES);
            scaled += group_scale(&u, format, j) * dot;
        }
        if (format != Q6_K) offsets += load(u.min) * load(x_sums + b * GROUPS);
    }
    *y = horizontal_sum(scaled) - horizontal_sum(offsets) + bias;
}

#include "block_row_kernels.h"

BLOCK_KERNELS(Q4_K) BLOCK_KERNELS(Q5_K) BLOCK_KERNELS(Q6_K)
/* Every format reads x in plane order; Q6_K has no mins, whose single-token term takes x's group sums. */
static const block_format FORMAT_TABLE[FORMATS] = {
    BLOCK_FORMAT(Q4_K, GGML_Q4_K, 1, permute_x), BLOCK_FORMAT(Q5_K, GGML_Q5_K, 1, permute_x),
    BLOCK_FORMAT(Q6_K, GGML_Q6_K, 0, permute_x)};

/* The format of ggml type id `ggml_type`: this file's, or kquant_low_bits.c's; NULL for another. */
static const block_format *format_of(int ggml_type) {
    const block_format *format = block_format_of(FORMAT_TABLE, FORMATS, ggml_type);
    return format ? format : low_bit_kquant_format(ggml_type);
}

/*
 * y[m, n] = sum_k W[n, k] * x[m, k] + bias[n] (bias may be NULL), for m < M tokens and n < N rows, W in the
 * format of ggml type id `ggml_type` (Q2_K to Q6_K), N rows of K / 256 super-blocks each, contiguous.
 * Returns 0; -1 (y untouched) for another type or a K that is not a positive multiple of 256; -2 if scratch
 * memory ran out.
 */
int kquant_linear_f32(float *y, int64_t ldy_token, int64_t ldy_row, const float *x, int64_t ldx, const uint8_t *w,
                      const float *bias, int64_t M, int64_t N, int64_t K, int ggml_type, int num_threads) {
    return block_linear_f32(format_of(ggml_type), y, ldy_token, ldy_row, x, ldx, w, bias, M, N, K, num_threads);
}

/*
 * out [N, K] = W in float32, W as for kquant_linear_f32: for many tokens, where the product is bound by
 * arithmetic and a float32 matmul of a few rows at a time beats the kernel above. Returns 0, or -1 (out
 * untouched) for another type or a K that is not a positive multiple of 256.
 */
int kquant_dequantize_f32(float *out, const uint8_t *w, int64_t N, int64_t K, int ggml_type, int num_threads) {
    return block_dequantize_f32(format_of(ggml_type), out, w, N, K, num_threads);
}
