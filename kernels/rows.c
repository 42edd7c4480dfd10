/*
 * Native CPU row kernels: cxltrain.kernels._rows (a private module; call it through
 * cxltrain/kernels/ops.py and native.py, which check every tensor before handing over addresses).
 *
 * Each call works on a whole row set (one table, one batch) with the GIL released; nothing loops
 * per row in Python. Every kernel checks each row index against the table's row count in a first
 * pass, before its first store, so a bad index is refused with nothing written.
 *
 *   copy_rows                    gather or scatter whole rows between a table and a dense block
 *   sparse_update                duplicate reduction + SGD or row-wise Adagrad, in place
 *   unique_rows                  the sorted distinct row ids of a lookup list (an undo record's rows)
 *   all_finite                   whether a float32 block holds no inf or NaN (gradients, before an update)
 *   capture_undo                 old weights, old state and row ids into an undo-record payload,
 *                                with non-temporal stores and one SFENCE
 *   flush_rows                   write back each run of adjacent rows (libpmem's pmem_flush, or
 *                                CLWB/CLFLUSHOPT), optionally followed by one drain; returns the runs
 *   copy_lines                   the power-loss emulator's flush: whole 64-byte lines of each run
 *                                of rows copied from the process's view to the media view; returns the runs
 *                                (with an undo plan, the undo capture folded in: chunk by chunk of the
 *                                unique rows, their undo record durable, then their update in place)
 *   crc32                        zlib's CRC-32, folded with carry-less multiply where the CPU has it
 *
 * Determinism: floats are added in a fixed order (a row's gradients in lookup order), the build
 * turns off implicit FMA contraction (-ffp-contract=off), and the update steps use explicit fmaf,
 * which is one IEEE rounding on every CPU. That is also what torch's CPU kernels compute for
 * `w.add_(g, alpha=-lr)`, so SGD matches torch bit for bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#define CACHE_LINE 64

/* A first pass over the rows: the index of the first one outside [0, limit), or -1. */
static Py_ssize_t first_bad_row(const int64_t *rows, Py_ssize_t count, int64_t limit)
{
    for (Py_ssize_t i = 0; i < count; i++)
        if (rows[i] < 0 || rows[i] >= limit)
            return i;
    return -1;
}

static PyObject *raise_bad_row(const int64_t *rows, Py_ssize_t at, int64_t limit)
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

/* Call run(args, first row, rows in the run) once per run of adjacent rows; returns the runs. */
typedef void (*run_fn)(const void *args, int64_t first, Py_ssize_t length);

static Py_ssize_t for_each_run(const void *args, const int64_t *rows, Py_ssize_t count, run_fn run)
{
    Py_ssize_t runs = 0;
    for (Py_ssize_t i = 0; i < count; runs++) {
        Py_ssize_t j = i + 1;
        while (j < count && rows[j] == rows[j - 1] + 1)
            j++;
        run(args, rows[i], j - i);
        i = j;
    }
    return runs;
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

/* Rows ahead of the copy whose lines are prefetched: a table's rows are scattered over a region far
 * larger than the caches, and one row's miss at a time would leave the copy waiting on memory
 * latency (measured: ~2x slower undo capture without it). */
#define PREFETCH_ROWS 16

static void prefetch_row(const char *row, size_t row_bytes, int for_write)
{
    for (size_t at = 0; at < row_bytes; at += CACHE_LINE) {
        if (for_write)
            __builtin_prefetch(row + at, 1);
        else
            __builtin_prefetch(row + at, 0);
    }
}

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

/* A cache-line write-back of a range (libpmem's pmem_flush, or CLWB/CLFLUSHOPT), and a drain. */
typedef void (*flush_fn)(const void *, size_t);
typedef void (*drain_fn)(void);

/* How the fused update writes its updated rows back (U2's flush; the commit drains later). */
enum row_flush_kind { ROW_FLUSH_CALLER = 0, ROW_FLUSH_CACHE_LINES = 1, ROW_FLUSH_MEDIA_COPY = 2,
                     ROW_FLUSH_PLANTED_SKIP = 3 /* planted U2 bug: the runs counted, nothing written back */ };

/* How a native kernel writes back what it stored (U2's flush, no drain), as the device would: a
 * Python RowFlush (kernels/native.py), read by read_write_back. */
struct write_back {
    int kind;           /* enum row_flush_kind */
    flush_fn flush;     /* ROW_FLUSH_CACHE_LINES: this flush of each range */
    const char *view;   /* ROW_FLUSH_MEDIA_COPY: whole lines copied from the mapping at view ... */
    char *media;        /* ... to its media mapping, ... */
    size_t map_size;    /* ... never past this size */
};

/* sparse_update's undo side, with an undo plan (the fused capture): the batch's unique rows U are taken in chunks of `chunk_rows`; before
 * the update reaches a chunk's first row, the chunk's rows that need a record (`recorded`, a sorted
 * subset of the unique rows: capture once per commit window) are written into that chunk's own
 * undo record, an ordinary ring record whose place, header template and checksum seeds the caller
 * laid out (checkpoint/ring.py). Per chunk (U1 per chunk, docs/architecture.md):
 *   1. payload: old weights, old state, row ids, with non-temporal stores, its checksum taken from
 *      the source rows as they are read; persisted (SFENCE, or copied to the media view)
 *   2. header (checksums filled in) and then the ring's tail mark covering it (two copies, one after
 *      the other), each stored and persisted
 *   3. the chunk's rows updated in place (the update loop), from the cache the capture filled
 *   4. with a row flush, the chunk's updated rows (weights and state) written back while this core
 *      still holds them, as the table's device flushes (U2: no drain here, the commit drains before
 *      the root); without one, the caller flushes the rows after the call.
 * Nothing here is allocated or checked after the first store: every index was checked before. */
struct fused_undo {
    char *ring;                   /* the ring region's first byte, in the process's mapping */
    char *media;                  /* the power-loss emulator's media mapping of the same bytes, or NULL:
                                     then a persist is SFENCE (streamed stores) */
    const int64_t *recorded;      /* [V] the rows to record, sorted */
    Py_ssize_t chunk_rows, chunks;
    const int64_t *rec_offset;    /* [chunks] ring offset of the chunk's record; -1: none (no recorded row) */
    const int64_t *rec_first;     /* [chunks + 1] the chunk's recorded rows are recorded[rec_first[c], rec_first[c+1]) */
    unsigned char *headers;       /* [chunks, 64] header templates, checksum fields zero (filled in here) */
    uint32_t payload_seed;        /* the payload checksums' seed before the record's seq (pool UUID, generation) */
    uint32_t header_seed;         /* the header checksum's (pool UUID, generation) */
    const unsigned char *tails;   /* [2, 64] the tail mark's two copies, seq_end and checksum zero */
    const uint32_t *tail_seeds;   /* [2] each copy's checksum seed (pool UUID, copy) */
    Py_ssize_t tail_offset;       /* the tail mark's ring offset */
    const char *weights, *state;  /* the table's rows (source of the capture) */
    Py_ssize_t row_bytes, state_bytes;
    int order;                    /* 0 as above; planted bugs: 1 header before payload, 2 update before header */
    Py_ssize_t stop_chunk;        /* crash tests: stop in this chunk ... */
    int stop_phase;               /* ... after step 1 (1) or step 2 (2); 0: never */
    struct write_back rows;       /* step 4 (read_plan checked a media copy's mapping holds the table) */
    /* progress */
    Py_ssize_t next, next_start;  /* the chunk to capture next, and the unique row it starts at (-1: none) */
    int stopped;                  /* the phase a crash test stopped at (the update loop stops too) */
    Py_ssize_t flushed;           /* the update's first `flushed` unique rows are written back (step 4) ... */
    Py_ssize_t flush_runs;        /* ... in this many runs of adjacent rows */
};
static int undo_next_chunk(struct fused_undo *u, const int64_t *updated, Py_ssize_t count);
static void undo_flush_rows(struct fused_undo *u, const int64_t *updated, Py_ssize_t count);
static void undo_finish(struct fused_undo *u);

/* The undo plan sparse_update may take (int64 [FUSED_PLAN_SIZE], kernels/ops.py lays it out). */
enum fused_plan {
    PLAN_RING, PLAN_MEDIA, PLAN_RECORDED, PLAN_RECORDED_COUNT, PLAN_CHUNK_ROWS, PLAN_CHUNKS, PLAN_REC_OFFSET,
    PLAN_REC_FIRST, PLAN_HEADERS, PLAN_PAYLOAD_SEED, PLAN_HEADER_SEED, PLAN_TAILS, PLAN_TAIL_OFFSET, PLAN_ORDER,
    PLAN_STOP_CHUNK, PLAN_STOP_PHASE, PLAN_STOPPED, PLAN_TAIL_SEEDS, PLAN_LOOKUP_ORDER, PLAN_LOOKUP_COUNT,
    PLAN_ROW_FLUSH, PLAN_ROW_FLUSH_ARG, PLAN_MAP_START, PLAN_MAP_END, PLAN_FLUSH_RUNS, FUSED_PLAN_SIZE
};

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
};

/* Stable LSD radix sort of lookup positions by row id (11-bit digits, only as many passes as the
 * table's row count needs): `order` ends up listing lookups by row, each row's in lookup order. */
static int sort_lookups(const int64_t *keys, Py_ssize_t n, int64_t table_rows, int64_t *order)
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
        if (a->undo && unique == a->undo->next_start && undo_next_chunk(a->undo, a->out_rows, unique)) \
            break; /* undo plan: the next chunk's undo record first (a crash test may stop) */ \
        const int64_t row = a->indices[order[j]];                                                 \
        if (j + PREFETCH_ROWS < a->n) { /* a row some lookups ahead: its weights and state */     \
            const int64_t ahead = a->indices[order[j + PREFETCH_ROWS]];                           \
            prefetch_row((const char *)(a->weight + ahead * a->w_stride), (size_t)dim * 4, 1);    \
            if (a->rule != RULE_SGD)                                                              \
                __builtin_prefetch(a->state + ahead * a->s_stride, 1);                            \
        }                                                                                         \
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
        float *w = a->weight + row * a->w_stride;                                                 \
        if (a->rule == RULE_SGD) {                                                                \
            for (Py_ssize_t d = 0; d < dim; d++)                                                  \
                w[d] = fmaf(-a->lr, acc[d], w[d]);                                                \
        } else {                                                                                  \
            float squares = 0.0f;                                                                 \
            for (Py_ssize_t d = 0; d < dim; d++)                                                  \
                squares += acc[d] * acc[d];                                                       \
            float *s = a->state + row * a->s_stride;                                              \
            *s = *s + squares / (float)dim;                                                       \
            const float denom = sqrtf(*s) + a->eps;                                               \
            for (Py_ssize_t d = 0; d < dim; d++)                                                  \
                w[d] = fmaf(-a->lr, acc[d] / denom, w[d]);                                        \
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
 * -1 out of memory. */
static int sparse_update_nogil(const struct update_args *a, Py_ssize_t *unique, Py_ssize_t *bad)
{
    *bad = first_bad_row(a->indices, a->n, a->table_rows);
    if (*bad >= 0)
        return 1;
    if (a->sorted && !sorted_order_holds(a->indices, a->n, a->sorted))
        return 4;
    if (a->offsets) {
        if (a->bags < 1 || a->offsets[0] != 0)
            return 2;
        for (Py_ssize_t b = 1; b < a->bags; b++)
            if (a->offsets[b] < a->offsets[b - 1] || a->offsets[b] > a->n)
                return 2;
    }
    size_t n = (size_t)(a->n ? a->n : 1);
    int64_t *order = a->sorted ? NULL : malloc(n * sizeof *order); /* given: sorted once, by unique_rows */
    int64_t *bag_of = malloc(n * sizeof *bag_of);
    float *scale_of = malloc(n * sizeof *scale_of);
    float *acc = malloc((size_t)(a->dim ? a->dim : 1) * sizeof *acc);
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

struct update_args;
static int read_plan(const int64_t *plan, const struct update_args *a, struct fused_undo *u);

static PyObject *sparse_update(PyObject *self, PyObject *args)
{
    struct update_args a;
    struct fused_undo u;
    unsigned long long weight, state, indices, grad_out, offsets, psw, out_rows, plan = 0;
    long long table_rows;
    if (!PyArg_ParseTuple(args, "iKnKnLnKnKnnKpKffKn|K", &a.rule, &weight, &a.w_stride, &state, &a.s_stride,
                          &table_rows, &a.dim, &indices, &a.n, &grad_out, &a.g_stride, &a.bags, &offsets,
                          &a.mean, &psw, &a.lr, &a.eps, &out_rows, &a.stop_after, &plan))
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
    int64_t *undo_plan = (int64_t *)(uintptr_t)plan;
    if (undo_plan) {
        if (read_plan(undo_plan, &a, &u) < 0)
            return NULL;
        a.undo = &u;
        if (undo_plan[PLAN_LOOKUP_ORDER]) {
            if (undo_plan[PLAN_LOOKUP_COUNT] != a.n) {
                PyErr_Format(PyExc_ValueError, "sparse_update: the undo plan's lookup order has %lld lookups, "
                             "the update %zd; nothing was written", (long long)undo_plan[PLAN_LOOKUP_COUNT], a.n);
                return NULL;
            }
            a.sorted = (const int64_t *)(uintptr_t)undo_plan[PLAN_LOOKUP_ORDER];
        }
    }
    Py_ssize_t unique = 0, bad = -1;
    int status;
    Py_BEGIN_ALLOW_THREADS
    /* the rows to record are checked too, before any store (they are the update's own rows) */
    bad = a.undo ? first_bad_row(u.recorded, (Py_ssize_t)undo_plan[PLAN_RECORDED_COUNT], a.table_rows) : -1;
    status = bad >= 0 ? 3 : sparse_update_nogil(&a, &unique, &bad);
    Py_END_ALLOW_THREADS
    if (status == 3)
        return raise_bad_row(u.recorded, bad, a.table_rows);
    if (status == 1)
        return raise_bad_row(a.indices, bad, a.table_rows);
    if (status == 2) {
        PyErr_Format(PyExc_ValueError, "offsets must start at 0, be non-decreasing and at most %zd; nothing was written",
                     a.n);
        return NULL;
    }
    if (status == 4) {
        PyErr_SetString(PyExc_ValueError, "sparse_update: the undo plan's lookup order is not these lookups' "
                        "sorted order; nothing was written");
        return NULL;
    }
    if (status < 0)
        return PyErr_NoMemory();
    if (a.undo) {
        undo_plan[PLAN_STOPPED] = u.stopped;
        undo_plan[PLAN_FLUSH_RUNS] = u.flush_runs;
    }
    return PyLong_FromSsize_t(unique);
}

/* ---------------------------------------------------------------------------------------------
 * Undo capture with non-temporal stores
 * ------------------------------------------------------------------------------------------- */
/* Copy n bytes (a multiple of 4, both ends 4-byte aligned) around the caches. */
static void stream_copy(char *dst, const char *src, size_t n)
{
#if defined(__x86_64__)
    while (n >= 4 && ((uintptr_t)dst & 15)) {
        int v;
        memcpy(&v, src, 4);
        _mm_stream_si32((int *)dst, v);
        dst += 4, src += 4, n -= 4;
    }
    for (; n >= 16; dst += 16, src += 16, n -= 16)
        _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
    for (; n >= 4; dst += 4, src += 4, n -= 4) {
        int v;
        memcpy(&v, src, 4);
        _mm_stream_si32((int *)dst, v);
    }
#endif
    memcpy(dst, src, n); /* other CPUs: ordinary stores (the caller persists the payload anyway) */
}

static void store_fence(void)
{
#if defined(__x86_64__)
    _mm_sfence();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

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
    stream_copy(u->old_rows, (const char *)rows, (size_t)count * sizeof *rows);
    store_fence(); /* non-temporal stores are weakly ordered: order them before what follows */
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
                    (size_t)row_bytes, 0, stream_copy},
        .state = {(char *)(uintptr_t)old_state, state_bytes, (const char *)(uintptr_t)state, state_bytes,
                  (size_t)state_bytes, 0, stream_copy},
        .old_rows = (char *)(uintptr_t)old_rows,
    };
    return run_checked(capture_work, &u, (const int64_t *)(uintptr_t)rows, count, table_rows);
}

/* ---------------------------------------------------------------------------------------------
 * Flushing row sets
 * ------------------------------------------------------------------------------------------- */

enum cpu_flush { CPU_FLUSH_NONE = 0, CPU_FLUSH_CLFLUSHOPT = 1, CPU_FLUSH_CLWB = 2 };
static int cpu_flush = CPU_FLUSH_NONE;

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("clwb")))
static void clwb_range(const void *addr, size_t len)
{
    uintptr_t line = (uintptr_t)addr & ~(uintptr_t)(CACHE_LINE - 1);
    for (; line < (uintptr_t)addr + len; line += CACHE_LINE)
        _mm_clwb((void *)line);
}

__attribute__((target("clflushopt")))
static void clflushopt_range(const void *addr, size_t len)
{
    uintptr_t line = (uintptr_t)addr & ~(uintptr_t)(CACHE_LINE - 1);
    for (; line < (uintptr_t)addr + len; line += CACHE_LINE)
        _mm_clflushopt((void *)line);
}
#endif

/* `given` (libpmem's pmem_flush), or where that is NULL the CPU's own line flush; NULL: none. */
static flush_fn flush_or_cpu(flush_fn given)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (!given)
        return cpu_flush == CPU_FLUSH_CLWB ? clwb_range : cpu_flush == CPU_FLUSH_CLFLUSHOPT ? clflushopt_range : NULL;
#endif
    return given;
}

struct row_flush {
    char *base;
    Py_ssize_t stride;
    flush_fn flush;
    drain_fn drain; /* NULL: SFENCE */
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
            store_fence();
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
    f.flush = (flush_fn)(uintptr_t)flush;
    f.drain = (drain_fn)(uintptr_t)drain;
    f.flush = flush_or_cpu(f.flush);
    if (!f.flush) {
        PyErr_SetString(PyExc_RuntimeError,
                        "no flush available: libpmem is absent and the CPU has neither CLWB nor CLFLUSHOPT");
        return NULL;
    }
    return run_checked(flush_work, &f, (const int64_t *)(uintptr_t)rows, count, table_rows);
}

/* The power-loss emulator's persist of bytes [start, end) of a mapping (offsets from `view`, which is
 * line aligned): the whole lines they touch, as CLWB writes back (neighbours sharing the first and
 * last line go along), copied from the process's view to `media`, never past `limit`. */
static void copy_whole_lines(const char *view, char *media, size_t start, size_t end, size_t limit)
{
    start &= ~(size_t)(CACHE_LINE - 1);
    end = (end + CACHE_LINE - 1) & ~(size_t)(CACHE_LINE - 1);
    if (end > limit)
        end = limit;
    memcpy(media + start, view + start, end - start);
}

/* w from a RowFlush's fields (kind, its address, map_start, map_end); 0, or -1 with an exception
 * set (its message starts with `who`). */
static int read_write_back(struct write_back *w, int64_t kind, int64_t address, int64_t map_start, int64_t map_end,
                           const char *who)
{
    *w = (struct write_back){.kind = (int)kind};
    if (kind == ROW_FLUSH_CACHE_LINES) {
        w->flush = flush_or_cpu((flush_fn)(uintptr_t)address);
        if (!w->flush) {
            PyErr_Format(PyExc_RuntimeError, "%s: a write-back of cache lines, and libpmem is absent and the CPU has "
                         "neither CLWB nor CLFLUSHOPT", who);
            return -1;
        }
    } else if (kind == ROW_FLUSH_MEDIA_COPY) {
        if (map_start % CACHE_LINE || map_end < map_start || !map_start || !address) {
            PyErr_Format(PyExc_ValueError, "%s: the mapping a media copy is told of is not line-aligned, or has "
                         "no media; nothing was written", who);
            return -1;
        }
        w->view = (const char *)(uintptr_t)map_start;
        w->media = (char *)(uintptr_t)(map_start + address); /* address: media - view */
        w->map_size = (size_t)(map_end - map_start);
    } else if (kind != ROW_FLUSH_CALLER && kind != ROW_FLUSH_PLANTED_SKIP) {
        PyErr_Format(PyExc_ValueError, "%s: unknown row flush %lld", who, (long long)kind);
        return -1;
    }
    return 0;
}

/* Whether the n bytes from `at` lie inside [start, end): what a media copy may reach. */
static int span_inside(uintptr_t at, size_t n, uintptr_t start, uintptr_t end)
{
    return at >= start && at <= end && n <= end - at;
}

/* Write [at, at + n) back as w says: each range flushed, or on the power-loss emulator its whole
 * lines copied to the media (the caller holds the media lock); nothing for the caller's or the
 * planted skip's kind, or for an empty range (a flush rounds its start down to a line, so it would
 * write back a neighbour's line). No drain. */
static void write_back_span(const struct write_back *w, const char *at, size_t n)
{
    if (!n)
        return;
    if (w->kind == ROW_FLUSH_CACHE_LINES) {
        w->flush(at, n);
    } else if (w->kind == ROW_FLUSH_MEDIA_COPY) {
        const size_t start = (size_t)(at - w->view);
        copy_whole_lines(w->view, w->media, start, start + n, w->map_size);
    }
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
    copy_whole_lines(c->view, c->media, start, start + (size_t)(length * c->stride), (size_t)c->map_size);
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


/* ---------------------------------------------------------------------------------------------
 * CRC-32 exactly as zlib's crc32() computes it (the IEEE polynomial, reflected, inverted before
 * and after), ~5x faster on CPUs with carry-less multiply: the pool's checksums stay the same
 * values, and zlib.crc32 stays the fallback.
 *
 * Bits are reflected: in a 16-byte little-endian load, bit j is the coefficient of x^(127-j) of
 * that chunk of the message polynomial. Folding: a chunk A = A_hi x^64 + A_lo that D bits of
 * message follow is replaced by a polynomial of degree < 128 congruent to A x^D mod P:
 * A_hi (x^(63+D) mod P) x + A_lo (x^(D-1) mod P) x. The extra x is what PCLMULQDQ of two
 * reflected 64-bit values adds (their product lands one bit short of the reflected 128-bit
 * position); each constant is x^e mod P, bit-reflected into the top half of a 64-bit lane.
 * What is left at the end, 16 bytes congruent to everything folded, and the last < 16 bytes go
 * through the byte table.
 * ------------------------------------------------------------------------------------------- */
#define CRC32_POLY_NORMAL 0x04C11DB7u   /* P without its x^32 term, bit k = coefficient of x^k */
#define CRC32_POLY_REFLECTED 0xEDB88320u

static uint32_t crc_table[256];
/* [0]: for A_hi (low lane), [1]: for A_lo (high lane); D = 2048, 512, 128 bits */
static uint64_t fold_2048[2], fold_512[2], fold_128[2];

/* How long buffers are folded, slowest first; crc_best is what the CPU has, crc_path what is used. */
enum crc_path { CRC_BYTES = 0, CRC_PCLMUL = 1, CRC_VPCLMUL = 2 };
static const char *const crc_path_names[] = {"bytes", "pclmul", "vpclmul"};
static enum crc_path crc_best = CRC_BYTES, crc_path = CRC_BYTES;

static uint32_t reflect32(uint32_t v)
{
    uint32_t r = 0;
    for (int i = 0; i < 32; i++)
        r |= ((v >> i) & 1u) << (31 - i);
    return r;
}

/* x^e mod P, bit-reflected into bits 32..63 (the lane layout PCLMULQDQ multiplies). */
static uint64_t x_pow_mod_reflected(int e)
{
    uint32_t v = 1; /* x^0 */
    for (int i = 0; i < e; i++)
        v = (v << 1) ^ ((v & 0x80000000u) ? CRC32_POLY_NORMAL : 0);
    return (uint64_t)reflect32(v) << 32;
}

static void crc32_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ CRC32_POLY_REFLECTED : c >> 1;
        crc_table[i] = c;
    }
    fold_2048[0] = x_pow_mod_reflected(63 + 2048), fold_2048[1] = x_pow_mod_reflected(2048 - 1);
    fold_512[0] = x_pow_mod_reflected(63 + 512), fold_512[1] = x_pow_mod_reflected(512 - 1);
    fold_128[0] = x_pow_mod_reflected(63 + 128), fold_128[1] = x_pow_mod_reflected(128 - 1);
}

/* The CRC register (not inverted) after `n` more bytes. */
static uint32_t crc32_bytes(uint32_t reg, const unsigned char *p, size_t n)
{
    while (n--)
        reg = crc_table[(reg ^ *p++) & 0xFF] ^ (reg >> 8);
    return reg;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("pclmul,sse4.1")))
static inline __m128i crc_fold(__m128i a, __m128i k, __m128i next)
{
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00), _mm_clmulepi64_si128(a, k, 0x11)), next);
}

/* Four lanes x0..x3 hold the 64 bytes before p, folded; n more bytes follow at p. Inlined, so that
 * the AVX-512 path runs it VEX-encoded and ends with VZEROUPPER (legacy SSE code after dirty upper
 * halves of the vector registers is slowed: measured, pclmul 14 -> 7 GB/s). */
__attribute__((target("pclmul,sse4.1"), always_inline))
static inline uint32_t crc32_lanes(__m128i x0, __m128i x1, __m128i x2, __m128i x3, const unsigned char *p, size_t n)
{
    const __m128i k512 = _mm_set_epi64x((long long)fold_512[1], (long long)fold_512[0]);
    const __m128i k128 = _mm_set_epi64x((long long)fold_128[1], (long long)fold_128[0]);
    for (; n >= 64; p += 64, n -= 64) { /* four lanes, each 512 bits on */
        x0 = crc_fold(x0, k512, _mm_loadu_si128((const __m128i *)p));
        x1 = crc_fold(x1, k512, _mm_loadu_si128((const __m128i *)(p + 16)));
        x2 = crc_fold(x2, k512, _mm_loadu_si128((const __m128i *)(p + 32)));
        x3 = crc_fold(x3, k512, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    x1 = crc_fold(x0, k128, x1); /* the lanes into one, 128 bits at a time */
    x2 = crc_fold(x1, k128, x2);
    x3 = crc_fold(x2, k128, x3);
    for (; n >= 16; p += 16, n -= 16)
        x3 = crc_fold(x3, k128, _mm_loadu_si128((const __m128i *)p));
    unsigned char last[16];
    _mm_storeu_si128((__m128i *)last, x3);
    return crc32_bytes(crc32_bytes(0, last, 16), p, n);
}

/* n >= 64. The register so far enters as the first 32 message bits (XORed in), as in the byte loop. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc32_folded(uint32_t reg, const unsigned char *p, size_t n)
{
    __m128i x0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)reg));
    return crc32_lanes(x0, _mm_loadu_si128((const __m128i *)(p + 16)), _mm_loadu_si128((const __m128i *)(p + 32)),
                       _mm_loadu_si128((const __m128i *)(p + 48)), p + 64, n - 64);
}

#define CRC_AVX512 "avx512f,vpclmulqdq,pclmul,sse4.1"

/* crc_fold on the four 128-bit lanes of a 512-bit register at once */
__attribute__((target(CRC_AVX512)))
static inline __m512i crc_fold4(__m512i a, __m512i k, __m512i next)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00), _mm512_clmulepi64_epi128(a, k, 0x11),
                                     next, 0x96); /* a ^ b ^ next */
}

/* n >= 256: sixteen lanes in four 512-bit registers, 256 bytes a step (each lane 2048 bits on);
 * then the registers fold into one, 512 bits at a time, whose four lanes go on in crc32_lanes. */
__attribute__((target(CRC_AVX512)))
static uint32_t crc32_folded_avx512(uint32_t reg, const unsigned char *p, size_t n)
{
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_2048[1], (long long)fold_2048[0]));
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_512[1], (long long)fold_512[0]));
    __m512i z0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)reg)));
    __m512i z1 = _mm512_loadu_si512(p + 64), z2 = _mm512_loadu_si512(p + 128), z3 = _mm512_loadu_si512(p + 192);
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
        z0 = crc_fold4(z0, k2048, _mm512_loadu_si512(p));
        z1 = crc_fold4(z1, k2048, _mm512_loadu_si512(p + 64));
        z2 = crc_fold4(z2, k2048, _mm512_loadu_si512(p + 128));
        z3 = crc_fold4(z3, k2048, _mm512_loadu_si512(p + 192));
    }
    z3 = crc_fold4(crc_fold4(crc_fold4(z0, k512, z1), k512, z2), k512, z3);
    return crc32_lanes(_mm512_extracti32x4_epi32(z3, 0), _mm512_extracti32x4_epi32(z3, 1),
                       _mm512_extracti32x4_epi32(z3, 2), _mm512_extracti32x4_epi32(z3, 3), p, n);
}
#endif

static uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t n)
{
    uint32_t reg = ~crc;
#if defined(__x86_64__) && defined(__GNUC__)
    if (crc_path == CRC_VPCLMUL && n >= 256)
        return ~crc32_folded_avx512(reg, p, n);
    if (crc_path != CRC_BYTES && n >= 64)
        return ~crc32_folded(reg, p, n);
#endif
    return ~crc32_bytes(reg, p, n);
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
static uint32_t stream_pieces_nogil(const struct write_back *w, char *dst, const int64_t *sources,
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
            for (size_t at = head; at < head + body; at += 16)
                _mm_stream_si128((__m128i *)(dst + at), _mm_loadu_si128((const __m128i *)(src + at)));
        }
#endif
        /* the ends around the streamed body (all of a short piece): stored, then written back (on the
         * power-loss emulator the whole payload's lines are copied once, at the end) */
        const size_t tail = head + body;
        memcpy(dst, src, head);
        memcpy(dst + tail, src + tail, len - tail);
        if (w->kind == ROW_FLUSH_CACHE_LINES) {
            write_back_span(w, dst, head);
            write_back_span(w, dst + tail, len - tail);
        }
        dst += len;
    }
    store_fence(); /* the streamed stores and the write-backs are complete before the caller's header */
    if (w->kind == ROW_FLUSH_MEDIA_COPY)
        write_back_span(w, first, (size_t)(dst - first));
    return crc;
}

/* stream_pieces(dst, capacity, kind, address, map_start, map_end, sources, lengths, n, seed) -> crc: the
 * write-back is a RowFlush's fields, of kind CACHE_LINES or MEDIA_COPY */
static PyObject *stream_pieces(PyObject *self, PyObject *args)
{
    unsigned long long dst, sources, lengths;
    long long kind, address, map_start, map_end;
    unsigned int seed;
    struct write_back w;
    Py_ssize_t capacity, n;
    if (!PyArg_ParseTuple(args, "KnLLLLKKnI", &dst, &capacity, &kind, &address, &map_start, &map_end, &sources,
                          &lengths, &n, &seed))
        return NULL;
    if (read_write_back(&w, kind, address, map_start, map_end, "stream_pieces") < 0)
        return NULL;
    if (w.kind != ROW_FLUSH_CACHE_LINES && w.kind != ROW_FLUSH_MEDIA_COPY) {
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
    const uintptr_t view = (uintptr_t)w.view;
    if (w.kind == ROW_FLUSH_MEDIA_COPY && !span_inside(dst, total, view, view + w.map_size)) {
        PyErr_SetString(PyExc_ValueError, "stream_pieces: the payload does not lie inside the mapping");
        return NULL;
    }
    uint32_t crc;
    Py_BEGIN_ALLOW_THREADS
    crc = stream_pieces_nogil(&w, (char *)(uintptr_t)dst, (const int64_t *)(uintptr_t)sources, len, n, seed);
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
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|s", &name))
        return NULL;
    if (name != NULL) {
        int found = -1;
        for (int i = 0; i <= (int)crc_best; i++)
            if (strcmp(name, crc_path_names[i]) == 0)
                found = i;
        if (found < 0) {
            PyErr_Format(PyExc_ValueError, "crc32 path %s is not one this CPU has (the best is %s)", name,
                         crc_path_names[crc_best]);
            return NULL;
        }
        crc_path = (enum crc_path)found;
    }
    return PyUnicode_FromString(crc_path_names[crc_path]);
}

static PyObject *cpu_flush_name(PyObject *self, PyObject *unused)
{
    static const char *names[] = {"none", "clflushopt", "clwb"};
    return PyUnicode_FromString(names[cpu_flush]);
}

static void detect_cpu(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned eax, ebx, ecx, edx;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx))
        cpu_flush = (ebx & (1u << 24)) ? CPU_FLUSH_CLWB : (ebx & (1u << 23)) ? CPU_FLUSH_CLFLUSHOPT : CPU_FLUSH_NONE;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        update_rows = update_rows_fma;
    if (__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1"))
        crc_best = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") ? CRC_VPCLMUL : CRC_PCLMUL;
    crc_path = crc_best;
#endif
    crc32_init();
}


/* ---------------------------------------------------------------------------------------------
 * Capture and update in one pass (struct fused_undo above says what it writes, and in what order)
 * ------------------------------------------------------------------------------------------- */
/* byte offsets in layout.UNDO_HEADER and layout.TAIL_MARK (little-endian, as the CPU) */
enum { UNDO_HEADER_BYTES = 64, UNDO_SEQ_AT = 16, UNDO_COUNT_AT = 32, UNDO_PAYLOAD_CRC_AT = 44,
       UNDO_PAYLOAD_BYTES_AT = 48, UNDO_HEADER_CRC_AT = 60 };
enum { TAIL_MARK_BYTES = 64, TAIL_SEQ_END_AT = 16, TAIL_CRC_AT = 60 };
enum { ORDER_PRODUCTION = 0, ORDER_HEADER_BEFORE_PAYLOAD = 1, ORDER_UPDATE_BEFORE_HEADER = 2 };

/* Make [at, at + n) of the ring durable after it was written with non-temporal stores: a fence
 * (they went around the caches), and on the power-loss emulator the lines copied to the media, as
 * the device's persist would (CachedFile.copy_lines; the caller holds the media lock). */
static void undo_persist(const struct fused_undo *u, const char *at, size_t n)
{
    store_fence();
    if (u->media)
        copy_whole_lines(u->ring, u->media, (size_t)(at - u->ring), (size_t)(at - u->ring) + n, SIZE_MAX);
}

/* The chunk's payload checksum, from the source rows in payload order; with `store`, the payload
 * too (non-temporal stores, not yet fenced). */
static uint32_t undo_payload(const struct fused_undo *u, Py_ssize_t c, int store)
{
    const Py_ssize_t first = u->rec_first[c], count = u->rec_first[c + 1] - first;
    const int64_t *rows = u->recorded + first;
    char *out = u->ring + u->rec_offset[c] + UNDO_HEADER_BYTES;
    uint32_t seq32; /* the record's seq, low 32 bits (layout.payload_checksum_seed) */
    memcpy(&seq32, u->headers + c * UNDO_HEADER_BYTES + UNDO_SEQ_AT, 4);
    uint32_t crc = crc32_update(u->payload_seed, (const unsigned char *)&seq32, 4);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + PREFETCH_ROWS < count) {
            prefetch_row(u->weights + rows[i + PREFETCH_ROWS] * u->row_bytes, (size_t)u->row_bytes, 1);
            if (u->state_bytes)
                __builtin_prefetch(u->state + rows[i + PREFETCH_ROWS] * u->state_bytes, 1);
        }
        const char *src = u->weights + rows[i] * u->row_bytes;
        if (store)
            stream_copy(out + i * u->row_bytes, src, (size_t)u->row_bytes);
        crc = crc32_update(crc, (const unsigned char *)src, (size_t)u->row_bytes);
    }
    out += count * u->row_bytes;
    for (Py_ssize_t i = 0; u->state_bytes && i < count; i++) {
        const char *src = u->state + rows[i] * u->state_bytes;
        if (store)
            stream_copy(out + i * u->state_bytes, src, (size_t)u->state_bytes);
        crc = crc32_update(crc, (const unsigned char *)src, (size_t)u->state_bytes);
    }
    out += count * u->state_bytes;
    if (store)
        stream_copy(out, (const char *)rows, (size_t)count * sizeof *rows);
    return crc32_update(crc, (const unsigned char *)rows, (size_t)count * sizeof *rows);
}

/* The chunk's header, sealed, stored and persisted; then the tail mark covering it, copy by copy
 * (persist 0: stored only, the planted update-before-header bug's). */
static void undo_header(const struct fused_undo *u, Py_ssize_t c, uint32_t payload_crc, int persist)
{
    unsigned char *h = u->headers + c * UNDO_HEADER_BYTES;
    memcpy(h + UNDO_PAYLOAD_CRC_AT, &payload_crc, 4);
    uint32_t sealed = crc32_update(u->header_seed, h, UNDO_HEADER_CRC_AT);
    memcpy(h + UNDO_HEADER_CRC_AT, &sealed, 4);
    char *at = u->ring + u->rec_offset[c];
    stream_copy(at, (const char *)h, UNDO_HEADER_BYTES);
    if (persist)
        undo_persist(u, at, UNDO_HEADER_BYTES);
    uint64_t seq_end;
    memcpy(&seq_end, h + UNDO_SEQ_AT, 8);
    seq_end++; /* the tail mark: records [0, seq + 1) of this generation are complete */
    for (int copy = 0; copy < 2; copy++) {
        unsigned char mark[TAIL_MARK_BYTES];
        memcpy(mark, u->tails + copy * TAIL_MARK_BYTES, TAIL_MARK_BYTES);
        memcpy(mark + TAIL_SEQ_END_AT, &seq_end, 8);
        uint32_t mark_crc = crc32_update(u->tail_seeds[copy], mark, TAIL_CRC_AT);
        memcpy(mark + TAIL_CRC_AT, &mark_crc, 4);
        char *tail = u->ring + u->tail_offset + copy * TAIL_MARK_BYTES;
        stream_copy(tail, (const char *)mark, TAIL_MARK_BYTES);
        if (persist)
            undo_persist(u, tail, TAIL_MARK_BYTES);
    }
}

static int undo_stop(struct fused_undo *u, Py_ssize_t c, int phase)
{
    if (u->stop_phase != phase || u->stop_chunk != c)
        return 0;
    u->stopped = phase;
    return 1;
}

/* Chunk u->next's record, durable, before the update loop stores into its rows; 1: a crash test
 * stops here (the update loop stops too). */
static int undo_chunk(struct fused_undo *u)
{
    const Py_ssize_t c = u->next++;
    u->next_start = u->next < u->chunks ? u->next * u->chunk_rows : -1;
    if (u->rec_offset[c] < 0)
        return 0; /* every row of the chunk was recorded earlier in the commit window */
    const Py_ssize_t count = u->rec_first[c + 1] - u->rec_first[c];
    char *payload = u->ring + u->rec_offset[c] + UNDO_HEADER_BYTES;
    const size_t payload_len = (size_t)(count * (u->row_bytes + u->state_bytes + 8));
    if (u->order == ORDER_HEADER_BEFORE_PAYLOAD) { /* planted U1 bug: the header before the payload is stored */
        undo_header(u, c, undo_payload(u, c, 0), 1);
        if (undo_stop(u, c, 1))
            return 1;
        undo_payload(u, c, 1);
        undo_persist(u, payload, payload_len);
        return undo_stop(u, c, 2);
    }
    const uint32_t crc = undo_payload(u, c, 1);
    undo_persist(u, payload, payload_len); /* U1: the payload durable before the header that vouches for it */
    if (undo_stop(u, c, 1))
        return 1;
    if (u->order == ORDER_UPDATE_BEFORE_HEADER) { /* planted U1 bug: the headers after the update */
        memcpy(u->headers + c * UNDO_HEADER_BYTES + UNDO_PAYLOAD_CRC_AT, &crc, 4);
        return 0;
    }
    undo_header(u, c, crc, 1); /* U1: header and tail mark durable before the chunk's first in-place store */
    return undo_stop(u, c, 2);
}

/* Step 4 for the update's unique rows [flushed, count) (sorted): each run of adjacent rows written
 * back, weights and then state, as the table's device flushes them (a CLWB-like flush of each range,
 * or on the power-loss emulator its whole lines copied to the media, under the media lock the caller
 * holds). No drain: the commit drains before its root (U2). */
static void undo_flush_run(const void *args, int64_t first, Py_ssize_t length)
{
    const struct fused_undo *u = args;
    write_back_span(&u->rows, u->weights + first * u->row_bytes, (size_t)(length * u->row_bytes));
    if (u->state_bytes)
        write_back_span(&u->rows, u->state + first * u->state_bytes, (size_t)(length * u->state_bytes));
}

static void undo_flush_rows(struct fused_undo *u, const int64_t *updated, Py_ssize_t count)
{
    if (u->rows.kind == ROW_FLUSH_CALLER || count <= u->flushed)
        return;
    u->flush_runs += for_each_run(u, updated + u->flushed, count - u->flushed, undo_flush_run);
    u->flushed = count;
}

/* At the update's unique row `count`, the first of chunk u->next: the rows updated so far written
 * back (step 4 of the chunk before), then this chunk's record (undo_chunk); 1: a crash test stops. */
static int undo_next_chunk(struct fused_undo *u, const int64_t *updated, Py_ssize_t count)
{
    undo_flush_rows(u, updated, count);
    return undo_chunk(u);
}

/* After the update loop: only the planted update-before-header order has headers left to write,
 * and it only stores them (left to a write-back that never comes: a power loss after the rows'
 * flush finds rows updated and no valid record; a SIGKILL at the stop, no header at all). */
static void undo_finish(struct fused_undo *u)
{
    if (u->order != ORDER_UPDATE_BEFORE_HEADER)
        return;
    if (u->stop_phase == 2) {
        u->stopped = 2; /* a crash test: the rows updated, their records' headers never written */
        return;
    }
    for (Py_ssize_t c = 0; c < u->chunks; c++) {
        if (u->rec_offset[c] >= 0) {
            uint32_t crc;
            memcpy(&crc, u->headers + c * UNDO_HEADER_BYTES + UNDO_PAYLOAD_CRC_AT, 4);
            undo_header(u, c, crc, 0);
        }
    }
}


/* Fill u from a plan (sparse_update's optional last argument); 0, or -1 with an exception set. */
static int read_plan(const int64_t *plan, const struct update_args *a, struct fused_undo *u)
{
    *u = (struct fused_undo){
        .ring = (char *)(uintptr_t)plan[PLAN_RING],
        .media = (char *)(uintptr_t)plan[PLAN_MEDIA],
        .recorded = (const int64_t *)(uintptr_t)plan[PLAN_RECORDED],
        .chunk_rows = (Py_ssize_t)plan[PLAN_CHUNK_ROWS],
        .chunks = (Py_ssize_t)plan[PLAN_CHUNKS],
        .rec_offset = (const int64_t *)(uintptr_t)plan[PLAN_REC_OFFSET],
        .rec_first = (const int64_t *)(uintptr_t)plan[PLAN_REC_FIRST],
        .headers = (unsigned char *)(uintptr_t)plan[PLAN_HEADERS],
        .payload_seed = (uint32_t)plan[PLAN_PAYLOAD_SEED],
        .header_seed = (uint32_t)plan[PLAN_HEADER_SEED],
        .tails = (const unsigned char *)(uintptr_t)plan[PLAN_TAILS],
        .tail_seeds = (const uint32_t *)(uintptr_t)plan[PLAN_TAIL_SEEDS],
        .tail_offset = (Py_ssize_t)plan[PLAN_TAIL_OFFSET],
        .weights = (const char *)a->weight,
        .state = (const char *)a->state,
        .row_bytes = a->w_stride * 4,
        .state_bytes = a->rule == RULE_SGD ? 0 : a->s_stride * 4,
        .order = (int)plan[PLAN_ORDER],
        .stop_chunk = (Py_ssize_t)plan[PLAN_STOP_CHUNK],
        .stop_phase = (int)plan[PLAN_STOP_PHASE],
    };
    if (read_write_back(&u->rows, plan[PLAN_ROW_FLUSH], plan[PLAN_ROW_FLUSH_ARG], plan[PLAN_MAP_START],
                        plan[PLAN_MAP_END], "sparse_update's row write-back") < 0)
        return -1;
    /* every line a copy touches lies in the mapping: the table's rows, rounded out to lines */
    if (u->rows.kind == ROW_FLUSH_MEDIA_COPY) {
        const uintptr_t map_start = (uintptr_t)u->rows.view, map_end = map_start + u->rows.map_size;
        const size_t rows = (size_t)a->table_rows;
        if (!span_inside((uintptr_t)u->weights, rows * (size_t)u->row_bytes, map_start, map_end)
            || (u->state_bytes && !span_inside((uintptr_t)u->state, rows * (size_t)u->state_bytes, map_start,
                                               map_end))) {
            PyErr_SetString(PyExc_ValueError, "sparse_update: the table does not lie inside the mapping its "
                            "row write-back copies; nothing was written");
            return -1;
        }
    }
    u->next_start = u->chunks > 0 ? 0 : -1;
    if (u->chunk_rows < 1 || u->chunks < 0 || u->rec_first[0] != 0
        || u->rec_first[u->chunks] != plan[PLAN_RECORDED_COUNT]) {
        PyErr_SetString(PyExc_ValueError, "sparse_update: inconsistent undo plan");
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * The fused update's undo layout (checkpoint/ring.py plan_chunks), in two calls around the ring's
 * placement: which recorded rows each chunk's record holds and how big it is; then, once the ring
 * has placed the records, where each one goes and its header. Plain arithmetic on the caller's
 * arrays: nothing here touches the pool.
 * ------------------------------------------------------------------------------------------- */
/* undo_chunk_counts(rows, U, recorded, V, chunk_rows, header_bytes, row_payload, align, rec_first,
 * sizes) -> (K, total): rec_first [C + 1] (chunk c of the sorted unique rows [U] records
 * recorded[rec_first[c], rec_first[c + 1]), recorded [V] being a sorted subset of them: what
 * numpy.searchsorted(recorded, rows[::chunk_rows]) gives), sizes [K] the ring bytes of the K
 * records (one per chunk with a recorded row: layout.record_bytes, header_bytes + count *
 * row_payload rounded up to align), and their total. */
static PyObject *undo_chunk_counts(PyObject *self, PyObject *args)
{
    unsigned long long rows_at, recorded_at, rec_first_at, sizes_at;
    Py_ssize_t u, v, chunk_rows, header_bytes, row_payload, align;
    if (!PyArg_ParseTuple(args, "KnKnnnnnKK", &rows_at, &u, &recorded_at, &v, &chunk_rows, &header_bytes,
                          &row_payload, &align, &rec_first_at, &sizes_at))
        return NULL;
    if (chunk_rows < 1 || align < 1 || u < 0 || v < 0 || v > u) {
        PyErr_SetString(PyExc_ValueError, "undo_chunk_counts: bad sizes");
        return NULL;
    }
    const int64_t *rows = (const int64_t *)(uintptr_t)rows_at, *recorded = (const int64_t *)(uintptr_t)recorded_at;
    int64_t *rec_first = (int64_t *)(uintptr_t)rec_first_at, *sizes = (int64_t *)(uintptr_t)sizes_at;
    const Py_ssize_t chunks = (u + chunk_rows - 1) / chunk_rows;
    Py_ssize_t j = 0, k = 0;
    long long total = 0;
    for (Py_ssize_t c = 0; c < chunks; c++) {
        while (j < v && recorded[j] < rows[c * chunk_rows])
            j++;
        rec_first[c] = j;
    }
    rec_first[chunks] = v;
    for (Py_ssize_t c = 0; c < chunks; c++) {
        const int64_t count = rec_first[c + 1] - rec_first[c];
        if (count) {
            sizes[k] = (header_bytes + count * row_payload + align - 1) / align * align;
            total += sizes[k++];
        }
    }
    return Py_BuildValue("nL", k, total);
}

/* undo_chunk_headers(template, seq, rec_first, chunks, sizes, offsets, run_start, row_payload,
 * rec_offset, headers): every chunk's header [chunks, 64] from the 64-byte template (count and
 * payload bytes set; for a chunk with a record, its seq, from `seq` on in chunk order; the
 * checksums left zero, the kernel's to fill in) and rec_offset [chunks]: -1 for a chunk without a
 * record, else offsets[k] for the k-th record (offsets [K], or 0: the records lie back to back
 * from run_start, sizes [K] long each). */
static PyObject *undo_chunk_headers(PyObject *self, PyObject *args)
{
    unsigned long long template_at, rec_first_at, sizes_at, offsets_at, rec_offset_at, headers_at;
    long long seq, run_start;
    Py_ssize_t chunks, row_payload;
    if (!PyArg_ParseTuple(args, "KLKnKKLnKK", &template_at, &seq, &rec_first_at, &chunks, &sizes_at, &offsets_at,
                          &run_start, &row_payload, &rec_offset_at, &headers_at))
        return NULL;
    const unsigned char *template = (const unsigned char *)(uintptr_t)template_at;
    const int64_t *rec_first = (const int64_t *)(uintptr_t)rec_first_at;
    const int64_t *sizes = (const int64_t *)(uintptr_t)sizes_at, *offsets = (const int64_t *)(uintptr_t)offsets_at;
    int64_t *rec_offset = (int64_t *)(uintptr_t)rec_offset_at;
    unsigned char *headers = (unsigned char *)(uintptr_t)headers_at;
    long long at = run_start;
    Py_ssize_t k = 0;
    for (Py_ssize_t c = 0; c < chunks; c++) {
        unsigned char *h = headers + c * UNDO_HEADER_BYTES;
        const int64_t count = rec_first[c + 1] - rec_first[c];
        const uint32_t count32 = (uint32_t)count;
        const uint64_t payload = (uint64_t)(count * row_payload);
        memcpy(h, template, UNDO_HEADER_BYTES);
        memcpy(h + UNDO_COUNT_AT, &count32, 4);
        memcpy(h + UNDO_PAYLOAD_BYTES_AT, &payload, 8);
        if (!count) {
            rec_offset[c] = -1;
            continue;
        }
        const uint64_t record_seq = (uint64_t)(seq + k);
        memcpy(h + UNDO_SEQ_AT, &record_seq, 8);
        rec_offset[c] = offsets ? offsets[k] : at;
        at += sizes[k++];
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(dst, dst_stride, src, src_stride, row_bytes, scatter, table_rows, rows, count): gather "
     "(scatter false: dst row i := src row rows[i]) or scatter (dst row rows[i] := src row i)"},
    {"sparse_update", sparse_update, METH_VARARGS,
     "sparse_update(rule, weight, w_stride, state, s_stride, table_rows, dim, indices, n, grad_out, g_stride, "
     "bags, offsets, mean, psw, lr, eps, out_rows, stop_after[, plan]) -> unique rows updated (all of them, or "
     "stop_after when that is fewer; -1: no stop); plan: an undo plan's address (int64 array, kernels/ops.py): the "
     "undo records written chunk by chunk, each durable right before its chunk's rows are updated"},
    {"all_finite", all_finite, METH_VARARGS, "all_finite(address, count) -> whether count float32s are all finite"},
    {"unique_rows", unique_rows, METH_VARARGS,
     "unique_rows(keys, n, table_rows, out[, sorted]) -> U: the sorted distinct row ids of keys [n] into out [U]; "
     "sorted [n], when given, receives the lookups' positions by row (what sparse_update would sort)"},
    {"undo_chunk_counts", undo_chunk_counts, METH_VARARGS,
     "undo_chunk_counts(rows, U, recorded, V, chunk_rows, header_bytes, row_payload, align, rec_first, sizes) "
     "-> (records, total bytes): the fused update's undo records, per chunk"},
    {"undo_chunk_headers", undo_chunk_headers, METH_VARARGS,
     "undo_chunk_headers(template, seq, rec_first, chunks, sizes, offsets, run_start, row_payload, rec_offset, "
     "headers): each chunk's record offset and header"},
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
     "stream_pieces(dst, capacity, kind, address, map_start, map_end, sources, lengths, n, seed) -> crc32: "
     "pieces stored back to back from dst (at most capacity bytes), durably, written back as a RowFlush of "
     "kind 1 (lines flushed) or 2 (copied to the media) says"},
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
     * FUSED_PLAN_SIZE: the undo plan this build reads (kernels/ops.py refuses another one's) */
    if (m && (PyModule_AddIntConstant(m, "STREAMS", streams) < 0
              || PyModule_AddIntConstant(m, "FUSED_PLAN_SIZE", FUSED_PLAN_SIZE) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
