/*
 * The 32-weight formats' products with 16-bit tokens on AMX's tile unit (amx_tiles.c): Intel Xeons since
 * Sapphire Rapids, where Linux grants the process its tile registers. int8_linear.c takes them for 2 or more
 * tokens and weight matrices of a multiple of 16 rows; elsewhere it keeps int16_dot.c's tiles, whose integers
 * these are.
 */
#ifndef PAGEDSERVE_AMX_TILES_H
#define PAGEDSERVE_AMX_TILES_H

#include <stdint.h>

#include "int8_activations.h"

enum {
    AMX_ROWS = 16,   /* weight rows a tile dot takes */
    AMX_TOKENS = 8,  /* tokens it takes: each is two rows of the tile unit's 16 */
    AMX_PAIR_BYTES = 2 * AMX_TOKENS * Q8_BLOCK, /* one block of up to AMX_TOKENS tokens as amx_pair_tokens lays it */
};

/* Whether amx_tile_dot runs for ggml type `ggml_type` in this process: built in, the CPU has the tile unit,
 * Linux granted it, and amx_tiles_allow has not turned it off. The first call asks Linux. */
int amx_tiles_for(int ggml_type);

/* Turns the tile path off (0) or back on (1) for the whole process (benchmarks and tests compare the two);
 * returns the setting it had. */
int amx_tiles_allow(int allow);

/* `tokens` (1..AMX_TOKENS) of x's tokens, natural feature order, as the tile unit reads them: per block, each
 * token's integers as two signed bytes (q = 256 hi + lo), hi in row 2t and lo in row 2t + 1 of AMX_PAIR_BYTES,
 * rows past 2 * tokens zero. pairs holds blocks * AMX_PAIR_BYTES bytes. Needs |q| <= Q16_MAX. */
void amx_pair_tokens(int8_t *pairs, const q16_token *x, int tokens, int64_t blocks);

/* Called by each thread before its first amx_tile_dot of a loop, and after its last (the tile registers are
 * a thread's: configured, then released so that a context switch no longer saves them). */
void amx_begin(void);
void amx_end(void);

/* AMX_ROWS weight rows (row_bytes apart) of ggml type `ggml_type`, `blocks` blocks each, times `tokens` tokens:
 * their integers in `pairs` (amx_pair_tokens), their scales and sums in x. sums[t * AMX_ROWS + r] = row r . x[t]. */
void amx_tile_dot(int ggml_type, const uint8_t *row, int64_t row_bytes, const int8_t *pairs, const q16_token *x,
                  int tokens, int64_t blocks, float *sums);

#endif
