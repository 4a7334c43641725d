/*
 * The interleaved layouts of rows8.h, written from a table: each format's block as fields, and a field as pieces
 * of a few bytes, stored piece by piece with the eight rows' pieces together (row 0 first). The layouts' own
 * comments (q4_0_rows8.c, q4_k_rows8.c, q6_k_rows8.c) show the result; kernels/interleaved_rows.py holds the
 * same table for its torch reference.
 */
#include <stdint.h>
#include <string.h>

#include "int8_activations.h"
#include "parallel.h"
#include "rows8.h"

/* Bytes [start, stop) of a block, in pieces of `width` bytes. */
typedef struct {
    int start, stop, width;
} field;

enum { MOST_FIELDS = 8 };

typedef struct {
    int block_bytes, num_fields;
    field fields[MOST_FIELDS];
} block_layout;

static const block_layout Q4_0_LAYOUT = {18, 2, {{0, 2, 2}, {2, 18, 2}}}; /* d; nibbles two bytes at a time */
static const block_layout Q4_K_LAYOUT = {/* d; dmin; the packed scales a word at a time; each 32-byte segment */
                                         144,
                                         7,
                                         {{0, 2, 2}, {2, 4, 2}, {4, 16, 4}, {16, 48, 2}, {48, 80, 2}, {80, 112, 2},
                                          {112, 144, 2}}};
static const block_layout Q6_K_LAYOUT = {/* d; the 16 scales a byte at a time; then each half of the weights:
                                          * ql's two 32-byte runs and qh's 32 bytes */
                                         210,
                                         8,
                                         {{208, 210, 2}, {192, 208, 1}, {0, 32, 2}, {32, 64, 2}, {128, 160, 2},
                                          {64, 96, 2}, {96, 128, 2}, {160, 192, 2}}};

/* The eight rows' pieces of `width` (a constant once inlined) bytes at `offset` of the block at `first`, one
 * after another from `at`; returns where the next field goes. */
static inline __attribute__((always_inline)) uint8_t *copy_pieces(uint8_t *at, const uint8_t *first,
                                                                  int64_t row_bytes, field piece, const int width) {
    for (int offset = piece.start; offset < piece.stop; offset += width)
        for (int r = 0; r < ROW_GROUP; ++r, at += width) memcpy(at, first + r * row_bytes + offset, (size_t)width);
    return at;
}

typedef struct {
    const block_layout *layout;
    uint8_t *out;
    const uint8_t *rows;
    int64_t row_bytes, blocks;
} interleave_job;

/* Row groups [begin, end) of the job. */
static void interleave_groups(void *context, int64_t begin, int64_t end) {
    const interleave_job *job = context;
    const block_layout *layout = job->layout;
    for (int64_t g = begin; g < end; ++g)
        for (int64_t b = 0; b < job->blocks; ++b) {
            uint8_t *at = job->out + (g * job->blocks + b) * ROW_GROUP * layout->block_bytes;
            const uint8_t *first = job->rows + g * ROW_GROUP * job->row_bytes + b * layout->block_bytes;
            for (int f = 0; f < layout->num_fields; ++f) {
                const field piece = layout->fields[f];
                if (piece.width == 1)
                    at = copy_pieces(at, first, job->row_bytes, piece, 1);
                else if (piece.width == 2)
                    at = copy_pieces(at, first, job->row_bytes, piece, 2);
                else
                    at = copy_pieces(at, first, job->row_bytes, piece, 4);
            }
        }
}

static int interleave(const block_layout *layout, uint8_t *out, const uint8_t *rows, int64_t num_rows,
                      int64_t row_bytes, int num_threads) {
    if (num_rows % ROW_GROUP != 0 || row_bytes % layout->block_bytes != 0) return -1;
    interleave_job job = {layout, out, rows, row_bytes, row_bytes / layout->block_bytes};
    parallel_for(num_rows / ROW_GROUP, 16, num_threads, interleave_groups, &job);
    return 0;
}

int q4_0_rows8_interleave(uint8_t *out, const uint8_t *rows, int64_t num_rows, int64_t row_bytes, int num_threads) {
    return interleave(&Q4_0_LAYOUT, out, rows, num_rows, row_bytes, num_threads);
}

int q4_k_rows8_interleave(uint8_t *out, const uint8_t *rows, int64_t num_rows, int64_t row_bytes, int num_threads) {
    return interleave(&Q4_K_LAYOUT, out, rows, num_rows, row_bytes, num_threads);
}

int q6_k_rows8_interleave(uint8_t *out, const uint8_t *rows, int64_t num_rows, int64_t row_bytes, int num_threads) {
    return interleave(&Q6_K_LAYOUT, out, rows, num_rows, row_bytes, num_threads);
}

int rows8_available(void) {
#ifdef INT8_AVX2
    return 1;
#else
    return 0;
#endif
}
