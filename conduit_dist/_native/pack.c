/* Row packing for conduit_dist records: copy each field of n items into its aligned column of
 * n contiguous records, one copy per (row, field), with the GIL released, testing float fields for
 * NaN/inf in the same pass. torch's strided copy pays a per-row loop overhead that dominates for
 * small fields; this runs at memcpy speed. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_FIELDS 256

#if defined(__x86_64__) && defined(__GNUC__)
/* an AVX2 clone next to the baseline one, picked at load time by the CPU it runs on */
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* Per float width: OR an exponent-all-ones test (NaN/inf) over m values, copying them to b when
 * b is set. Two branch-free loops, so each vectorises. */
#define DEFINE_SCAN(NAME, T)                                                            \
    static inline int NAME(const T* restrict a, T* restrict b, long long m, T mask) {   \
        T any = 0;                                                                      \
        if (b)                                                                          \
            for (long long j = 0; j < m; j++) {                                         \
                T v = a[j];                                                             \
                any |= (T)((v & mask) == mask);                                         \
                b[j] = v;                                                               \
            }                                                                           \
        else                                                                            \
            for (long long j = 0; j < m; j++) any |= (T)((a[j] & mask) == mask);       \
        return any != 0;                                                                \
    }
DEFINE_SCAN(scan16, uint16_t)
DEFINE_SCAN(scan32, uint32_t)
DEFINE_SCAN(scan64, uint64_t)

/* sz bytes of floats of a kind (4 = float32, 8 = float64, 2 = float16, 3 = bfloat16): 1 if any
 * is NaN/inf; copied to d on the way unless d is NULL. */
static inline int scan(const uint8_t* s, uint8_t* d, long long sz, int kind) {
    switch (kind) {
        case 4: return scan32((const uint32_t*)s, (uint32_t*)d, sz / 4, 0x7f800000u);
        case 8: return scan64((const uint64_t*)s, (uint64_t*)d, sz / 8, 0x7ff0000000000000ull);
        case 2: return scan16((const uint16_t*)s, (uint16_t*)d, sz / 2, 0x7c00u);
        default: return scan16((const uint16_t*)s, (uint16_t*)d, sz / 2, 0x7f80u);
    }
}

/* Copy one field of one item; for a float kind (non-zero), also report NaN/inf in the same pass. */
static inline int copy_field(uint8_t* restrict d, const uint8_t* restrict s, long long sz, int kind) {
    if (kind) return scan(s, d, sz, kind);
    switch (sz) { /* scalars: single loads and stores instead of a libc call */
        case 8: memcpy(d, s, 8); break;
        case 4: memcpy(d, s, 4); break;
        case 2: memcpy(d, s, 2); break;
        case 1: *d = *s; break;
        default: memcpy(d, s, (size_t)sz);
    }
    return 0;
}

CLONES
static void pack_impl(uint8_t* out, long long row_bytes, long long n, Py_ssize_t nf,
                      uint8_t* const* src, const long long* size, const long long* off,
                      const int* kind, int* bad) {
    /* row by row, so each record's cache lines are written once */
    for (long long i = 0; i < n; i++) {
        uint8_t* row = out + i * row_bytes;
        for (Py_ssize_t f = 0; f < nf; f++)
            bad[f] |= copy_field(row + off[f], src[f] + i * size[f], size[f], kind[f]);
    }
}

/* Read the field layout (sizes, offsets, kinds: tuples of nf ints) into arrays, checking that
 * every field fits in a row_bytes record and every kind is 0, 2, 3, 4 or 8. Returns 0, or -1 with
 * a Python error set (prefixed by the calling function's name). */
static int parse_fields(const char* fn, long long row_bytes, PyObject* sizes, PyObject* offsets,
                        PyObject* kinds, Py_ssize_t nf, long long* size, long long* off,
                        int* kind) {
    if (nf > MAX_FIELDS || PyTuple_GET_SIZE(sizes) != nf || PyTuple_GET_SIZE(offsets) != nf ||
        PyTuple_GET_SIZE(kinds) != nf) {
        PyErr_Format(PyExc_ValueError, "%s: the field tuples must have equal length <= 256", fn);
        return -1;
    }
    for (Py_ssize_t f = 0; f < nf; f++) {
        size[f] = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, f));
        off[f] = PyLong_AsLongLong(PyTuple_GET_ITEM(offsets, f));
        kind[f] = (int)PyLong_AsLong(PyTuple_GET_ITEM(kinds, f));
        if (PyErr_Occurred()) return -1;
        if (size[f] < 0 || off[f] < 0 || off[f] + size[f] > row_bytes) {
            PyErr_Format(PyExc_ValueError, "%s: a field does not fit in the record", fn);
            return -1;
        }
        if (kind[f] != 0 && kind[f] != 2 && kind[f] != 3 && kind[f] != 4 && kind[f] != 8) {
            PyErr_Format(PyExc_ValueError, "%s: kinds must be 0, 2, 3, 4 or 8", fn);
            return -1;
        }
    }
    return 0;
}

/* The index of the first field flagged in bad[], or -1. */
static PyObject* first_bad(const int* bad, Py_ssize_t nf) {
    for (Py_ssize_t f = 0; f < nf; f++)
        if (bad[f]) return PyLong_FromSsize_t(f);
    return PyLong_FromLong(-1);
}

/* pack_rows(dst, row_bytes, n, srcs, sizes, offsets, kinds) -> index of the first field holding
 * NaN/inf among those with a float kind (2, 3, 4, 8; 0 = not checked), or -1. (Non-temporal
 * stores into cold ring slots were tried: slower here than plain stores, for both record sizes.) */
static PyObject* pack_rows(PyObject* self, PyObject* args) {
    unsigned long long dst;
    long long row_bytes, n;
    PyObject *srcs, *sizes, *offsets, *kinds;
    if (!PyArg_ParseTuple(args, "KLLO!O!O!O!", &dst, &row_bytes, &n, &PyTuple_Type, &srcs,
                          &PyTuple_Type, &sizes, &PyTuple_Type, &offsets, &PyTuple_Type, &kinds))
        return NULL;
    Py_ssize_t nf = PyTuple_GET_SIZE(srcs);
    uint8_t* src[MAX_FIELDS];
    long long size[MAX_FIELDS], off[MAX_FIELDS];
    int kind[MAX_FIELDS], bad[MAX_FIELDS] = {0};
    if (parse_fields("pack_rows", row_bytes, sizes, offsets, kinds, nf, size, off, kind)) return NULL;
    for (Py_ssize_t f = 0; f < nf; f++)
        src[f] = (uint8_t*)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(srcs, f));
    if (PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    pack_impl((uint8_t*)(uintptr_t)dst, row_bytes, n, nf, src, size, off, kind, bad);
    Py_END_ALLOW_THREADS
    return first_bad(bad, nf);
}

CLONES
static int any_impl(const uint8_t* p, long long nbytes, int kind) { return scan(p, NULL, nbytes, kind); }

/* any_nonfinite(addr, n, kind): whether any of n contiguous floats of a kind is NaN/inf. */
static PyObject* any_nonfinite(PyObject* self, PyObject* args) {
    unsigned long long addr;
    long long n;
    int kind, any;
    if (!PyArg_ParseTuple(args, "KLi", &addr, &n, &kind)) return NULL;
    if (kind != 2 && kind != 3 && kind != 4 && kind != 8) {
        PyErr_SetString(PyExc_ValueError, "any_nonfinite: kind must be 2, 3, 4 or 8");
        return NULL;
    }
    const long long width = kind == 3 ? 2 : kind;
    Py_BEGIN_ALLOW_THREADS
    any = any_impl((const uint8_t*)(uintptr_t)addr, n * width, kind);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(any);
}

CLONES
static void rows_impl(const uint8_t* rows, long long row_bytes, long long n, Py_ssize_t nf,
                      const long long* size, const long long* off, const int* kind, int* bad) {
    for (long long i = 0; i < n; i++) {
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
    long long size[MAX_FIELDS], off[MAX_FIELDS];
    int kind[MAX_FIELDS], bad[MAX_FIELDS] = {0};
    if (parse_fields("rows_nonfinite", row_bytes, sizes, offsets, kinds, nf, size, off, kind))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rows_impl((const uint8_t*)(uintptr_t)addr, row_bytes, n, nf, size, off, kind, bad);
    Py_END_ALLOW_THREADS
    return first_bad(bad, nf);
}

static PyMethodDef methods[] = {
    {"rows_nonfinite", rows_nonfinite, METH_VARARGS,
     "rows_nonfinite(addr, row_bytes, n, sizes, offsets, kinds): first field of n records "
     "holding NaN/inf (float kinds only), scanned in place, or -1."},
    {"any_nonfinite", any_nonfinite, METH_VARARGS,
     "any_nonfinite(addr, n, kind): whether n contiguous floats (kind 2, 3, 4 or 8) hold NaN/inf."},
    {"pack_rows", pack_rows, METH_VARARGS,
     "pack_rows(dst, row_bytes, n, srcs, sizes, offsets, kinds): pack n items into rows; "
     "returns the first field with NaN/inf (float kinds only) or -1."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pack(void) { return PyModule_Create(&module); }
