/* The shared-memory exchanges' barrier (shmbar.c), added to the module of pack.c. */
#ifndef CONDUIT_SHMBAR_H
#define CONDUIT_SHMBAR_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

extern PyMethodDef shmbar_methods[];

#endif
