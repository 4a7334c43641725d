/*
 * The kernels' thread pool (see parallel.h for why it exists).
 *
 * A job is published in one 64-bit word, `claim`: a generation number (which job), the next chunk to hand
 * out and the job's chunk count. Threads take a chunk by compare-and-swap on that word, so a chunk can only
 * be taken while its job is live, and the caller does not return before every taken chunk has finished:
 * whoever takes a chunk may read the job's description without further locking.
 *
 * An idle worker waits in three stages: it polls with the CPU's pause hint (a loop starts within a
 * microsecond), then polls with sched_yield (the core goes to any other runnable thread, another process's
 * included), then sleeps on a condition variable until the next job.
 */
#define _GNU_SOURCE
#include "parallel.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

enum { MAX_WORKERS = 255 };
/* Stages of an idle worker's wait. Within an engine step the gaps between kernel calls are tens to
 * hundreds of microseconds; between steps, a few milliseconds. */
static const int64_t PAUSE_NS = 50 * 1000;
static const int64_t YIELD_NS = 5 * 1000 * 1000;

/* claim = generation (16 bits) | next chunk (24) | chunk count (24). */
#define CHUNK_BITS 24
static const uint64_t CHUNK_MASK = (UINT64_C(1) << CHUNK_BITS) - 1;
static const int64_t MAX_CHUNKS = (INT64_C(1) << CHUNK_BITS) - 1;

static inline uint64_t pack(uint64_t generation, uint64_t next, uint64_t chunks) {
    return (generation << (2 * CHUNK_BITS)) | (next << CHUNK_BITS) | chunks;
}
static inline uint64_t generation_of(uint64_t claim) { return claim >> (2 * CHUNK_BITS); }
static inline int64_t next_of(uint64_t claim) { return (int64_t)((claim >> CHUNK_BITS) & CHUNK_MASK); }
static inline int64_t chunks_of(uint64_t claim) { return (int64_t)(claim & CHUNK_MASK); }

typedef struct {
    parallel_body *body;
    void *context;
    int64_t items, grain;
} job;

static struct {
    _Atomic uint64_t claim;
    _Atomic int64_t done; /* chunks of the live job that have finished */
    _Atomic int helpers;  /* workers 1..helpers may take chunks of the live job */
    _Atomic int sleepers;
    job live; /* written only while no chunk of it can be taken */
    int workers;
    pthread_mutex_t caller; /* one job at a time */
    pthread_mutex_t sleep_lock;
    pthread_cond_t wake;
} pool = {.caller = PTHREAD_MUTEX_INITIALIZER,
          .sleep_lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

static inline void cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* MXCSR's flush-to-zero and denormals-are-zero bits. */
enum { FLUSH_SUBNORMALS = 0x8040 };

/* Sets this thread's float mode to flush subnormals; returns the mode it had (0 where there is none to set). */
static inline unsigned flush_subnormals(void) {
#if defined(__SSE__)
    const unsigned mode = _mm_getcsr();
    if ((mode & FLUSH_SUBNORMALS) != FLUSH_SUBNORMALS) _mm_setcsr(mode | FLUSH_SUBNORMALS);
    return mode;
#else
    return 0;
#endif
}

static inline void restore_float_mode(unsigned mode) {
#if defined(__SSE__)
    if ((mode & FLUSH_SUBNORMALS) != FLUSH_SUBNORMALS) _mm_setcsr(mode);
#else
    (void)mode;
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Takes and runs chunks of the live job until none is left to take. */
static void run_chunks(void) {
    uint64_t claim = atomic_load_explicit(&pool.claim, memory_order_acquire);
    while (next_of(claim) < chunks_of(claim)) {
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &claim, claim + (UINT64_C(1) << CHUNK_BITS),
                                                   memory_order_acquire, memory_order_acquire))
            continue; /* claim now holds the current word */
        const int64_t begin = next_of(claim) * pool.live.grain;
        const int64_t end = begin + pool.live.grain < pool.live.items ? begin + pool.live.grain : pool.live.items;
        pool.live.body(pool.live.context, begin, end);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        claim = atomic_load_explicit(&pool.claim, memory_order_acquire);
    }
}

/* Waits until a job newer than `seen` is published; returns its claim word. */
static uint64_t wait_for_job(uint64_t seen) {
    const int64_t start = now_ns();
    for (;;) {
        const uint64_t claim = atomic_load_explicit(&pool.claim, memory_order_acquire);
        if (generation_of(claim) != seen) return claim;
        const int64_t waited = now_ns() - start;
        if (waited < PAUSE_NS) {
            cpu_pause();
        } else if (waited < YIELD_NS) {
            sched_yield();
        } else {
            pthread_mutex_lock(&pool.sleep_lock);
            atomic_fetch_add(&pool.sleepers, 1); /* sequentially consistent: pairs with publish() */
            while (generation_of(atomic_load(&pool.claim)) == seen) pthread_cond_wait(&pool.wake, &pool.sleep_lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.sleep_lock);
            return atomic_load_explicit(&pool.claim, memory_order_acquire);
        }
    }
}

static void *worker_main(void *argument) {
    const int index = (int)(intptr_t)argument; /* 1-based: the caller is thread 0 */
    flush_subnormals();                          /* for good: this thread runs nothing but the pool's loops */
    uint64_t seen = generation_of(atomic_load(&pool.claim));
    for (;;) {
        seen = generation_of(wait_for_job(seen));
        if (index <= atomic_load_explicit(&pool.helpers, memory_order_relaxed)) run_chunks();
    }
    return NULL;
}

/* A forked child has the pool's memory but none of its threads: start again. */
static void reset_after_fork(void) {
    pool.workers = 0;
    atomic_store(&pool.sleepers, 0);
    pthread_mutex_init(&pool.caller, NULL);
    pthread_mutex_init(&pool.sleep_lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, reset_after_fork); }

/* Starts workers up to `wanted` (as many as the system allows); returns how many there are. */
static int start_workers(int wanted) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    wanted = wanted < MAX_WORKERS ? wanted : MAX_WORKERS;
    pthread_attr_t attributes;
    pthread_attr_init(&attributes);
    pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
    while (pool.workers < wanted) {
        pthread_t thread;
        if (pthread_create(&thread, &attributes, worker_main, (void *)(intptr_t)(pool.workers + 1)) != 0) break;
        ++pool.workers;
    }
    pthread_attr_destroy(&attributes);
    return pool.workers;
}

static void publish(uint64_t claim) {
    atomic_store(&pool.claim, claim); /* sequentially consistent: a worker going to sleep sees it, or we see it */
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.sleep_lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep_lock);
    }
}

static void wait_until_done(int64_t chunks) {
    const int64_t start = now_ns();
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < chunks) {
        if (now_ns() - start < PAUSE_NS)
            cpu_pause();
        else
            sched_yield(); /* a worker holding a chunk was descheduled: let it run */
    }
}

/* parallel_for with the caller's float mode as it is (see the top of this file). */
static void share_loop(int64_t items, int64_t grain, int threads, parallel_body *body, void *context) {
    grain = grain < 1 ? 1 : grain;
    if ((items + grain - 1) / grain > MAX_CHUNKS) grain = (items + MAX_CHUNKS - 1) / MAX_CHUNKS;
    const int64_t chunks = (items + grain - 1) / grain;
    if (threads <= 1 || chunks == 1 || pthread_mutex_trylock(&pool.caller) != 0) {
        body(context, 0, items); /* nothing to share, or another thread's job holds the pool */
        return;
    }
    const int helpers = start_workers(threads - 1);
    if (helpers == 0) {
        pthread_mutex_unlock(&pool.caller);
        body(context, 0, items);
        return;
    }
    pool.live = (job){body, context, items, grain};
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.helpers, threads - 1 < helpers ? threads - 1 : helpers, memory_order_relaxed);
    const uint64_t generation = (generation_of(atomic_load(&pool.claim)) + 1) & 0xFFFF;
    publish(pack(generation, 0, (uint64_t)chunks));
    run_chunks();
    wait_until_done(chunks);
    pthread_mutex_unlock(&pool.caller);
}

void parallel_for(int64_t items, int64_t grain, int threads, parallel_body *body, void *context) {
    if (items <= 0) return;
    const unsigned mode = flush_subnormals();
    share_loop(items, grain, threads, body, context);
    restore_float_mode(mode);
}
