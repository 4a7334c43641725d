/*
 * Block formats with their rows interleaved eight at a time (q4_0_rows8.c, q4_k_rows8.c, q6_k_rows8.c; written by
 * rows8_layout.c): the layouts' type ids, and their products with 16-bit tokens.
 */
#ifndef PAGEDSERVE_ROWS8_H
#define PAGEDSERVE_ROWS8_H

#include <stdint.h>

#include "int8_activations.h"

/* The layouts' type ids where the kernels take a ggml type (kernels/block_formats.py's KERNEL_LAYOUTS): past any
 * ggml type, as no file stores them. */
enum { ROWS8_Q4_0_TYPE = 1002, ROWS8_Q4_K_TYPE = 1012, ROWS8_Q6_K_TYPE = 1014 };
enum { ROW_GROUP = 8, ROWS8_Q4_0_BLOCK = ROW_GROUP * 18, ROWS8_Q4_K_BLOCK = ROW_GROUP * 144 };
enum { ROWS8_Q6_K_BLOCK = ROW_GROUP * 210 };

/* out = `num_rows` rows of `row_bytes` bytes each, interleaved (the same number of bytes), on `num_threads`
 * threads. Return 0, or -1 (out untouched) where num_rows is not a multiple of ROW_GROUP or row_bytes not of a
 * block. */
int q4_0_rows8_interleave(uint8_t *out, const uint8_t *rows, int64_t num_rows, int64_t row_bytes, int num_threads);
int q4_k_rows8_interleave(uint8_t *out, const uint8_t *rows, int64_t num_rows, int64_t row_bytes, int num_threads);
int q6_k_rows8_interleave(uint8_t *out, const uint8_t *rows, int64_t num_rows, int64_t row_bytes, int num_threads);

/* sums[t * ROW_GROUP + r] = row r of the group at `group` (`blocks` of the format's blocks a row: 32 weights for
 * Q4_0, 256 for the K-quants) . x[t], for t < tokens (1..4). */
typedef void rows8_tile(const uint8_t *group, int64_t blocks, const q16_token *x, int tokens, float *sums);
rows8_tile q4_0_rows8_tile, q4_k_rows8_tile, q6_k_rows8_tile;

/* Whether this build has the vector kernels (AVX2); without them the tiles are scalar, correct but slow. */
int rows8_available(void);

#ifdef INT8_AVX2
#include <string.h>

/* acc + the pair products of w's 16 int16 (a pair of weights of each of eight rows) and the pair of x's integers
 * at `pair`, broadcast to every row's lanes: what every group tile's inner loop does. */
static inline __attribute__((always_inline)) __m256i pair_products(__m256i acc, __m256i w, const int16_t *pair) {
    int32_t both;
    memcpy(&both, pair, sizeof both);
    const __m256i x = _mm256_set1_epi32(both);
#ifdef INT8_VNNI
    acc = _mm256_dpwssd_epi32(acc, w, x);
#else
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
    /* Opaque to the compiler from here: else GCC reassociates a tile's unrolled chain of integer adds into a tree
     * whose every product is live at once, and spills them all to the stack (4 tokens took 1.5x the time). */
    __asm__("" : "+x"(acc));
    return acc;
}

/* How far ahead of its reading a group tile asks for its blocks: int16_dot.c's PREFETCH_BYTES, the same stream. */
enum { PREFETCH_BYTES = 2048 };

/* Asks for the cache lines of the `bytes` bytes PREFETCH_BYTES past `at`: the part of a group a tile reads next. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *at, const int bytes) {
    for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)(at + PREFETCH_BYTES + line), _MM_HINT_T0);
}

/* A format's exported tile from its group_tile(group, blocks, x, sums, T): T a constant in each of the four
 * copies (1-4 tokens), so that the accumulators live in registers. */
#define ROWS8_TILE(name)                                                                                             \
    void name##_rows8_tile(const uint8_t *group, int64_t blocks, const q16_token *x, int tokens, float *sums) {      \
        switch (tokens) {                                                                                            \
        case 1:                                                                                                      \
            group_tile(group, blocks, x, sums, 1);                                                                   \
            return;                                                                                                  \
        case 2:                                                                                                      \
            group_tile(group, blocks, x, sums, 2);                                                                   \
            return;                                                                                                  \
        case 3:                                                                                                      \
            group_tile(group, blocks, x, sums, 3);                                                                   \
            return;                                                                                                  \
        default:                                                                                                     \
            group_tile(group, blocks, x, sums, 4);                                                                   \
        }                                                                                                            \
    }
#endif

#endif
