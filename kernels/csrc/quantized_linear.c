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
 * intrinsics where the host has them, in the vector extensions elsewhere. Rows are split across threads (for a
 * single token, in two runs of rows a thread: sequential_runs_grain).
 *
 * From TILE_TOKENS tokens the product goes by float32 tiles instead (dequantized_tiles.c): each weight is
 * dequantized once per block of tokens and serves them all from L1. dequantize_f32 writes W out in float32, a
 * few rows at a time (embedding lookups, and the torch path's tiles).
 *
 * Built at first use with the system C compiler (kernels/cpu_native.py), for the host CPU.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half_float.h"
#include "parallel.h"
#include "dequantized_tiles.h"
#include "vector_math.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

enum { QK = 32, TOKENS = 8 };
/* ggml's type ids (GGUF's tensor types). */
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 };
/* The formats in this file's tables, and each one's block size in bytes. */
enum format { Q8_0, Q4_0, Q4_1, FORMATS };
static const int64_t BLOCK_BYTES[FORMATS] = {34, 18, 20};
/* Blocks a unit of parallel work holds at least: a few microseconds of work. */
enum { GRAIN_BLOCKS = 1024 };

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

static inline __attribute__((always_inline)) unpacked_block unpack(const uint8_t *block, const enum format format) {
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
 * The block's weights, four vectors of eight: bit for bit those gguf-py's dequantize computes, since d * q is
 * exact in float32 (an 11-bit by at most 8-bit product), fused with the add of m or not. (Adding Q8_0's and
 * Q4_0's m of 0 would not be a no-op: it turns -0 into +0.)
 */
static inline __attribute__((always_inline)) void dequantize_block(const uint8_t *block, const enum format format,
                                                                   vec w[4]) {
    const unpacked_block b = unpack(block, format);
    for (int i = 0; i < 4; ++i) w[i] = format == Q4_1 ? splat(b.d) * b.q[i] + splat(b.m) : splat(b.d) * b.q[i];
}

/*
 * y[t * ldy_token] = sum_k w[k] * x[t * ldx + k] + bias, t < tokens, for one weight row w of `blocks`
 * blocks, dequantizing each block once for all the tokens. Always inlined with constant format and tokens,
 * so the token loop unrolls and the accumulators live in registers.
 */
static inline __attribute__((always_inline)) void row_tile(float *y, int64_t ldy_token, const float *x, int64_t ldx,
                                                           const uint8_t *row, int64_t blocks, float bias,
                                                           const enum format format, const int tokens) {
    /* Named accumulators, not an array: GCC keeps these in registers through the block loop. */
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    const int64_t block_bytes = BLOCK_BYTES[format];
    for (int64_t b = 0; b < blocks; ++b) {
        vec w[4];
        dequantize_block(row + b * block_bytes, format, w);
        const float *xb = x + b * QK;
        /* One or two tokens: the four products summed first, so that each block adds one dependent
         * operation, not four, to the accumulator's chain. From three tokens the chains interleave and one
         * fused multiply-add per product is faster (measured: 7-11% at 3-8 tokens, Zen 3). */
#define ACCUMULATE(t)                                                                                             \
    if (tokens > t) {                                                                                             \
        const float *xt = xb + t * ldx;                                                                           \
        if (tokens >= 3) {                                                                                        \
            a##t += w[0] * load(xt);                                                                              \
            a##t += w[1] * load(xt + LANES);                                                                      \
            a##t += w[2] * load(xt + 2 * LANES);                                                                  \
            a##t += w[3] * load(xt + 3 * LANES);                                                                  \
        } else {                                                                                                  \
            a##t += w[0] * load(xt) + w[1] * load(xt + LANES) + w[2] * load(xt + 2 * LANES) +                     \
                    w[3] * load(xt + 3 * LANES);                                                                  \
        }                                                                                                         \
    }
        ACCUMULATE(0) ACCUMULATE(1) ACCUMULATE(2) ACCUMULATE(3) ACCUMULATE(4) ACCUMULATE(5) ACCUMULATE(6)
        ACCUMULATE(7)
#undef ACCUMULATE
    }
    const vec sums = transposed_sums(a0, a1, a2, a3, a4, a5, a6, a7); /* lane t: token t's dot product */
    for (int t = 0; t < tokens; ++t) y[t * ldy_token] = sums[t] + bias;
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
 * blocks, computed once per call (Q4_1 only: the other formats have no m). The same product as row_tile's,
 * regrouped: with a single token nothing shares a dequantized block, and this skips the four multiply-adds
 * that dequantize it.
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
 * blocks, computed once per call (Q4_1 only: the other formats have no m). The same product as row_tile's,
 * regrouped: with a single token nothing shares a dequantized block, and this skips the four multiply-adds
 * that dequantize it, a fifth of the work (measured: 8.6 against 10.4 cycles a Q4_1 block, Zen 3).
 */
static inline __attribute__((always_inline)) void row_single(float *y, const float *x, const float *x_sums,
                                                             const uint8_t *row, int64_t blocks, float bias,
                                                             const enum format format) {
    vec scaled = {0};
    float offsets = 0.0f;
    const int64_t block_bytes = BLOCK_BYTES[format];
    for (int64_t b = 0; b < blocks; ++b) {
        const unpacked_block u = unpack(row + b * block_bytes, format);
        const float *xb = x + b * QK;
        const vec dot = u.q[0] * load(xb) + u.q[1] * load(xb + LANES) + u.q[2] * load(xb + 2 * LANES) +
                        u.q[3] * load(xb + 3 * LANES);
        scaled += splat(u.d) * dot;
        if (format == Q4_1) offsets += u.m * x_sums[b];
    }
    *y = horizontal_sum(scaled) + offsets + bias;
}
#endif

/* The row kernels for one format: row_single, and row_tile for each token count. */
typedef void single_kernel(float *, const float *, const float *, const uint8_t *, int64_t, float);
typedef void tile_kernel(float *, int64_t, const float *, int64_t, const uint8_t *, int64_t, float);
#define SINGLE_KERNEL(format)                                                                                     \
    static void single_##format(float *y, const float *x, const float *x_sums, const uint8_t *row, int64_t blocks, \
                                float bias) {                                                                     \
        row_single(y, x, x_sums, row, blocks, bias, format);                                                      \
    }
#define TILE_KERNEL(format, tokens)                                                                               \
    static void tile_##format##_##tokens(float *y, int64_t ldy_token, const float *x, int64_t ldx,               \
                                         const uint8_t *row, int64_t blocks, float bias) {                        \
        row_tile(y, ldy_token, x, ldx, row, blocks, bias, format, tokens);                                        \
    }
#define FORMAT_KERNELS(format)                                                                                    \
    SINGLE_KERNEL(format)                                                                                         \
    TILE_KERNEL(format, 1) TILE_KERNEL(format, 2) TILE_KERNEL(format, 3) TILE_KERNEL(format, 4)                   \
    TILE_KERNEL(format, 5) TILE_KERNEL(format, 6) TILE_KERNEL(format, 7) TILE_KERNEL(format, 8)
FORMAT_KERNELS(Q8_0) FORMAT_KERNELS(Q4_0) FORMAT_KERNELS(Q4_1)
#define TILE_ROW(format)                                                                                          \
    {tile_##format##_1, tile_##format##_2, tile_##format##_3, tile_##format##_4,                                  \
     tile_##format##_5, tile_##format##_6, tile_##format##_7, tile_##format##_8}
static single_kernel *const SINGLES[FORMATS] = {single_Q8_0, single_Q4_0, single_Q4_1};
static tile_kernel *const TILES[FORMATS][TOKENS] = {TILE_ROW(Q8_0), TILE_ROW(Q4_0), TILE_ROW(Q4_1)};
#undef TILE_ROW
#undef FORMAT_KERNELS
#undef TILE_KERNEL
#undef SINGLE_KERNEL

typedef struct {
    float *y;
    int64_t ldy_token, ldy_row;
    const float *x, *x_sums; /* x_sums: a single Q4_1 token's block sums, else NULL */
    int64_t ldx;
    const uint8_t *w;
    const float *bias;
    int64_t M, K;
    enum format format;
} linear_job;

/* Output rows [begin, end): each row's blocks once from memory, then from L1 for each further token tile. */
static void linear_rows(void *context, int64_t begin, int64_t end) {
    const linear_job *job = context;
    const int64_t blocks = job->K / QK, row_bytes = blocks * BLOCK_BYTES[job->format];
    for (int64_t n = begin; n < end; ++n) {
        const uint8_t *row = job->w + n * row_bytes;
        const float bias = job->bias ? job->bias[n] : 0.0f;
        if (job->M == 1) {
            SINGLES[job->format](job->y + n * job->ldy_row, job->x, job->x_sums, row, blocks, bias);
            continue;
        }
        for (int64_t m = 0; m < job->M; m += TOKENS) {
            const int tokens = job->M - m < TOKENS ? (int)(job->M - m) : TOKENS;
            TILES[job->format][tokens - 1](job->y + m * job->ldy_token + n * job->ldy_row, job->ldy_token,
                                           job->x + m * job->ldx, job->ldx, row, blocks, bias);
        }
    }
}

/* The format of a ggml type id, or FORMATS for one this file does not read. */
static enum format format_of(int ggml_type) {
    switch (ggml_type) {
    case GGML_Q8_0: return Q8_0;
    case GGML_Q4_0: return Q4_0;
    case GGML_Q4_1: return Q4_1;
    default: return FORMATS;
    }
}

/* Rows a unit of parallel work: GRAIN_BLOCKS blocks' work (a few microseconds), counting a block once per
 * pass over it, so that the threads still finish together when many tokens make each row slow. */
static int64_t grain_rows(int64_t K, int64_t passes) {
    const int64_t work = K / QK * (passes > 1 ? passes : 1);
    return work >= GRAIN_BLOCKS ? 1 : GRAIN_BLOCKS / work;
}

/* One row of K weights as float32, for dequantized_tiles.c. */
static void dequantize_row(float *out, const uint8_t *row, int64_t K, int ggml_type) {
    const enum format format = format_of(ggml_type);
    for (int64_t b = 0; b < K / QK; ++b) {
        vec w[4];
        switch (format) { /* constant in each case: the dequantization inlines for that format */
        case Q8_0: dequantize_block(row + b * BLOCK_BYTES[Q8_0], Q8_0, w); break;
        case Q4_0: dequantize_block(row + b * BLOCK_BYTES[Q4_0], Q4_0, w); break;
        default: dequantize_block(row + b * BLOCK_BYTES[Q4_1], Q4_1, w); break;
        }
        for (int i = 0; i < 4; ++i) store(out + b * QK + i * LANES, w[i]);
    }
}

/*
 * y[m, n] = sum_k W[n, k] * x[m, k] + bias[n] (bias may be NULL), for m < M tokens and n < N rows, W in the
 * format of ggml type id `ggml_type` (Q8_0, Q4_0 or Q4_1), N rows of K / 32 blocks each, contiguous.
 * Returns 0; -1 (y untouched) for another type or a K that is not a positive multiple of 32; -2 if scratch
 * memory ran out.
 */
int quantized_linear_f32(float *y, int64_t ldy_token, int64_t ldy_row, const float *x, int64_t ldx,
                         const uint8_t *w, const float *bias, int64_t M, int64_t N, int64_t K, int ggml_type,
                         int num_threads) {
    const enum format format = format_of(ggml_type);
    if (format == FORMATS || K <= 0 || K % QK != 0) return -1;
    if (M <= 0) return 0;
    if (M >= TILE_TOKENS)
        return linear_by_tiles(y, ldy_token, ldy_row, x, ldx, w, bias, M, N, K, ggml_type,
                               K / QK * BLOCK_BYTES[format], dequantize_row, num_threads);
    /* One token takes row_single, which reads the sums of x's blocks (Q4_1) or nothing (NULL is fine). */
    float *x_sums = NULL;
    if (M == 1 && format == Q4_1) {
        x_sums = malloc(sizeof(float) * (size_t)(K / QK));
        if (x_sums == NULL) return -2;
        for (int64_t b = 0; b < K / QK; ++b) {
            const float *xb = x + b * QK;
            x_sums[b] = horizontal_sum(load(xb) + load(xb + LANES) + load(xb + 2 * LANES) + load(xb + 3 * LANES));
        }
    }
    linear_job job = {y, ldy_token, ldy_row, x, x_sums, ldx, w, bias, M, K, format};
    const int64_t grain = M == 1 ? sequential_runs_grain(N, grain_rows(K, 1), num_threads)
                                 : grain_rows(K, (M + TOKENS - 1) / TOKENS);
    parallel_for(N, grain, num_threads, linear_rows, &job);
    free(x_sums);
    return 0;
}

typedef struct {
    float *out;
    const uint8_t *w;
    int64_t K;
    enum format format;
} dequantize_job;

/* Rows [begin, end) of W: their blocks are consecutive, as are the 32 floats of each. */
static void dequantize_rows(void *context, int64_t begin, int64_t end) {
    const dequantize_job *job = context;
    const int64_t blocks = job->K / QK, block_bytes = BLOCK_BYTES[job->format];
    const uint8_t *block = job->w + begin * blocks * block_bytes;
    float *out = job->out + begin * job->K;
    for (int64_t b = begin * blocks; b < end * blocks; ++b, block += block_bytes, out += QK) {
        vec w[4];
        switch (job->format) { /* constant in each case: the dequantization inlines for that format */
        case Q8_0: dequantize_block(block, Q8_0, w); break;
        case Q4_0: dequantize_block(block, Q4_0, w); break;
        default: dequantize_block(block, Q4_1, w); break;
        }
        for (int i = 0; i < 4; ++i) store(out + i * LANES, w[i]);
    }
}

/*
 * out [N, K] = W in float32, W as for quantized_linear_f32: for many tokens, where the product is bound by
 * arithmetic and a float32 matmul of a few rows at a time beats the kernel above. Returns 0, or -1 (out
 * untouched) for another type or a K that is not a positive multiple of 32.
 */
int dequantize_f32(float *out, const uint8_t *w, int64_t N, int64_t K, int ggml_type, int num_threads) {
    const enum format format = format_of(ggml_type);
    if (format == FORMATS || K <= 0 || K % QK != 0) return -1;
    dequantize_job job = {out, w, K, format};
    parallel_for(N, grain_rows(K, 1), num_threads, dequantize_rows, &job);
    return 0;
}
