/* What the row kernels (rows.c) and the undo writer (undo.c) share about walking a set of rows. */
#ifndef CXLTRAIN_ROWSET_H
#define CXLTRAIN_ROWSET_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "persist.h"

/* Rows ahead of a copy whose lines are prefetched: a table's rows are scattered over a region far
 * larger than the caches, and one row's miss at a time would leave the copy waiting on memory. */
#define PREFETCH_ROWS 16

static inline void prefetch_row(const char *row, size_t row_bytes, int for_write)
{
    for (size_t at = 0; at < row_bytes; at += CACHE_LINE) {
        if (for_write)
            __builtin_prefetch(row + at, 1);
        else
            __builtin_prefetch(row + at, 0);
    }
}

/* Call run(args, first row, rows in the run) once per run of adjacent rows; returns the runs. */
typedef void (*run_fn)(const void *args, int64_t first, ssize_t length);

static inline ssize_t for_each_run(const void *args, const int64_t *rows, ssize_t count, run_fn run)
{
    ssize_t runs = 0;
    for (ssize_t i = 0; i < count; runs++) {
        ssize_t j = i + 1;
        while (j < count && rows[j] == rows[j - 1] + 1)
            j++;
        run(args, rows[i], j - i);
        i = j;
    }
    return runs;
}

#endif
