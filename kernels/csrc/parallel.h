/*
 * The thread pool every CPU kernel here runs its loops on (parallel.c).
 *
 * Why not OpenMP: a decode step calls these kernels a few hundred times, a fraction of a millisecond each,
 * with Python in between. OpenMP's workers either sleep as soon as a loop ends, and waking them costs tens of
 * microseconds to milliseconds on a virtual machine, or spin, and then take the core from the thread doing
 * the work whenever another process wants it. This pool's workers spin for a few milliseconds after each
 * loop but yield the core to anything else runnable while they do, then sleep; and work is handed out in
 * chunks, first come first served, so a worker that starts late only does less of it.
 */
#ifndef PAGEDSERVE_PARALLEL_H
#define PAGEDSERVE_PARALLEL_H

#include <stdint.h>

/* Runs items [begin, end) of a loop. */
typedef void parallel_body(void *context, int64_t begin, int64_t end);

/*
 * body(context, begin, end) over [0, items) in chunks of `grain` items, on the calling thread and up to
 * `threads` - 1 pool workers; returns when every chunk has run. Chunks run in any order, each exactly
 * once. Safe to call from several threads at once (a second caller runs its loop alone).
 */
void parallel_for(int64_t items, int64_t grain, int threads, parallel_body *body, void *context);

/*
 * A grain for streaming loops (one token's rows of a weight matrix): `items` in two chunks a thread, or
 * `least` items where that is more. Each chunk streams from memory as one sequential run, and the hardware
 * prefetcher ramps up again at each one's start: a decode step's projections take 10-15% less time so than in
 * few-microsecond chunks (2 threads, Zen 3). Two a thread still let one thread take over what a descheduled
 * other has not begun.
 */
static inline int64_t sequential_runs_grain(int64_t items, int64_t least, int threads) {
    const int64_t chunks = 2 * (threads > 1 ? threads : 1), even = (items + chunks - 1) / chunks;
    return even > least ? even : least;
}

#endif
