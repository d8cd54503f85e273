/* Sequence and n-step helpers of conduit_dist.sampling.sequences (seq.c), registered in the
 * module table of pack.c. */
#ifndef CONDUIT_SEQ_H
#define CONDUIT_SEQ_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject* seq_windows(PyObject* self, PyObject* args);
PyObject* seq_back(PyObject* self, PyObject* args);
PyObject* seq_starts(PyObject* self, PyObject* args);
PyObject* seq_link(PyObject* self, PyObject* args);
PyObject* seq_nstep(PyObject* self, PyObject* args);

#endif
