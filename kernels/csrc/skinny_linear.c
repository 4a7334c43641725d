/*
 * y = x @ W^T + bias for a few tokens (a decode batch), float32, for the CPU.
 *
 * A decode step multiplies every weight matrix by a batch of 1 to ~64 tokens. BLAS libraries tune for
 * large square products; at these shapes MKL reaches under a quarter of this CPU's float32 peak (measured
 * on SmolLM2's projections: ~40 GFLOP/s at 20 tokens, against ~170 for two cores), and the weights are the
 * only large operand. This kernel reads each weight row from memory once a call (later token columns find
 * it in cache) and keeps a tile of outputs in registers.
 *
 * Layout: activations are feature-major (the transposed view kernels/cpu_backend.py passes between the
 * CPU ops for small batches): xt is [K, M], one row per input feature, `ldx` floats apart; out is [N, M],
 * `ldo` floats apart. W is [N, K], contiguous (nn.Linear's weight).
 *
 * Register tile: ROWS weight rows x one or two vectors of tokens. For each input feature k, the tile loads
 * its token vectors from xt and broadcasts one weight per row: 2 * ROWS fused multiply-adds per 2 + ROWS
 * loads. Token columns past the last whole vector go through a zero-padded copy.
 *
 * Built at first use with the system C compiler (kernels/cpu_native.py), for the host CPU.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "skinny_linear.h"
#include "vector_math.h"

enum { ROWS = SKINNY_ROWS, WIDE = 2 * LANES };

/*
 * out[r, 0:vecs * LANES] = sum_k w[r, k] * xt[k, 0:vecs * LANES] + bias[r], r < rows, where out[r, m] is
 * out[r * ldo + m * ldo_token]. Always inlined with constant rows and vecs, so the loops unroll and the
 * accumulators live in registers.
 */
static inline __attribute__((always_inline)) void tile(float *out, int64_t ldo, int64_t ldo_token, const float *xt,
                                                        int64_t ldx, const float *w, int64_t K, const float *bias,
                                                        const int rows, const int vecs) {
    /* Named accumulators, not an array: GCC keeps these in registers through the k loop. */
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0};
    vec b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0}, b4 = {0}, b5 = {0};
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K, *w4 = w + 4 * K, *w5 = w + 5 * K;
    for (int64_t k = 0; k < K; ++k) {
        const vec x0 = load(xt + k * ldx), x1 = vecs == 2 ? load(xt + k * ldx + LANES) : x0;
#define ACCUMULATE(r)                                                                                             \
    if (rows > r) {                                                                                               \
        const vec weight = splat(w##r[k]);                                                                       \
        a##r += weight * x0;                                                                                      \
        if (vecs == 2) b##r += weight * x1;                                                                       \
    }
        ACCUMULATE(0) ACCUMULATE(1) ACCUMULATE(2) ACCUMULATE(3) ACCUMULATE(4) ACCUMULATE(5)
#undef ACCUMULATE
    }
    if (ldo_token == 1) { /* feature-major out: each row's tokens are a vector */
#define STORE(r)                                                                                                  \
    if (rows > r) {                                                                                               \
        const vec b = splat(bias ? bias[r] : 0.0f);                                                               \
        store(out + r * ldo, a##r + b);                                                                           \
        if (vecs == 2) store(out + r * ldo + LANES, b##r + b);                                                    \
    }
        STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
        return;
    }
    /* Token-major out: the tile goes through the stack, so that the caller needs no transposed copy. */
    float tokens[ROWS][WIDE];
#define SPILL(r)                                                                                                  \
    if (rows > r) {                                                                                               \
        const vec b = splat(bias ? bias[r] : 0.0f);                                                               \
        store(tokens[r], a##r + b);                                                                               \
        if (vecs == 2) store(tokens[r] + LANES, b##r + b);                                                        \
    }
    SPILL(0) SPILL(1) SPILL(2) SPILL(3) SPILL(4) SPILL(5)
#undef SPILL
    for (int m = 0; m < vecs * LANES; ++m)
        for (int r = 0; r < rows; ++r) out[m * ldo_token + r * ldo] = tokens[r][m];
}

/* The kernel for a tile of `rows` weight rows and `vecs` vectors of tokens. */
typedef void tile_kernel(float *, int64_t, int64_t, const float *, int64_t, const float *, int64_t, const float *);
#define TILE_KERNEL(rows, vecs)                                                                                   \
    static void tile_##rows##x##vecs(float *out, int64_t ldo, int64_t ldo_token, const float *xt, int64_t ldx,    \
                                     const float *w, int64_t K, const float *bias) {                              \
        tile(out, ldo, ldo_token, xt, ldx, w, K, bias, rows, vecs);                                               \
    }
TILE_KERNEL(1, 1) TILE_KERNEL(2, 1) TILE_KERNEL(3, 1) TILE_KERNEL(4, 1) TILE_KERNEL(5, 1) TILE_KERNEL(6, 1)
TILE_KERNEL(1, 2) TILE_KERNEL(2, 2) TILE_KERNEL(3, 2) TILE_KERNEL(4, 2) TILE_KERNEL(5, 2) TILE_KERNEL(6, 2)
static tile_kernel *const TILES[2][ROWS] = {
    {tile_1x1, tile_2x1, tile_3x1, tile_4x1, tile_5x1, tile_6x1},
    {tile_1x2, tile_2x2, tile_3x2, tile_4x2, tile_5x2, tile_6x2},
};

/* Every token column of `rows` weight rows; columns past the last full vector go through a padded copy. */
static void row_block(float *out, int64_t ldo, int64_t ldo_token, const float *xt, int64_t ldx, const float *w,
                      int64_t K, const float *bias, int64_t M, int rows, const float *tail_x) {
    int64_t m = 0;
    for (; m + WIDE <= M; m += WIDE) TILES[1][rows - 1](out + m * ldo_token, ldo, ldo_token, xt + m, ldx, w, K, bias);
    for (; m + LANES <= M; m += LANES) TILES[0][rows - 1](out + m * ldo_token, ldo, ldo_token, xt + m, ldx, w, K, bias);
    if (m == M) return;
    float tail_out[ROWS * LANES];
    TILES[0][rows - 1](tail_out, LANES, 1, tail_x, LANES, w, K, bias);
    for (int r = 0; r < rows; ++r)
        for (int64_t t = m; t < M; ++t) out[r * ldo + t * ldo_token] = tail_out[r * LANES + t - m];
}

void skinny_row_block_f32(float *out, int64_t ldo, int64_t ldo_token, const float *xt, int64_t ldx, const float *w,
                          int64_t K, const float *bias, int64_t M, int rows, const float *tail_x) {
    row_block(out, ldo, ldo_token, xt, ldx, w, K, bias, M, rows, tail_x);
}

int skinny_tail_f32(float **tail_x, const float *xt, int64_t ldx, int64_t M, int64_t K) {
    const int64_t tail = M % LANES, first_tail = M - tail;
    *tail_x = NULL;
    if (tail == 0) return 0;
    *tail_x = calloc((size_t)K * LANES, sizeof(float));
    if (*tail_x == NULL) return -1;
    for (int64_t k = 0; k < K; ++k) memcpy(*tail_x + k * LANES, xt + k * ldx + first_tail, sizeof(float) * tail);
    return 0;
}

typedef struct {
    float *out;
    int64_t ldo;
    const float *xt;
    int64_t ldx;
    const float *w, *bias;
    int64_t M, N, K;
    const float *tail_x;
} linear_job;

/* Row blocks [begin, end) of the output. */
static void row_blocks(void *context, int64_t begin, int64_t end) {
    const linear_job *job = context;
    for (int64_t block = begin; block < end; ++block) {
        const int64_t n = block * ROWS;
        const int rows = job->N - n < ROWS ? (int)(job->N - n) : ROWS;
        row_block(job->out + n * job->ldo, job->ldo, 1, job->xt, job->ldx, job->w + n * job->K, job->K,
                  job->bias ? job->bias + n : NULL, job->M, rows, job->tail_x);
    }
}

/*
 * out[n, m] = sum_k w[n, k] * xt[k, m] + bias[n] (bias may be NULL), for n < N, m < M. Returns 0, or -1 if
 * scratch memory ran out (out is then not written).
 */
int skinny_linear_f32(float *out, int64_t ldo, const float *xt, int64_t ldx, const float *w, const float *bias,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    float *tail_x; /* shared, read-only, by all threads */
    if (skinny_tail_f32(&tail_x, xt, ldx, M, K)) return -1;
    linear_job job = {out, ldo, xt, ldx, w, bias, M, N, K, tail_x};
    /* Chunks of 4 row blocks (24 weight rows): microseconds of work each, so taking one costs little and
     * the threads still finish together. */
    parallel_for((N + ROWS - 1) / ROWS, 4, num_threads, row_blocks, &job);
    free(tail_x);
    return 0;
}
