/* Row packing for conduit_dist records: copy each field of n items into its aligned column of
 * n contiguous records, one memcpy per (row, field), with the GIL released. torch's strided copy
 * pays a per-row loop overhead that dominates for small fields; this runs at memcpy speed. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_FIELDS 256

static PyObject* pack_rows(PyObject* self, PyObject* args) {
    unsigned long long dst;
    long long row_bytes, n;
    PyObject *srcs, *sizes, *offsets;
    if (!PyArg_ParseTuple(args, "KLLO!O!O!", &dst, &row_bytes, &n, &PyTuple_Type, &srcs,
                          &PyTuple_Type, &sizes, &PyTuple_Type, &offsets))
        return NULL;
    Py_ssize_t nf = PyTuple_GET_SIZE(srcs);
    if (nf > MAX_FIELDS || PyTuple_GET_SIZE(sizes) != nf || PyTuple_GET_SIZE(offsets) != nf) {
        PyErr_SetString(PyExc_ValueError, "pack_rows: srcs, sizes and offsets must have equal length <= 256");
        return NULL;
    }
    uint8_t* src[MAX_FIELDS];
    long long size[MAX_FIELDS], off[MAX_FIELDS];
    for (Py_ssize_t f = 0; f < nf; f++) {
        src[f] = (uint8_t*)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(srcs, f));
        size[f] = PyLong_AsLongLong(PyTuple_GET_ITEM(sizes, f));
        off[f] = PyLong_AsLongLong(PyTuple_GET_ITEM(offsets, f));
        if (PyErr_Occurred()) return NULL;
        if (size[f] < 0 || off[f] < 0 || off[f] + size[f] > row_bytes) {
            PyErr_SetString(PyExc_ValueError, "pack_rows: a field does not fit in the record");
            return NULL;
        }
    }
    uint8_t* out = (uint8_t*)(uintptr_t)dst;
    Py_BEGIN_ALLOW_THREADS
    /* row by row, so each record's cache lines are written once; scalars get fixed-size copies
     * the compiler turns into single loads and stores instead of a libc call */
    for (long long i = 0; i < n; i++) {
        uint8_t* row = out + i * row_bytes;
        for (Py_ssize_t f = 0; f < nf; f++) {
            const long long sz = size[f];
            const uint8_t* s = src[f] + i * sz;
            uint8_t* d = row + off[f];
            switch (sz) {
                case 8: memcpy(d, s, 8); break;
                case 4: memcpy(d, s, 4); break;
                case 2: memcpy(d, s, 2); break;
                case 1: *d = *s; break;
                default: memcpy(d, s, (size_t)sz);
            }
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
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
     "pack_rows(dst, row_bytes, n, srcs, sizes, offsets): copy n items of each field into rows."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pack(void) { return PyModule_Create(&module); }
