/* A small thread pool for the decode kernels: workers that stay awake for a bounded time between
 * calls, and share each call's work by stealing chunks.
 *
 * Why not OpenMP's own team: a decode step of a small model is ~120 kernel calls of 20-100 us
 * each, with a few microseconds of Python between them. Under OMP_WAIT_POLICY=PASSIVE (what a
 * shared machine needs, see README "Threads") every `omp parallel` wakes sleeping threads, and
 * waking an idle virtual core costs more than the call: on a 2-core EPYC a step took 32 ms on two
 * threads and 20 ms on one. GOMP_SPINCOUNT keeps the team awake, but OpenMP splits the work
 * statically, so a call waits at its barrier for a thread the OS has descheduled (a co-running
 * process, the HTTP loop, the client): two spinning engines side by side measured 10x slower.
 *
 * This pool fixes both:
 *   - a worker spins for `spin_ns` of wall time after its last chunk (a step's gaps are shorter),
 *     then sleeps on a futex; so between steps, or when the engine idles, it costs nothing;
 *   - a call is cut into chunks that every participant (the caller included) claims with one
 *     compare-and-swap; a worker that is asleep or descheduled simply gets none, and the caller
 *     never waits for work nobody started, only for chunks already claimed.
 *
 * One call runs at a time (a mutex); a call from another thread while one runs executes its chunks
 * inline on that thread. After fork() the child starts its own workers on first use.
 *
 * The caller's thread count is OpenMP's (omp_get_max_threads() on the calling thread, which torch's
 * set_num_threads sets), so `--num-threads` means the same with or without the pool.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef void (*pool_task)(void *ctx, int64_t chunk);

#define MAX_WORKERS 255
#define NEXT_BITS 24 /* state = sequence << NEXT_BITS | next unclaimed chunk */
#define NEXT_MASK ((1ull << NEXT_BITS) - 1)

static struct {
    _Atomic uint64_t state;
    _Atomic uint32_t futex_word; /* bumped at each call; sleeping workers wait on it */
    _Atomic int sleepers;
    /* two job slots: the call being run and the next one, so a worker that is late reads a job
     * that the caller cannot overwrite before that worker's claim fails */
    _Atomic(pool_task) fn[2];
    _Atomic(void *) ctx[2];
    _Atomic int64_t nchunks[2];
    _Atomic int nthreads[2];
    _Atomic int64_t done[2];
    _Atomic int64_t spin_ns;
    int nworkers;
    pid_t owner; /* the process that started the workers (fork: the child starts its own) */
    pthread_mutex_t run_lock, start_lock;
} P = {.spin_ns = 200000, .run_lock = PTHREAD_MUTEX_INITIALIZER, .start_lock = PTHREAD_MUTEX_INITIALIZER};

static atomic_llong calls_pooled, calls_inline, chunks_by_workers;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* claim and run chunks of job `seq` until none are left or the job is no longer current;
 * `rank` 0 is the caller, workers are 1.. (a worker beyond the call's thread count takes none) */
static int64_t run_chunks(uint64_t seq, int rank) {
    const int slot = (int)(seq & 1);
    int64_t ran = 0;
    for (;;) {
        uint64_t st = atomic_load_explicit(&P.state, memory_order_acquire);
        if ((st >> NEXT_BITS) != seq) return ran;
        if (rank >= atomic_load_explicit(&P.nthreads[slot], memory_order_relaxed)) return ran;
        const int64_t next = (int64_t)(st & NEXT_MASK);
        if (next >= atomic_load_explicit(&P.nchunks[slot], memory_order_relaxed)) return ran;
        if (atomic_compare_exchange_weak_explicit(&P.state, &st, st + 1, memory_order_acq_rel,
                                                  memory_order_relaxed)) {
            /* claimed: the job cannot finish (and its slot cannot be reused) before done counts it */
            atomic_load_explicit(&P.fn[slot], memory_order_relaxed)(
                atomic_load_explicit(&P.ctx[slot], memory_order_relaxed), next);
            atomic_fetch_add_explicit(&P.done[slot], 1, memory_order_release);
            ran++;
        }
    }
}

static void *worker_main(void *arg) {
    const int rank = (int)(intptr_t)arg;
    uint64_t seen = atomic_load(&P.state) >> NEXT_BITS;
    for (;;) {
        int64_t t0 = now_ns();
        uint64_t seq;
        for (unsigned i = 1;; i++) {
            seq = atomic_load_explicit(&P.state, memory_order_acquire) >> NEXT_BITS;
            if (seq != seen) break;
            relax();
            if ((i & 63) == 0) sched_yield(); /* another runnable thread on this core goes first */
            if ((i & 63) == 0 && now_ns() - t0 > atomic_load_explicit(&P.spin_ns, memory_order_relaxed)) {
                /* Dekker with pool_run: sleepers++ before re-reading the state; the caller bumps the
                 * futex word before reading sleepers, and FUTEX_WAIT re-checks the word */
                const uint32_t word = atomic_load(&P.futex_word);
                atomic_fetch_add(&P.sleepers, 1);
                if ((atomic_load(&P.state) >> NEXT_BITS) == seen)
                    syscall(SYS_futex, &P.futex_word, FUTEX_WAIT_PRIVATE, word, NULL, NULL, 0);
                atomic_fetch_sub(&P.sleepers, 1);
                t0 = now_ns();
            }
        }
        seen = seq;
        const int64_t ran = run_chunks(seq, rank);
        if (ran) atomic_fetch_add_explicit(&chunks_by_workers, ran, memory_order_relaxed);
    }
    return NULL;
}

/* start workers up to `want` (never fewer than running: they sleep when unused) */
static void ensure_workers(int want) {
    if (want > MAX_WORKERS) want = MAX_WORKERS;
    const pid_t pid = getpid();
    if (P.owner == pid && P.nworkers >= want) return;
    pthread_mutex_lock(&P.start_lock);
    if (P.owner != pid) { /* first use, or a forked child: the parent's workers do not exist here */
        P.owner = pid;
        P.nworkers = 0;
        atomic_store(&P.sleepers, 0);
    }
    while (P.nworkers < want) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 1 << 20);
        const int rc = pthread_create(&th, &attr, worker_main, (void *)(intptr_t)(P.nworkers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break; /* fewer workers: the caller does more chunks itself */
        P.nworkers++;
    }
    pthread_mutex_unlock(&P.start_lock);
}

/* Run fn(ctx, 0..nchunks-1), chunks in any order and on any participant; returns after all ran. */
void phaselab_pool_run(pool_task fn, void *ctx, int64_t nchunks) {
    const int nthreads = omp_get_max_threads();
    if (nchunks <= 0) return;
    if (nchunks == 1 || nthreads <= 1 || (uint64_t)nchunks > NEXT_MASK || pthread_mutex_trylock(&P.run_lock) != 0) {
        atomic_fetch_add_explicit(&calls_inline, 1, memory_order_relaxed);
        for (int64_t c = 0; c < nchunks; c++) fn(ctx, c);
        return;
    }
    ensure_workers(nthreads - 1);
    const uint64_t seq = (atomic_load_explicit(&P.state, memory_order_relaxed) >> NEXT_BITS) + 1;
    const int slot = (int)(seq & 1);
    atomic_store_explicit(&P.fn[slot], fn, memory_order_relaxed);
    atomic_store_explicit(&P.ctx[slot], ctx, memory_order_relaxed);
    atomic_store_explicit(&P.nchunks[slot], nchunks, memory_order_relaxed);
    atomic_store_explicit(&P.nthreads[slot], nthreads, memory_order_relaxed);
    atomic_store_explicit(&P.done[slot], 0, memory_order_relaxed);
    atomic_store_explicit(&P.state, seq << NEXT_BITS, memory_order_seq_cst); /* publishes the slot */
    atomic_fetch_add(&P.futex_word, 1);
    if (atomic_load(&P.sleepers) > 0) syscall(SYS_futex, &P.futex_word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    run_chunks(seq, 0);
    while (atomic_load_explicit(&P.done[slot], memory_order_acquire) < nchunks) relax();
    atomic_fetch_add_explicit(&calls_pooled, 1, memory_order_relaxed);
    pthread_mutex_unlock(&P.run_lock);
}

/* how long a worker stays awake after its last chunk, in microseconds (0: sleep at once) */
void phaselab_pool_set_spin_us(int64_t us) { atomic_store(&P.spin_ns, us < 0 ? 0 : us * 1000); }

/* counters for tests and benchmarks: calls pooled, calls run inline, chunks run by workers,
 * workers started in this process, workers asleep now */
void phaselab_pool_stats(int64_t *out) {
    out[0] = atomic_load(&calls_pooled);
    out[1] = atomic_load(&calls_inline);
    out[2] = atomic_load(&chunks_by_workers);
    out[3] = P.owner == getpid() ? P.nworkers : 0;
    out[4] = atomic_load(&P.sleepers);
}
