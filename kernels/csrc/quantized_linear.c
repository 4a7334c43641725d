/*
 * y = x @ W^T + bias for a few tokens, with W in one of ggml's block formats (as GGUF files store it) and
 * x, y and the sums in float32, for the CPU.
 *
 * A decode step of one sequence reads every weight once and does two flops per weight read: in float32 it
 * is bound by memory bandwidth. ggml's 8- and 4-bit formats are 3.8 to 7.1 times smaller, so this kernel
 * reads W as stored and dequantizes each block of 32 weights into registers as it streams past; W never exists
 * in float32. Every token of the call uses a block while it is in registers, so each block comes from memory
 * once per call, whatever the number of tokens.
 *
 * Formats (ggml's; blocks of QK = 32 consecutive weights of a row, a row of W is K / 32 blocks in a row):
 *   Q8_0, 34 bytes: fp16 d, int8 q[32];                      w[j] = d * q[j]
 *   Q4_0, 18 bytes: fp16 d, uint8 qs[16];                    w[j] = d * (nibble j - 8)
 *   Q4_1, 20 bytes: fp16 d, fp16 m, uint8 qs[16];            w[j] = d * nibble j + m
 * where nibble j < 16 is the low half of qs[j] and nibble j + 16 the high half. They are chosen by ggml's
 * type id, as GGUF numbers them.
 *
 * Layout: x is token-major, [M, K] with rows `ldx` floats apart (each token's features contiguous, so that a
 * block's 32 weights meet 32 contiguous activations); y is [M, N], written with strides `ldy_token` and
 * `ldy_row`, so the caller picks token-major (ldy_row = 1) or feature-major (ldy_token = 1) output.
 *
 * Register tile: one weight row x up to TOKENS tokens. For each block, the row's 32 weights are dequantized
 * into four vectors; each token then adds their products with its 32 activations into one vector of partial
 * sums, reduced across lanes once the row is done. Tokens past TOKENS take further passes over the row,
 * which by then is in L1. A single token, which shares a dequantized block with nothing, takes the product
 * regrouped instead (row_single): the block's integers times x, scaled once per block; written in AVX2
 * intrinsics where the host has them, in the vector extensions elsewhere. The row driver, shared with
 * kquant_linear.c, splits the rows across threads and runs these kernels (block_rows.c, block_row_kernels.h).
 *
 * From TILE_TOKENS tokens the product goes by float32 tiles instead (dequantized_tiles.c): each weight is
 * dequantized once per block of tokens and serves them all from L1. dequantize_f32 writes W out in float32, a
 * few rows at a time (embedding lookups, and the torch path's tiles).
 *
 * Built at first use with the system C compiler (kernels/cpu_native.py), for the host CPU.
 */
#include <stdint.h>
#include <string.h>

#include "block_rows.h"
#include "half_float.h"
#include "vector_math.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

enum { QK = 32, BLOCK_WEIGHTS = QK };
/* ggml's type ids (GGUF's tensor types). */
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 };
/* The formats in this file's table, and each one's block size in bytes (named too, for the table's initializer). */
enum format { Q8_0, Q4_0, Q4_1, FORMATS };
enum { Q8_0_BYTES = 34, Q4_0_BYTES = 18, Q4_1_BYTES = 20 };
static const int64_t BLOCK_BYTES[FORMATS] = {Q8_0_BYTES, Q4_0_BYTES, Q4_1_BYTES};

/* Eight bytes of a block as a vector, from any address. */
typedef uint8_t bytes8 __attribute__((vector_size(8), aligned(1), may_alias));
typedef uint16_t halfwords4 __attribute__((vector_size(8)));
typedef int32_t ints __attribute__((vector_size(LANES * sizeof(int32_t))));

/*
 * Eight unsigned bytes less `offset`, as eight floats: widened to int32, offset, converted. GCC 12 converts
 * a byte vector one lane at a time when it is signed or comes straight from memory; bytes already in a
 * register, unsigned, take one zero-extension and one int-to-float conversion. So Q8_0's int8 are read as
 * q ^ 0x80 (unsigned) less 128.
 */
static inline vec to_floats(bytes8 b, int32_t offset) {
    return __builtin_convertvector(__builtin_convertvector(b, ints) - offset, vec);
}

/* The high nibbles of eight bytes, shifted as 16-bit lanes: x86 has no shift of byte lanes. */
static inline bytes8 high_nibbles(bytes8 b) { return (bytes8)((halfwords4)b >> 4) & 0x0F; }

/*
 * A block's 32 weights as d * q + m, q an integer: its scale d, offset m (Q4_1 only; 0 otherwise) and the q
 * as four vectors of eight. Always inlined with a constant format, so the vectors stay in registers and only
 * that format's code remains.
 */
typedef struct {
    float d, m;
    vec q[4];
} unpacked_block;

static inline __attribute__((always_inline)) unpacked_block unpack_block(const uint8_t *block,
                                                                         const enum format format) {
    unpacked_block out = {.d = half_to_float(block), .m = format == Q4_1 ? half_to_float(block + 2) : 0.0f};
    if (format == Q8_0) {
        for (int i = 0; i < 4; ++i) out.q[i] = to_floats(*(const bytes8 *)(block + 2 + 8 * i) ^ 0x80, 128);
        return out;
    }
    /* Q4_0 and Q4_1: bytes 0-7 and 8-15 of qs hold weights 0-7 and 8-15 in their low nibbles, 16-23 and
     * 24-31 in their high ones. Q4_0's nibbles are offset by 8. */
    const int32_t offset = format == Q4_0 ? 8 : 0;
    const uint8_t *qs = block + (format == Q4_1 ? 4 : 2);
    const bytes8 low = *(const bytes8 *)qs, high = *(const bytes8 *)(qs + 8);
    out.q[0] = to_floats(low & 0x0F, offset);
    out.q[1] = to_floats(high & 0x0F, offset);
    out.q[2] = to_floats(high_nibbles(low), offset);
    out.q[3] = to_floats(high_nibbles(high), offset);
    return out;
}

/*
 * The block's weights (its one group), four vectors of eight: bit for bit those gguf-py's dequantize computes,
 * since d * q is exact in float32 (an 11-bit by at most 8-bit product), fused with the add of m or not. (Adding
 * Q8_0's and Q4_0's m of 0 would not be a no-op: it turns -0 into +0.)
 */
static inline __attribute__((always_inline)) void dequantize_group(const uint8_t *block, const unpacked_block *u,
                                                                   const enum format format, const int j,
                                                                   vec w[4]) {
    (void)block, (void)j; /* all in u */
    for (int i = 0; i < 4; ++i) w[i] = format == Q4_1 ? splat(u->d) * u->q[i] + splat(u->m) : splat(u->d) * u->q[i];
}

/* The block's weights are in order already. */
static inline void store_group(float *out, const vec w[4]) {
    for (int i = 0; i < 4; ++i) store(out + i * LANES, w[i]);
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/*
 * row_single in AVX2 intrinsics, for x86 since Haswell and Zen: 1.5x the vector extensions' speed for Q4_1, 1.8x
 * for Q8_0 (Zen 3, weights in L2: 2.1 against 3.2 ns a Q4_1 block, 1.8 against 3.3 a Q8_0 one). The bytes widen
 * to int32 as they load (vpmovzxbd/vpmovsxbd from memory: GCC widens signed bytes one lane at a time, and
 * unsigned ones only from a register), and a nibble is then a mask or a shift of whole int32 lanes, with no
 * higher bits to clear; d and m convert from fp16 in one instruction. Rows are taken one at a time:
 * interleaving the blocks of two or four rows, to share x's loads, is 5% faster from L2 but up to twice as slow
 * from memory (the LM head, one thread: 5.3 GB/s four rows at a time, 10.6 one at a time), where one
 * sequential run suits the hardware prefetcher. Two blocks a step (their scales converted together, two
 * accumulators) measured no faster.
 */

/* A block's first four bytes as floats: d, then m for Q4_1 (for the others, two bytes of q: unused). */
static inline __m128 block_scales(const uint8_t *block) {
    int32_t bits;
    memcpy(&bits, block, sizeof bits);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

/* Eight bytes at any address as eight int32, widened by the load itself. */
static inline __m256i unsigned_bytes(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline __m256i signed_bytes(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* q . x_b for one block, as eight partial sums: q the block's integers (Q4_0's less 8), xb its 32 activations. */
static inline __attribute__((always_inline)) __m256 block_dot(const uint8_t *block, const float *xb,
                                                              const enum format format) {
    __m256i q[4];
    if (format == Q8_0) {
        for (int i = 0; i < 4; ++i) q[i] = signed_bytes(block + 2 + 8 * i);
    } else {
        const uint8_t *qs = block + (format == Q4_1 ? 4 : 2);
        const __m256i low = unsigned_bytes(qs), high = unsigned_bytes(qs + 8), nibble = _mm256_set1_epi32(0x0F);
        q[0] = _mm256_and_si256(low, nibble);
        q[1] = _mm256_and_si256(high, nibble);
        q[2] = _mm256_srli_epi32(low, 4);
        q[3] = _mm256_srli_epi32(high, 4);
        if (format == Q4_0)
            for (int i = 0; i < 4; ++i) q[i] = _mm256_sub_epi32(q[i], _mm256_set1_epi32(8));
    }
    return dot_ints_avx2(q, xb);
}

/*
 * One token: y = sum over blocks of d * (q . x_b) + m * sum(x_b) + bias, with sum(x_b), the sums of x's
 * blocks, computed once per call (Q4_1 only: the other formats have no m). The same product as row_tile's
 * (block_row_kernels.h), regrouped: with a single token nothing shares a dequantized block, and this skips the
 * four multiply-adds that dequantize it.
 */
static inline __attribute__((always_inline)) void row_single(float *y, const float *x, const float *x_sums,
                                                             const uint8_t *row, int64_t blocks, float bias,
                                                             const enum format format) {
    __m256 scaled = _mm256_setzero_ps();
    __m128 offsets = _mm_setzero_ps(); /* lane 1: the sum of m * sum(x_b) (lane 0 sums d * sum(x_b): unused) */
    const int64_t block_bytes = BLOCK_BYTES[format];
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * block_bytes;
        const __m128 scales = block_scales(block);
        scaled = _mm256_fmadd_ps(_mm256_broadcastss_ps(scales), block_dot(block, x + b * QK, format), scaled);
        if (format == Q4_1) offsets = _mm_fmadd_ps(scales, _mm_broadcast_ss(x_sums + b), offsets);
    }
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(scaled), _mm256_extractf128_ps(scaled, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    const float sum = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
    *y = sum + (format == Q4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(offsets)) : 0.0f) + bias;
}
#else
/*
 * One token: y = sum over blocks of d * (q . x_b) + m * sum(x_b) + bias, with sum(x_b), the sums of x's
 * blocks, computed once per call (Q4_1 only: the other formats have no m). The same product as row_tile's
 * (block_row_kernels.h), regrouped: with a single token nothing shares a dequantized block, and this skips the
 * four multiply-adds that dequantize it, a fifth of the work (measured: 8.6 against 10.4 cycles a Q4_1 block,
 * Zen 3).
 */
static inline __attribute__((always_inline)) void row_single(float *y, const float *x, const float *x_sums,
                                                             const uint8_t *row, int64_t blocks, float bias,
                                                             const enum format format) {
    vec scaled = {0};
    float offsets = 0.0f;
    const int64_t block_bytes = BLOCK_BYTES[format];
    for (int64_t b = 0; b < blocks; ++b) {
        const unpacked_block u = unpack_block(row + b * block_bytes, format);
        const float *xb = x + b * QK;
        const vec dot = u.q[0] * load(xb) + u.q[1] * load(xb + LANES) + u.q[2] * load(xb + 2 * LANES) +
                        u.q[3] * load(xb + 3 * LANES);
        scaled += splat(u.d) * dot;
        if (format == Q4_1) offsets += u.m * x_sums[b];
    }
    *y = horizontal_sum(scaled) + offsets + bias;
}
#endif

#include "block_row_kernels.h"

BLOCK_KERNELS(Q8_0) BLOCK_KERNELS(Q4_0) BLOCK_KERNELS(Q4_1)
/* Only Q4_1 has an offset m, whose single-token term takes x's block sums. */
static const block_format FORMAT_TABLE[FORMATS] = {
    BLOCK_FORMAT(Q8_0, GGML_Q8_0, 0, NULL), BLOCK_FORMAT(Q4_0, GGML_Q4_0, 0, NULL),
    BLOCK_FORMAT(Q4_1, GGML_Q4_1, 1, NULL)};

/* The format of ggml type id `ggml_type`: this file's, or q5_linear.c's; NULL for another. */
static const block_format *format_of(int ggml_type) {
    const block_format *format = block_format_of(FORMAT_TABLE, FORMATS, ggml_type);
    return format ? format : q5_format(ggml_type);
}

/*
 * y[m, n] = sum_k W[n, k] * x[m, k] + bias[n] (bias may be NULL), for m < M tokens and n < N rows, W in the
 * format of ggml type id `ggml_type` (Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1), N rows of K / 32 blocks each, contiguous.
 * Returns 0; -1 (y untouched) for another type or a K that is not a positive multiple of 32; -2 if scratch
 * memory ran out.
 */
int quantized_linear_f32(float *y, int64_t ldy_token, int64_t ldy_row, const float *x, int64_t ldx,
                         const uint8_t *w, const float *bias, int64_t M, int64_t N, int64_t K, int ggml_type,
                         int num_threads) {
    return block_linear_f32(format_of(ggml_type), y, ldy_token, ldy_row, x, ldx, w, bias, M, N, K, num_threads);
}

/*
 * out [N, K] = W in float32, W as for quantized_linear_f32: for many tokens, where the product is bound by
 * arithmetic and a float32 matmul of a few rows at a time beats the kernel above. Returns 0, or -1 (out
 * untouched) for another type or a K that is not a positive multiple of 32.
 */
int dequantize_f32(float *out, const uint8_t *w, int64_t N, int64_t K, int ggml_type, int num_threads) {
    return block_dequantize_f32(format_of(ggml_type), out, w, N, K, num_threads);
}
