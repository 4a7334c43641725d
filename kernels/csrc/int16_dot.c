/*
 * Tile dots of every block format with tokens quantized to 16 bits (int8_activations.h's q16_token), AVX2: the
 * sums of int8_dot_blocks.c and int8_dot_kquants.c, term for term, with x's integers to 1 part in 32639 of each
 * block's largest, where 8 bits keep 1 in 127. The weights widen to int16 and meet x in pair products
 * (vpmaddwd, or VNNI's vpdpwssd): no sign trick, as both sides are signed.
 *
 * A tile is a row (two, for the 32-weight formats) against up to TILE_TOKENS tokens. Each weight block is
 * unpacked to int16 lanes once for all of them, where a token at a time unpacked it again for each (the
 * unpacking costs as much as the products); with AVX-512, four tokens' dots are summed across lanes together and
 * scaled in one four-lane multiply-add (in_fours). One token of a 32-weight format has a row kernel of its own
 * (one_token_32): a scalar scale a block and the offsets as scalar terms, ~13% fewer cycles than a tile of one
 * (Zen 4). Q4_0's and Q4_1's x comes in nibble order (nibble_order_q16), so that their nibbles unpack without a
 * shuffle. Without AVX2: int16_dot_portable.c.
 */
#include "half_float.h"
#include "int16_formats.h"

#ifdef INT8_AVX2
/* A 32-weight block's integers as two vectors of 16 int16, in the order of x's integers: Q8_0's weights 0-15,
 * then 16-31; Q4_0's and Q4_1's nibbles in nibble order (int8_linear.c puts their x so), which takes no shuffle.
 * The 16 packed bytes, in both 128-bit lanes, are eight 16-bit words (bytes 2i and 2i + 1): shifted right by 0 in
 * the low lane and 8 in the high one, a word's low nibble is byte 2i's low nibble (feature 2i), then byte
 * 2i + 1's (feature 2i + 1); by 4 and 12, their high nibbles (features 16 + 2i, 17 + 2i). AVX-512 shifts each
 * lane by its own count; AVX2 multiplies the low lane's words by 256 and shifts both alike. Q4_0's nibbles less
 * 8 where `centred`; else its offset is a term of its own. */
static inline __attribute__((always_inline)) void unpack_block(const uint8_t *block, const enum format format,
                                                               const int centred, __m256i w[2]) {
    if (format == Q8_0) {
        w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 2)));
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(block + 18)));
        return;
    }
    const __m256i packed =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(block + (format == Q4_1 ? 4 : 2))));
    const __m256i nibble = _mm256_set1_epi16(0x0F);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m256i low = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
    w[0] = _mm256_and_si256(_mm256_srlv_epi16(packed, low), nibble);
    w[1] = _mm256_and_si256(_mm256_srlv_epi16(packed, _mm256_add_epi16(low, _mm256_set1_epi16(4))), nibble);
#else
    const __m256i raised = _mm256_mullo_epi16(packed, _mm256_setr_epi16(256, 256, 256, 256, 256, 256, 256, 256, 1, 1,
                                                                        1, 1, 1, 1, 1, 1));
    w[0] = _mm256_and_si256(_mm256_srli_epi16(raised, 8), nibble);
    w[1] = _mm256_srli_epi16(raised, 12);
#endif
    if (format == Q4_0 && centred) {
        w[0] = _mm256_sub_epi16(w[0], _mm256_set1_epi16(8));
        w[1] = _mm256_sub_epi16(w[1], _mm256_set1_epi16(8));
    }
}

/* Group j (32 weights) of a K-quant super-block as two vectors of 16 int16: Q4_K's and Q5_K's unsigned integers,
 * Q6_K's (q - 32) times each 16-weight half's scale (|.| <= 32 * 128). */
static inline __attribute__((always_inline)) void unpack_group(const uint8_t *block, int j, const enum format format,
                                                               __m256i w[2]) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    if (format == Q6_K) {
        const int8_t *sc = (const int8_t *)(block + 192);
        const int half = j / 4, s = j % 4;
        const __m256i low = _mm256_loadu_si256((const __m256i *)(block + 64 * half + 32 * (s % 2)));
        const __m256i high = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * half));
        const __m256i nibble = _mm256_and_si256(s >= 2 ? _mm256_srli_epi16(low, 4) : low, low_nibbles);
        const __m256i top = _mm256_and_si256(s > 0 ? _mm256_srli_epi16(high, 2 * s) : high, _mm256_set1_epi8(3));
        const __m256i value = _mm256_or_si256(nibble, _mm256_slli_epi16(top, 4));
        const __m256i thirty_two = _mm256_set1_epi16(32);
        w[0] = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(value)), thirty_two),
                                  _mm256_set1_epi16(sc[2 * j]));
        w[1] = _mm256_mullo_epi16(
            _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(value, 1)), thirty_two),
            _mm256_set1_epi16(sc[2 * j + 1]));
        return;
    }
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + (format == Q5_K ? 48 : 16) + 32 * (j / 2)));
    __m256i value = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(packed, 4) : packed, low_nibbles);
    if (format == Q5_K) { /* bit j of each of the 32 high-bit bytes */
        const __m256i bits = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(block + 16)), j);
        value = _mm256_or_si256(value, _mm256_slli_epi16(_mm256_and_si256(bits, _mm256_set1_epi8(1)), 4));
    }
    w[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(value));
    w[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(value, 1));
}

/* Four vectors' lane sums as one vector of four: tokens' dots summed across lanes four tokens at a time. */
static inline __attribute__((always_inline)) __m128i four_sums(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i pairs = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
}

static inline __attribute__((always_inline)) __m128 four_sums_ps(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

/* 32 unpacked weights times x's 32 integers at xq, as eight int32 lanes. */
static inline __attribute__((always_inline)) __m256i weights_dot(const __m256i w[2], const int16_t *xq) {
    return dot_i16(dot_i16(_mm256_setzero_si256(), w[0], xq), w[1], xq + 16);
}

/* AVX-512's 32 vector registers hold what tiles of 5-7 tokens keep in them: two rows' accumulators, four tokens
 * summed together and the rest a token at a time. With AVX2's 16 they spill, and those tiles are faster a row and
 * a token at a time. */
#if defined(__AVX512VL__)
enum { MANY_REGISTERS = 1 };
#else
enum { MANY_REGISTERS = 0 };
#endif

/* Tokens of a tile that are summed four at a time (the rest a token at a time). With AVX-512: the 32-weight
 * formats' first T - T % 4, the K-quants' all or none (their mixed tiles of 5-7 tokens came out slower). With
 * AVX2, none: summing four dots across lanes every block made tiles of 4 tokens 1.3-1.6x the time a token of
 * those of 5-7 (Zen 3, in cache); a token at a time, 4 tokens take 0.68-0.85x the time they took. */
static inline __attribute__((always_inline)) int in_fours(const enum format format, const int T) {
    if (!MANY_REGISTERS) return 0;
    return format < Q4_K ? T - T % 4 : (T % 4 == 0 ? T : 0);
}

/*
 * 32 unpacked weights against the T tokens' integers at q + at, each token's dot times scale * d[scale_at]. The
 * first in_fours(format, T) tokens: four tokens' dots are summed across lanes together and scaled as one four-lane
 * vector (acc4, one lane a token), a few instructions for four tokens where a token alone takes a conversion, a
 * broadcast, a multiply and a multiply-add; Q6_K sums in float (its eight lanes' sum may pass int32). The rest:
 * one eight-lane accumulator a token (acc).
 */
static inline __attribute__((always_inline)) void weights_terms(__m256 *acc, __m128 *acc4, const __m256i w[2],
                                                                const q16_token *x, int64_t at, int64_t scale_at,
                                                                float scale, const enum format format, const int T) {
#pragma GCC unroll 4
    for (int g = 0; g < in_fours(format, T) / 4; ++g) {
        const q16_token *four = x + 4 * g;
        __m256i dots[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) dots[i] = weights_dot(w, four[i].q + at);
        const __m128 sums = format == Q6_K ? four_sums_ps(_mm256_cvtepi32_ps(dots[0]), _mm256_cvtepi32_ps(dots[1]),
                                                          _mm256_cvtepi32_ps(dots[2]), _mm256_cvtepi32_ps(dots[3]))
                                           : _mm_cvtepi32_ps(four_sums(dots[0], dots[1], dots[2], dots[3]));
        const __m128 scales =
            _mm_setr_ps(four[0].d[scale_at], four[1].d[scale_at], four[2].d[scale_at], four[3].d[scale_at]);
        acc4[g] = _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(scale), scales), sums, acc4[g]);
    }
#pragma GCC unroll 16
    for (int t = in_fours(format, T); t < T; ++t) {
        const __m256 token_scale = _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_broadcast_ss(x[t].d + scale_at));
        acc[t] = _mm256_fmadd_ps(token_scale, _mm256_cvtepi32_ps(weights_dot(w, x[t].q + at)), acc[t]);
    }
}

/* A tile's accumulators: one set or the other, as weights_terms fills them. */
typedef struct {
    __m256 lanes[TILE_TOKENS];
    __m128 fours[TILE_TOKENS / 4];
    float offsets[TILE_TOKENS];
} tile_sums;

static inline __attribute__((always_inline)) void tile_start(tile_sums *a, const int T) {
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) a->lanes[t] = _mm256_setzero_ps(), a->offsets[t] = 0.0f;
#pragma GCC unroll 4
    for (int g = 0; g < T / 4; ++g) a->fours[g] = _mm_setzero_ps();
}

static inline __attribute__((always_inline)) void tile_finish(float *sums, const tile_sums *a,
                                                              const enum format format, const int T) {
#pragma GCC unroll 4
    for (int g = 0; g < in_fours(format, T) / 4; ++g) _mm_storeu_ps(sums + 4 * g, a->fours[g]);
#pragma GCC unroll 16
    for (int t = in_fours(format, T); t < T; ++t) sums[t] = sum_lanes(a->lanes[t]);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) sums[t] += a->offsets[t];
}

/* Block b of a 32-weight format, unpacked once, against each of the T tokens. */
static inline __attribute__((always_inline)) void block_terms(tile_sums *a, const uint8_t *block, const q16_token *x,
                                                              int64_t b, const enum format format, const int T) {
    __m256i w[2];
    unpack_block(block, format, 1, w);
    weights_terms(a->lanes, a->fours, w, x, b * Q8_BLOCK, b, half_to_float(block), format, T);
    if (format == Q4_1)
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) a->offsets[t] += half_to_float(block + 2) * x[t].s[b];
}

/* sums[t] = row . x[t] for T >= 2 tokens (a constant once inlined, so that the accumulators live in registers). */
static inline __attribute__((always_inline)) void tile_32(const uint8_t *row, const q16_token *x, int64_t blocks,
                                                          float *sums, const enum format format, const int T) {
    tile_sums a;
    tile_start(&a, T);
    for (int64_t b = 0; b < blocks; ++b) block_terms(&a, row + b * BLOCK_BYTES[format], x, b, format, T);
    tile_finish(sums, &a, format, T);
}

/* One token's terms of block b: its scale a scalar product, Q4_0's offset (-8 dw s, the -8 applied by the caller)
 * and Q4_1's (m s) a scalar multiply-add, where a tile's subtractions and per-token loops cost more. */
static inline __attribute__((always_inline)) void one_token_block(__m256 *acc, float *offset, const uint8_t *block,
                                                                  const int16_t *q, const float *d, const float *s,
                                                                  int64_t b, const enum format format) {
    const float dw = half_to_float(block);
    __m256i w[2];
    unpack_block(block, format, 0, w);
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * d[b]), _mm256_cvtepi32_ps(weights_dot(w, q + b * Q8_BLOCK)), *acc);
    if (format == Q4_0) *offset += dw * s[b];
    if (format == Q4_1) *offset += half_to_float(block + 2) * s[b];
}

/* How far ahead of its reading a tile asks for the weights: rows stream from memory, and the hardware prefetcher
 * alone left a thread stalled on them. Measured on a 1B model's decode step, one thread (Zen 4): 2048-4096 bytes
 * take 8-10% off the layers' CPU time, 1024 about 7%, 8192 3%. */
enum { PREFETCH_BYTES = 2048 };

/* Asks for the cache line PREFETCH_BYTES past `at`. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *at) {
    _mm_prefetch((const char *)(at + PREFETCH_BYTES), _MM_HINT_T0);
}

/* row . x for one token: two accumulators a block about (one chain of multiply-adds is bound by its latency). */
static inline __attribute__((always_inline)) float one_token_32(const uint8_t *row, const q16_token *x,
                                                                int64_t blocks, const enum format format) {
    const int16_t *q = x->q;
    const float *d = x->d, *s = x->s;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float offset0 = 0.0f, offset1 = 0.0f;
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        prefetch_ahead(row + b * BLOCK_BYTES[format]);
        one_token_block(&acc0, &offset0, row + b * BLOCK_BYTES[format], q, d, s, b, format);
        one_token_block(&acc1, &offset1, row + (b + 1) * BLOCK_BYTES[format], q, d, s, b + 1, format);
    }
    if (b < blocks) one_token_block(&acc0, &offset0, row + b * BLOCK_BYTES[format], q, d, s, b, format);
    const float offset = offset0 + offset1;
    return sum_lanes(_mm256_add_ps(acc0, acc1)) + (format == Q4_0 ? -8.0f * offset : offset);
}

/* tile_32 for two rows at once: each of x's vectors, loaded once, meets both rows' weights (the loads of x, two
 * a token and block, bound one row's tile as much as its products do). */
static inline __attribute__((always_inline)) void pair_32(const uint8_t *row, int64_t row_bytes, const q16_token *x,
                                                          int64_t blocks, float *sums, const enum format format,
                                                          const int T) {
    tile_sums a, c;
    tile_start(&a, T);
    tile_start(&c, T);
    for (int64_t b = 0; b < blocks; ++b) {
        if (b % 2 == 0) {
            prefetch_ahead(row + b * BLOCK_BYTES[format]);
            prefetch_ahead(row + row_bytes + b * BLOCK_BYTES[format]);
        }
        block_terms(&a, row + b * BLOCK_BYTES[format], x, b, format, T);
        block_terms(&c, row + row_bytes + b * BLOCK_BYTES[format], x, b, format, T);
    }
    tile_finish(sums, &a, format, T);
    tile_finish(sums + TILE_TOKENS, &c, format, T);
}

/* Q4_K's and Q5_K's mins term of super-block b, for every token: dmin * m . s, eight groups a multiply. */
static inline __attribute__((always_inline)) void mins_terms(tile_sums *a, __m256 mins, const q16_token *x, int64_t b,
                                                             const enum format format, const int T) {
#pragma GCC unroll 4
    for (int g = 0; g < in_fours(format, T) / 4; ++g) {
        const q16_token *four = x + 4 * g;
        __m256 products[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) products[i] = _mm256_mul_ps(mins, _mm256_loadu_ps(four[i].s + b * GROUPS));
        a->fours[g] = _mm_sub_ps(a->fours[g], four_sums_ps(products[0], products[1], products[2], products[3]));
    }
#pragma GCC unroll 16
    for (int t = in_fours(format, T); t < T; ++t)
        a->lanes[t] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(x[t].s + b * GROUPS), a->lanes[t]);
}

/* tile_32 for the K-quants: each group unpacked once a super-block for all T tokens. */
static inline __attribute__((always_inline)) void tile_k(const uint8_t *row, const q16_token *x, int64_t blocks,
                                                         float *sums, const enum format format, const int T) {
    tile_sums a;
    tile_start(&a, T);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *block = row + b * BLOCK_BYTES[format];
        for (int64_t line = 0; line < BLOCK_BYTES[format]; line += 64) /* every line of a block, ahead */
            prefetch_ahead(block + line);
        float group_scale[GROUPS];
        if (format == Q6_K) {
            for (int j = 0; j < GROUPS; ++j) group_scale[j] = half_to_float(block + 208);
        } else {
            uint8_t sc[GROUPS], m[GROUPS];
            unpack_scales(block + 4, sc, m);
            const __m256 sc_floats = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
            const __m256 m_floats = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m)));
            _mm256_storeu_ps(group_scale, _mm256_mul_ps(_mm256_set1_ps(half_to_float(block)), sc_floats));
            mins_terms(&a, _mm256_mul_ps(_mm256_set1_ps(half_to_float(block + 2)), m_floats), x, b, format, T);
        }
#pragma GCC unroll 8
        for (int j = 0; j < GROUPS; ++j) {
            __m256i w[2];
            unpack_group(block, j, format, w);
            weights_terms(a.lanes, a.fours, w, x, b * QK_K + 32 * j, b * GROUPS + j, group_scale[j], format, T);
        }
    }
    tile_finish(sums, &a, format, T);
}

/* The tile kernel of a format for T tokens. */
static inline __attribute__((always_inline)) void tile_of(const uint8_t *row, int64_t row_bytes, int rows,
                                                          const q16_token *x, int64_t blocks, float *sums,
                                                          const enum format format, const int T) {
    if (rows == 2 && format < Q4_K && in_fours(format, T) > 0) { /* x's loads shared where four tokens sum together */
        pair_32(row, row_bytes, x, blocks, sums, format, T);
        return;
    }
    for (int r = 0; r < rows; ++r)
        if (format < Q4_K && T == 1)
            sums[r * TILE_TOKENS] = one_token_32(row + r * row_bytes, x, blocks, format);
        else if (format >= Q4_K)
            tile_k(row + r * row_bytes, x, blocks, sums + r * TILE_TOKENS, format, T);
        else
            tile_32(row + r * row_bytes, x, blocks, sums + r * TILE_TOKENS, format, T);
}

/* tile_of for one format and 5-8 tokens as a function of its own. Inlined into one function per format with the
 * other counts, its loops shared their register allocation and came out worse for it (Q4_1's 8-token tile 40%
 * slower once two-row tiles took 5-7 tokens too). 1-4 tokens stay inline: their tiles are short enough for a call
 * to show. */
typedef void tile_function(const uint8_t *row, int64_t row_bytes, int rows, const q16_token *x, int64_t blocks,
                           float *sums);

#define TILE_FUNCTION(name, format, T)                                                                               \
    static __attribute__((noinline)) void tile_##name##_##T(const uint8_t *row, int64_t row_bytes, int rows,         \
                                                            const q16_token *x, int64_t blocks, float *sums) {       \
        tile_of(row, row_bytes, rows, x, blocks, sums, format, T);                                                   \
    }
#define TILE_FUNCTIONS(name, format)                                                                                 \
    TILE_FUNCTION(name, format, 5) TILE_FUNCTION(name, format, 6) TILE_FUNCTION(name, format, 7)                     \
    TILE_FUNCTION(name, format, 8)
#define FROM_FIVE_TOKENS(name) {tile_##name##_5, tile_##name##_6, tile_##name##_7, tile_##name##_8}

TILE_FUNCTIONS(q8_0, Q8_0)
TILE_FUNCTIONS(q4_0, Q4_0)
TILE_FUNCTIONS(q4_1, Q4_1)
TILE_FUNCTIONS(q4_k, Q4_K)
TILE_FUNCTIONS(q5_k, Q5_K)
TILE_FUNCTIONS(q6_k, Q6_K)

static tile_function *const FIVE_TO_EIGHT_TOKENS[][TILE_TOKENS - 4] = {
    [Q8_0] = FROM_FIVE_TOKENS(q8_0), [Q4_0] = FROM_FIVE_TOKENS(q4_0), [Q4_1] = FROM_FIVE_TOKENS(q4_1),
    [Q4_K] = FROM_FIVE_TOKENS(q4_k), [Q5_K] = FROM_FIVE_TOKENS(q5_k), [Q6_K] = FROM_FIVE_TOKENS(q6_k),
};

/* The tile of `tokens` (1..TILE_TOKENS) tokens: T made a constant, one copy of the loops per count. */
static inline __attribute__((always_inline)) void tile(const uint8_t *row, int64_t row_bytes, int rows,
                                                       const q16_token *x, int tokens, int64_t blocks, float *sums,
                                                       const enum format format) {
    switch (tokens) {
#define TILE_CASE(T)                                                                                                 \
    case T:                                                                                                          \
        tile_of(row, row_bytes, rows, x, blocks, sums, format, T);                                                   \
        return;
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
#undef TILE_CASE
    default:
        FIVE_TO_EIGHT_TOKENS[format][tokens - 5](row, row_bytes, rows, x, blocks, sums);
    }
}
INT16_TILE_KERNELS
#endif
