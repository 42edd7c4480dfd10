/* What lookups.c takes from rows.c (the bounds and offsets checks, the lookups' sort by row id)
 * and gives the module's method table there. */
#ifndef CXLTRAIN_LOOKUPS_H
#define CXLTRAIN_LOOKUPS_H

#include <Python.h>
#include <stdint.h>

Py_ssize_t first_bad_row(const int64_t *rows, Py_ssize_t count, int64_t limit);
PyObject *raise_bad_row(const int64_t *rows, Py_ssize_t at, int64_t limit);
int offsets_hold(const int64_t *offsets, Py_ssize_t bags, Py_ssize_t n);
int sort_lookups(const int64_t *keys, Py_ssize_t n, int64_t table_rows, int64_t *order);

PyObject *asked_rows(PyObject *self, PyObject *args);
PyObject *add_bags_to_rows(PyObject *self, PyObject *args);

#endif
