/* Row packing for conduit_dist records: copy each field of n items into its aligned column of
 * n contiguous records, one memcpy per (row, field), with the GIL released. torch's strided copy
 * pays a per-row loop overhead that dominates for small fields; this runs at memcpy speed. */
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

/* Copy one field of one item; for a float kind, return 1 if any value is NaN/inf (exponent bits
 * all ones), found in the same pass as the copy. Branch-free loops the compiler vectorises. */
static inline int copy_field(uint8_t* restrict d, const uint8_t* restrict s, long long sz, int kind) {
    switch (kind) {
        case 4: {
            const uint32_t* restrict a = (const uint32_t*)s;
            uint32_t* restrict b = (uint32_t*)d;
            uint32_t any = 0;
            for (long long j = 0; j < sz / 4; j++) {
                uint32_t v = a[j];
                any |= (uint32_t)((v & 0x7f800000u) == 0x7f800000u);
                b[j] = v;
            }
            return any != 0;
        }
        case 8: {
            const uint64_t* restrict a = (const uint64_t*)s;
            uint64_t* restrict b = (uint64_t*)d;
            const uint64_t m = 0x7ff0000000000000ull;
            uint64_t any = 0;
            for (long long j = 0; j < sz / 8; j++) {
                uint64_t v = a[j];
                any |= (uint64_t)((v & m) == m);
                b[j] = v;
            }
            return any != 0;
        }
        case 2:
        case 3: {
            const uint16_t* restrict a = (const uint16_t*)s;
            uint16_t* restrict b = (uint16_t*)d;
            const uint16_t m = kind == 2 ? 0x7c00u : 0x7f80u;
            uint16_t any = 0;
            for (long long j = 0; j < sz / 2; j++) {
                uint16_t v = a[j];
                any |= (uint16_t)((v & m) == m);
                b[j] = v;
            }
            return any != 0;
        }
        default:
            switch (sz) { /* scalars: single loads and stores instead of a libc call */
                case 8: memcpy(d, s, 8); break;
                case 4: memcpy(d, s, 4); break;
                case 2: memcpy(d, s, 2); break;
                case 1: *d = *s; break;
                default: memcpy(d, s, (size_t)sz);
            }
            return 0;
    }
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
    if (nf > MAX_FIELDS || PyTuple_GET_SIZE(sizes) != nf || PyTuple_GET_SIZE(offsets) != nf ||
        PyTuple_GET_SIZE(kinds) != nf) {
        PyErr_SetString(PyExc_ValueError,
                        "pack_rows: srcs, sizes, offsets and kinds must have equal length <= 256");
        return NULL;
    }
    uint8_t* src[MAX_FIELDS];
    long long size[MAX_FIELDS], off[MAX_FIELDS];
    int kind[MAX_FIELDS], bad[MAX_FIELDS];
    for (Py_ssize_t f = 0; f < nf; f++) {
        src[f] = (uint8_t*)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(srcs, f));
        size[f] = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, f));
        off[f] = PyLong_AsLongLong(PyTuple_GET_ITEM(offsets, f));
        kind[f] = (int)PyLong_AsLong(PyTuple_GET_ITEM(kinds, f));
        bad[f] = 0;
        if (PyErr_Occurred()) return NULL;
        if (size[f] < 0 || off[f] < 0 || off[f] + size[f] > row_bytes) {
            PyErr_SetString(PyExc_ValueError, "pack_rows: a field does not fit in the record");
            return NULL;
        }
        if (kind[f] != 0 && kind[f] != 2 && kind[f] != 3 && kind[f] != 4 && kind[f] != 8) {
            PyErr_SetString(PyExc_ValueError, "pack_rows: kinds must be 0, 2, 3, 4 or 8");
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    pack_impl((uint8_t*)(uintptr_t)dst, row_bytes, n, nf, src, size, off, kind, bad);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t f = 0; f < nf; f++)
        if (bad[f]) return PyLong_FromSsize_t(f);
    return PyLong_FromLong(-1);
}

/* count_nonfinite(addr, n, kind): number of NaN/inf among n contiguous floats of a kind:
 * 4 = float32, 8 = float64, 2 = float16, 3 = bfloat16 (exponent bits all ones). */
static PyObject* count_nonfinite(PyObject* self, PyObject* args) {
    unsigned long long addr;
    long long n;
    int kind;
    if (!PyArg_ParseTuple(args, "KLi", &addr, &n, &kind)) return NULL;
    long long bad = 0;
    const uint8_t* p = (const uint8_t*)(uintptr_t)addr;
    if (kind != 2 && kind != 3 && kind != 4 && kind != 8) {
        PyErr_SetString(PyExc_ValueError, "count_nonfinite: kind must be 2, 3, 4 or 8");
        return NULL;
    }
    /* a branch-free OR reduction first (vectorised); count only when something is non-finite */
    Py_BEGIN_ALLOW_THREADS
    if (kind == 4) {
        const uint32_t* v = (const uint32_t*)p;
        uint32_t any = 0;
        for (long long i = 0; i < n; i++) any |= (uint32_t)((v[i] & 0x7f800000u) == 0x7f800000u);
        if (any)
            for (long long i = 0; i < n; i++) bad += (v[i] & 0x7f800000u) == 0x7f800000u;
    } else if (kind == 8) {
        const uint64_t* v = (const uint64_t*)p;
        const uint64_t m = 0x7ff0000000000000ull;
        uint64_t any = 0;
        for (long long i = 0; i < n; i++) any |= (uint64_t)((v[i] & m) == m);
        if (any)
            for (long long i = 0; i < n; i++) bad += (v[i] & m) == m;
    } else {
        const uint16_t* v = (const uint16_t*)p;
        const uint16_t m = kind == 2 ? 0x7c00u : 0x7f80u;
        uint16_t any = 0;
        for (long long i = 0; i < n; i++) any |= (uint16_t)((v[i] & m) == m);
        if (any)
            for (long long i = 0; i < n; i++) bad += (v[i] & m) == m;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(bad);
}

static PyMethodDef methods[] = {
    {"count_nonfinite", count_nonfinite, METH_VARARGS,
     "count_nonfinite(addr, n, kind): NaN/inf among n contiguous floats (kind 2, 3, 4 or 8)."},
    {"pack_rows", pack_rows, METH_VARARGS,
     "pack_rows(dst, row_bytes, n, srcs, sizes, offsets, kinds): pack n items into rows; "
     "returns the first field with NaN/inf (float kinds only) or -1."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pack(void) { return PyModule_Create(&module); }
