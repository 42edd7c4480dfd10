/*
 * The unique-row exchange's per-table work on a rank's lookups (cxltrain/models/replicated.py,
 * AskedRows; called through kernels/lookups.py, which checks every tensor first):
 *
 *   asked_rows        the distinct ids of a slice's lookups split into the replicated ones (the
 *                     copies) and those asked of their holders, and each lookup's row of the
 *                     answers-then-copies block, in one sort and one pass
 *   add_bags_to_rows  each lookup's bag gradient added to its row of that block, in lookup order
 *
 * Done in torch these are a score of small calls per table and batch, each paying torch's dispatch
 * on a few thousand ids (docs/distributed.md, "Replicated hot rows").
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>

#include "lookups.h"

/* The first position in sorted[0, n) whose value is >= key. */
static Py_ssize_t lower_bound(const int64_t *sorted, Py_ssize_t n, int64_t key)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (sorted[mid] < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

struct asked {
    const int64_t *keys;     /* [n] the slice's lookups, ids in [0, table_rows) */
    Py_ssize_t n;
    int64_t table_rows;
    const int64_t *copies;   /* [h] the replicated ids, strictly ascending */
    Py_ssize_t h;
    const int64_t *spans;    /* [w][2] each holder's ids [lo, hi), disjoint (lookups.py checks), in the
                                order the holders answer */
    Py_ssize_t w;
    int64_t *cold;           /* [n] out: the distinct ids not replicated, ascending (U of them) */
    int64_t *starts;         /* [w] out: where each holder's ids begin in cold */
    int64_t *counts;         /* [w] out: how many they are */
    int64_t *positions;      /* [n] out: each lookup's row of [U + h]: the answers in holder order,
                                then the copies */
};

/* U, or -1 out of memory, -2 a distinct id that no span holds. */
static Py_ssize_t asked_rows_work(const struct asked *a)
{
    int64_t *order = malloc((size_t)(a->n ? a->n : 1) * sizeof *order);
    if (!order || sort_lookups(a->keys, a->n, a->table_rows, order) != 0) {
        free(order);
        return -1;
    }
    /* one pass over the lookups by id: each distinct id is a copy (merge-walked, both ascend) or the
     * next cold id; positions hold -(copy + 1) or the cold index until the holders' order is known */
    Py_ssize_t u = 0, copy = 0;
    for (Py_ssize_t j = 0; j < a->n;) {
        const int64_t id = a->keys[order[j]];
        while (copy < a->h && a->copies[copy] < id)
            copy++;
        int64_t code;
        if (copy < a->h && a->copies[copy] == id) {
            code = -(int64_t)copy - 1;
        } else {
            code = u;
            a->cold[u++] = id;
        }
        for (; j < a->n && a->keys[order[j]] == id; j++)
            a->positions[order[j]] = code;
    }
    free(order);
    /* each holder's ids are a run of the ascending cold ids; the runs are answered in span order */
    int64_t *answer = malloc((size_t)(u ? u : 1) * sizeof *answer);
    if (!answer)
        return -1;
    Py_ssize_t answered = 0;
    for (Py_ssize_t k = 0; k < a->w; k++) {
        const Py_ssize_t start = lower_bound(a->cold, u, a->spans[2 * k]);
        const Py_ssize_t end = lower_bound(a->cold, u, a->spans[2 * k + 1]);
        a->starts[k] = start;
        a->counts[k] = end > start ? end - start : 0;
        for (Py_ssize_t c = start; c < end; c++)
            answer[c] = answered++;
    }
    if (answered != u) { /* disjoint spans: some id lies in none */
        free(answer);
        return -2;
    }
    for (Py_ssize_t i = 0; i < a->n; i++) {
        const int64_t code = a->positions[i];
        a->positions[i] = code >= 0 ? answer[code] : (int64_t)u + (-code - 1);
    }
    free(answer);
    return u;
}

PyObject *asked_rows(PyObject *self, PyObject *args)
{
    unsigned long long keys, copies, cold, positions;
    PyObject *span_list, *result = NULL;
    struct asked a = {0};
    long long table_rows;
    if (!PyArg_ParseTuple(args, "KnLKnO!KK", &keys, &a.n, &table_rows, &copies, &a.h, &PyTuple_Type, &span_list,
                          &cold, &positions))
        return NULL;
    a.keys = (const int64_t *)(uintptr_t)keys;
    a.table_rows = table_rows;
    a.copies = (const int64_t *)(uintptr_t)copies;
    a.cold = (int64_t *)(uintptr_t)cold;
    a.positions = (int64_t *)(uintptr_t)positions;
    if (PyTuple_GET_SIZE(span_list) % 2) {
        PyErr_SetString(PyExc_ValueError, "asked_rows: spans must be lo, hi pairs");
        return NULL;
    }
    a.w = PyTuple_GET_SIZE(span_list) / 2;
    int64_t *spans = malloc((size_t)(a.w ? 4 * a.w : 1) * sizeof *spans); /* the bounds, then starts and counts */
    if (!spans)
        return PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < 2 * a.w && !PyErr_Occurred(); k++)
        spans[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(span_list, k));
    if (PyErr_Occurred())
        goto out;
    a.spans = spans;
    a.starts = spans + 2 * a.w;
    a.counts = spans + 3 * a.w;
    Py_ssize_t bad = first_bad_row(a.keys, a.n, table_rows);
    if (bad >= 0) {
        raise_bad_row(a.keys, bad, table_rows);
        goto out;
    }
    for (Py_ssize_t c = 0; c < a.h; c++)
        if (a.copies[c] < 0 || a.copies[c] >= table_rows || (c && a.copies[c] <= a.copies[c - 1])) {
            PyErr_SetString(PyExc_ValueError, "asked_rows: the copies' ids must be distinct, ascending and in the table");
            goto out;
        }
    /* the GIL is kept: work of microseconds, where giving it up could wait out another thread's
     * switch interval to take it back */
    const Py_ssize_t u = asked_rows_work(&a);
    if (u == -1) {
        PyErr_NoMemory();
        goto out;
    }
    if (u == -2) {
        PyErr_SetString(PyExc_ValueError, "asked_rows: an id that no holder's span holds");
        goto out;
    }
    PyObject *starts = PyTuple_New(a.w), *counts = PyTuple_New(a.w);
    for (Py_ssize_t k = 0; starts && counts && k < a.w; k++) {
        PyTuple_SET_ITEM(starts, k, PyLong_FromLongLong(a.starts[k]));
        PyTuple_SET_ITEM(counts, k, PyLong_FromLongLong(a.counts[k]));
    }
    if (starts && counts && !PyErr_Occurred())
        result = Py_BuildValue("nNN", u, starts, counts);
    else {
        Py_XDECREF(starts);
        Py_XDECREF(counts);
    }
out:
    free(spans);
    return result;
}

PyObject *add_bags_to_rows(PyObject *self, PyObject *args)
{
    unsigned long long grad, offsets, positions, out;
    Py_ssize_t bags, g_stride, n, rows, dim;
    if (!PyArg_ParseTuple(args, "KnnKKnKnn", &grad, &bags, &g_stride, &offsets, &positions, &n, &out, &rows, &dim))
        return NULL;
    const float *g = (const float *)(uintptr_t)grad;
    const int64_t *off = (const int64_t *)(uintptr_t)offsets;
    const int64_t *pos = (const int64_t *)(uintptr_t)positions;
    float *o = (float *)(uintptr_t)out;
    Py_ssize_t bad = first_bad_row(pos, n, rows);
    if (bad >= 0)
        return raise_bad_row(pos, bad, rows);
    if (!offsets_hold(off, bags, n)) {
        PyErr_SetString(PyExc_ValueError, "add_bags_to_rows: offsets must start at 0 and never decrease, within "
                        "the lookups");
        return NULL;
    }
    /* lookup order, one float add each (as index_add_ on the CPU): the same bits every run; the GIL
     * kept, as in asked_rows */
    for (Py_ssize_t b = 0; b < bags; b++) {
        const float *bag = g + b * g_stride;
        const Py_ssize_t end = b + 1 < bags ? off[b + 1] : n;
        for (Py_ssize_t i = off[b]; i < end; i++) {
            float *row = o + pos[i] * dim;
            for (Py_ssize_t d = 0; d < dim; d++)
                row[d] += bag[d];
        }
    }
    Py_RETURN_NONE;
}
