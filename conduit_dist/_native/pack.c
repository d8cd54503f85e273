/* Row packing for conduit_dist records: copy each field of n items into its aligned column of
 * n contiguous records, one copy per (row, field), with the GIL released, testing float fields for
 * NaN/inf in the same pass. torch's strided copy pays a per-row loop overhead that dominates for
 * small fields; this runs at memcpy speed.
 *
 * The callers pass raw addresses, so every size is checked before any byte is touched: counts and
 * sizes are non-negative, each field (start + size) lies inside the record, and every product of a
 * count and a size fits in a Py_ssize_t (ValueError / OverflowError otherwise). Values are loaded
 * and stored with memcpy, so records and sources need no alignment (compilers turn the fixed-size
 * memcpy into one plain, unaligned-safe load or store). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_FIELDS 256

#include "pool.h"
#include "seq.h"
#include "shmbar.h"

#if defined(__x86_64__) && defined(__GNUC__)
/* an AVX2 clone next to the baseline one, picked at load time by the CPU it runs on */
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* Per float width: OR an exponent-all-ones test (NaN/inf) over m values at a, copying them to b
 * when b is set. Two branch-free loops, so each vectorises. */
#define DEFINE_SCAN(NAME, T)                                                                 \
    static inline int NAME(const uint8_t* restrict a, uint8_t* restrict b, size_t m, T mask) { \
        T any = 0;                                                                           \
        if (b)                                                                               \
            for (size_t j = 0; j < m; j++) {                                                 \
                T v;                                                                         \
                memcpy(&v, a + j * sizeof(T), sizeof(T));                                    \
                any |= (T)((v & mask) == mask);                                              \
                memcpy(b + j * sizeof(T), &v, sizeof(T));                                    \
            }                                                                                \
        else                                                                                 \
            for (size_t j = 0; j < m; j++) {                                                 \
                T v;                                                                         \
                memcpy(&v, a + j * sizeof(T), sizeof(T));                                    \
                any |= (T)((v & mask) == mask);                                              \
            }                                                                                \
        return any != 0;                                                                     \
    }
DEFINE_SCAN(scan16, uint16_t)
DEFINE_SCAN(scan32, uint32_t)
DEFINE_SCAN(scan64, uint64_t)

/* Bytes per value of a float kind (4 = float32, 8 = float64, 2 = float16, 3 = bfloat16), 0 for
 * any other kind. */
static inline int kind_width(long kind) {
    return kind == 2 || kind == 3 ? 2 : kind == 4 || kind == 8 ? (int)kind : 0;
}

/* sz bytes of floats of a kind: 1 if any is NaN/inf; copied to d on the way unless d is NULL.
 * sz is a multiple of the kind's width (checked by the callers). */
static inline int scan(const uint8_t* s, uint8_t* d, size_t sz, int kind) {
    switch (kind) {
        case 4: return scan32(s, d, sz / 4, 0x7f800000u);
        case 8: return scan64(s, d, sz / 8, 0x7ff0000000000000ull);
        case 2: return scan16(s, d, sz / 2, 0x7c00u);
        default: return scan16(s, d, sz / 2, 0x7f80u);
    }
}

/* Copy one field of one item; for a float kind (non-zero), also report NaN/inf in the same pass. */
static inline int copy_field(uint8_t* restrict d, const uint8_t* restrict s, size_t sz, int kind) {
    if (kind) return scan(s, d, sz, kind);
    switch (sz) { /* scalars: single loads and stores instead of a libc call */
        case 8: memcpy(d, s, 8); break;
        case 4: memcpy(d, s, 4); break;
        case 2: memcpy(d, s, 2); break;
        case 1: *d = *s; break;
        default: memcpy(d, s, sz);
    }
    return 0;
}

CLONES
static void pack_impl(uint8_t* out, size_t row_bytes, size_t n, Py_ssize_t nf,
                      uint8_t* const* src, const size_t* size, const size_t* off,
                      const int* kind, int* bad) {
    /* row by row, so each record's cache lines are written once */
    for (size_t i = 0; i < n; i++) {
        uint8_t* row = out + i * row_bytes;
        for (Py_ssize_t f = 0; f < nf; f++)
            bad[f] |= copy_field(row + off[f], src[f] + i * size[f], size[f], kind[f]);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_NT 1
/* A pack whose destination is larger than this writes with non-temporal stores: it cannot stay in
 * any cache (twice the 32 MiB L3 of the machines measured), and skipping the read-for-ownership
 * of every destination line made packing 3,470 Atari-like items (196 MB) ~20% faster here
 * (0.84-0.87x a plain torch copy_ of the same bytes, against 0.98-1.11x). Smaller
 * packs (staging reused every round, a ring slot range) may be cache-hot: plain stores. */
#define NT_MIN_BYTES ((size_t)64 << 20)

/* Write one field as whole 8-byte words (the record layout pads every field to 8 bytes). */
static inline void nt_field(uint8_t* d, const uint8_t* s, size_t sz) {
    size_t w = 0;
    for (; w + 8 <= sz; w += 8) {
        long long v;
        memcpy(&v, s + w, 8);
        _mm_stream_si64((long long*)(d + w), v);
    }
    if (w < sz) {
        long long v = 0;
        memcpy(&v, s + w, sz - w);
        _mm_stream_si64((long long*)(d + w), v);
    }
}

/* Whether every field starts on an 8-byte boundary and no two share a word (the layout
 * ExperienceSpec makes), with rows and the destination 8-byte aligned: what nt_field needs. */
static int nt_layout(uintptr_t dst, size_t row_bytes, Py_ssize_t nf, const size_t* size,
                     const size_t* off) {
    if ((dst | row_bytes) & 7) return 0;
    for (Py_ssize_t f = 0; f < nf; f++) {
        size_t end = (off[f] + size[f] + 7) & ~(size_t)7;
        if ((off[f] & 7) || end > row_bytes) return 0;
        for (Py_ssize_t g = 0; g < nf; g++)
            if (g != f && off[g] >= off[f] && off[g] < end) return 0;
    }
    return 1;
}

CLONES
static void pack_nt(uint8_t* out, size_t row_bytes, size_t n, Py_ssize_t nf,
                    uint8_t* const* src, const size_t* size, const size_t* off, const int* kind,
                    int* bad) {
    for (size_t i = 0; i < n; i++) {
        uint8_t* row = out + i * row_bytes;
        for (Py_ssize_t f = 0; f < nf; f++) {
            const uint8_t* s = src[f] + i * size[f];
            if (kind[f]) bad[f] |= scan(s, NULL, size[f], kind[f]);
            nt_field(row + off[f], s, size[f]);
        }
    }
    _mm_sfence();
}
#endif

/* A pack split by rows over pool workers: part p packs its rows (pool_range) and ORs its NaN/inf
 * flags into bad[] (each part keeps its own, merged atomically). */
typedef struct {
    uint8_t* out;
    size_t row_bytes, n;
    Py_ssize_t nf;
    uint8_t* const* src;
    const size_t *size, *off;
    const int* kind;
    int* bad;
    int nt;
} PackJob;

static void pack_part(void* arg, size_t part, size_t parts) {
    const PackJob* j = arg;
    size_t lo, hi;
    pool_range(j->n, part, parts, &lo, &hi);
    uint8_t* src[MAX_FIELDS];
    int bad[MAX_FIELDS] = {0};
    for (Py_ssize_t f = 0; f < j->nf; f++) src[f] = j->src[f] + lo * j->size[f];
#ifdef HAVE_NT
    if (j->nt)
        pack_nt(j->out + lo * j->row_bytes, j->row_bytes, hi - lo, j->nf, src, j->size, j->off,
                j->kind, bad);
    else
#endif
        pack_impl(j->out + lo * j->row_bytes, j->row_bytes, hi - lo, j->nf, src, j->size, j->off,
                  j->kind, bad);
    for (Py_ssize_t f = 0; f < j->nf; f++)
        if (bad[f]) __atomic_fetch_or(&j->bad[f], 1, __ATOMIC_RELAXED);
}

/* Check that n items of `width` bytes span at most PY_SSIZE_T_MAX bytes (both already >= 0).
 * Returns 0, or -1 with OverflowError set. */
static int check_span(const char* fn, const char* what, long long n, long long width) {
    if (width != 0 && n > PY_SSIZE_T_MAX / width) {
        PyErr_Format(PyExc_OverflowError, "%s: %lld items of %lld bytes (%s) overflow the address "
                     "space", fn, n, width, what);
        return -1;
    }
    return 0;
}

/* Check the record count and size: row_bytes > 0, n >= 0, n * row_bytes in range. */
static int check_rows(const char* fn, long long row_bytes, long long n) {
    if (row_bytes <= 0 || n < 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected row_bytes > 0 and n >= 0, got row_bytes=%lld, "
                     "n=%lld", fn, row_bytes, n);
        return -1;
    }
    return check_span(fn, "records", n, row_bytes);
}

/* Read the field layout (sizes, offsets, kinds: tuples of nf ints) into arrays, checking that
 * every field lies inside a row_bytes record, every kind is 0, 2, 3, 4 or 8 and a float field's
 * size is a whole number of its values. Returns 0, or -1 with a Python error set (prefixed by the
 * calling function's name). */
static int parse_fields(const char* fn, long long row_bytes, PyObject* sizes, PyObject* offsets,
                        PyObject* kinds, Py_ssize_t nf, size_t* size, size_t* off, int* kind) {
    if (nf > MAX_FIELDS || PyTuple_GET_SIZE(sizes) != nf || PyTuple_GET_SIZE(offsets) != nf ||
        PyTuple_GET_SIZE(kinds) != nf) {
        PyErr_Format(PyExc_ValueError, "%s: the field tuples must have equal length <= %d", fn,
                     MAX_FIELDS);
        return -1;
    }
    for (Py_ssize_t f = 0; f < nf; f++) {
        long long sz = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, f));
        long long start = PyLong_AsLongLong(PyTuple_GET_ITEM(offsets, f));
        long k = PyLong_AsLong(PyTuple_GET_ITEM(kinds, f));
        if (PyErr_Occurred()) return -1;
        /* start <= row_bytes first, so row_bytes - start cannot overflow */
        if (sz < 0 || start < 0 || start > row_bytes || sz > row_bytes - start) {
            PyErr_Format(PyExc_ValueError, "%s: field %zd (start %lld, size %lld) does not fit in "
                         "a record of %lld bytes", fn, f, start, sz, row_bytes);
            return -1;
        }
        if (k != 0 && (kind_width(k) == 0 || sz % kind_width(k) != 0)) {
            PyErr_Format(PyExc_ValueError, "%s: field %zd: kind must be 0, 2, 3, 4 or 8 and its "
                         "size a multiple of the kind's width, got kind %ld, size %lld", fn, f, k,
                         sz);
            return -1;
        }
        size[f] = (size_t)sz;
        off[f] = (size_t)start;
        kind[f] = (int)k;
    }
    return 0;
}

/* The index of the first field flagged in bad[], or -1. */
static PyObject* first_bad(const int* bad, Py_ssize_t nf) {
    for (Py_ssize_t f = 0; f < nf; f++)
        if (bad[f]) return PyLong_FromSsize_t(f);
    return PyLong_FromLong(-1);
}

/* pack_rows(dst, row_bytes, n, srcs, sizes, offsets, kinds[, threads]) -> index of the first
 * field holding NaN/inf among those with a float kind (2, 3, 4, 8; 0 = not checked), or -1.
 * Packs from 4 MiB are split by rows over up to `threads` threads (pool.c). Non-temporal stores
 * are used only above NT_MIN_BYTES: into cold ring slots of smaller packs they were slower here
 * than plain stores, for both record sizes. */
static PyObject* pack_rows(PyObject* self, PyObject* args) {
    unsigned long long dst;
    long long row_bytes, n;
    long threads = 1;
    PyObject *srcs, *sizes, *offsets, *kinds;
    if (!PyArg_ParseTuple(args, "KLLO!O!O!O!|l", &dst, &row_bytes, &n, &PyTuple_Type, &srcs,
                          &PyTuple_Type, &sizes, &PyTuple_Type, &offsets, &PyTuple_Type, &kinds,
                          &threads))
        return NULL;
    Py_ssize_t nf = PyTuple_GET_SIZE(srcs);
    uint8_t* src[MAX_FIELDS];
    size_t size[MAX_FIELDS], off[MAX_FIELDS];
    int kind[MAX_FIELDS], bad[MAX_FIELDS] = {0};
    if (check_rows("pack_rows", row_bytes, n) ||
        parse_fields("pack_rows", row_bytes, sizes, offsets, kinds, nf, size, off, kind))
        return NULL;
    /* each source spans n * size[f] <= n * row_bytes bytes: in range too */
    for (Py_ssize_t f = 0; f < nf; f++)
        src[f] = (uint8_t*)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(srcs, f));
    if (PyErr_Occurred()) return NULL;
    PackJob job = {(uint8_t*)(uintptr_t)dst, (size_t)row_bytes, (size_t)n, nf, src, size, off,
                   kind, bad, 0};
#ifdef HAVE_NT
    job.nt = (size_t)n * (size_t)row_bytes >= NT_MIN_BYTES &&
             nt_layout((uintptr_t)dst, (size_t)row_bytes, nf, size, off);
#endif
    Py_BEGIN_ALLOW_THREADS
    pool_run(pack_part, &job,
             pool_parts((size_t)n * (size_t)row_bytes, (size_t)n, threads, POOL_COPY));
    Py_END_ALLOW_THREADS
    return first_bad(bad, nf);
}

CLONES
static int any_impl(const uint8_t* p, size_t nbytes, int kind) { return scan(p, NULL, nbytes, kind); }

/* A scan split over pool workers: part p scans its values (pool_range). */
typedef struct {
    const uint8_t* p;
    size_t m;
    int width, kind, any;
} ScanJob;

static void scan_part(void* arg, size_t part, size_t parts) {
    ScanJob* j = arg;
    size_t lo, hi;
    pool_range(j->m, part, parts, &lo, &hi);
    if (any_impl(j->p + lo * (size_t)j->width, (hi - lo) * (size_t)j->width, j->kind))
        __atomic_fetch_or(&j->any, 1, __ATOMIC_RELAXED);
}

/* any_nonfinite(addr, n, kind[, threads]): whether any of n contiguous floats of a kind is
 * NaN/inf. */
static PyObject* any_nonfinite(PyObject* self, PyObject* args) {
    unsigned long long addr;
    long long n;
    int kind;
    long threads = 1;
    if (!PyArg_ParseTuple(args, "KLi|l", &addr, &n, &kind, &threads)) return NULL;
    const int width = kind_width(kind);
    if (width == 0 || n < 0) {
        PyErr_Format(PyExc_ValueError, "any_nonfinite: expected kind 2, 3, 4 or 8 and n >= 0, got "
                     "kind %d, n %lld", kind, n);
        return NULL;
    }
    if (check_span("any_nonfinite", "floats", n, width)) return NULL;
    ScanJob job = {(const uint8_t*)(uintptr_t)addr, (size_t)n, width, kind, 0};
    Py_BEGIN_ALLOW_THREADS
    pool_run(scan_part, &job,
             pool_parts((size_t)n * (size_t)width, (size_t)n, threads, POOL_SCAN));
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(job.any);
}

CLONES
static void rows_impl(const uint8_t* rows, size_t row_bytes, size_t n, Py_ssize_t nf,
                      const size_t* size, const size_t* off, const int* kind, int* bad) {
    for (size_t i = 0; i < n; i++) {
        const uint8_t* row = rows + i * row_bytes;
        for (Py_ssize_t f = 0; f < nf; f++)
            if (kind[f]) bad[f] |= scan(row + off[f], NULL, size[f], kind[f]);
    }
}

/* rows_nonfinite(addr, row_bytes, n, sizes, offsets, kinds): scan the float fields (kind 2, 3, 4,
 * 8; 0 = skip) of n records in place; the index of the first field holding NaN/inf, or -1. */
static PyObject* rows_nonfinite(PyObject* self, PyObject* args) {
    unsigned long long addr;
    long long row_bytes, n;
    PyObject *sizes, *offsets, *kinds;
    if (!PyArg_ParseTuple(args, "KLLO!O!O!", &addr, &row_bytes, &n, &PyTuple_Type, &sizes,
                          &PyTuple_Type, &offsets, &PyTuple_Type, &kinds))
        return NULL;
    Py_ssize_t nf = PyTuple_GET_SIZE(sizes);
    size_t size[MAX_FIELDS], off[MAX_FIELDS];
    int kind[MAX_FIELDS], bad[MAX_FIELDS] = {0};
    if (check_rows("rows_nonfinite", row_bytes, n) ||
        parse_fields("rows_nonfinite", row_bytes, sizes, offsets, kinds, nf, size, off, kind))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rows_impl((const uint8_t*)(uintptr_t)addr, (size_t)row_bytes, (size_t)n, nf, size, off, kind,
              bad);
    Py_END_ALLOW_THREADS
    return first_bad(bad, nf);
}

/* Copy rows idx[lo..hi) of src into rows lo..hi of dst, prefetching a few rows ahead: random
 * rows of a large store miss the caches, and overlapping those misses is what makes a gather
 * fast. With base >= 0, idx holds generations of a ring of src_rows slots (see gather_rows).
 * Every index was checked by gather_check first. */
#define PREFETCH_AHEAD 8
typedef struct {
    uint8_t* dst;
    const uint8_t* src;
    size_t row_bytes, src_rows, n;
    const int64_t* idx;
    int64_t base;
} GatherJob;

/* Row i's slot: its index, or its generation less base, wrapped once (checked: gather_check). */
static inline int64_t gather_slot(const GatherJob* j, size_t i) {
    int64_t k = j->idx[i];
    if (j->base >= 0) {
        k -= j->base;
        if (k >= (int64_t)j->src_rows) k -= (int64_t)j->src_rows;
    }
    return k;
}

static void gather_part(void* arg, size_t part, size_t parts) {
    const GatherJob* j = arg;
    size_t lo, hi;
    pool_range(j->n, part, parts, &lo, &hi);
    for (size_t i = lo; i < hi; i++) {
#if defined(__GNUC__)
        if (i + PREFETCH_AHEAD < hi) {
            size_t ahead_slot = (size_t)gather_slot(j, i + PREFETCH_AHEAD);
            const uint8_t* ahead = j->src + ahead_slot * j->row_bytes;
            for (size_t b = 0; b < j->row_bytes; b += 64) __builtin_prefetch(ahead + b, 0, 0);
        }
#endif
        memcpy(j->dst + i * j->row_bytes, j->src + (size_t)gather_slot(j, i) * j->row_bytes,
               j->row_bytes);
    }
}

/* The position of the first index whose slot falls outside [0, src_rows), or -1. */
static long long gather_check(const GatherJob* j) {
    for (size_t i = 0; i < j->n; i++) {
        int64_t k = gather_slot(j, i);
        if (k < 0 || k >= (int64_t)j->src_rows) return (long long)i;
    }
    return -1;
}

/* unpack_rows(src, row_bytes, stride, n, dsts, sizes, offsets, kinds): copy field f (size[f]
 * bytes at offset[f] of each of n rows of row_bytes, rows stride bytes apart) into contiguous
 * dsts[f] (n * size[f] bytes): the opposite of pack_rows, one call for a batch's fields where a
 * torch copy per field costs a few microseconds. kinds are parsed as pack_rows's (not checked). */
static PyObject* unpack_rows(PyObject* self, PyObject* args) {
    unsigned long long src;
    long long row_bytes, stride, n;
    PyObject *dsts, *sizes, *offsets, *kinds;
    if (!PyArg_ParseTuple(args, "KLLLO!O!O!O!", &src, &row_bytes, &stride, &n, &PyTuple_Type,
                          &dsts, &PyTuple_Type, &sizes, &PyTuple_Type, &offsets, &PyTuple_Type,
                          &kinds))
        return NULL;
    Py_ssize_t nf = PyTuple_GET_SIZE(dsts);
    uint8_t* dst[MAX_FIELDS];
    size_t size[MAX_FIELDS], off[MAX_FIELDS];
    int kind[MAX_FIELDS];
    if (check_rows("unpack_rows", row_bytes, n) || check_span("unpack_rows", "rows", n, stride) ||
        parse_fields("unpack_rows", row_bytes, sizes, offsets, kinds, nf, size, off, kind))
        return NULL;
    if (stride < row_bytes) {
        PyErr_Format(PyExc_ValueError, "unpack_rows: expected stride >= row_bytes, got stride "
                     "%lld, row_bytes %lld", stride, row_bytes);
        return NULL;
    }
    for (Py_ssize_t f = 0; f < nf; f++)
        dst[f] = (uint8_t*)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(dsts, f));
    if (PyErr_Occurred()) return NULL;
    const uint8_t* base = (const uint8_t*)(uintptr_t)src;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t f = 0; f < nf; f++) /* field by field: each destination written in order */
        for (long long i = 0; i < n; i++)
            memcpy(dst[f] + (size_t)i * size[f], base + (size_t)i * (size_t)stride + off[f], size[f]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* copy_spans((dst, src, n, dst, src, n, ...)): memcpy each span of n >= 0 bytes, in order (the
 * caller checked every address against its buffer); every span is parsed before any byte is
 * copied; the GIL is released above 64 KiB in all. One call for the copies of an exchange (one
 * per peer), where torch's slicing and copy_ cost ~4 us each. */
static PyObject* copy_spans(PyObject* self, PyObject* args) {
    PyObject* spans;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &spans)) return NULL;
    Py_ssize_t k = PyTuple_GET_SIZE(spans);
    if (k % 3) {
        PyErr_Format(PyExc_ValueError, "copy_spans: expected (dst, src, n) triples, got %zd "
                     "values", k);
        return NULL;
    }
    Py_ssize_t m = k / 3;
    /* at least one element: PyMem_Malloc(0) may return NULL */
    uintptr_t* span = PyMem_Malloc((size_t)(3 * m + 1) * sizeof(uintptr_t));
    if (!span) return PyErr_NoMemory();
    size_t total = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        span[3 * i] = (uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(spans, 3 * i));
        span[3 * i + 1] = (uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(spans, 3 * i + 1));
        long long n = PyLong_AsLongLong(PyTuple_GET_ITEM(spans, 3 * i + 2));
        if (PyErr_Occurred()) {
            PyMem_Free(span);
            return NULL;
        }
        if (n < 0) {
            PyErr_Format(PyExc_ValueError, "copy_spans: span %zd has %lld bytes, expected >= 0",
                         i, n);
            PyMem_Free(span);
            return NULL;
        }
        span[3 * i + 2] = (uintptr_t)n;
        total += (size_t)n;
    }
    PyThreadState* saved = total >= 65536 ? PyEval_SaveThread() : NULL; /* GIL off if large */
    for (Py_ssize_t i = 0; i < m; i++)
        memcpy((void*)span[3 * i], (const void*)span[3 * i + 1], (size_t)span[3 * i + 2]);
    if (saved) PyEval_RestoreThread(saved);
    PyMem_Free(span);
    Py_RETURN_NONE;
}

/* mean2_f32(dst, src, n): dst[i] = (dst[i] + src[i]) * 0.5f for n float32 values, in place: the
 * mean of two learners' payloads, bitwise what torch's add_ then mul_ by 0.5 give (IEEE single
 * addition commutes, so both learners get the same bits). dst must be 4-byte aligned; src may be
 * unaligned (a payload inside received rows). The two ranges must not overlap. The GIL is released
 * above 64 KiB. */
static PyObject* mean2_f32(PyObject* self, PyObject* args) {
    unsigned long long dst, src;
    long long n;
    if (!PyArg_ParseTuple(args, "KKL", &dst, &src, &n)) return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "mean2_f32: expected n >= 0 values, got %lld", n);
        return NULL;
    }
    /* dst: a float32 tensor's data, 4-byte aligned (check_payload refuses any other); src is read
     * with memcpy (any alignment). restrict: the two never overlap (the loop vectorises) */
    float* restrict d = (float*)(uintptr_t)dst;
    const unsigned char* restrict s = (const unsigned char*)(uintptr_t)src;
    PyThreadState* saved = n >= 16384 ? PyEval_SaveThread() : NULL;
    for (long long i = 0; i < n; i++) {
        float v;
        memcpy(&v, s + 4 * i, 4);
        d[i] = (d[i] + v) * 0.5f;
    }
    if (saved) PyEval_RestoreThread(saved);
    Py_RETURN_NONE;
}

/* gather_rows(dst, src, row_bytes, src_rows, idx, n[, base[, threads]]): dst[i] = src[idx[i]]
 * for n int64 indices; with base >= 0, idx holds generations of a ring of src_rows slots and
 * dst[i] = src[idx[i] - base], less src_rows when that passes the end (base: the first
 * generation of the lap the oldest live item is in, so every live generation is within
 * [base, base + 2 * src_rows): no division per row). IndexError naming the first index whose
 * slot falls outside [0, src_rows); nothing is copied then. */
static PyObject* gather_rows(PyObject* self, PyObject* args) {
    unsigned long long dst, src, idx;
    long long row_bytes, src_rows, n, base = -1, bad;
    long threads = 1;
    if (!PyArg_ParseTuple(args, "KKLLKL|Ll", &dst, &src, &row_bytes, &src_rows, &idx, &n, &base,
                          &threads))
        return NULL;
    if (check_rows("gather_rows", row_bytes, n) || check_rows("gather_rows", row_bytes, src_rows))
        return NULL;
    if (src_rows < 1 && n > 0) {
        PyErr_Format(PyExc_IndexError, "gather_rows: %lld indices into 0 rows", n);
        return NULL;
    }
    GatherJob job = {(uint8_t*)(uintptr_t)dst, (const uint8_t*)(uintptr_t)src, (size_t)row_bytes,
                     (size_t)src_rows, (size_t)n, (const int64_t*)(uintptr_t)idx, base};
    Py_BEGIN_ALLOW_THREADS
    bad = gather_check(&job);
    if (bad < 0)
        pool_run(gather_part, &job,
                 pool_parts((size_t)n * (size_t)row_bytes, (size_t)n, threads, POOL_COPY));
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "gather_rows: index %lld at position %lld is outside the "
                     "%lld rows", (long long)job.idx[bad], bad, src_rows);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* splitmix64: the mixing step sampling/base.py's mix() uses, and the stream of uniform_slots */
static inline uint64_t splitmix_step(uint64_t h, uint64_t k) {
    h = (h ^ k) * 0xBF58476D1CE4E5B9ULL;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBULL;
    return h ^ (h >> 31);
}

/* uniform_slots(out, n, size, seed, round, rank[, offset]): n int64 values offset + [0, size)
 * uniform, from a splitmix64 stream keyed by (seed, round, rank) -- the same on every process and
 * run. Values use the multiply-shift reduction (bias below size / 2**64). */
static PyObject* uniform_slots(PyObject* self, PyObject* args) {
    unsigned long long out, seed, round, rank;
    long long n, size, offset = 0;
    if (!PyArg_ParseTuple(args, "KLLKKK|L", &out, &n, &size, &seed, &round, &rank, &offset))
        return NULL;
    if (n < 0 || size < 1) {
        PyErr_Format(PyExc_ValueError, "uniform_slots: expected n >= 0 and size >= 1, got n=%lld, "
                     "size=%lld", n, size);
        return NULL;
    }
    if (check_span("uniform_slots", "slots", n, 8)) return NULL;
    uint64_t h = 0x9E3779B97F4A7C15ULL;
    h = splitmix_step(splitmix_step(splitmix_step(h, seed), round), rank);
    int64_t* o = (int64_t*)(uintptr_t)out;
    for (long long i = 0; i < n; i++) {
        h += 0x9E3779B97F4A7C15ULL;
        uint64_t z = splitmix_step(h, 0);
        o[i] = offset + (int64_t)(((unsigned __int128)z * (uint64_t)size) >> 64);
    }
    Py_RETURN_NONE;
}

/* uniform_alloc(counts, world, ends, requests, seed, round, key): for each learner l with
 * requests[l] > 0, draw requests[l] items uniform over [0, ends[world-1]) from the stream
 * (seed, round, key + l) and count each in the shard whose cumulative-size interval holds it:
 * counts[l * world + s] (int64, zeroed here). ends are the shards' cumulative sizes. */
/* (The comment above is uniform_alloc's.) The arguments both allocations share (counts, world,
 * cumulative, requests, seed, round, key), checked, with counts zeroed. */
typedef struct {
    int64_t* c;
    long long world;
    const void* cum;
    const int64_t* req;
    uint64_t seed, round, key;
} AllocArgs;

static int alloc_args(PyObject* args, const char* fn, AllocArgs* a) {
    unsigned long long counts, cum_p, req_p;
    if (!PyArg_ParseTuple(args, "KLKKKKK", &counts, &a->world, &cum_p, &req_p, &a->seed, &a->round,
                          &a->key))
        return -1;
    if (a->world < 1) {
        PyErr_Format(PyExc_ValueError, "%s: expected world >= 1, got %lld", fn, a->world);
        return -1;
    }
    a->c = (int64_t*)(uintptr_t)counts;
    a->cum = (const void*)(uintptr_t)cum_p;
    a->req = (const int64_t*)(uintptr_t)req_p;
    memset(a->c, 0, (size_t)(a->world * a->world) * sizeof(int64_t));
    return 0;
}

static inline uint64_t alloc_stream(const AllocArgs* a, long long l) {
    uint64_t h = 0x9E3779B97F4A7C15ULL;
    return splitmix_step(splitmix_step(splitmix_step(h, a->seed), a->round), a->key + (uint64_t)l);
}

static PyObject* uniform_alloc(PyObject* self, PyObject* args) {
    AllocArgs a;
    if (alloc_args(args, "uniform_alloc", &a)) return NULL;
    const int64_t* ends = (const int64_t*)a.cum;
    long long world = a.world;
    int64_t total = ends[world - 1];
    if (total < 1) Py_RETURN_NONE;
    for (long long l = 0; l < world; l++) {
        if (a.req[l] <= 0) continue;
        uint64_t h = alloc_stream(&a, l);
        int64_t* row = a.c + l * world;
        for (int64_t i = 0; i < a.req[l]; i++) {
            h += 0x9E3779B97F4A7C15ULL;
            uint64_t z = splitmix_step(h, 0);
            int64_t item = (int64_t)(((unsigned __int128)z * (uint64_t)total) >> 64);
            long long lo = 0, hi = world - 1; /* first shard whose end exceeds item */
            while (lo < hi) {
                long long mid = (lo + hi) / 2;
                if (ends[mid] > item) hi = mid; else lo = mid + 1;
            }
            row[lo]++;
        }
    }
    Py_RETURN_NONE;
}


/* Sum and min trees with fan-out 8 (one cache line of children per node): level 0 holds the
 * leaves, level d + 1 one node per 8 of level d, the last level (H) the root alone; each level
 * starts at offs[d] in one float64 array and is padded to a multiple of 8 (padding 0 in the sum
 * tree, +inf in the min tree). A dead leaf has sum 0 and min +inf. */
#define FAN 8

/* Recompute the ancestors of leaves i[0..g_n), level by level across the group (its cache
 * misses overlap; a shared ancestor is recomputed after all of its changed children). */
static inline void tree_fix(double* s, double* m, const int64_t* offs, long long H, int64_t* i,
                            int g_n) {
    for (long long d = 1; d <= H; d++) {
        for (int g = 0; g < g_n; g++) {
            int64_t j = i[g] / FAN;
            const double* cs = s + offs[d - 1] + j * FAN;
            const double* cm = m + offs[d - 1] + j * FAN;
            double sum = 0.0, mn = INFINITY;
            for (int c = 0; c < FAN; c++) {
                sum += cs[c];
                if (cm[c] < mn) mn = cm[c];
            }
            s[offs[d] + j] = sum;
            m[offs[d] + j] = mn;
            i[g] = j;
            if (d < H) {
                __builtin_prefetch(s + offs[d] + (j / FAN) * FAN);
                __builtin_prefetch(m + offs[d] + (j / FAN) * FAN);
            }
        }
    }
}

enum { FIX_GROUP = 16 };

/* Leaf idx[i] := val[i], or := value for every i where val is NULL; then the ancestors. */
static PyObject* tree_assign(const char* what, unsigned long long sum_p, unsigned long long min_p,
                             unsigned long long offs_p, long long H, unsigned long long idx_p,
                             const double* val, double value, long long n) {
    double* s = (double*)(uintptr_t)sum_p;
    double* m = (double*)(uintptr_t)min_p;
    const int64_t* offs = (const int64_t*)(uintptr_t)offs_p;
    const int64_t* idx = (const int64_t*)(uintptr_t)idx_p;
    int64_t leaves = H > 0 ? offs[1] : 1;
    for (long long i = 0; i < n; i++) {
        if (idx[i] < 0 || idx[i] >= leaves) {
            PyErr_Format(PyExc_IndexError, "%s: leaf %lld outside [0, %lld)", what,
                         (long long)idx[i], (long long)leaves);
            return NULL;
        }
    }
    int64_t group[FIX_GROUP];
    for (long long at = 0; at < n; at += FIX_GROUP) {
        int g_n = n - at < FIX_GROUP ? (int)(n - at) : FIX_GROUP;
        for (int g = 0; g < g_n; g++) {
            int64_t k = idx[at + g];
            double v = val ? val[at + g] : value;
            s[k] = v;
            m[k] = v > 0 ? v : INFINITY;
            group[g] = k;
        }
        tree_fix(s, m, offs, H, group, g_n);
    }
    Py_RETURN_NONE;
}

/* tree_set(sum, min, offs, H, idx, val, n): leaf idx[i] := val[i] (float64 >= 0), in order (the
 * last of duplicates wins), then its ancestors are recomputed. Leaves must be < offs[1]. */
static PyObject* tree_set(PyObject* self, PyObject* args) {
    unsigned long long sum_p, min_p, offs_p, idx_p, val_p;
    long long H, n;
    if (!PyArg_ParseTuple(args, "KKKLKKL", &sum_p, &min_p, &offs_p, &H, &idx_p, &val_p, &n))
        return NULL;
    return tree_assign("tree_set", sum_p, min_p, offs_p, H, idx_p,
                       (const double*)(uintptr_t)val_p, 0.0, n);
}

/* tree_fill(sum, min, offs, H, idx, n, value): every leaf idx[i] := value (float64 >= 0): what
 * tree_set does with one value, without a buffer of it. */
static PyObject* tree_fill(PyObject* self, PyObject* args) {
    unsigned long long sum_p, min_p, offs_p, idx_p;
    long long H, n;
    double value;
    if (!PyArg_ParseTuple(args, "KKKLKLd", &sum_p, &min_p, &offs_p, &H, &idx_p, &n, &value))
        return NULL;
    if (!(value >= 0) || isinf(value)) { /* PyErr_Format has no %g */
        char got[64];
        snprintf(got, sizeof got, "%g", value);
        PyErr_Format(PyExc_ValueError, "tree_fill: expected a finite value >= 0, got %s", got);
        return NULL;
    }
    return tree_assign("tree_fill", sum_p, min_p, offs_p, H, idx_p, NULL, value, n);
}

/* tree_sample(sum, offs, H, n, seed, round, key, out, mass[, gen]): n leaves drawn i.i.d. with
 * probability leaf / root, from the splitmix64 stream (seed, round, key); their indices (int64;
 * with gen, the generations gen[leaf] they hold) into out and their values (float64) into mass. The descent never enters a child of zero mass,
 * so rounding cannot land on a dead leaf. The root must be > 0. */
static PyObject* tree_sample(PyObject* self, PyObject* args) {
    unsigned long long sum_p, offs_p, seed, round, key, out_p, mass_p, gen_p = 0;
    long long H, n;
    if (!PyArg_ParseTuple(args, "KKLLKKKKK|K", &sum_p, &offs_p, &H, &n, &seed, &round, &key,
                          &out_p, &mass_p, &gen_p))
        return NULL;
    const int64_t* gen = (const int64_t*)(uintptr_t)gen_p; /* optional: leaf -> generation */
    const double* s = (const double*)(uintptr_t)sum_p;
    const int64_t* offs = (const int64_t*)(uintptr_t)offs_p;
    double total = s[offs[H]];
    if (n < 0 || !(total > 0)) {
        char msg[160];
        snprintf(msg, sizeof msg, "tree_sample: expected n >= 0 and a positive total, got n=%lld, "
                 "total=%g", n, total);
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    int64_t* out = (int64_t*)(uintptr_t)out_p;
    double* mass = (double*)(uintptr_t)mass_p;
    uint64_t h = 0x9E3779B97F4A7C15ULL;
    h = splitmix_step(splitmix_step(splitmix_step(h, seed), round), key);
    /* draws descend in groups, level by level, each prefetching its next line: the cache
     * misses of a group overlap instead of queueing one behind the other */
    enum { GROUP = 16 };
    double u[GROUP];
    int64_t j[GROUP];
    for (long long at = 0; at < n; at += GROUP) {
        int g_n = n - at < GROUP ? (int)(n - at) : GROUP;
        for (int g = 0; g < g_n; g++) {
            h += 0x9E3779B97F4A7C15ULL;
            u[g] = (double)(splitmix_step(h, 0) >> 11) * 0x1.0p-53 * total;
            j[g] = 0;
        }
        for (long long d = H - 1; d >= 0; d--) {
            for (int g = 0; g < g_n; g++) {
                const double* cs = s + offs[d] + j[g] * FAN;
                int last = -1, pick = -1;
                double v = u[g];
                for (int c = 0; c < FAN; c++) {
                    if (!(cs[c] > 0)) continue;
                    last = c;
                    if (v < cs[c]) { pick = c; break; }
                    v -= cs[c];
                }
                if (pick < 0) { pick = last; v = cs[last] * 0.5; } /* rounding past the end */
                u[g] = v;
                j[g] = j[g] * FAN + pick;
                if (d > 0) __builtin_prefetch(s + offs[d - 1] + j[g] * FAN);
            }
        }
        for (int g = 0; g < g_n; g++) {
            out[at + g] = gen ? gen[j[g]] : j[g];
            mass[at + g] = s[j[g]];
        }
    }
    Py_RETURN_NONE;
}

/* tree_update(sum, min, offs, H, gen, cap, lo, upd, n, alpha, eps): apply n priority updates,
 * pairs (generation, float64 priority bits) in upd: an update whose leaf (generation % cap)
 * holds another generation, or one older than lo, is stale and skipped; a live one sets the leaf
 * to (priority + eps) ** alpha and recomputes its ancestors. Returns (applied, largest priority
 * applied, or -1.0). */
static PyObject* tree_update(PyObject* self, PyObject* args) {
    unsigned long long sum_p, min_p, offs_p, gen_p, upd_p;
    long long H, cap, lo, n;
    double alpha, eps;
    if (!PyArg_ParseTuple(args, "KKKLKLLKLdd", &sum_p, &min_p, &offs_p, &H, &gen_p, &cap, &lo,
                          &upd_p, &n, &alpha, &eps))
        return NULL;
    if (cap < 1 || n < 0) {
        PyErr_Format(PyExc_ValueError, "tree_update: expected cap >= 1 and n >= 0, got cap=%lld, "
                     "n=%lld", cap, n);
        return NULL;
    }
    double* s = (double*)(uintptr_t)sum_p;
    double* m = (double*)(uintptr_t)min_p;
    const int64_t* offs = (const int64_t*)(uintptr_t)offs_p;
    const int64_t* gen = (const int64_t*)(uintptr_t)gen_p;
    const int64_t* upd = (const int64_t*)(uintptr_t)upd_p;
    long long applied = 0;
    double top = -1.0;
    int64_t group[FIX_GROUP];
    int g_n = 0;
    for (long long i = 0; i < n; i++) {
        int64_t g = upd[2 * i];
        double p;
        memcpy(&p, &upd[2 * i + 1], sizeof p);
        if (g < lo || g < 0) continue;
        int64_t leaf = g % cap;
        if (gen[leaf] != g) continue;
        applied++;
        if (p > top) top = p;
        double v = alpha == 0.0 ? 1.0 : pow(p + eps, alpha);
        s[leaf] = v;
        m[leaf] = v > 0 ? v : INFINITY;
        group[g_n++] = leaf;
        if (g_n == FIX_GROUP) {
            tree_fix(s, m, offs, H, group, g_n);
            g_n = 0;
        }
    }
    if (g_n) tree_fix(s, m, offs, H, group, g_n);
    return Py_BuildValue("Ld", applied, top);
}

/* tag_rows(out, row_bytes, n, col, gens, cap, leaves, rank_bits): for each of n rows just
 * gathered, the items of generations gens, write gens[i] | rank_bits (int64) and the item's mass
 * leaves[gens[i] % cap] (float64) at byte col of the row (8-byte aligned rows). */
static PyObject* tag_rows(PyObject* self, PyObject* args) {
    unsigned long long out_p, gen_p, sum_p;
    long long row_bytes, n, col, cap, rank_bits;
    if (!PyArg_ParseTuple(args, "KLLLKLKL", &out_p, &row_bytes, &n, &col, &gen_p, &cap, &sum_p,
                          &rank_bits))
        return NULL;
    if (row_bytes % 8 || col % 8 || col + 16 > row_bytes || (out_p % 8) || cap < 1) {
        PyErr_Format(PyExc_ValueError, "tag_rows: expected 8-byte aligned rows, a trailer inside "
                     "them and cap >= 1, got row_bytes=%lld, col=%lld, cap=%lld", row_bytes, col,
                     cap);
        return NULL;
    }
    uint8_t* out = (uint8_t*)(uintptr_t)out_p;
    const int64_t* gen = (const int64_t*)(uintptr_t)gen_p;
    const double* s = (const double*)(uintptr_t)sum_p;
    for (long long i = 0; i < n; i++) {
        int64_t* t = (int64_t*)(out + i * row_bytes + col);
        t[0] = gen[i] | rank_bits;
        memcpy(&t[1], &s[(uint64_t)gen[i] % (uint64_t)cap], sizeof(double));
    }
    Py_RETURN_NONE;
}

/* queue_updates(idx, prio, n, world, shift, out, counts): check n priority updates (int64
 * addresses rank << shift | generation, float64 priorities) and write them as (generation,
 * priority bits) pairs into out, grouped by owner rank in rank order (counts[world] receives each
 * owner's count). Returns -1, or the position of the first bad update (nothing is written past
 * the check then): 2 * pos for a priority that is NaN, inf or negative, 2 * pos + 1 for an
 * address whose rank is outside [0, world). */
static PyObject* queue_updates(PyObject* self, PyObject* args) {
    unsigned long long idx_p, prio_p, out_p, counts_p;
    long long n, world, shift;
    if (!PyArg_ParseTuple(args, "KKLLLKK", &idx_p, &prio_p, &n, &world, &shift, &out_p, &counts_p))
        return NULL;
    const int64_t* idx = (const int64_t*)(uintptr_t)idx_p;
    const double* prio = (const double*)(uintptr_t)prio_p;
    int64_t* out = (int64_t*)(uintptr_t)out_p;
    int64_t* counts = (int64_t*)(uintptr_t)counts_p;
    memset(counts, 0, (size_t)world * sizeof(int64_t));
    for (long long i = 0; i < n; i++) {
        double p = prio[i];
        if (!(p >= 0) || isinf(p)) return PyLong_FromLongLong(2 * i);
        int64_t r = idx[i] < 0 ? -1 : idx[i] >> shift;
        if (r < 0 || r >= world) return PyLong_FromLongLong(2 * i + 1);
        counts[r]++;
    }
    int64_t mask = ((int64_t)1 << shift) - 1;
    int64_t start[4096];
    int64_t* at = world <= 4096 ? start : (int64_t*)malloc((size_t)world * sizeof(int64_t));
    if (!at) return PyErr_NoMemory();
    int64_t sum = 0;
    for (long long r = 0; r < world; r++) { at[r] = sum; sum += counts[r]; }
    for (long long i = 0; i < n; i++) {
        int64_t k = at[idx[i] >> shift]++;
        out[2 * k] = idx[i] & mask;
        memcpy(&out[2 * k + 1], &prio[i], sizeof(double));
    }
    if (at != start) free(at);
    return PyLong_FromLongLong(-1);
}

/* read_trailer(rows, row_bytes, n, col, min_mass, beta, index, weight): each delivered row's
 * address (int64) and importance weight (mass / min_mass) ** -beta (float32) from its trailer. */
static PyObject* read_trailer(PyObject* self, PyObject* args) {
    unsigned long long rows_p, idx_p, w_p;
    long long row_bytes, n, col;
    double min_mass, beta;
    if (!PyArg_ParseTuple(args, "KLLLddKK", &rows_p, &row_bytes, &n, &col, &min_mass, &beta,
                          &idx_p, &w_p))
        return NULL;
    const uint8_t* rows = (const uint8_t*)(uintptr_t)rows_p;
    int64_t* idx = (int64_t*)(uintptr_t)idx_p;
    float* w = (float*)(uintptr_t)w_p;
    for (long long i = 0; i < n; i++) {
        const uint8_t* t = rows + i * row_bytes + col;
        double mass;
        memcpy(&idx[i], t, sizeof(int64_t));
        memcpy(&mass, t + 8, sizeof(double));
        w[i] = beta == 0.0 ? 1.0f : (float)pow(mass / min_mass, -beta);
    }
    Py_RETURN_NONE;
}

/* mass_alloc(counts, world, cum, requests, seed, round, key): like uniform_alloc over float64
 * cumulative masses cum[world]: each of learner l's requests[l] draws is u uniform in
 * [0, cum[world-1]) from the stream (seed, round, key + l), counted for the first shard whose
 * cumulative mass exceeds u and whose own mass is positive. */
static PyObject* mass_alloc(PyObject* self, PyObject* args) {
    AllocArgs a;
    if (alloc_args(args, "mass_alloc", &a)) return NULL;
    const double* cum = (const double*)a.cum;
    long long world = a.world;
    double total = cum[world - 1];
    if (!(total > 0)) Py_RETURN_NONE;
    for (long long l = 0; l < world; l++) {
        if (a.req[l] <= 0) continue;
        uint64_t h = alloc_stream(&a, l);
        int64_t* row = a.c + l * world;
        for (int64_t i = 0; i < a.req[l]; i++) {
            h += 0x9E3779B97F4A7C15ULL;
            double u = (double)(splitmix_step(h, 0) >> 11) * 0x1.0p-53 * total;
            long long lo = 0, hi = world - 1; /* first shard whose cumulative mass exceeds u */
            while (lo < hi) {
                long long mid = (lo + hi) / 2;
                if (cum[mid] > u) hi = mid; else lo = mid + 1;
            }
            /* u rounded up to the total: the last shard of positive mass takes it */
            while (lo > 0 && cum[lo] == cum[lo - 1]) lo--;
            row[lo]++;
        }
    }
    Py_RETURN_NONE;
}

/* pool_workers(): the extension's worker threads started in this process (for tests). */
static PyObject* py_pool_workers(PyObject* self, PyObject* args) {
    return PyLong_FromSize_t(pool_workers());
}

static PyMethodDef methods[] = {
    {"tree_fill", tree_fill, METH_VARARGS,
     "tree_fill(sum, min, offs, H, idx, n, value): leaves idx := value, ancestors fixed."},
    {"tree_set", tree_set, METH_VARARGS,
     "tree_set(sum, min, offs, H, idx, val, n): set n leaves of float64 8-ary sum/min trees "
     "and recompute their ancestors."},
    {"tree_sample", tree_sample, METH_VARARGS,
     "tree_sample(sum, offs, H, n, seed, round, key, out, mass[, gen]): n leaves (with gen: "
     "their generations gen[leaf]) drawn in proportion to their mass from the stream "
     "(seed, round, key)."},
    {"tree_update", tree_update, METH_VARARGS,
     "tree_update(sum, min, offs, H, gen, cap, lo, upd, n, alpha, eps): apply live priority "
     "updates; "
     "returns (applied, largest priority or -1)."},
    {"tag_rows", tag_rows, METH_VARARGS,
     "tag_rows(out, row_bytes, n, col, gens, cap, leaves, rank_bits): write each row's "
     "address and mass (leaves[gen % cap]) into its trailer."},
    {"queue_updates", queue_updates, METH_VARARGS,
     "queue_updates(idx, prio, n, world, shift, out, counts): check priority updates and group "
     "them by owner; returns -1 or the first bad one (2 * pos: priority, 2 * pos + 1: rank)."},
    {"read_trailer", read_trailer, METH_VARARGS,
     "read_trailer(rows, row_bytes, n, col, min_mass, beta, index, weight): addresses and "
     "importance weights of delivered rows."},
    {"mass_alloc", mass_alloc, METH_VARARGS,
     "mass_alloc(counts, world, cum, requests, seed, round, key): int64 [world, world] counts "
     "of each learner's requests[l] draws over float64 cumulative masses cum."},
    {"seq_windows", seq_windows, METH_VARARGS,
     "seq_windows(next, cap, starts, k, L, out, m): each start's window of up to L items."},
    {"seq_starts", seq_starts, METH_VARARGS,
     "seq_starts(prev, gen, end, cap, gens, n, L, cut, out) -> k: the live starts whose window the "
     "new items complete (Episodes._starts in one pass)."},
    {"seq_back", seq_back, METH_VARARGS,
     "seq_back(prev, gen, cap, g, n, steps, out, ok): the item steps live links back from each "
     "of g."},
    {"seq_link", seq_link, METH_VARARGS,
     "seq_link(prev, next, gen, end, term, src, cap, gens, n, rows, rb, off_done, off_trunc, "
     "off_stream, stream_kind, sources, tab, tab_len): link n new items to their streams; "
     "returns the streams added."},
    {"seq_nstep", seq_nstep, METH_VARARGS,
     "seq_nstep(rows, k, L, rb, m, gens, term, cap, off_reward, gamma, out, out_stride, at): "
     "first and last records, return and discount of k n-step windows."},
    {"uniform_alloc", uniform_alloc, METH_VARARGS,
     "uniform_alloc(counts, world, ends, requests, seed, round, key): int64 [world, world] "
     "counts of each learner's requests[l] items uniform over the cumulative sizes ends."},
    {"uniform_slots", uniform_slots, METH_VARARGS,
     "uniform_slots(out, n, size, seed, round, rank[, offset]): n int64 values uniform in "
     "offset + [0, size) into out, from a stream keyed by (seed, round, rank)."},
    {"gather_rows", gather_rows, METH_VARARGS,
     "gather_rows(dst, src, row_bytes, src_rows, idx, n[, base[, threads]]): copy rows "
     "src[idx[i]] (base >= 0: generations of a ring, slot idx[i] - base wrapped once) into n "
     "contiguous rows of dst (int64 indices, each checked), large copies split over threads."},
    {"rows_nonfinite", rows_nonfinite, METH_VARARGS,
     "rows_nonfinite(addr, row_bytes, n, sizes, offsets, kinds): first field of n records "
     "holding NaN/inf (float kinds only), scanned in place, or -1."},
    {"any_nonfinite", any_nonfinite, METH_VARARGS,
     "any_nonfinite(addr, n, kind[, threads]): whether n contiguous floats (kind 2, 3, 4 or 8) "
     "hold NaN/inf, large scans split over threads."},
    {"unpack_rows", unpack_rows, METH_VARARGS,
     "unpack_rows(src, row_bytes, stride, n, dsts, sizes, offsets, kinds): copy each field of "
     "n rows into its own contiguous destination."},
    {"copy_spans", copy_spans, METH_VARARGS,
     "copy_spans((dst, src, n, ...)): memcpy n bytes from each src address to its dst."},
    {"mean2_f32", mean2_f32, METH_VARARGS,
     "mean2_f32(dst, src, n): dst[i] = (dst[i] + src[i]) * 0.5 for n float32 values (src may be "
     "unaligned)."},
    {"pool_workers", py_pool_workers, METH_NOARGS,
     "pool_workers(): worker threads the large copies have started in this process."},
    {"pack_rows", pack_rows, METH_VARARGS,
     "pack_rows(dst, row_bytes, n, srcs, sizes, offsets, kinds[, threads]): pack n items into "
     "rows, large packs split over threads; returns the first field with NaN/inf (float kinds "
     "only) or -1."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pack(void) {
    PyObject* m = PyModule_Create(&module);
    if (m && PyModule_AddFunctions(m, shmbar_methods)) Py_CLEAR(m);
    return m;
}
