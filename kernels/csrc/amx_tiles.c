/*
 * Tile dots of Q8_0, Q4_0 and Q4_1 with 16-bit tokens on AMX's tile unit (amx_tiles.h). From two tokens up,
 * int16_dot.c's tiles are bound by arithmetic: unpacking a block once for all tokens, each token still takes a
 * multiply-add per 16 weight pairs. The tile unit takes 16 rows x 16 x 32 byte products in one instruction.
 *
 * It multiplies bytes, so a token's integer q (|q| <= Q16_MAX) goes in as two signed ones, q = 256 hi + lo with
 * lo in [-128, 127]: one block of up to 8 tokens is a tile A of 16 rows (each token's hi, then its lo) by 32
 * bytes, and one block of 16 weight rows a tile B of 8 rows by 64 bytes, B[j][4n + i] = row n's weight 4j + i
 * (the byte-pair layout of the dot instruction). Their product C (16 x 16 int32) holds every row's block dot
 * with each token's hi and lo: integers, as exact as int16_dot.c's. hi and lo meet again, and the block's
 * scales, on the vector unit; as every block has its own scales, C goes to memory once a block.
 *
 * The tile unit and the vector unit work on different blocks at once: the B of two blocks ahead is unpacked
 * while this block's product runs, and the C of two blocks back is scaled. Measured one thread in cache
 * (Sapphire Rapids), Q4_0, ns per 32 weights for all tokens, against int16_dot.c's tiles: 2 tokens 1.35 vs
 * 2.50, 4 tokens 1.74 vs 4.32, 8 tokens 2.12 vs 8.15. Without the lead and lag (each block's stores read back
 * at once by the next unit) it was 3.3 at every count.
 *
 * Streaming from memory, the next 16 rows (one contiguous run) are asked for while these are multiplied: a 1B
 * model's Q4_0 layers, 2 threads, alternating builds, 2/4/8 tokens 8.8-10.2 / 7.4-9.1 / 6.0-7.6 -> 10.8-11.6 /
 * 8.7-11.2 / 7.1-8.7 GB/s. Each row asking for its own lines 2 KiB ahead (int16_dot.c's way) was 5-10% slower.
 *
 * Built with AVX-512 (-march=native on such a CPU, or x86-64-v4 ahead of time) by GCC 11+, which gives the
 * functions that use the tile unit its target (only CPUs that have one, under a Linux that grants it, run them),
 * or by any compiler whose -march enables AMX. An AVX2 build (an older CPU's, or the tests' narrower builds)
 * leaves it out: no CPU without AVX-512 has the tile unit.
 */
#define _GNU_SOURCE
#include "amx_tiles.h"

#include <stdatomic.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__AVX512BW__) && defined(__AVX512VL__) &&                   \
    defined(__AVX512DQ__) && defined(__F16C__) && defined(__FMA__) &&                                                \
    (defined(__AMX_INT8__) || (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11))
#define AMX_BUILT 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* ggml's type ids of the formats here. */
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 };

/* -1 not asked yet, 0 unavailable, 1 available; allowed: amx_tiles_allow's last word. */
static atomic_int available = -1;
static atomic_int allowed = 1;

#ifdef AMX_BUILT
enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

/* The CPU has the tile unit with its byte products (the build's AVX-512 it has, or the library would not load). */
static int cpu_has_tile_unit(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1);
}
#endif

static int ask_for_tiles(void) {
#ifdef AMX_BUILT
    /* Linux hands a process the tile registers' 8 KiB of state only when asked (for all its threads). */
    return cpu_has_tile_unit() && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

int amx_tiles_for(int ggml_type) {
    if (ggml_type != GGML_Q4_0 && ggml_type != GGML_Q4_1 && ggml_type != GGML_Q8_0) return 0;
    int known = atomic_load(&available);
    if (known < 0) atomic_store(&available, known = ask_for_tiles());
    return known && atomic_load(&allowed);
}

int amx_tiles_allow(int allow) { return atomic_exchange(&allowed, allow != 0); }

void amx_pair_tokens(int8_t *pairs, const q16_token *x, int tokens, int64_t blocks) {
    memset(pairs, 0, (size_t)(blocks * AMX_PAIR_BYTES));
    for (int t = 0; t < tokens; ++t)
        for (int64_t b = 0; b < blocks; ++b) {
            int8_t *hi = pairs + b * AMX_PAIR_BYTES + 2 * t * Q8_BLOCK, *lo = hi + Q8_BLOCK;
            const int16_t *q = x[t].q + b * Q8_BLOCK;
            for (int k = 0; k < Q8_BLOCK; ++k) {
                const int high = (q[k] + 128) >> 8; /* arithmetic shift: rounds lo into [-128, 127] */
                hi[k] = (int8_t)high;
                lo[k] = (int8_t)(q[k] - 256 * high);
            }
        }
}

#ifdef AMX_BUILT
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8")
#include <immintrin.h>

/* Tile registers: C (products) 0 and 1, A (tokens) 2 and 3, B (weights) 4 and 5, alternating by block. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

/* A constant in memory: GCC 12 took the stores of a configuration built on the stack for dead and left them out,
 * as if ldtilecfg did not read them. */
static const tile_config CONFIG = {
    .palette = 1,
    .bytes_per_row = {AMX_ROWS * 4, AMX_ROWS * 4, Q8_BLOCK, Q8_BLOCK, AMX_ROWS * 4, AMX_ROWS * 4},
    .rows = {AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, Q8_BLOCK / 4, Q8_BLOCK / 4},
};

void amx_begin(void) { _tile_loadconfig(&CONFIG); }

void amx_end(void) { _tile_release(); }

/* Blocks the weights are unpacked ahead of their product, products scaled behind it, and the ring their memory
 * turns in: a power of two past the AHEAD + BEHIND + 1 blocks whose scales are live at once. */
enum { AHEAD = 2, BEHIND = 2, RING = 8 };

typedef struct {
    _Alignas(64) int8_t b[RING][Q8_BLOCK / 4][64];
    _Alignas(64) int32_t c[RING][AMX_ROWS][AMX_ROWS];
    __m512 scale[RING], min[RING]; /* each row's block scale, and Q4_1's min */
} pipeline;

/* Dwords j = 0..3 of the 16 bytes at p + n * row_bytes for rows n = 0..15, as g[j] (lane n): loads of four rows
 * a register, then a 4 x 4 transpose of dwords within each 128-bit lane. */
static inline __attribute__((always_inline)) void transpose_rows(const uint8_t *p, int64_t row_bytes, __m512i g[4]) {
    __m512i r[4];
    for (int a = 0; a < 4; ++a) {
        const uint8_t *row = p + a * row_bytes;
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)row));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(row + 4 * row_bytes)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(row + 8 * row_bytes)), 2);
        r[a] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(row + 12 * row_bytes)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
    g[0] = _mm512_unpacklo_epi64(t0, t2);
    g[1] = _mm512_unpackhi_epi64(t0, t2);
    g[2] = _mm512_unpacklo_epi64(t1, t3);
    g[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Block b of the 16 rows into ring slot b % RING: its weights as tile B, its scales (and Q4_1's mins). */
static inline __attribute__((always_inline)) void unpack_block(pipeline *p, const uint8_t *row, int64_t row_bytes,
                                                               int64_t b, int format) {
    const int64_t block_bytes = format == GGML_Q8_0 ? 34 : format == GGML_Q4_0 ? 18 : 20;
    const uint8_t *block = row + b * block_bytes;
    const int slot = (int)(b % RING);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i head = _mm512_i32gather_epi32(_mm512_mullo_epi32(lanes, _mm512_set1_epi32((int)row_bytes)),
                                                block, 1); /* d, then Q4_1's m */
    p->scale[slot] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
    if (format == GGML_Q4_1) p->min[slot] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
    __m512i g[4];
    transpose_rows(block + (format == GGML_Q4_1 ? 4 : 2), row_bytes, g);
    if (format == GGML_Q8_0) {
        __m512i h[4];
        transpose_rows(block + 18, row_bytes, h);
        for (int j = 0; j < 4; ++j) {
            _mm512_store_si512(p->b[slot][j], g[j]);
            _mm512_store_si512(p->b[slot][4 + j], h[j]);
        }
        return;
    }
    /* Byte i of a row's 16: weight i in its low nibble, weight 16 + i in its high one. */
    const __m512i nibble = _mm512_set1_epi8(0x0F), offset = _mm512_set1_epi8(format == GGML_Q4_0 ? 8 : 0);
    for (int j = 0; j < 4; ++j) {
        _mm512_store_si512(p->b[slot][j], _mm512_sub_epi8(_mm512_and_si512(g[j], nibble), offset));
        _mm512_store_si512(p->b[slot][4 + j],
                           _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(g[j], 4), nibble), offset));
    }
}

/* Block b's products, from ring slot b % RING, into the T tokens' accumulators (lane r: row r). */
static inline __attribute__((always_inline)) void scale_block(__m512 *acc, const pipeline *p, const q16_token *x,
                                                              int64_t b, int format, const int T) {
    const int slot = (int)(b % RING);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
        const __m512i hi = _mm512_load_si512(p->c[slot][2 * t]), lo = _mm512_load_si512(p->c[slot][2 * t + 1]);
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
        acc[t] = _mm512_fmadd_ps(dots, _mm512_mul_ps(p->scale[slot], _mm512_set1_ps(x[t].d[b])), acc[t]);
        if (format == GGML_Q4_1) acc[t] = _mm512_fmadd_ps(p->min[slot], _mm512_set1_ps(x[t].s[b]), acc[t]);
    }
}

/* Block b's product on the tile unit: C = A (tokens) . B (weights), then to ring slot b % RING. Tile register
 * numbers are part of each instruction, hence a macro. */
#define MULTIPLY_BLOCK(C, A, B)                                                                                      \
    do {                                                                                                             \
        _tile_loadd(B, p.b[b % RING], 64);                                                                           \
        _tile_loadd(A, pairs + b * AMX_PAIR_BYTES, Q8_BLOCK);                                                        \
        _tile_zero(C);                                                                                               \
        _tile_dpbssd(C, A, B);                                                                                       \
        _tile_stored(C, p.c[b % RING], AMX_ROWS * 4);                                                                \
    } while (0)

static inline __attribute__((always_inline)) void tile_dot(const uint8_t *row, int64_t row_bytes,
                                                           const int8_t *pairs, const q16_token *x, int64_t blocks,
                                                           float *sums, int format, const int T) {
    pipeline p;
    __m512 acc[AMX_TOKENS];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < AHEAD && b < blocks; ++b) unpack_block(&p, row, row_bytes, b, format);
    /* The next 16 rows, one contiguous run of memory, asked for a block's share at a time. */
    const uint8_t *next = row + AMX_ROWS * row_bytes;
    const int64_t share = AMX_ROWS * row_bytes / blocks;
    for (int64_t b = 0; b < blocks; ++b) {
        for (int64_t at = b * share; at < (b + 1) * share; at += 64)
            _mm_prefetch((const char *)(next + at), _MM_HINT_T0);
        if (b + AHEAD < blocks) unpack_block(&p, row, row_bytes, b + AHEAD, format);
        if (b % 2 == 0)
            MULTIPLY_BLOCK(0, 2, 4);
        else
            MULTIPLY_BLOCK(1, 3, 5);
        if (b >= BEHIND) scale_block(acc, &p, x, b - BEHIND, format, T);
    }
    for (int64_t b = blocks > BEHIND ? blocks - BEHIND : 0; b < blocks; ++b) scale_block(acc, &p, x, b, format, T);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(sums + t * AMX_ROWS, acc[t]);
}

/* tile_dot of one format for each token count, the count a constant so that the accumulators stay in
 * registers. */
#define FORMAT_TILE_DOT(name, format)                                                                                \
    static __attribute__((noinline)) void tile_dot_##name(const uint8_t *row, int64_t row_bytes,                     \
                                                          const int8_t *pairs, const q16_token *x, int tokens,       \
                                                          int64_t blocks, float *sums) {                             \
        switch (tokens) {                                                                                            \
        case 1: tile_dot(row, row_bytes, pairs, x, blocks, sums, format, 1); return;                                 \
        case 2: tile_dot(row, row_bytes, pairs, x, blocks, sums, format, 2); return;                                 \
        case 3: tile_dot(row, row_bytes, pairs, x, blocks, sums, format, 3); return;                                 \
        case 4: tile_dot(row, row_bytes, pairs, x, blocks, sums, format, 4); return;                                 \
        case 5: tile_dot(row, row_bytes, pairs, x, blocks, sums, format, 5); return;                                 \
        case 6: tile_dot(row, row_bytes, pairs, x, blocks, sums, format, 6); return;                                 \
        case 7: tile_dot(row, row_bytes, pairs, x, blocks, sums, format, 7); return;                                 \
        default: tile_dot(row, row_bytes, pairs, x, blocks, sums, format, 8); return;                                \
        }                                                                                                            \
    }
FORMAT_TILE_DOT(q8_0, GGML_Q8_0)
FORMAT_TILE_DOT(q4_0, GGML_Q4_0)
FORMAT_TILE_DOT(q4_1, GGML_Q4_1)

void amx_tile_dot(int ggml_type, const uint8_t *row, int64_t row_bytes, const int8_t *pairs, const q16_token *x,
                  int tokens, int64_t blocks, float *sums) {
    if (ggml_type == GGML_Q8_0)
        tile_dot_q8_0(row, row_bytes, pairs, x, tokens, blocks, sums);
    else if (ggml_type == GGML_Q4_0)
        tile_dot_q4_0(row, row_bytes, pairs, x, tokens, blocks, sums);
    else
        tile_dot_q4_1(row, row_bytes, pairs, x, tokens, blocks, sums);
}
#pragma GCC pop_options

#else /* never called: amx_tiles_for says 0 */
void amx_begin(void) {}
void amx_end(void) {}
void amx_tile_dot(int ggml_type, const uint8_t *row, int64_t row_bytes, const int8_t *pairs, const q16_token *x,
                  int tokens, int64_t blocks, float *sums) {
    (void)ggml_type, (void)row, (void)row_bytes, (void)pairs, (void)x, (void)tokens, (void)blocks, (void)sums;
}
#endif
