/*
 * Native CPU row kernels: cxltrain.kernels._rows (a private module; call it through
 * kernels/ops.py and native.py, which check every tensor before handing over addresses).
 *
 * Each call works on a whole row set (one table, one batch) with the GIL released; nothing loops
 * per row in Python. Every kernel checks each row index against the table's row count in a first
 * pass, before its first store, so a bad index is refused with nothing written.
 *
 *   copy_rows                    gather or scatter whole rows between a table and a dense block
 *   sparse_update                duplicate reduction + SGD or row-wise Adagrad, in place; with the
 *                                undo writer's fields (undo.c), the undo capture folded in: chunk by
 *                                chunk of the unique rows, their records written, then their update
 *   unique_rows                  the sorted distinct row ids of a lookup list (an undo record's rows)
 *   asked_rows, add_bags_to_rows the unique-row exchange's per-table work on a slice (lookups.c)
 *   all_finite                   whether a float32 block holds no inf or NaN (gradients, before an update)
 *   capture_undo                 old weights, old state and row ids into an undo-record payload,
 *                                with non-temporal stores and one fence
 *   flush_rows                   write back each run of adjacent rows, optionally followed by one drain
 *   copy_lines                   the power-loss emulator's flush of each run of adjacent rows
 *   stream_pieces                a dense snapshot's payload, stored and made durable in one pass
 *   crc32                        zlib's CRC-32 (crc32.c)
 *
 * The other sources of this module: lookups.c (the exchange's per-table work), persist.c (generic
 * persistence primitives: copy, write back, fence), undo.c (the undo-record writer, in the
 * checkpoint layer's layout), crc32.c.
 *
 * Determinism: floats are added in a fixed order (a row's gradients in lookup order), the build
 * turns off implicit FMA contraction (-ffp-contract=off), and the update steps use explicit fmaf,
 * which is one IEEE rounding on every CPU. That is also what torch's CPU kernels compute for
 * `w.add_(g, alpha=-lr)`, so SGD matches torch bit for bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "crc32.h"
#include "lookups.h"
#include "persist.h"
#include "rowset.h"
#include "undo.h"

/* A first pass over the rows: the index of the first one outside [0, limit), or -1. */
Py_ssize_t first_bad_row(const int64_t *rows, Py_ssize_t count, int64_t limit)
{
    for (Py_ssize_t i = 0; i < count; i++)
        if (rows[i] < 0 || rows[i] >= limit)
            return i;
    return -1;
}

/* Whether bag offsets [bags] start at 0 and never decrease, within [0, n] lookups (no bags: yes). */
int offsets_hold(const int64_t *offsets, Py_ssize_t bags, Py_ssize_t n)
{
    if (bags && offsets[0] != 0)
        return 0;
    for (Py_ssize_t b = 1; b < bags; b++)
        if (offsets[b] < offsets[b - 1] || offsets[b] > n)
            return 0;
    return 1;
}

PyObject *raise_bad_row(const int64_t *rows, Py_ssize_t at, int64_t limit)
{
    PyErr_Format(PyExc_IndexError, "row index %lld is out of range [0, %lld); nothing was written",
                 (long long)rows[at], (long long)limit);
    return NULL;
}

/* The work of a row-set kernel; runs only after every row passed the bounds check. Returns what
 * the caller gets back: the rows done, or for the flushes the runs written back (which the
 * devices count as flushes). */
typedef Py_ssize_t (*row_set_work)(const void *args, const int64_t *rows, Py_ssize_t count);

/* Check the rows against the table, then do the work, both without the GIL. */
static PyObject *run_checked(row_set_work work, const void *args, const int64_t *rows, Py_ssize_t count,
                             int64_t table_rows)
{
    Py_ssize_t bad, done = 0;
    Py_BEGIN_ALLOW_THREADS
    bad = first_bad_row(rows, count, table_rows);
    if (bad < 0)
        done = work(args, rows, count);
    Py_END_ALLOW_THREADS
    if (bad >= 0)
        return raise_bad_row(rows, bad, table_rows);
    return PyLong_FromSsize_t(done);
}

/* ---------------------------------------------------------------------------------------------
 * gather / scatter (and the undo capture below): whole rows, as bytes
 * ------------------------------------------------------------------------------------------- */
typedef void (*copy_fn)(char *dst, const char *src, size_t n);

static void plain_copy(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}

struct row_copy {
    char *dst;
    Py_ssize_t dst_stride;
    const char *src;
    Py_ssize_t src_stride;
    size_t row_bytes;
    int scatter; /* 0: dst row i := src row rows[i] (gather); 1: dst row rows[i] := src row i */
    copy_fn copy;
};

static Py_ssize_t copy_rows_work(const void *args, const int64_t *rows, Py_ssize_t count)
{
    const struct row_copy *c = args;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + PREFETCH_ROWS < count) { /* the table side of a row a few iterations ahead */
            if (c->scatter)
                prefetch_row(c->dst + rows[i + PREFETCH_ROWS] * c->dst_stride, c->row_bytes, 1);
            else
                prefetch_row(c->src + rows[i + PREFETCH_ROWS] * c->src_stride, c->row_bytes, 0);
        }
        Py_ssize_t to = c->scatter ? rows[i] : i, from = c->scatter ? i : rows[i];
        c->copy(c->dst + to * c->dst_stride, c->src + from * c->src_stride, c->row_bytes);
    }
    return count;
}

static PyObject *copy_rows(PyObject *self, PyObject *args)
{
    unsigned long long dst, src, rows;
    Py_ssize_t count, row_bytes;
    long long table_rows;
    struct row_copy c = {.copy = plain_copy};
    if (!PyArg_ParseTuple(args, "KnKnnpLKn", &dst, &c.dst_stride, &src, &c.src_stride, &row_bytes, &c.scatter,
                          &table_rows, &rows, &count))
        return NULL;
    c.dst = (char *)(uintptr_t)dst;
    c.src = (const char *)(uintptr_t)src;
    c.row_bytes = (size_t)row_bytes;
    return run_checked(copy_rows_work, &c, (const int64_t *)(uintptr_t)rows, count, table_rows);
}

/* ---------------------------------------------------------------------------------------------
 * Fused sparse update
 * ------------------------------------------------------------------------------------------- */
enum rule { RULE_SGD = 0, RULE_ROWWISE_ADAGRAD = 1 };

/* A table's hot-row cache as the update sees it (as FBGEMM's caching kernels take cache locations):
 * the row map and the slots' arrays. A cached row is read and updated in its slot only. */
struct cached_rows {
    const void *slot_of;    /* [R] int32 or int64: the slot of each row, -1 not cached; NULL: no cache */
    int wide;               /* slot_of is int64 */
    float *weight;          /* [S, w_stride] floats, columns [0, dim) updated */
    Py_ssize_t w_stride;
    float *state;           /* [S, s_stride] floats, column 0 used (Adagrad only) */
    Py_ssize_t s_stride;
    int64_t slots;          /* S */
};

static inline int64_t cached_slot(const struct cached_rows *c, int64_t row)
{
    if (!c->slot_of)
        return -1;
    return c->wide ? ((const int64_t *)c->slot_of)[row] : ((const int32_t *)c->slot_of)[row];
}

/* A first pass over the lookups' map entries: the index of the first lookup whose row maps outside
 * [-1, S), or -1 (a damaged map is refused before any store, as a bad row is). */
static Py_ssize_t first_bad_slot(const struct cached_rows *c, const int64_t *rows, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; c->slot_of && i < count; i++) {
        const int64_t slot = cached_slot(c, rows[i]);
        if (slot < -1 || slot >= c->slots)
            return i;
    }
    return -1;
}

/* The index of the first of rows [count] that the map caches, or -1 (none, or no map). */
static Py_ssize_t first_cached(const struct cached_rows *c, const int64_t *rows, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; c->slot_of && i < count; i++)
        if (cached_slot(c, rows[i]) >= 0)
            return i;
    return -1;
}

struct update_args {
    int rule;
    float *weight;          /* [R, w_stride] floats, columns [0, dim) updated */
    Py_ssize_t w_stride;
    float *state;           /* [R, s_stride] floats, column 0 used (Adagrad only) */
    Py_ssize_t s_stride;
    int64_t table_rows;
    Py_ssize_t dim;
    const int64_t *indices; /* [N] */
    Py_ssize_t n;
    const float *grad_out;  /* [B, g_stride] floats: one gradient per bag */
    Py_ssize_t g_stride;
    Py_ssize_t bags;
    const int64_t *offsets; /* [B] bag starts, or NULL: lookup i is bag i (B == N) */
    int mean;               /* mode "mean": a lookup's gradient is its bag's times 1/len */
    const float *psw;       /* [N] per-sample weights (mode "sum" only), or NULL */
    float lr, eps;
    int64_t *out_rows;      /* [N]: the sorted unique rows, U of them */
    Py_ssize_t stop_after;  /* update only the first this many unique rows (crash tests); -1: all */
    struct fused_undo *undo; /* capture and update in one pass (an undo plan), or NULL */
    const int64_t *sorted;  /* [N] the lookups by row (sort_lookups' order, from unique_rows), or NULL:
                               sorted here. Checked before use (sorted_order_holds). */
    struct cached_rows cache; /* where cached rows live instead (no row map: every row is the table's) */
    int file_fd;            /* >= 0: table rows (not slots) are written to this file with pwrite, at */
    int64_t file_weight;    /* these offsets of row 0, not stored through the mapping (ops.FileRows) */
    int64_t file_state;
    int *write_errno;       /* set when such a write fails (the loop stops there) */
};

/* Where a row lives: its slot when the row map caches it (returns 1), else its table row (0). */
static inline int row_home(const struct update_args *a, int64_t row, float **w, float **s)
{
    const int64_t slot = cached_slot(&a->cache, row);
    if (slot >= 0) {
        *w = a->cache.weight + slot * a->cache.w_stride;
        *s = a->cache.state + slot * a->cache.s_stride;
        return 1;
    }
    *w = a->weight + row * a->w_stride;
    *s = a->state + row * a->s_stride;
    return 0;
}

static int pwrite_all(int fd, const void *data, size_t length, int64_t offset)
{
    const char *p = data;
    while (length) {
        ssize_t done = pwrite(fd, p, length, (off_t)offset);
        if (done < 0 && errno == EINTR)
            continue;
        if (done == 0)
            errno = EIO; /* no progress (a full disk can say so): never loop on it */
        if (done <= 0)
            return -1;
        p += done;
        length -= (size_t)done;
        offset += done;
    }
    return 0;
}

/* A table row's new values [dim] (and state) written to the file (a->file_fd), not stored through
 * the shared mapping: a sync must write-protect every page stored through a mapping, one TLB
 * shootdown each (docs/tiers.md, "Rows written to the file"); the page cache is the same either way,
 * so the mapping reads the new values at once. 0, or -1 with errno set. */
static int write_row_to_file(const struct update_args *a, int64_t row, const float *w, const float *s)
{
    if (pwrite_all(a->file_fd, w, (size_t)a->dim * 4, a->file_weight + row * a->w_stride * 4) != 0)
        return -1;
    if (a->rule != RULE_SGD && pwrite_all(a->file_fd, s, 4, a->file_state + row * a->s_stride * 4) != 0)
        return -1;
    return 0;
}

/* Stable LSD radix sort of lookup positions by row id (11-bit digits, only as many passes as the
 * table's row count needs): `order` ends up listing lookups by row, each row's in lookup order. */
int sort_lookups(const int64_t *keys, Py_ssize_t n, int64_t table_rows, int64_t *order)
{
    enum { BITS = 11, BUCKETS = 1 << BITS };
    int64_t *scratch = malloc((size_t)(n ? n : 1) * sizeof *scratch);
    Py_ssize_t *count = malloc(BUCKETS * sizeof *count);
    if (!scratch || !count) {
        free(scratch);
        free(count);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        order[i] = i;
    int key_bits = 0;
    while (key_bits < 63 && ((int64_t)1 << key_bits) < table_rows)
        key_bits++;
    int64_t *from = order, *to = scratch;
    for (int shift = 0; shift < key_bits; shift += BITS) {
        memset(count, 0, BUCKETS * sizeof *count);
        for (Py_ssize_t i = 0; i < n; i++)
            count[(keys[from[i]] >> shift) & (BUCKETS - 1)]++;
        Py_ssize_t sum = 0;
        for (int b = 0; b < BUCKETS; b++) {
            Py_ssize_t c = count[b];
            count[b] = sum;
            sum += c;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            to[count[(keys[from[i]] >> shift) & (BUCKETS - 1)]++] = from[i];
        int64_t *swap = from;
        from = to;
        to = swap;
    }
    if (from != order)
        memcpy(order, from, (size_t)n * sizeof *order);
    free(scratch);
    free(count);
    return 0;
}

/* Whether `order` [n] is exactly what sort_lookups gives for keys [n]: positions in [0, n) whose
 * (row id, position) pairs strictly increase. Distinct pairs make the positions distinct, so n of
 * them in [0, n) are a permutation, and the one sorted stably by row. O(n), no allocation. */
static int sorted_order_holds(const int64_t *keys, Py_ssize_t n, const int64_t *order)
{
    for (Py_ssize_t j = 0; j < n; j++) {
        if (order[j] < 0 || order[j] >= n)
            return 0;
        if (j && (keys[order[j - 1]] > keys[order[j]]
                  || (keys[order[j - 1]] == keys[order[j]] && order[j - 1] >= order[j])))
            return 0;
    }
    return 1;
}

/* One unique row: sum its lookups' gradients in lookup order, then apply the rule. The body is
 * compiled twice (plain x86-64 and AVX2+FMA); fmaf is exact either way, so both give equal bits.
 * stop_after cuts the loop short after that many rows: a crash test's kill lands inside this very
 * loop, with exactly those rows updated in place (-1 never matches). */
#define UPDATE_ROWS_BODY                                                                          \
    Py_ssize_t unique = 0;                                                                        \
    const Py_ssize_t dim = a->dim;                                                                \
    for (Py_ssize_t j = 0; j < a->n && unique != a->stop_after;) {                                \
        /* ORDERING U1h: the chunk's undo record (and a cached table's slots' record of it) is    \
         * written, durably, by its step list (undo.c) before this loop stores into the chunk's   \
         * first row or slot, or writes the row to the file (file_fd) (a crash test's stop step   \
         * stops it) */                                                                           \
        if (a->undo && unique == a->undo->next_start && undo_next_chunk(a->undo, a->out_rows, unique)) \
            break;                                                                                \
        const int64_t row = a->indices[order[j]];                                                 \
        float *w, *s;                                                                             \
        if (j + PREFETCH_ROWS < a->n) { /* a row some lookups ahead: its weights and state */     \
            row_home(a, a->indices[order[j + PREFETCH_ROWS]], &w, &s);                            \
            prefetch_row((const char *)w, (size_t)dim * 4, 1);                                    \
            if (a->rule != RULE_SGD)                                                              \
                __builtin_prefetch(s, 1);                                                         \
        }                                                                                         \
        /* the slot of a cached row, else the table row: read there; stored there, or put in     \
         * acc + dim (and s_new) and written to the file (file_fd) */                              \
        const int to_file = !row_home(a, row, &w, &s) && a->file_fd >= 0;                         \
        float *w_out = to_file ? acc + dim : w, s_new, *s_out = to_file ? &s_new : s;             \
        for (Py_ssize_t d = 0; d < dim; d++)                                                      \
            acc[d] = 0.0f;                                                                        \
        for (; j < a->n && a->indices[order[j]] == row; j++) {                                    \
            const Py_ssize_t i = order[j];                                                        \
            const float *g = a->grad_out + bag_of[i] * a->g_stride;                               \
            const float scale = scale_of[i];                                                      \
            if (scale_used)                                                                       \
                for (Py_ssize_t d = 0; d < dim; d++)                                              \
                    acc[d] += g[d] * scale;                                                       \
            else                                                                                  \
                for (Py_ssize_t d = 0; d < dim; d++)                                              \
                    acc[d] += g[d];                                                               \
        }                                                                                         \
        if (a->rule == RULE_SGD) {                                                                \
            for (Py_ssize_t d = 0; d < dim; d++)                                                  \
                w_out[d] = fmaf(-a->lr, acc[d], w[d]);                                            \
        } else {                                                                                  \
            float squares = 0.0f;                                                                 \
            for (Py_ssize_t d = 0; d < dim; d++)                                                  \
                squares += acc[d] * acc[d];                                                       \
            *s_out = *s + squares / (float)dim;                                                   \
            const float denom = sqrtf(*s_out) + a->eps;                                           \
            for (Py_ssize_t d = 0; d < dim; d++)                                                  \
                w_out[d] = fmaf(-a->lr, acc[d] / denom, w[d]);                                    \
        }                                                                                         \
        /* a write to the file is a store by other means: after its chunk's record (U1h above) */ \
        if (to_file && write_row_to_file(a, row, w_out, s_out) != 0) {                            \
            *a->write_errno = errno;                                                              \
            break;                                                                                \
        }                                                                                         \
        a->out_rows[unique++] = row;                                                              \
    }                                                                                             \
    return unique;

typedef Py_ssize_t (*update_rows_fn)(const struct update_args *, const int64_t *, const int64_t *,
                                     const float *, int, float *);

static Py_ssize_t update_rows_plain(const struct update_args *a, const int64_t *order, const int64_t *bag_of,
                                    const float *scale_of, int scale_used, float *acc)
{
    UPDATE_ROWS_BODY
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma")))
static Py_ssize_t update_rows_fma(const struct update_args *a, const int64_t *order, const int64_t *bag_of,
                                  const float *scale_of, int scale_used, float *acc)
{
    UPDATE_ROWS_BODY
}
#endif

static update_rows_fn update_rows = update_rows_plain;

/* 0 on success; 1 bad index (at *bad); 2 bad offsets; 4 a given order that is not the lookups' own;
 * 5 a row map entry outside the slots; -1 out of memory. */
static int sparse_update_nogil(const struct update_args *a, Py_ssize_t *unique, Py_ssize_t *bad)
{
    *bad = first_bad_row(a->indices, a->n, a->table_rows);
    if (*bad >= 0)
        return 1;
    if (a->sorted && !sorted_order_holds(a->indices, a->n, a->sorted))
        return 4;
    if (first_bad_slot(&a->cache, a->indices, a->n) >= 0)
        return 5;
    if (a->offsets && (a->bags < 1 || !offsets_hold(a->offsets, a->bags, a->n)))
        return 2;
    size_t n = (size_t)(a->n ? a->n : 1);
    int64_t *order = a->sorted ? NULL : malloc(n * sizeof *order); /* given: sorted once, by unique_rows */
    int64_t *bag_of = malloc(n * sizeof *bag_of);
    float *scale_of = malloc(n * sizeof *scale_of);
    float *acc = malloc((size_t)(a->dim ? 2 * a->dim : 1) * sizeof *acc); /* the sum, then a new row */
    int status = -1;
    if ((!a->sorted && !order) || !bag_of || !scale_of || !acc)
        goto out;
    /* Each lookup's bag and the factor its bag gradient is scaled by, as torch's reference does:
     * times (1/len) in mode "mean", then times its per-sample weight. */
    for (Py_ssize_t b = 0; b < a->bags; b++) {
        Py_ssize_t start = a->offsets ? a->offsets[b] : b;
        Py_ssize_t end = a->offsets ? (b + 1 < a->bags ? a->offsets[b + 1] : a->n) : b + 1;
        float reciprocal = 1.0f / (float)(end - start);
        for (Py_ssize_t i = start; i < end; i++) {
            bag_of[i] = b;
            scale_of[i] = a->mean ? reciprocal : a->psw ? a->psw[i] : 1.0f;
        }
    }
    if (order && sort_lookups(a->indices, a->n, a->table_rows, order) != 0)
        goto out;
    *unique = update_rows(a, order ? order : a->sorted, bag_of, scale_of, a->mean || a->psw, acc);
    if (a->undo) {
        undo_flush_rows(a->undo, a->out_rows, *unique); /* the last chunk's rows (or those before a stop) */
        if (!a->undo->stopped)
            undo_finish(a->undo);
    }
    status = 0;
out:
    free(order);
    free(bag_of);
    free(scale_of);
    free(acc);
    return status;
}

/* ---------------------------------------------------------------------------------------------
 * Whether every float32 of a block is finite: an exponent of all ones is inf or NaN. One pass the
 * compiler vectorises; torch.isfinite(x).all() costs several times more on a batch's gradients.
 * ------------------------------------------------------------------------------------------- */
static PyObject *all_finite(PyObject *self, PyObject *args)
{
    unsigned long long address;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "Kn", &address, &count))
        return NULL;
    const uint32_t *bits = (const uint32_t *)(uintptr_t)address;
    uint32_t bad = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        bad |= (uint32_t)((bits[i] & 0x7f800000u) == 0x7f800000u);
    return PyBool_FromLong(!bad);
}

/* ---------------------------------------------------------------------------------------------
 * The sorted unique rows of a lookup list (what an undo record holds), by the same radix sort
 * ------------------------------------------------------------------------------------------- */
/* 0 on success, 1 bad index (at *bad), -1 out of memory; *unique rows written to out. */
/* sorted: [n] receives the lookups' order (sort_lookups), or NULL: a scratch one is used. */
static int unique_rows_nogil(const int64_t *keys, Py_ssize_t n, int64_t table_rows, int64_t *out,
                             int64_t *sorted, Py_ssize_t *unique, Py_ssize_t *bad)
{
    *bad = first_bad_row(keys, n, table_rows);
    if (*bad >= 0)
        return 1;
    int64_t *order = sorted ? sorted : malloc((size_t)(n ? n : 1) * sizeof *order);
    int status = order && sort_lookups(keys, n, table_rows, order) == 0 ? 0 : -1;
    Py_ssize_t u = 0;
    for (Py_ssize_t i = 0; status == 0 && i < n; i++)
        if (u == 0 || keys[order[i]] != out[u - 1])
            out[u++] = keys[order[i]];
    if (!sorted)
        free(order);
    *unique = u;
    return status;
}

static PyObject *unique_rows(PyObject *self, PyObject *args)
{
    unsigned long long keys, out, sorted = 0;
    Py_ssize_t n, unique = 0, bad = -1;
    long long table_rows;
    if (!PyArg_ParseTuple(args, "KnLK|K", &keys, &n, &table_rows, &out, &sorted))
        return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = unique_rows_nogil((const int64_t *)(uintptr_t)keys, n, table_rows, (int64_t *)(uintptr_t)out,
                               (int64_t *)(uintptr_t)sorted, &unique, &bad);
    Py_END_ALLOW_THREADS
    if (status == 1)
        return raise_bad_row((const int64_t *)(uintptr_t)keys, bad, table_rows);
    if (status != 0)
        return PyErr_NoMemory();
    return PyLong_FromSsize_t(unique);
}

/* The cache's named fields (a dict: slot_of, wide, weight, w_stride, state, s_stride, slots), or
 * None: no cache. 0, or -1 with an exception set. */
static int cached_rows_read(PyObject *fields, struct cached_rows *c, int with_state)
{
    static char *names[] = {"slot_of", "wide", "weight", "w_stride", "state", "s_stride", "slots", NULL};
    unsigned long long slot_of, weight, state;
    *c = (struct cached_rows){0};
    if (fields == Py_None)
        return 0;
    if (named_fields(fields, "KpKnKnL:sparse_update's cache", names, &slot_of, &c->wide, &weight, &c->w_stride,
                     &state, &c->s_stride, &c->slots) < 0)
        return -1;
    c->slot_of = (const void *)(uintptr_t)slot_of;
    c->weight = (float *)(uintptr_t)weight;
    c->state = (float *)(uintptr_t)state;
    if (!c->slot_of || !c->weight || (with_state && !c->state) || c->slots < 0) {
        PyErr_SetString(PyExc_ValueError, "sparse_update: the cache needs its row map, slot weights and (Adagrad) "
                        "slot state");
        return -1;
    }
    return 0;
}

static PyObject *sparse_update(PyObject *self, PyObject *args)
{
    struct update_args a;
    struct fused_undo u, slots_undo;
    unsigned long long weight, state, indices, grad_out, offsets, psw, out_rows;
    long long table_rows;
    PyObject *undo_fields = Py_None, *cache_fields = Py_None, *slots_fields = Py_None, *file_fields = Py_None;
    if (!PyArg_ParseTuple(args, "iKnKnLnKnKnnKpKffKn|OOOO", &a.rule, &weight, &a.w_stride, &state, &a.s_stride,
                          &table_rows, &a.dim, &indices, &a.n, &grad_out, &a.g_stride, &a.bags, &offsets,
                          &a.mean, &psw, &a.lr, &a.eps, &out_rows, &a.stop_after, &undo_fields, &cache_fields,
                          &slots_fields, &file_fields))
        return NULL;
    int write_errno = 0;
    a.write_errno = &write_errno;
    a.file_fd = -1;
    a.file_weight = a.file_state = 0;
    if (file_fields != Py_None && !PyArg_ParseTuple(file_fields, "iLL:sparse_update's file rows", &a.file_fd,
                                                    &a.file_weight, &a.file_state))
        return NULL;
    if (cached_rows_read(cache_fields, &a.cache, a.rule != RULE_SGD) < 0)
        return NULL;
    if (a.rule != RULE_SGD && a.rule != RULE_ROWWISE_ADAGRAD) {
        PyErr_Format(PyExc_ValueError, "unknown update rule %d", a.rule);
        return NULL;
    }
    if (a.mean && psw) {
        PyErr_SetString(PyExc_ValueError, "per-sample weights need mode \"sum\"");
        return NULL;
    }
    if (!offsets && a.bags != a.n) {
        PyErr_SetString(PyExc_ValueError, "without offsets every lookup is its own bag: bags must equal lookups");
        return NULL;
    }
    a.table_rows = table_rows;
    a.weight = (float *)(uintptr_t)weight;
    a.state = (float *)(uintptr_t)state;
    a.indices = (const int64_t *)(uintptr_t)indices;
    a.grad_out = (const float *)(uintptr_t)grad_out;
    a.offsets = (const int64_t *)(uintptr_t)offsets;
    a.psw = (const float *)(uintptr_t)psw;
    a.out_rows = (int64_t *)(uintptr_t)out_rows;
    a.undo = NULL;
    a.sorted = NULL;
    if (undo_fields != Py_None) {
        if (undo_read(undo_fields, &u, (const char *)a.weight, a.w_stride * 4, (const char *)a.state,
                      a.rule == RULE_SGD ? 0 : a.s_stride * 4, a.table_rows) < 0)
            return NULL;
        a.undo = &u;
        if (u.lookup_order) {
            if (u.lookup_count != a.n) {
                PyErr_Format(PyExc_ValueError, "sparse_update: the undo plan's lookup order has %zd lookups, "
                             "the update %zd; nothing was written", u.lookup_count, a.n);
                return NULL;
            }
            a.sorted = u.lookup_order;
        }
        /* A cached row is updated in its slot, whose record is the slots' part (below) or the
         * caller's, written first (the records here name table rows); the write-back here would
         * flush table rows, not the slots. */
        if (a.cache.slot_of && u.write_back_rows) {
            PyErr_SetString(PyExc_ValueError, "sparse_update: a cached table's update writes no rows back itself "
                            "(its cached rows live in their slots); nothing was written");
            return NULL;
        }
    }
    if (slots_fields != Py_None) {
        /* the slots' records: weights and the whole state row (the map entry with it), chunk by
         * chunk of the same unique rows as the table's */
        if (!a.undo || !a.cache.slot_of || !a.cache.state) {
            PyErr_SetString(PyExc_ValueError, "sparse_update: the slots' records need the table's undo plan and "
                            "the cache with its slots' state; nothing was written");
            return NULL;
        }
        if (undo_read(slots_fields, &slots_undo, (const char *)a.cache.weight, a.cache.w_stride * 4,
                      (const char *)a.cache.state, a.cache.s_stride * 4, a.cache.slots) < 0)
            return NULL;
        if (slots_undo.chunks != u.chunks || slots_undo.chunk_rows != u.chunk_rows || slots_undo.write_back_rows
            || slots_undo.lookup_order) {
            PyErr_SetString(PyExc_ValueError, "sparse_update: the slots' undo plan must chunk the table's rows as "
                            "its plan does, and write no rows back; nothing was written");
            return NULL;
        }
        u.also = &slots_undo;
    }
    Py_ssize_t unique = 0, bad = -1;
    int status;
    Py_BEGIN_ALLOW_THREADS
    /* the rows to record are checked too, before any store (they are the update's own rows) */
    bad = a.undo ? first_bad_row(u.recorded, u.recorded_count, a.table_rows) : -1;
    status = bad >= 0 ? 3 : a.undo && first_cached(&a.cache, u.recorded, u.recorded_count) >= 0 ? 6
           : a.undo && u.also && first_bad_row(u.also->recorded, u.also->recorded_count, a.cache.slots) >= 0
                 ? 7 : sparse_update_nogil(&a, &unique, &bad);
    Py_END_ALLOW_THREADS
    if (status == 3)
        return raise_bad_row(u.recorded, bad, a.table_rows);
    if (status == 6) {
        PyErr_SetString(PyExc_ValueError, "sparse_update: the undo plan records a row the map caches (its slot, "
                        "not its table row, is updated); nothing was written");
        return NULL;
    }
    if (status == 7) {
        PyErr_Format(PyExc_ValueError, "sparse_update: the slots' undo plan records a slot outside the %lld "
                     "slots; nothing was written", (long long)a.cache.slots);
        return NULL;
    }
    if (status == 1)
        return raise_bad_row(a.indices, bad, a.table_rows);
    if (status == 2) {
        PyErr_Format(PyExc_ValueError, "offsets must start at 0, be non-decreasing and at most %zd; nothing was written",
                     a.n);
        return NULL;
    }
    if (status == 5) {
        PyErr_Format(PyExc_ValueError, "sparse_update: the row map sends a looked-up row outside the %lld slots; "
                     "nothing was written", (long long)a.cache.slots);
        return NULL;
    }
    if (status == 4) {
        PyErr_SetString(PyExc_ValueError, "sparse_update: the undo plan's lookup order is not these lookups' "
                        "sorted order; nothing was written");
        return NULL;
    }
    if (status < 0)
        return PyErr_NoMemory();
    if (write_errno) {
        errno = write_errno;
        return PyErr_SetFromErrno(PyExc_OSError); /* rows before it are written, as a crash leaves them */
    }
    if (a.undo)
        return Py_BuildValue("nin", unique, u.stopped, u.flush_runs);
    return PyLong_FromSsize_t(unique);
}

/* ---------------------------------------------------------------------------------------------
 * A cached table's lookups in one pass (the hot-row cache's forward): each lookup's row copied from
 * where it lives, its slot or its table row
 * ------------------------------------------------------------------------------------------- */
struct cached_gather {
    float *dst;             /* [N, dst_stride] */
    Py_ssize_t dst_stride;
    const float *table;     /* [R, t_stride] */
    Py_ssize_t t_stride;
    struct cached_rows cache;
    size_t row_bytes;
};

static inline const float *cached_home(const struct cached_gather *g, int64_t row, Py_ssize_t *hits)
{
    const int64_t slot = cached_slot(&g->cache, row);
    *hits += slot >= 0;
    return slot >= 0 ? g->cache.weight + slot * g->cache.w_stride : g->table + row * g->t_stride;
}

/* The lookups' rows into dst; returns how many came from a slot. */
static Py_ssize_t cached_gather_work(const struct cached_gather *g, const int64_t *rows, Py_ssize_t count)
{
    Py_ssize_t hits = 0, ahead = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + PREFETCH_ROWS < count) /* the home of a row some lookups ahead */
            prefetch_row((const char *)cached_home(g, rows[i + PREFETCH_ROWS], &ahead), g->row_bytes, 0);
        memcpy(g->dst + i * g->dst_stride, cached_home(g, rows[i], &hits), g->row_bytes);
    }
    return hits;
}

/* gather_cached(dst, table, t_stride, table_rows, cache, rows, count) -> hits: dst row i := the row
 * rows[i] from its slot where the cache (a dict, cached_rows_read) maps it, else from the table;
 * rows of t_stride floats. Rows and map entries are checked first: a bad one writes nothing. */
static PyObject *gather_cached(PyObject *self, PyObject *args)
{
    unsigned long long dst, table, rows_at;
    Py_ssize_t count, bad = -1, bad_slot = -1, hits = 0;
    long long table_rows;
    PyObject *cache_fields;
    struct cached_gather g;
    if (!PyArg_ParseTuple(args, "KKnLOKn", &dst, &table, &g.t_stride, &table_rows, &cache_fields, &rows_at, &count))
        return NULL;
    if (cache_fields == Py_None || cached_rows_read(cache_fields, &g.cache, 0) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "gather_cached needs the cache's row map and slots");
        return NULL;
    }
    if (g.cache.w_stride != g.t_stride) {
        PyErr_SetString(PyExc_ValueError, "gather_cached: the slots' rows must be as wide as the table's");
        return NULL;
    }
    g.dst = (float *)(uintptr_t)dst;
    g.dst_stride = g.t_stride;
    g.table = (const float *)(uintptr_t)table;
    g.row_bytes = (size_t)g.t_stride * sizeof(float);
    const int64_t *rows = (const int64_t *)(uintptr_t)rows_at;
    Py_BEGIN_ALLOW_THREADS
    bad = first_bad_row(rows, count, table_rows);
    bad_slot = bad < 0 ? first_bad_slot(&g.cache, rows, count) : -1;
    if (bad < 0 && bad_slot < 0)
        hits = cached_gather_work(&g, rows, count);
    Py_END_ALLOW_THREADS
    if (bad >= 0)
        return raise_bad_row(rows, bad, table_rows);
    if (bad_slot >= 0) {
        PyErr_Format(PyExc_ValueError, "gather_cached: the row map sends row %lld outside the %lld slots",
                     (long long)rows[bad_slot], (long long)g.cache.slots);
        return NULL;
    }
    return PyLong_FromSsize_t(hits);
}

/* ---------------------------------------------------------------------------------------------
 * Undo capture with non-temporal stores
 * ------------------------------------------------------------------------------------------- */
struct undo_capture {
    struct row_copy weights, state; /* gathers into the payload's first two blocks */
    char *old_rows;                 /* its third block: the row ids */
};

static Py_ssize_t capture_work(const void *args, const int64_t *rows, Py_ssize_t count)
{
    const struct undo_capture *u = args;
    copy_rows_work(&u->weights, rows, count);
    if (u->state.row_bytes)
        copy_rows_work(&u->state, rows, count);
    pm_stream_copy(u->old_rows, (const char *)rows, (size_t)count * sizeof *rows);
    pm_fence(); /* non-temporal stores are weakly ordered: order them before what follows */
    return count;
}

static PyObject *capture_undo(PyObject *self, PyObject *args)
{
    unsigned long long old_weights, old_state, old_rows, weights, state, rows;
    Py_ssize_t row_bytes, state_bytes, count;
    long long table_rows;
    if (!PyArg_ParseTuple(args, "KKKKnKnLKn", &old_weights, &old_state, &old_rows, &weights, &row_bytes, &state,
                          &state_bytes, &table_rows, &rows, &count))
        return NULL;
    if ((row_bytes | state_bytes) & 3 || (old_weights | old_state | old_rows | weights | state) & 3) {
        PyErr_SetString(PyExc_ValueError, "capture_undo needs 4-byte aligned rows and blocks");
        return NULL;
    }
    struct undo_capture u = {
        .weights = {(char *)(uintptr_t)old_weights, row_bytes, (const char *)(uintptr_t)weights, row_bytes,
                    (size_t)row_bytes, 0, pm_stream_copy},
        .state = {(char *)(uintptr_t)old_state, state_bytes, (const char *)(uintptr_t)state, state_bytes,
                  (size_t)state_bytes, 0, pm_stream_copy},
        .old_rows = (char *)(uintptr_t)old_rows,
    };
    return run_checked(capture_work, &u, (const int64_t *)(uintptr_t)rows, count, table_rows);
}

/* ---------------------------------------------------------------------------------------------
 * Flushing row sets
 * ------------------------------------------------------------------------------------------- */

struct row_flush {
    char *base;
    Py_ssize_t stride;
    pm_flush_fn flush;
    void (*drain)(void); /* NULL: pm_fence */
    int do_drain;
};

static void flush_run(const void *args, int64_t first, Py_ssize_t length)
{
    const struct row_flush *f = args;
    f->flush(f->base + first * f->stride, (size_t)(length * f->stride));
}

static Py_ssize_t flush_work(const void *args, const int64_t *rows, Py_ssize_t count)
{
    const struct row_flush *f = args;
    Py_ssize_t runs = for_each_run(f, rows, count, flush_run);
    if (f->do_drain) {
        if (f->drain)
            f->drain();
        else
            pm_fence();
    }
    return runs;
}

static PyObject *flush_rows(PyObject *self, PyObject *args)
{
    unsigned long long base, rows, flush, drain;
    Py_ssize_t count;
    long long table_rows;
    struct row_flush f;
    if (!PyArg_ParseTuple(args, "KnLKnKKp", &base, &f.stride, &table_rows, &rows, &count, &flush, &drain,
                          &f.do_drain))
        return NULL;
    f.base = (char *)(uintptr_t)base;
    f.flush = (pm_flush_fn)(uintptr_t)flush;
    f.drain = (void (*)(void))(uintptr_t)drain;
    f.flush = pm_flush_or_cpu(f.flush);
    if (!f.flush) {
        PyErr_SetString(PyExc_RuntimeError,
                        "no flush available: libpmem is absent and the CPU has neither CLWB nor CLFLUSHOPT");
        return NULL;
    }
    return run_checked(flush_work, &f, (const int64_t *)(uintptr_t)rows, count, table_rows);
}

struct line_copy {
    const char *view;
    char *media;
    Py_ssize_t map_size, offset, stride;
};

/* Offsets are from the mapping's start, which is page aligned, so they round to lines as addresses do. */
static void copy_lines_run(const void *args, int64_t first, Py_ssize_t length)
{
    const struct line_copy *c = args;
    const size_t start = (size_t)(c->offset + first * c->stride);
    pm_copy_lines(c->view, c->media, start, start + (size_t)(length * c->stride), (size_t)c->map_size);
}

static Py_ssize_t copy_lines_work(const void *args, const int64_t *rows, Py_ssize_t count)
{
    return for_each_run(args, rows, count, copy_lines_run);
}

static PyObject *copy_lines(PyObject *self, PyObject *args)
{
    unsigned long long view, media, rows;
    Py_ssize_t count;
    long long table_rows;
    struct line_copy c;
    if (!PyArg_ParseTuple(args, "KKnnnLKn", &view, &media, &c.map_size, &c.offset, &c.stride, &table_rows, &rows,
                          &count))
        return NULL;
    if (c.offset < 0 || c.stride <= 0 || table_rows < 0 || c.offset + table_rows * c.stride > c.map_size) {
        PyErr_SetString(PyExc_ValueError, "copy_lines: the table does not lie inside the mapping");
        return NULL;
    }
    c.view = (const char *)(uintptr_t)view;
    c.media = (char *)(uintptr_t)media;
    return run_checked(copy_lines_work, &c, (const int64_t *)(uintptr_t)rows, count, table_rows);
}

static PyObject *crc32(PyObject *self, PyObject *args)
{
    Py_buffer data;
    unsigned int seed;
    if (!PyArg_ParseTuple(args, "y*I", &data, &seed)) /* any C-contiguous buffer: no address lookup in Python */
        return NULL;
    uint32_t crc;
    if (data.len >= (64 << 10)) {
        Py_BEGIN_ALLOW_THREADS
        crc = crc32_update(seed, (const unsigned char *)data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = crc32_update(seed, (const unsigned char *)data.buf, (size_t)data.len);
    }
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc);
}

/* ---------------------------------------------------------------------------------------------
 * A dense snapshot's payload in one pass
 * ------------------------------------------------------------------------------------------- */
/* Pieces at least this long go around the caches (as libpmem's pmem_memcpy does for large copies);
 * shorter ones, and the unaligned ends of long ones, are stored and written back line by line. */
enum { STREAM_PIECE_BYTES = 16 << 10 };

/* The payload's pieces [n] (sources[i]: lengths[i] bytes), stored back to back from dst and made
 * durable; returns their CRC-32 continued from seed, summed from the sources as they are copied. */
static uint32_t stream_pieces_nogil(const struct pm_domain *d, char *dst, const int64_t *sources,
                                    const int64_t *lengths, Py_ssize_t n, uint32_t seed)
{
    char *const first = dst;
    uint32_t crc = seed;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *src = (const char *)(uintptr_t)sources[i];
        const size_t len = (size_t)lengths[i];
        crc = crc32_update(crc, (const unsigned char *)src, len);
        size_t head = len, body = 0;
#if defined(__x86_64__)
        if (len >= STREAM_PIECE_BYTES) {
            /* whole cache lines only: a line is either streamed or stored and written back */
            head = (CACHE_LINE - ((uintptr_t)dst & (CACHE_LINE - 1))) & (CACHE_LINE - 1);
            body = (len - head) & ~(size_t)(CACHE_LINE - 1);
            pm_stream_copy(dst + head, src + head, body);
        }
#endif
        /* the ends around the streamed body (all of a short piece): stored, then written back (on the
         * power-loss emulator the whole payload's lines are copied once, at the end) */
        const size_t tail = head + body;
        memcpy(dst, src, head);
        memcpy(dst + tail, src + tail, len - tail);
        if (d->kind == PM_LINES) {
            pm_write_back(d, dst, head);
            pm_write_back(d, dst + tail, len - tail);
        }
        dst += len;
    }
    /* the streamed stores and the write-backs are complete before the caller's header (on the
     * emulator, then the payload's lines copied) */
    pm_persist(d, first, (size_t)(dst - first), PM_STREAMED);
    return crc;
}

/* stream_pieces(dst, capacity, persistence, sources, lengths, n, seed) -> crc: persistence is a
 * NativePersistence of kind LINES or MEDIA */
static PyObject *stream_pieces(PyObject *self, PyObject *args)
{
    unsigned long long dst, sources, lengths;
    PyObject *persistence;
    unsigned int seed;
    struct pm_domain d;
    Py_ssize_t capacity, n;
    if (!PyArg_ParseTuple(args, "KnOKKnI", &dst, &capacity, &persistence, &sources, &lengths, &n, &seed))
        return NULL;
    if (pm_domain_from(persistence, &d, "stream_pieces") < 0)
        return NULL;
    if (d.kind != PM_LINES && d.kind != PM_MEDIA) {
        PyErr_SetString(PyExc_ValueError, "stream_pieces: the write-back must flush lines or copy them to the media");
        return NULL;
    }
    if (capacity < 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "stream_pieces: a negative capacity or count");
        return NULL;
    }
    const int64_t *len = (const int64_t *)(uintptr_t)lengths;
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (len[i] < 0 || (size_t)len[i] > (size_t)capacity - total) {
            PyErr_SetString(PyExc_ValueError, "stream_pieces: the pieces are longer than the room at dst");
            return NULL;
        }
        total += (size_t)len[i];
    }
    if (!pm_domain_holds(&d, (const void *)(uintptr_t)dst, total)) {
        PyErr_SetString(PyExc_ValueError, "stream_pieces: the payload does not lie inside the mapping");
        return NULL;
    }
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = stream_pieces_nogil(&d, (char *)(uintptr_t)dst, (const int64_t *)(uintptr_t)sources, len, n, seed);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(crc);
}

/* addresses(a, b, ...): the address of each C-contiguous buffer's first byte (None: 0), in one call:
 * numpy's `ndarray.ctypes.data` builds an object per array, which the per-table path paid ~20 times. */
static PyObject *addresses(PyObject *self, PyObject *args)
{
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *out = PyTuple_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(args, i);
        uintptr_t address = 0;
        if (item != Py_None) {
            Py_buffer view;
            if (PyObject_GetBuffer(item, &view, PyBUF_C_CONTIGUOUS) < 0) {
                Py_DECREF(out);
                return NULL;
            }
            address = (uintptr_t)view.buf;
            PyBuffer_Release(&view);
        }
        PyObject *value = PyLong_FromUnsignedLongLong((unsigned long long)address);
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, value);
    }
    return out;
}

/* crc32_path([name]): the path in use, after switching to `name` (tests check every path the CPU has). */
static PyObject *crc32_path_py(PyObject *self, PyObject *args)
{
    const char *name = NULL, *best;
    if (!PyArg_ParseTuple(args, "|s", &name))
        return NULL;
    const char *path = crc32_path(name, &best);
    if (path == NULL) {
        PyErr_Format(PyExc_ValueError, "crc32 path %s is not one this CPU has (the best is %s)", name, best);
        return NULL;
    }
    return PyUnicode_FromString(path);
}

static PyObject *cpu_flush_name(PyObject *self, PyObject *unused)
{
    return PyUnicode_FromString(pm_cpu_flush_name());
}

static void detect_cpu(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        update_rows = update_rows_fma;
#endif
    pm_init();
    crc32_init();
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(dst, dst_stride, src, src_stride, row_bytes, scatter, table_rows, rows, count): gather "
     "(scatter false: dst row i := src row rows[i]) or scatter (dst row rows[i] := src row i)"},
    {"sparse_update", sparse_update, METH_VARARGS,
     "sparse_update(rule, weight, w_stride, state, s_stride, table_rows, dim, indices, n, grad_out, g_stride, "
     "bags, offsets, mean, psw, lr, eps, out_rows, stop_after[, undo[, cache[, slots_undo]]]) -> unique rows "
     "updated (all of them, or stop_after when that is fewer; -1: no stop); undo: the undo writer's fields (a "
     "dict, undo.c undo_read): the records written chunk by chunk by its step list, and then (unique, stopped "
     "phase, runs written back); cache: the row map and slot arrays (a dict, cached_rows_read), each cached row "
     "updated in its slot; slots_undo: the slots' records, written as undo's, each chunk's after the table's"},
    {"gather_cached", gather_cached, METH_VARARGS,
     "gather_cached(dst, table, t_stride, table_rows, cache, rows, count) -> hits: each lookup's row from its "
     "slot (cache: the row map and slot arrays, as sparse_update's) or its table row"},
    {"all_finite", all_finite, METH_VARARGS, "all_finite(address, count) -> whether count float32s are all finite"},
    {"unique_rows", unique_rows, METH_VARARGS,
     "unique_rows(keys, n, table_rows, out[, sorted]) -> U: the sorted distinct row ids of keys [n] into out [U]; "
     "sorted [n], when given, receives the lookups' positions by row (what sparse_update would sort)"},
    {"asked_rows", asked_rows, METH_VARARGS,
     "asked_rows(keys, n, table_rows, copies, h, spans, cold, positions) -> (U, starts, counts): the distinct keys "
     "not among the copies into cold [U] (ascending), each holder span's run of them (spans: a flat tuple of lo, hi "
     "pairs; starts, counts: tuples), and each key's row of the holders' answers (in span order) then the copies, "
     "into positions [n]"},
    {"add_bags_to_rows", add_bags_to_rows, METH_VARARGS,
     "add_bags_to_rows(grad, bags, g_stride, offsets, positions, n, out, rows, dim): out[positions[i]] += the "
     "gradient of lookup i's bag, in lookup order"},
    {"undo_chunk_counts", undo_chunk_counts, METH_VARARGS,
     "undo_chunk_counts(rows, U, recorded, V, chunk_rows, header_bytes, row_payload, align, rec_first, sizes[, "
     "slots]) -> (records, total bytes[, V, slots recorded, slots' bytes]): the fused update's undo records, per "
     "chunk (slots: a cached table's, a dict; each chunk's slots' record after its table record)"},
    {"undo_chunk_headers", undo_chunk_headers, METH_VARARGS,
     "undo_chunk_headers(template, seq, rec_first, chunks, sizes, offsets, run_start, row_payload, rec_offset, "
     "headers[, slot_template, slot_first, slot_row_payload, slot_offset, slot_headers]): each chunk's record "
     "offset and header (and its slots')"},
    {"capture_undo", capture_undo, METH_VARARGS,
     "capture_undo(old_weights, old_state, old_rows, weights, row_bytes, state, state_bytes, table_rows, rows, "
     "count)"},
    {"flush_rows", flush_rows, METH_VARARGS,
     "flush_rows(base, stride, table_rows, rows, count, flush_fn, drain_fn, drain) -> runs written back"},
    {"copy_lines", copy_lines, METH_VARARGS,
     "copy_lines(view, media, map_size, offset, stride, table_rows, rows, count) -> runs copied"},
    {"cpu_flush", cpu_flush_name, METH_NOARGS, "the cache-line flush instruction used without libpmem"},
    {"crc32", crc32, METH_VARARGS, "crc32(buffer, seed) -> zlib.crc32 of a C-contiguous buffer's bytes, continuing seed"},
    {"stream_pieces", stream_pieces, METH_VARARGS,
     "stream_pieces(dst, capacity, persistence, sources, lengths, n, seed) -> crc32: pieces stored back to back "
     "from dst (at most capacity bytes), durably, as a NativePersistence of kind LINES or MEDIA says"},
    {"addresses", addresses, METH_VARARGS,
     "addresses(*buffers) -> tuple of each C-contiguous buffer's address (None: 0)"},
    {"crc32_path", crc32_path_py, METH_VARARGS,
     "crc32_path([name]) -> how crc32 folds (\"bytes\", \"pclmul\", \"vpclmul\"), after switching to name"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", "Native CPU row kernels (private).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__rows(void)
{
    detect_cpu();
    PyObject *m = PyModule_Create(&module);
#if defined(__x86_64__)
    const int streams = 1;
#else
    const int streams = 0;
#endif
    /* STREAMS: capture_undo writes with non-temporal stores (else ordinary ones, to be flushed);
     * UNDO_LAYOUT, UNDO_STEPS: the undo writer's (undo.c), checked by cxltrain/checkpoint/fused.py */
    if (m && (PyModule_AddIntConstant(m, "STREAMS", streams) < 0 || undo_add_constants(m) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}