/*
 * Block-format products with 8-bit activations (int8_linear.c): a token's x is quantized once per call into
 * blocks of 32 (q8_activations.c), and each weight block meets it in integer dot products (int8_dot_blocks.c
 * for Q8_0, Q4_0, Q4_1; int8_dot_kquants.c for Q4_K, Q5_K, Q6_K), scaled once per 32 weights.
 *
 * A quantized token of K features, block b = features 32b..32b+31 (as in ggml's Q8_0, with a float scale):
 *   q[k]  int8 = round-half-even(x[k] / d[b]), |q| <= 127;   d[b] = max |x| over the block / 127 (0: q = 0)
 *   s[b]  float = d[b] * (sum of the block's q): the term of a weight format's offset (Q4_0's -8, Q4_1's m,
 *         the K-quants' mins)
 * so x[k] ~ d[b] * q[k]. Every weight format's 32-weight groups line up with these blocks, and a tensor-parallel
 * shard of K (a whole number of blocks) quantizes exactly as the same features of the whole x do.
 */
#ifndef PAGEDSERVE_INT8_ACTIVATIONS_H
#define PAGEDSERVE_INT8_ACTIVATIONS_H

#include <stdint.h>

enum { Q8_BLOCK = 32 };

/* The SIMD paths: AVX2 (x86 since Haswell and Zen), and AVX-512 VNNI's 256-bit dot products where present. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INT8_AVX2 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define INT8_VNNI 1
#endif
#endif

/* 16-bit tokens' largest integer: 127 * 256 + 127, so that every q is two signed bytes, 256 hi + lo with lo in
 * [-128, 127], as AMX's tile unit takes them (amx_tiles.c); 32767 would need hi = 128. */
enum { Q16_MAX = 32639 };

/* One quantized token, as above. */
typedef struct {
    const int8_t *q;
    const float *d, *s;
} q8_token;

/* The same with 16-bit integers (d = max |x| / Q16_MAX): x to ~1e-5, for the float32 path's tokens at most of
 * the 8-bit path's speed (int16_dot.c). */
typedef struct {
    const int16_t *q;
    const float *d, *s;
    const int32_t *sums16; /* each 16 integers' sum, where a format asks for them (sums_of_16_q16); else NULL */
} q16_token;

/* q [K], d [K / 32], s [K / 32] = x [K] quantized; K a multiple of 32. */
void quantize_q8(int8_t *q, float *d, float *s, const float *x, int64_t K);

/* q [K], d [K / 32], s [K / 32] = x [K] quantized to 16 bits. */
void quantize_q16(int16_t *q, float *d, float *s, const float *x, int64_t K);

/* sums[i] = q[16i] + ... + q[16i + 15], i < K / 16: what Q6_K's interleaved layout (q6_k_rows8.c) takes its
 * weights' offset of 32 off with, once per 16 weights instead of once per weight. */
void sums_of_16_q16(int32_t *sums, const int16_t *q, int64_t K);

/* A 16-bit token's q [K] put in the order Q4_0's and Q4_1's tile dots read it (int16_dot.c's unpack_block): in each
 * half of each block of 32, its 8 even features, then its 8 odd ones (nibble_order_feature in int16_formats.h). */
void nibble_order_q16(int16_t *q, int64_t K);

/* A weight row of `blocks` blocks of its format times a quantized token: sum_k w[k] * d * q[k]. */
typedef float int8_row_dot(const uint8_t *row, const q8_token *x, int64_t blocks);

/* The row dots of each format with 8-bit tokens (int8_dot_blocks.c, int8_dot_kquants.c). */
int8_row_dot int8_dot_q8_0, int8_dot_q4_0, int8_dot_q4_1, int8_dot_q4_k, int8_dot_q5_k, int8_dot_q6_k;

/* Tokens one call of a tile dot takes: eight float accumulators and a block's weights fit AVX2's 16 registers. */
enum { TILE_TOKENS = 8 };

/* `rows` (1 or 2) weight rows, row_bytes apart, times `tokens` (1..TILE_TOKENS) quantized tokens x[0..tokens):
 * sums[r * TILE_TOKENS + t] = row r . x[t], each weight block unpacked once for all of them (int16_dot.c). */
typedef void int16_tile_dot(const uint8_t *row, int64_t row_bytes, int rows, const q16_token *x, int tokens,
                            int64_t blocks, float *sums);
int16_tile_dot int16_tile_q8_0, int16_tile_q4_0, int16_tile_q4_1, int16_tile_q4_k, int16_tile_q5_k, int16_tile_q6_k;

#ifdef INT8_AVX2
/* The four-byte dot products of unsigned u and signed s, as eight int32 lanes (lane i: bytes 4i..4i+3). No
 * caller's pair of products overflows maddubs' int16: u <= 128 everywhere. */
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#ifdef INT8_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* 16 int16 weights times 16 int16 activations at any address, as eight int32 pair sums added to acc. */
static inline __m256i dot_i16(__m256i acc, __m256i w, const int16_t *x) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
#ifdef INT8_VNNI
    return _mm256_dpwssd_epi32(acc, w, xv);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, xv));
#endif
}

/* 32 unsigned bytes times 32 int16 activations, as eight int32 partial sums (any grouping of the products). */
static inline __m256i dot_u8_s16(__m256i u, const int16_t *x) {
    const __m256i low = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
    return dot_i16(dot_i16(_mm256_setzero_si256(), low, x), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1)),
                   x + 16);
}

static inline float sum_lanes(__m256 v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#endif

#endif
