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
    for (long long i = 0; i < n; i++) {
        uint8_t* row = out + i * row_bytes;
        for (Py_ssize_t f = 0; f < nf; f++)
            memcpy(row + off[f], src[f] + i * size[f], (size_t)size[f]);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"pack_rows", pack_rows, METH_VARARGS,
     "pack_rows(dst, row_bytes, n, srcs, sizes, offsets): copy n items of each field into rows."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pack(void) { return PyModule_Create(&module); }
