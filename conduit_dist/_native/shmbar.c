/* The barrier of shared-memory exchanges (conduit_dist.collectives.shm): a control block that
 * every rank of one host maps, one 64-byte slot per rank, and a futex per slot.
 *
 * Slot r: uint32 seq (offset 0: the last exchange rank r arrived at), uint32 waiters (offset 4:
 * peers sleeping on seq), int64 gen[2] (offsets 8, 16: rank r's file generation for exchanges of
 * each parity), int64 at[2] (offsets 24, 32: when rank r arrived at them, CLOCK_MONOTONIC ns, the
 * clock of Python's time.perf_counter: the exchange completed at the latest rank's). Rank r
 * arriving at exchange k writes gen[k % 2] and at[k % 2], then seq = k (release), and
 * wakes the peers sleeping on its seq. A rank waiting for exchange k needs every peer's seq to
 * have reached k (compared modulo 2^32): it spins briefly, then sleeps on the first missing
 * peer's futex, at most 2 ms at a time, checking between sleeps the deadline and whether the
 * missing peers still live. Liveness: each rank holds a POSIX write lock on byte r of the control
 * file (lock_slot) for as long as its process and its descriptor live; F_GETLK on a peer's byte
 * that finds no lock means the peer exited (this works across PID namespaces, unlike kill(pid, 0)).
 *
 * A peer is at most one exchange ahead of a waiter (it cannot pass exchange k + 1 before the
 * waiter arrives there), so gen[k % 2] is stable while the waiter reads exchange k. The GIL is
 * released while waiting, and taken back every 50 ms to run signal handlers (a KeyboardInterrupt
 * in the main thread ends the wait). Linux only (futex); elsewhere the functions raise. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <time.h>

#include "shmbar.h"

#define SLOT 64
#define SPIN_NS 30000LL      /* spin this long before sleeping (a peer a few us behind) */
#define SLEEP_NS 2000000LL   /* longest single sleep: the deadline and liveness are checked then */
#define SIGNAL_NS 50000000LL /* the GIL is taken back this often to run signal handlers */

#ifdef __linux__
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline uint32_t* seq_of(uintptr_t ctl, long long r) { return (uint32_t*)(ctl + r * SLOT); }
static inline uint32_t* waiters_of(uintptr_t ctl, long long r) {
    return (uint32_t*)(ctl + r * SLOT + 4);
}
static inline int64_t* gen_of(uintptr_t ctl, long long r, int parity) {
    return (int64_t*)(ctl + r * SLOT + 8 + 8 * parity);
}
static inline int64_t* at_of(uintptr_t ctl, long long r, int parity) {
    return (int64_t*)(ctl + r * SLOT + 24 + 8 * parity);
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int reached(uint32_t seq, uint32_t target) { return (int32_t)(seq - target) >= 0; }

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Whether rank r's lock on the control file is held by some process (1), gone (0), or the
 * query failed (-1, errno set). */
static int holds_lock(int fd, long long r) {
    struct flock fl = {0};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = r;
    fl.l_len = 1;
    if (fcntl(fd, F_GETLK, &fl) != 0) return -1;
    return fl.l_type != F_UNLCK;
}

/* shm_lock(fd, rank): take this process's write lock on byte rank of the control file. */
static PyObject* shm_lock(PyObject* self, PyObject* args) {
    int fd;
    long long r;
    if (!PyArg_ParseTuple(args, "iL", &fd, &r)) return NULL;
    struct flock fl = {0};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = r;
    fl.l_len = 1;
    if (fcntl(fd, F_SETLK, &fl) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* shm_arrive(ctl, rank, seq, gen): write gen and the time into this rank's slot for seq's
 * parity, publish seq and wake the peers sleeping on it. */
static PyObject* shm_arrive(PyObject* self, PyObject* args) {
    unsigned long long ctl;
    long long r, gen;
    unsigned long long seq;
    if (!PyArg_ParseTuple(args, "KLKL", &ctl, &r, &seq, &gen)) return NULL;
    if (r < 0) {
        PyErr_Format(PyExc_ValueError, "shm_arrive: expected a rank >= 0, got %lld", r);
        return NULL;
    }
    uint32_t s = (uint32_t)seq;
    __atomic_store_n(gen_of((uintptr_t)ctl, r, (int)(s & 1)), (int64_t)gen, __ATOMIC_RELAXED);
    __atomic_store_n(at_of((uintptr_t)ctl, r, (int)(s & 1)), (int64_t)now_ns(), __ATOMIC_RELAXED);
    __atomic_store_n(seq_of((uintptr_t)ctl, r), s, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(waiters_of((uintptr_t)ctl, r), __ATOMIC_SEQ_CST))
        syscall(SYS_futex, seq_of((uintptr_t)ctl, r), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    Py_RETURN_NONE;
}

/* shm_wait(ctl, world, rank, seq, timeout_s, fd) -> (state, ranks): wait until every rank's seq
 * has reached seq. state 0: all arrived (ranks empty); 1: the timeout passed first (ranks: those
 * missing); 2: missing ranks exited (ranks: those). timeout_s 0 checks once, without waiting. */
static PyObject* shm_wait(PyObject* self, PyObject* args) {
    unsigned long long ctl, seq;
    long long world, me;
    double timeout_s;
    int fd;
    if (!PyArg_ParseTuple(args, "KLLKdi", &ctl, &world, &me, &seq, &timeout_s, &fd)) return NULL;
    if (world < 1 || me < 0 || me >= world || !(timeout_s >= 0)) {
        PyErr_Format(PyExc_ValueError,
                     "shm_wait: expected 0 <= rank < world and timeout_s >= 0, got rank %lld, "
                     "world %lld, timeout_s %g", me, world, timeout_s);
        return NULL;
    }
    uintptr_t base = (uintptr_t)ctl;
    uint32_t target = (uint32_t)seq;
    int state = 0, lock_err = 0;
    long long first = 0; /* ranks below first have arrived */
    if (timeout_s > 1e9) timeout_s = 1e9; /* ~31 years: "never", without overflowing */
    long long start = now_ns(), deadline = start + (long long)(timeout_s * 1e9);
    for (int again = 1; again;) {
        again = 0;
        Py_BEGIN_ALLOW_THREADS
        long long slice_end = now_ns() + SIGNAL_NS;
        for (;;) {
            while (first < world &&
                   (first == me ||
                    reached(__atomic_load_n(seq_of(base, first), __ATOMIC_ACQUIRE), target)))
                first++;
            if (first == world) break;
            long long t = now_ns();
            if (t >= deadline) {
                state = 1;
                break;
            }
            if (t - start < SPIN_NS) {
                relax();
                continue;
            }
            if (t >= slice_end) { /* take the GIL back a moment: Ctrl-C must not wait 60 s */
                again = 1;
                break;
            }
            /* sleep on the first missing peer's seq: woken by its arrival, or after a while */
            uint32_t* w = waiters_of(base, first);
            uint32_t* s = seq_of(base, first);
            __atomic_fetch_add(w, 1, __ATOMIC_SEQ_CST);
            uint32_t seen = __atomic_load_n(s, __ATOMIC_SEQ_CST);
            if (!reached(seen, target)) {
                long long nap = deadline - t < SLEEP_NS ? deadline - t : SLEEP_NS;
                struct timespec ts = {(time_t)(nap / 1000000000LL), (long)(nap % 1000000000LL)};
                syscall(SYS_futex, s, FUTEX_WAIT, seen, &ts, NULL, 0);
            }
            __atomic_fetch_sub(w, 1, __ATOMIC_SEQ_CST);
            if (!reached(__atomic_load_n(s, __ATOMIC_ACQUIRE), target)) {
                int held = holds_lock(fd, first);
                if (held < 0) {
                    lock_err = errno;
                    break;
                }
                /* gone, unless it arrived (and closed) between the two loads */
                if (!held && !reached(__atomic_load_n(s, __ATOMIC_ACQUIRE), target)) {
                    state = 2;
                    break;
                }
            }
        }
        Py_END_ALLOW_THREADS
        if (again && PyErr_CheckSignals()) return NULL; /* e.g. KeyboardInterrupt */
    }
    if (lock_err) {
        errno = lock_err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject* ranks = PyList_New(0);
    if (!ranks) return NULL;
    for (long long p = first; state && p < world; p++) {
        if (p == me || reached(__atomic_load_n(seq_of(base, p), __ATOMIC_ACQUIRE), target))
            continue;
        int held = state == 2 ? holds_lock(fd, p) : 1;
        if (state == 2 && held != 0) continue; /* late, not gone: the exited ones are named */
        PyObject* v = PyLong_FromLongLong(p);
        if (!v || PyList_Append(ranks, v)) {
            Py_XDECREF(v);
            Py_DECREF(ranks);
            return NULL;
        }
        Py_DECREF(v);
    }
    return Py_BuildValue("(iN)", state, ranks);
}

#else /* not Linux */

static PyObject* unsupported(PyObject* self, PyObject* args) {
    PyErr_SetString(PyExc_OSError, "shared-memory exchanges need Linux (futex)");
    return NULL;
}
static PyObject* shm_lock(PyObject* self, PyObject* args) { return unsupported(self, args); }
static PyObject* shm_arrive(PyObject* self, PyObject* args) { return unsupported(self, args); }
static PyObject* shm_wait(PyObject* self, PyObject* args) { return unsupported(self, args); }

#endif

PyMethodDef shmbar_methods[] = {
    {"shm_lock", shm_lock, METH_VARARGS,
     "shm_lock(fd, rank): take this process's write lock on byte rank of the control file."},
    {"shm_arrive", shm_arrive, METH_VARARGS,
     "shm_arrive(ctl, rank, seq, gen): publish this rank's arrival at exchange seq with its file "
     "generation gen; wake the peers waiting for it."},
    {"shm_wait", shm_wait, METH_VARARGS,
     "shm_wait(ctl, world, rank, seq, timeout_s, fd) -> (state, ranks): wait for every rank's "
     "arrival at seq (state 0), or say which ranks are missing at the timeout (1) or exited (2)."},
    {NULL, NULL, 0, NULL}};
