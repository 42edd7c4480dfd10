/*
 * The undo-record writer of the fused capture (undo.h): chunk by chunk of a batch's unique rows,
 * the chunk's record (payload, header, tail mark) written into the undo ring by a step list, inside
 * sparse_update's loop (rows.c). The record layout below is cxltrain/checkpoint/layout.py's
 * (UNDO_HEADER, TAIL_MARK); exported as UNDO_LAYOUT and checked against it before first use.
 * Persistence goes through the generic primitives (persist.h); this file knows the format, they
 * know the device.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdarg.h>
#include <string.h>

#include "crc32.h"
#include "persist.h"
#include "rowset.h"
#include "undo.h"

/* byte offsets in layout.UNDO_HEADER and layout.TAIL_MARK (little-endian, as the CPU) */
enum { UNDO_HEADER_BYTES = 64, UNDO_SEQ_AT = 16, UNDO_COUNT_AT = 32, UNDO_PAYLOAD_CRC_AT = 44,
       UNDO_PAYLOAD_BYTES_AT = 48, UNDO_HEADER_CRC_AT = 60 };
enum { TAIL_MARK_BYTES = 64, TAIL_SEQ_END_AT = 16, TAIL_CRC_AT = 60, TAIL_COPIES = 2 };
enum { ROW_ID_BYTES = 8 }; /* a payload: old weights [U, row_bytes], old state [U, state_bytes], row ids int64 [U] */

static unsigned char *header_of(const struct fused_undo *u, Py_ssize_t c)
{
    return u->headers + c * UNDO_HEADER_BYTES;
}

/* The chunk's payload checksum, from the source rows in payload order; with `store`, the payload
 * too (non-temporal stores, not yet fenced). */
static uint32_t undo_payload(const struct fused_undo *u, Py_ssize_t c, int store)
{
    const Py_ssize_t first = u->rec_first[c], count = u->rec_first[c + 1] - first;
    const int64_t *rows = u->recorded + first;
    char *out = u->ring + u->rec_offset[c] + UNDO_HEADER_BYTES;
    uint32_t seq32; /* the record's seq, low 32 bits (layout.payload_checksum_seed) */
    memcpy(&seq32, header_of(u, c) + UNDO_SEQ_AT, 4);
    uint32_t crc = crc32_update(u->payload_seed, (const unsigned char *)&seq32, 4);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i + PREFETCH_ROWS < count) {
            prefetch_row(u->weights + rows[i + PREFETCH_ROWS] * u->row_bytes, (size_t)u->row_bytes, 1);
            if (u->state_bytes)
                __builtin_prefetch(u->state + rows[i + PREFETCH_ROWS] * u->state_bytes, 1);
        }
        const char *src = u->weights + rows[i] * u->row_bytes;
        if (store)
            pm_stream_copy(out + i * u->row_bytes, src, (size_t)u->row_bytes);
        crc = crc32_update(crc, (const unsigned char *)src, (size_t)u->row_bytes);
    }
    out += count * u->row_bytes;
    for (Py_ssize_t i = 0; u->state_bytes && i < count; i++) {
        const char *src = u->state + rows[i] * u->state_bytes;
        if (store)
            pm_stream_copy(out + i * u->state_bytes, src, (size_t)u->state_bytes);
        crc = crc32_update(crc, (const unsigned char *)src, (size_t)u->state_bytes);
    }
    out += count * u->state_bytes;
    if (store)
        pm_stream_copy(out, (const char *)rows, (size_t)count * ROW_ID_BYTES);
    return crc32_update(crc, (const unsigned char *)rows, (size_t)count * ROW_ID_BYTES);
}

/* The payload step: stored around the caches, its checksum kept in the header template. */
static void step_payload(const struct fused_undo *u, Py_ssize_t c, int persist)
{
    const uint32_t crc = undo_payload(u, c, 1);
    memcpy(header_of(u, c) + UNDO_PAYLOAD_CRC_AT, &crc, 4);
    if (persist) {
        const Py_ssize_t count = u->rec_first[c + 1] - u->rec_first[c];
        pm_persist(&u->ring_domain, u->ring + u->rec_offset[c] + UNDO_HEADER_BYTES,
                   (size_t)(count * (u->row_bytes + u->state_bytes + ROW_ID_BYTES)), PM_STREAMED);
    }
}

/* The header step: sealed (its payload checksum summed from the sources when the payload step has
 * not run yet) and stored. */
static void step_header(const struct fused_undo *u, Py_ssize_t c, int persist, int payload_stored)
{
    unsigned char *h = header_of(u, c);
    if (!payload_stored) {
        const uint32_t crc = undo_payload(u, c, 0);
        memcpy(h + UNDO_PAYLOAD_CRC_AT, &crc, 4);
    }
    const uint32_t sealed = crc32_update(u->header_seed, h, UNDO_HEADER_CRC_AT);
    memcpy(h + UNDO_HEADER_CRC_AT, &sealed, 4);
    pm_copy(&u->ring_domain, u->ring + u->rec_offset[c], (const char *)h, UNDO_HEADER_BYTES,
            PM_STREAMED | (persist ? PM_PERSIST : 0));
}

/* The tail mark step: records [0, seq + 1) of this generation are complete, in both copies, one
 * after the other (a crash tears at most one). */
static void step_tail(const struct fused_undo *u, Py_ssize_t c, int persist)
{
    uint64_t seq_end;
    memcpy(&seq_end, header_of(u, c) + UNDO_SEQ_AT, 8);
    seq_end++;
    for (int copy = 0; copy < TAIL_COPIES; copy++) {
        unsigned char mark[TAIL_MARK_BYTES];
        memcpy(mark, u->tails + copy * TAIL_MARK_BYTES, TAIL_MARK_BYTES);
        memcpy(mark + TAIL_SEQ_END_AT, &seq_end, 8);
        const uint32_t mark_crc = crc32_update(u->tail_seeds[copy], mark, TAIL_CRC_AT);
        memcpy(mark + TAIL_CRC_AT, &mark_crc, 4);
        pm_copy(&u->ring_domain, u->ring + u->tail_offset + copy * TAIL_MARK_BYTES, (const char *)mark,
                TAIL_MARK_BYTES, PM_STREAMED | (persist ? PM_PERSIST : 0));
    }
}

/* Steps [from, to) of the list for chunk c, in list order; 1: a crash test stops here. */
static int run_steps(struct fused_undo *u, Py_ssize_t c, int from, int to)
{
    for (int i = from; i < to; i++) {
        const struct undo_step s = u->steps[i];
        if (s.op == UNDO_STEP_PAYLOAD) {
            step_payload(u, c, s.arg & UNDO_PERSIST);
        } else if (s.op == UNDO_STEP_HEADER) {
            step_header(u, c, s.arg & UNDO_PERSIST, u->payload_at < i);
        } else if (s.op == UNDO_STEP_TAIL) {
            step_tail(u, c, s.arg & UNDO_PERSIST);
        } else if (s.op == UNDO_STEP_STOP && s.arg == u->stop_phase && c == u->stop_chunk) {
            u->stopped = s.arg;
            return 1;
        }
    }
    return 0;
}

static void undo_flush_run(const void *args, int64_t first, ssize_t length)
{
    const struct fused_undo *u = args;
    pm_write_back(&u->rows, u->weights + first * u->row_bytes, (size_t)(length * u->row_bytes));
    if (u->state_bytes)
        pm_write_back(&u->rows, u->state + first * u->state_bytes, (size_t)(length * u->state_bytes));
}

void undo_flush_rows(struct fused_undo *u, const int64_t *updated, Py_ssize_t count)
{
    if (!u->write_back_rows || count <= u->flushed)
        return;
    u->flush_runs += for_each_run(u, updated + u->flushed, count - u->flushed, undo_flush_run);
    u->flushed = count;
}

/* The next chunk's steps before the update; 1: a crash test stops. */
static int chunk_before_update(struct fused_undo *u)
{
    const Py_ssize_t c = u->next++;
    u->next_start = u->next < u->chunks ? u->next * u->chunk_rows : -1;
    if (u->rec_offset[c] < 0)
        return 0; /* every row of the chunk was recorded earlier in the commit window */
    return run_steps(u, c, 0, u->update_at);
}

int undo_next_chunk(struct fused_undo *u, const int64_t *updated, Py_ssize_t count)
{
    undo_flush_rows(u, updated, count);
    /* the slots' record of the chunk follows the table's in the ring (seq order: recovery's scan
     * stops at the first record not written) */
    return chunk_before_update(u) || (u->also && chunk_before_update(u->also));
}

/* Chunk c's steps after the update; 1: a crash test stops. */
static int chunk_after_update(struct fused_undo *u, Py_ssize_t c)
{
    return u->rec_offset[c] >= 0 && run_steps(u, c, u->update_at + 1, u->n_steps);
}

void undo_finish(struct fused_undo *u)
{
    for (Py_ssize_t c = 0; c < u->chunks && u->update_at + 1 < u->n_steps; c++)
        if (chunk_after_update(u, c) || (u->also && chunk_after_update(u->also, c)))
            return;
}

/* The step list: (op, arg) byte pairs, each of payload, header, tail mark and update exactly once. */
static int read_steps(struct fused_undo *u, const unsigned char *steps, Py_ssize_t length)
{
    int seen[UNDO_STEP_STOP + 1] = {0};
    if (length % 2 || length / 2 > UNDO_MAX_STEPS)
        return -1;
    u->n_steps = (int)(length / 2);
    for (int i = 0; i < u->n_steps; i++) {
        const struct undo_step s = {steps[2 * i], steps[2 * i + 1]};
        if (s.op < UNDO_STEP_PAYLOAD || s.op > UNDO_STEP_STOP)
            return -1;
        seen[s.op]++;
        if (s.op == UNDO_STEP_UPDATE)
            u->update_at = i;
        if (s.op == UNDO_STEP_PAYLOAD)
            u->payload_at = i;
        u->steps[i] = s;
    }
    for (int op = UNDO_STEP_PAYLOAD; op < UNDO_STEP_STOP; op++)
        if (seen[op] != 1)
            return -1;
    return 0;
}

int named_fields(PyObject *fields, const char *format, char **names, ...)
{
    if (!PyDict_Check(fields)) {
        PyErr_Format(PyExc_TypeError, "%s: its fields must be a dict", strchr(format, ':') + 1);
        return -1;
    }
    PyObject *none = PyTuple_New(0);
    if (none == NULL)
        return -1;
    va_list fields_at;
    va_start(fields_at, names);
    const int parsed = PyArg_VaParseTupleAndKeywords(none, fields, format, names, fields_at);
    va_end(fields_at);
    Py_DECREF(none);
    return parsed ? 0 : -1;
}

int undo_read(PyObject *fields, struct fused_undo *u, const char *weights, Py_ssize_t row_bytes, const char *state,
              Py_ssize_t state_bytes, int64_t table_rows)
{
    static char *names[] = {"ring", "ring_persistence", "recorded", "recorded_count", "chunk_rows", "chunks",
                            "rec_offset", "rec_first", "headers", "payload_seed", "header_seed", "tails",
                            "tail_seeds", "tail_offset", "steps", "stop_chunk", "stop_phase", "lookup_order",
                            "lookup_count", "row_write_back", NULL};
    unsigned long long ring, recorded, rec_offset, rec_first, headers, tails, tail_seeds, lookup_order;
    PyObject *ring_persistence, *row_write_back;
    const char *steps;
    Py_ssize_t steps_length;
    *u = (struct fused_undo){.weights = weights, .state = state, .row_bytes = row_bytes, .state_bytes = state_bytes};
    if (named_fields(fields, "KOKnnnKKKIIKKny#niKnO:sparse_update's undo writer", names, &ring, &ring_persistence,
                     &recorded, &u->recorded_count, &u->chunk_rows, &u->chunks, &rec_offset, &rec_first, &headers,
                     &u->payload_seed, &u->header_seed, &tails, &tail_seeds, &u->tail_offset, &steps, &steps_length,
                     &u->stop_chunk, &u->stop_phase, &lookup_order, &u->lookup_count, &row_write_back) < 0)
        return -1;
    u->ring = (char *)(uintptr_t)ring;
    u->recorded = (const int64_t *)(uintptr_t)recorded;
    u->rec_offset = (const int64_t *)(uintptr_t)rec_offset;
    u->rec_first = (const int64_t *)(uintptr_t)rec_first;
    u->headers = (unsigned char *)(uintptr_t)headers;
    u->tails = (const unsigned char *)(uintptr_t)tails;
    u->tail_seeds = (const uint32_t *)(uintptr_t)tail_seeds;
    u->lookup_order = (const int64_t *)(uintptr_t)lookup_order;
    if (read_steps(u, (const unsigned char *)steps, steps_length) < 0) {
        PyErr_SetString(PyExc_ValueError, "sparse_update: a step list needs payload, header, tail mark and update "
                        "once each, and known steps only");
        return -1;
    }
    if (pm_domain_from(ring_persistence, &u->ring_domain, "sparse_update's undo ring") < 0)
        return -1;
    if (!pm_domain_holds(&u->ring_domain, u->ring, (size_t)(u->tail_offset + TAIL_COPIES * TAIL_MARK_BYTES))) {
        PyErr_SetString(PyExc_ValueError, "sparse_update: the undo ring does not lie inside the mapping its "
                        "persistence copies; nothing was written");
        return -1;
    }
    if (row_write_back != Py_None) {
        if (pm_domain_from(row_write_back, &u->rows, "sparse_update's row write-back") < 0)
            return -1;
        u->write_back_rows = 1;
        /* every line a copy touches lies in the mapping: the table's rows, rounded out to lines */
        if (!pm_domain_holds(&u->rows, weights, (size_t)table_rows * (size_t)row_bytes)
            || (state_bytes && !pm_domain_holds(&u->rows, state, (size_t)table_rows * (size_t)state_bytes))) {
            PyErr_SetString(PyExc_ValueError, "sparse_update: the table does not lie inside the mapping its "
                            "row write-back copies; nothing was written");
            return -1;
        }
    }
    u->next_start = u->chunks > 0 ? 0 : -1;
    if (u->chunk_rows < 1 || u->chunks < 0 || u->rec_first[0] != 0 || u->rec_first[u->chunks] != u->recorded_count) {
        PyErr_SetString(PyExc_ValueError, "sparse_update: inconsistent undo plan");
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * The fused update's undo layout (checkpoint/ring.py plan_chunks), in two calls around the ring's
 * placement: which rows each chunk's records hold and how big they are; then, once the ring has
 * placed the records, where each one goes and its header. A cached table's chunk has two records,
 * the table's then its slots' (ring order: recovery's scan reads them by seq), and both calls lay
 * out both kinds in the one pass. Plain arithmetic on the caller's arrays: nothing here touches
 * the pool.
 * ------------------------------------------------------------------------------------------- */
/* A record of `count` rows: the header and count * row_payload bytes, rounded up to align. */
static long long record_bytes(Py_ssize_t header_bytes, int64_t count, Py_ssize_t row_payload, Py_ssize_t align)
{
    return (header_bytes + count * row_payload + align - 1) / align * align;
}

/* The cached part of undo_chunk_counts, from its dict (see there); the arrays as the caller checked them. */
struct slot_layout {
    const int32_t *slot_of;  /* [table_rows] each row's slot, -1: the row is its own copy */
    Py_ssize_t table_rows, slot_count;
    const uint8_t *fresh;    /* [slot_count] 1: the slot is recorded; NULL: every slot */
    Py_ssize_t row_payload;
    int64_t *slot_first;     /* [chunks + 1] out */
    int64_t *slot_ids;       /* [U] out: the recorded slots, in the order of their rows */
    int64_t *recorded_out;   /* [U] out: the table rows to record, where the caller gave none */
};

/* Chunk by chunk of rows [u]: the rows' slots to record into slot_ids (slot_first), and, where
 * none were given, the uncached rows into recorded_out (rec_first); -1 (exception set) on a slot
 * outside the cache. Returns the recorded slots' count; *v the table rows'. */
static Py_ssize_t split_cached(const struct slot_layout *s, const int64_t *rows, Py_ssize_t u, Py_ssize_t chunk_rows,
                               Py_ssize_t chunks, int given, int64_t *rec_first, Py_ssize_t *v)
{
    Py_ssize_t n = 0, j = 0;
    for (Py_ssize_t c = 0; c < chunks; c++) {
        s->slot_first[c] = n;
        if (!given)
            rec_first[c] = j;
        const Py_ssize_t end = (c + 1) * chunk_rows < u ? (c + 1) * chunk_rows : u;
        for (Py_ssize_t i = c * chunk_rows; i < end; i++) {
            const int32_t slot = s->slot_of[rows[i]];
            if (slot >= s->slot_count || slot < -1) {
                PyErr_Format(PyExc_ValueError, "undo_chunk_counts: row %lld maps to slot %d, outside the %zd slots",
                             (long long)rows[i], slot, s->slot_count);
                return -1;
            }
            if (slot >= 0 && (s->fresh == NULL || s->fresh[slot]))
                s->slot_ids[n++] = slot;
            else if (slot < 0 && !given)
                s->recorded_out[j++] = rows[i];
        }
    }
    s->slot_first[chunks] = n;
    if (!given) {
        rec_first[chunks] = j;
        *v = j;
    }
    return n;
}

/* undo_chunk_counts(rows, U, recorded, V, chunk_rows, header_bytes, row_payload, align, rec_first,
 * sizes[, slots]) -> (K, total[, V, V', slot bytes]): rec_first [C + 1] (chunk c of the sorted
 * unique rows [U] records recorded[rec_first[c], rec_first[c + 1]), recorded [V] being a sorted
 * subset of them: what numpy.searchsorted(recorded, rows[::chunk_rows]) gives), sizes the ring
 * bytes of the K records in ring order (one per chunk with a recorded row: header_bytes + count *
 * row_payload rounded up to align), and their total.
 * slots, for a cached table (a dict): slot_of (int32 [table_rows]), table_rows, slot_count, fresh
 * (uint8 [slot_count] or 0: every slot), slot_row_payload, slot_first ([C + 1] out), slot_ids ([U]
 * out), recorded_out ([U] out). Chunk c then also records the slots its rows map to (fresh ones
 * only), slot_ids[slot_first[c], slot_first[c + 1]), in a record right after the table's; sizes
 * [2C] holds both kinds' sizes, interleaved in ring order (K counts both). V may then be -1 (no
 * recorded rows given): every row the map leaves in the table is recorded, written to recorded_out
 * (the V returned). */
PyObject *undo_chunk_counts(PyObject *self, PyObject *args)
{
    unsigned long long rows_at, recorded_at, rec_first_at, sizes_at;
    Py_ssize_t u, v, chunk_rows, header_bytes, row_payload, align;
    PyObject *slot_fields = NULL;
    if (!PyArg_ParseTuple(args, "KnKnnnnnKK|O", &rows_at, &u, &recorded_at, &v, &chunk_rows, &header_bytes,
                          &row_payload, &align, &rec_first_at, &sizes_at, &slot_fields))
        return NULL;
    /* v = -1: no recorded rows given (a cached table's layout then picks out the uncached ones) */
    const int given = v >= 0;
    if (chunk_rows < 1 || align < 1 || u < 0 || v < -1 || v > u || (!given && slot_fields == NULL)) {
        PyErr_SetString(PyExc_ValueError, "undo_chunk_counts: bad sizes");
        return NULL;
    }
    const int64_t *rows = (const int64_t *)(uintptr_t)rows_at, *recorded = (const int64_t *)(uintptr_t)recorded_at;
    int64_t *rec_first = (int64_t *)(uintptr_t)rec_first_at, *sizes = (int64_t *)(uintptr_t)sizes_at;
    const Py_ssize_t chunks = (u + chunk_rows - 1) / chunk_rows;
    struct slot_layout s = {0};
    Py_ssize_t slots = 0;
    if (slot_fields != NULL) {
        static char *names[] = {"slot_of", "table_rows", "slot_count", "fresh", "slot_row_payload", "slot_first",
                                "slot_ids", "recorded_out", NULL};
        unsigned long long slot_of, fresh, slot_first, slot_ids, recorded_out;
        if (named_fields(slot_fields, "KnnKnKKK:undo_chunk_counts' slots", names, &slot_of, &s.table_rows,
                         &s.slot_count, &fresh, &s.row_payload, &slot_first, &slot_ids, &recorded_out) < 0)
            return NULL;
        if (u && (rows[0] < 0 || rows[u - 1] >= s.table_rows)) {
            PyErr_SetString(PyExc_ValueError, "undo_chunk_counts: a row outside the cache's row map");
            return NULL;
        }
        s.slot_of = (const int32_t *)(uintptr_t)slot_of;
        s.fresh = (const uint8_t *)(uintptr_t)fresh;
        s.slot_first = (int64_t *)(uintptr_t)slot_first;
        s.slot_ids = (int64_t *)(uintptr_t)slot_ids;
        s.recorded_out = (int64_t *)(uintptr_t)recorded_out;
        slots = split_cached(&s, rows, u, chunk_rows, chunks, given, rec_first, &v);
        if (slots < 0)
            return NULL;
    }
    if (given) {
        Py_ssize_t j = 0;
        for (Py_ssize_t c = 0; c < chunks; c++) {
            while (j < v && recorded[j] < rows[c * chunk_rows])
                j++;
            rec_first[c] = j;
        }
        rec_first[chunks] = v;
    }
    Py_ssize_t k = 0;
    long long total = 0, slot_bytes = 0;
    for (Py_ssize_t c = 0; c < chunks; c++) {
        const int64_t count = rec_first[c + 1] - rec_first[c];
        if (count) {
            sizes[k] = record_bytes(header_bytes, count, row_payload, align);
            total += sizes[k++];
        }
        const int64_t held = slot_fields != NULL ? s.slot_first[c + 1] - s.slot_first[c] : 0;
        if (held) {
            sizes[k] = record_bytes(header_bytes, held, s.row_payload, align);
            slot_bytes += sizes[k];
            total += sizes[k++];
        }
    }
    if (slot_fields == NULL)
        return Py_BuildValue("nL", k, total);
    return Py_BuildValue("nLnnL", k, total, v, slots, slot_bytes);
}

/* One chunk's record of one kind: its header from the template (count and payload bytes set; with
 * a record, the seq of its place k in ring order), its offset (offsets[k], or back to back from
 * *at), -1 without one. */
static void place_record(unsigned char *h, int64_t *rec_offset, const unsigned char *template, int64_t count,
                         Py_ssize_t row_payload, long long seq, const int64_t *sizes, const int64_t *offsets,
                         Py_ssize_t *k, long long *at)
{
    const uint32_t count32 = (uint32_t)count;
    const uint64_t payload = (uint64_t)(count * row_payload);
    memcpy(h, template, UNDO_HEADER_BYTES);
    memcpy(h + UNDO_COUNT_AT, &count32, 4);
    memcpy(h + UNDO_PAYLOAD_BYTES_AT, &payload, 8);
    if (!count) {
        *rec_offset = -1;
        return;
    }
    const uint64_t record_seq = (uint64_t)(seq + *k);
    memcpy(h + UNDO_SEQ_AT, &record_seq, 8);
    *rec_offset = offsets ? offsets[*k] : *at;
    *at += sizes[(*k)++];
}

/* undo_chunk_headers(template, seq, rec_first, chunks, sizes, offsets, run_start, row_payload,
 * rec_offset, headers[, slot_template, slot_first, slot_row_payload, slot_offset, slot_headers]):
 * every chunk's header [chunks, 64] from the 64-byte template (count and payload bytes set; for a
 * chunk with a record, its seq: from `seq` on in ring order; the checksums left zero, the kernel's
 * to fill in) and rec_offset [chunks]: -1 for a chunk without a record, else offsets[k] for the
 * k-th record in ring order (offsets [K], or 0: the records lie back to back from run_start, sizes
 * [K] long each). With the slots' part (undo_chunk_counts' slots), each chunk's slots' record
 * comes right after the chunk's table record, its header and offset into slot_headers and
 * slot_offset [chunks] alike. */
PyObject *undo_chunk_headers(PyObject *self, PyObject *args)
{
    unsigned long long template_at, rec_first_at, sizes_at, offsets_at, rec_offset_at, headers_at;
    unsigned long long slot_template_at = 0, slot_first_at = 0, slot_offset_at = 0, slot_headers_at = 0;
    long long seq, run_start;
    Py_ssize_t chunks, row_payload, slot_row_payload = 0;
    if (!PyArg_ParseTuple(args, "KLKnKKLnKK|KKnKK", &template_at, &seq, &rec_first_at, &chunks, &sizes_at,
                          &offsets_at, &run_start, &row_payload, &rec_offset_at, &headers_at, &slot_template_at,
                          &slot_first_at, &slot_row_payload, &slot_offset_at, &slot_headers_at))
        return NULL;
    const unsigned char *template = (const unsigned char *)(uintptr_t)template_at;
    const unsigned char *slot_template = (const unsigned char *)(uintptr_t)slot_template_at;
    const int64_t *rec_first = (const int64_t *)(uintptr_t)rec_first_at;
    const int64_t *slot_first = (const int64_t *)(uintptr_t)slot_first_at;
    const int64_t *sizes = (const int64_t *)(uintptr_t)sizes_at, *offsets = (const int64_t *)(uintptr_t)offsets_at;
    int64_t *rec_offset = (int64_t *)(uintptr_t)rec_offset_at, *slot_offset = (int64_t *)(uintptr_t)slot_offset_at;
    unsigned char *headers = (unsigned char *)(uintptr_t)headers_at;
    unsigned char *slot_headers = (unsigned char *)(uintptr_t)slot_headers_at;
    if (slot_first != NULL && (slot_template == NULL || slot_offset == NULL || slot_headers == NULL)) {
        PyErr_SetString(PyExc_ValueError, "undo_chunk_headers: the slots' part needs all five of its arguments");
        return NULL;
    }
    long long at = run_start;
    Py_ssize_t k = 0;
    for (Py_ssize_t c = 0; c < chunks; c++) {
        place_record(headers + c * UNDO_HEADER_BYTES, rec_offset + c, template, rec_first[c + 1] - rec_first[c],
                     row_payload, seq, sizes, offsets, &k, &at);
        if (slot_first != NULL)
            place_record(slot_headers + c * UNDO_HEADER_BYTES, slot_offset + c, slot_template,
                         slot_first[c + 1] - slot_first[c], slot_row_payload, seq, sizes, offsets, &k, &at);
    }
    Py_RETURN_NONE;
}

int undo_add_constants(PyObject *module)
{
    PyObject *layout = Py_BuildValue(
        "{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "UNDO_HEADER_BYTES", UNDO_HEADER_BYTES, "UNDO_SEQ_AT",
        UNDO_SEQ_AT, "UNDO_COUNT_AT", UNDO_COUNT_AT, "UNDO_PAYLOAD_CRC_AT", UNDO_PAYLOAD_CRC_AT,
        "UNDO_PAYLOAD_BYTES_AT", UNDO_PAYLOAD_BYTES_AT, "UNDO_HEADER_CRC_AT", UNDO_HEADER_CRC_AT, "TAIL_MARK_BYTES",
        TAIL_MARK_BYTES, "TAIL_SEQ_END_AT", TAIL_SEQ_END_AT, "TAIL_CRC_AT", TAIL_CRC_AT, "TAIL_COPIES", TAIL_COPIES,
        "ROW_ID_BYTES", ROW_ID_BYTES);
    PyObject *steps = Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i}", "payload", UNDO_STEP_PAYLOAD, "header",
                                    UNDO_STEP_HEADER, "tail", UNDO_STEP_TAIL, "update", UNDO_STEP_UPDATE, "stop",
                                    UNDO_STEP_STOP, "persist", UNDO_PERSIST);
    if (layout == NULL || steps == NULL || PyModule_AddObject(module, "UNDO_LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        Py_XDECREF(steps);
        return -1;
    }
    if (PyModule_AddObject(module, "UNDO_STEPS", steps) < 0) {
        Py_DECREF(steps);
        return -1;
    }
    return 0;
}
