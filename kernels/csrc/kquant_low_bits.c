/*
 * The row kernels of ggml's 2- and 3-bit K-quants, Q2_K and Q3_K (what llama.cpp's Q2_K and Q3_K_* files store
 * most tensors in), for the row driver (block_rows.c): kquant_linear_f32 and kquant_dequantize_f32
 * (kquant_linear.c) find them through low_bit_kquant_format. Same calling convention, register tiles and byte
 * planes (byte_planes.h) as kquant_linear.c's formats.
 *
 * Formats (super-blocks of QK_K = 256 weights; 16 sub-blocks of 16 weights, each with a scale of its own):
 *   Q2_K, 84 bytes: uint8 scales[16], uint8 qs[64], fp16 d, fp16 dmin
 *       w = d * (scales[i] & 15) * q - dmin * (scales[i] >> 4), i = weight / 16, q 2-bit.
 *   Q3_K, 110 bytes: uint8 hmask[32], uint8 qs[64], uint8 scales[12], fp16 d
 *       w = d * (sc[i] - 32) * (q - 4), q 3-bit; sc[i] is 6-bit: its low nibble is nibble i / 8 of scales[i % 8],
 *       its top two bits are bits 2(i / 4), 2(i / 4) + 1 of scales[8 + i % 4].
 * In both, each half of 128 weights (h = 0, 1) owns 32 bytes of qs: weight 32s + l of a half (s < 4, l < 32)
 * has its two low bits in bits 2s, 2s + 1 of qs[32h + l]; Q3_K's third bit is bit 4h + s of hmask[l].
 *
 * So group j of 32 weights (h = j / 4, s = j % 4) is one shift and one mask of 32 bytes of qs (and for Q3_K
 * of hmask), and its byte planes hold sub-block 2j in lanes 0-3, 2j + 1 in lanes 4-7, as Q6_K's do.
 * Every product d * sc * q is exact in float32 (at most 11 + 6 + 3 bits), so the weights are bit for bit
 * gguf-py's, fused multiply-add or not.
 */
#include <stdint.h>
#include <string.h>

#include "block_rows.h"
#include "byte_planes.h"
#include "half_float.h"
#include "vector_math.h"

enum { QK_K = 256, BLOCK_WEIGHTS = QK_K, GROUPS = QK_K / GROUP, SUB_BLOCKS = QK_K / 16 };
/* For block_row_kernels.h: a super-block's groups unrolled, so that each one's shifts and masks are constants. */
#define UNROLL_GROUPS _Pragma("GCC unroll 8")
/* ggml's type ids (GGUF's tensor types). */
enum { GGML_Q2_K = 10, GGML_Q3_K = 11 };
/* The formats in this file's table, and each one's super-block size in bytes (named too, for the table's
 * initializer). */
enum format { Q2_K, Q3_K, FORMATS };
enum { Q2_K_BYTES = 84, Q3_K_BYTES = 110 };
static const int64_t BLOCK_BYTES[FORMATS] = {Q2_K_BYTES, Q3_K_BYTES};

typedef uint16_t halfwords4 __attribute__((vector_size(8)));

/* A super-block's sub-block scales and (Q2_K) mins as floats: w = scale[i] * q - min[i]. */
typedef struct {
    float scale[SUB_BLOCKS];
    float min[SUB_BLOCKS];
} super_scales;

static inline __attribute__((always_inline)) super_scales unpack_block(const uint8_t *block,
                                                                       const enum format format) {
    super_scales out;
    if (format == Q2_K) {
        const vec d = splat(half_to_float(block + 80)), dmin = splat(half_to_float(block + 82));
        for (int half = 0; half < 2; ++half) {
            const bytes8 packed = *(const bytes8 *)(block + 8 * half);
            const bytes8 mins = (bytes8)((halfwords4)packed >> 4) & 0x0F; /* x86 has no shift of byte lanes */
            store(out.scale + LANES * half, d * bytes_to_floats(packed & 0x0F, 0));
            store(out.min + LANES * half, dmin * bytes_to_floats(mins, 0));
        }
        return out;
    }
    /* Q3_K: three words, the low nibbles of scales 0-7 (words 0, 1) and 8-15 (their high nibbles), and word 2
     * the top two bits, scales 4k..4k+3 in bits 2k, 2k + 1 of its bytes. */
    uint32_t packed[3];
    memcpy(packed, block + 96, sizeof packed);
    const uint32_t nibble = 0x0F0F0F0Fu, two = 0x03030303u;
    uint32_t scales[4];
    for (int k = 0; k < 4; ++k)
        scales[k] = ((packed[k % 2] >> (4 * (k / 2))) & nibble) | ((packed[2] >> (2 * k)) & two) << 4;
    const vec d = splat(half_to_float(block + 108));
    store(out.scale, d * (bytes_of_words(scales[0], scales[1]) - 32));
    store(out.scale + LANES, d * (bytes_of_words(scales[2], scales[3]) - 32));
    return out;
}

/* Group j's 32 quantized values (Q3_K's less 4) as its four byte planes, floats. Always inlined with a
 * constant format and, in unrolled loops, a constant j, so only that group's shifts and masks remain. */
static inline __attribute__((always_inline)) void group_q(const uint8_t *block, const enum format format,
                                                          const int j, vec q[4]) {
    const int half = j / 4, s = j % 4;
    const words packed = *(const words *)(block + (format == Q2_K ? 16 : 32) + 32 * half);
    if (format == Q2_K) { /* each plane straight from the packed words: one shift and one mask */
        for (int k = 0; k < 4; ++k) q[k] = __builtin_convertvector((ints)((packed >> (8 * k + 2 * s)) & 3), vec);
        return;
    }
    const words low = (packed >> (2 * s)) & 0x03030303u;
    const words third = (*(const words *)block >> (4 * half + s)) & 0x01010101u;
    const words value = (words)((signed_bytes32)(low | third << 2) - 4); /* byte lanes: no borrow crosses */
    for (int k = 0; k < 4; ++k) q[k] = signed_byte_plane(value, k);
}

/* Sub-block values 2j and 2j + 1 of `per_sub_block`, in lanes 0-3 and 4-7 (as group j's planes hold them). */
static inline __attribute__((always_inline)) vec group_lanes(const float *per_sub_block, const int j) {
    const float first = per_sub_block[2 * j], second = per_sub_block[2 * j + 1];
    return (vec){first, first, first, first, second, second, second, second};
}

/* Group j's weights as its four byte planes: scale * q - min (exact product, one rounding: gguf-py's). */
static inline __attribute__((always_inline)) void dequantize_group(const uint8_t *block, const super_scales *u,
                                                                   const enum format format, const int j,
                                                                   vec w[4]) {
    vec q[4];
    group_q(block, format, j, q);
    const vec scale = group_lanes(u->scale, j);
    if (format == Q3_K) {
        for (int k = 0; k < 4; ++k) w[k] = scale * q[k];
        return;
    }
    const vec min = group_lanes(u->min, j);
    for (int k = 0; k < 4; ++k) w[k] = scale * q[k] - min;
}

/*
 * One token. Q3_K: y = sum over groups of scale * (q . x_group) + bias, lane by lane (each lane of a plane
 * belongs to one sub-block), with x in plane order: row_tile's product (block_row_kernels.h) regrouped, as
 * nothing shares a dequantized group. Q2_K's mins would add a sum of x per sub-block to that (the driver's sums
 * are per 32 weights): dequantizing its groups, into one accumulator per plane, measured faster (2.8 against
 * 3.45 ns a group, one thread, weights in L2, AVX-512 host), and for Q3_K slower (3.7 against 3.5). Both stay in
 * the vector extensions on every host: each plane is already one shift and one mask of the group's words (and
 * for Q3_K a shift pair), which is all AVX2 intrinsics would do.
 */
static inline __attribute__((always_inline)) void row_single(float *y, const float *x, const float *x_sums,
                                                             const uint8_t *row, int64_t blocks, float bias,
                                                             const enum format format) {
    (void)x_sums;
    vec a[4] = {{0}, {0}, {0}, {0}}; /* Q2_K: one per plane; Q3_K: a[0] */
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * BLOCK_BYTES[format];
        const super_scales u = unpack_block(block, format);
#pragma GCC unroll 8
        for (int j = 0; j < GROUPS; ++j) {
            const float *xg = x + b * QK_K + j * GROUP;
            vec w[4];
            if (format == Q2_K) {
                dequantize_group(block, &u, format, j, w);
                for (int k = 0; k < 4; ++k) a[k] += w[k] * load(xg + k * LANES);
                continue;
            }
            group_q(block, format, j, w);
            const vec dot = w[0] * load(xg) + w[1] * load(xg + LANES) + w[2] * load(xg + 2 * LANES) +
                            w[3] * load(xg + 3 * LANES);
            a[0] += group_lanes(u.scale, j) * dot;
        }
    }
    *y = horizontal_sum((a[0] + a[1]) + (a[2] + a[3])) + bias;
}

#include "block_row_kernels.h"

BLOCK_KERNELS(Q2_K) BLOCK_KERNELS(Q3_K)
/* Both read x in plane order; neither takes x's group sums (Q2_K's mins are per 16 weights: see row_single). */
static const block_format FORMAT_TABLE[FORMATS] = {BLOCK_FORMAT(Q2_K, GGML_Q2_K, 0, permute_x),
                                                   BLOCK_FORMAT(Q3_K, GGML_Q3_K, 0, permute_x)};

const block_format *low_bit_kquant_format(int ggml_type) { return block_format_of(FORMAT_TABLE, FORMATS, ggml_type); }
