/* Worker threads for the extension's large copies: packing rows, gathering rows and scanning for
 * NaN/inf split a large copy into up to `threads` parts, where the Python side passes
 * torch.get_num_threads(): the extension uses the intra-op budget torch's own copies use (one
 * thread under torchrun's default OMP_NUM_THREADS=1, so no worker ever starts there).
 *
 * A copy is split only from two parts' worth (POOL_COPY, POOL_SCAN in pool.h) up. Waking a
 * sleeping thread costs tens of microseconds on the machines measured, as much as a part takes, so
 * workers poll for the next job for SPIN_NS after each part before they sleep on a condition
 * variable of their own (as OpenMP's workers do; a job wakes only the workers it needs), and the
 * caller polls for its workers' parts likewise.
 *
 * Workers start on first use (at most POOL_MAX; if one cannot be started, no more are tried and
 * the caller runs the parts it has no worker for). One job runs at a time (run_mu): a caller that
 * finds a job running (another Python thread, the GIL released) copies alone rather than wait for
 * it. A job's caller runs part 0, then waits until every part is done, so a worker never sees a
 * job other than the one it was woken for, and the job (on the caller's stack) outlives every
 * access to it. A forked child has none of its parent's threads: pthread_atfork resets the pool
 * there, and its first large copy starts workers of its own. */
#include "pool.h"

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <time.h>

#define POOL_MAX 15                              /* workers: 16 parts at most */
#define SPIN_NS ((int64_t)50000) /* a worker polls this long for the next job before it sleeps */

static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;     /* the fields below */
static pthread_cond_t wake[POOL_MAX + 1];                  /* per worker: a job for it */
static pthread_cond_t done = PTHREAD_COND_INITIALIZER;     /* pending reached 0 */
static size_t workers;                                     /* started */
static unsigned long gen;                                  /* jobs posted */
static pool_fn job_fn;
static void* job_arg;
static size_t job_parts; /* parts workers take: 1 .. job_parts - 1 */
static size_t job_total; /* parts the job is split into (the caller runs the rest) */
static unsigned long born[POOL_MAX + 1]; /* gen when each worker was started: jobs after it */
static size_t pending; /* worker parts of the current job not finished */
static int state;      /* 0: not set up; 1: workers may start; -1: none will (atfork or create) */

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Poll gen (without the lock) for up to SPIN_NS: waking a sleeping thread costs tens of
 * microseconds on the machines measured, as much as a part of a large copy takes. */
static void spin_for_job(unsigned long seen) {
    int64_t until = now_ns() + SPIN_NS;
    while (__atomic_load_n(&gen, __ATOMIC_ACQUIRE) == seen && now_ns() < until)
        for (int k = 0; k < 64; k++) CPU_RELAX();
}

static void* worker(void* p) {
    const size_t me = (size_t)(uintptr_t)p; /* runs part `me` of jobs with more parts */
    int ran = 0;                            /* ran a part of the last job: poll before sleeping */
    pthread_mutex_lock(&mu);
    unsigned long seen = born[me];
    for (;;) {
        if (ran && gen == seen) {
            pthread_mutex_unlock(&mu);
            spin_for_job(seen);
            pthread_mutex_lock(&mu);
        }
        /* a job is posted only once every part of the last one ran: a job that needs this
         * worker is never skipped here, and one that does not is (it was not woken for it) */
        while (gen == seen || me >= job_parts) {
            seen = gen;
            ran = 0;
            pthread_cond_wait(&wake[me], &mu);
        }
        seen = gen;
        ran = 1;
        pool_fn fn = job_fn;
        void* arg = job_arg;
        size_t parts = job_total;
        pthread_mutex_unlock(&mu);
        fn(arg, me, parts);
        pthread_mutex_lock(&mu);
        if (__atomic_sub_fetch(&pending, 1, __ATOMIC_RELEASE) == 0) pthread_cond_signal(&done);
    }
    return NULL;
}

static void init_wake(void) {
    for (size_t w = 0; w <= POOL_MAX; w++) pthread_cond_init(&wake[w], NULL);
}

/* In a forked child (registered only once pthread_atfork succeeded): no workers, every lock
 * free (whatever the parent's threads held), and workers may start again even where a thread
 * start had failed in the parent. */
static void reset_in_child(void) {
    pthread_mutex_init(&run_mu, NULL);
    pthread_mutex_init(&mu, NULL);
    init_wake();
    pthread_cond_init(&done, NULL);
    workers = 0;
    pending = 0;
    state = 1;
}

size_t pool_parts(size_t nbytes, size_t units, long threads, size_t part_bytes) {
    if (threads <= 1 || nbytes < 2 * part_bytes) return 1;
    size_t parts = (size_t)threads;
    if (parts > POOL_MAX + 1) parts = POOL_MAX + 1;
    if (parts > nbytes / part_bytes) parts = nbytes / part_bytes;
    if (parts > units) parts = units; /* a part without a row would only wait */
    return parts < 1 ? 1 : parts;
}

void pool_range(size_t n, size_t part, size_t parts, size_t* lo, size_t* hi) {
    size_t q = n / parts, r = n % parts; /* no n * part: cannot overflow */
    *lo = part * q + (part < r ? part : r);
    *hi = *lo + q + (part < r);
}

size_t pool_workers(void) {
    pthread_mutex_lock(&mu);
    size_t n = workers;
    pthread_mutex_unlock(&mu);
    return n;
}

/* Start workers until `parts - 1` exist (or one cannot be): with every signal blocked, so that
 * signals keep going to the threads that handle them. Called with mu held. */
static void start_workers(size_t parts) {
    if (state == 0) { /* without the child's reset a fork would leave a pool with no threads */
        init_wake();
        state = pthread_atfork(NULL, NULL, reset_in_child) == 0 ? 1 : -1;
    }
    if (state != 1 || workers + 1 >= parts) return;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (workers + 1 < parts) { /* worker w runs part w: 1..parts-1 */
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, (size_t)256 << 10);
        born[workers + 1] = gen;
        int rc = pthread_create(&t, &attr, worker, (void*)(uintptr_t)(workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            state = -1; /* e.g. RLIMIT_NPROC: not retried on every copy */
            break;
        }
        workers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

void pool_run(pool_fn fn, void* arg, size_t parts) {
    if (parts <= 1) {
        fn(arg, 0, 1);
        return;
    }
    if (pthread_mutex_trylock(&run_mu) != 0) { /* another thread's job: copy alone meanwhile */
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&mu);
    start_workers(parts);
    size_t posted = workers + 1 < parts ? workers + 1 : parts; /* parts a worker takes, + 0 */
    job_fn = fn;
    job_arg = arg;
    job_parts = posted;
    job_total = parts;
    pending = posted - 1;
    __atomic_store_n(&gen, gen + 1, __ATOMIC_RELEASE);
    for (size_t w = 1; w < posted; w++) pthread_cond_signal(&wake[w]);
    pthread_mutex_unlock(&mu);
    fn(arg, 0, parts);
    for (size_t p = posted; p < parts; p++) fn(arg, p, parts); /* no worker for these */
    int64_t until = now_ns() + SPIN_NS; /* the workers' parts are as long as this one: poll */
    while (__atomic_load_n(&pending, __ATOMIC_ACQUIRE) && now_ns() < until)
        for (int k = 0; k < 64; k++) CPU_RELAX();
    pthread_mutex_lock(&mu);
    while (pending) pthread_cond_wait(&done, &mu);
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&run_mu);
}
