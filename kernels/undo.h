/*
 * The undo-record writer of the fused capture (undo.c): the checkpoint layer's writer in C. Its
 * record layout is cxltrain/checkpoint/layout.py's, compiled in and exported as UNDO_LAYOUT, which
 * cxltrain/checkpoint/fused.py checks against layout.py before the first use (a build that
 * disagrees is refused). Include after Python.h.
 */
#ifndef CXLTRAIN_UNDO_H
#define CXLTRAIN_UNDO_H

#include <stdint.h>

#include "persist.h"

/* A chunk's record is written by a step list (fused.py builds it from the checkpointer's Ordering):
 * the steps before UNDO_STEP_UPDATE run for each chunk before its rows are updated, those after it
 * for each chunk after the whole update. arg: UNDO_PERSIST for the three stores, the phase for a stop. */
enum undo_step_op { UNDO_STEP_PAYLOAD = 1, UNDO_STEP_HEADER = 2, UNDO_STEP_TAIL = 3, UNDO_STEP_UPDATE = 4,
                    UNDO_STEP_STOP = 5 };
enum { UNDO_PERSIST = 1, UNDO_MAX_STEPS = 16 };

struct undo_step {
    uint8_t op, arg;
};

/* sparse_update's undo side (the fused capture): the batch's unique rows in chunks of chunk_rows,
 * each chunk's recorded rows (recorded[rec_first[c], rec_first[c+1]), a sorted subset of them)
 * written into the chunk's own ring record by the step list, before the update reaches the chunk.
 * Nothing here is allocated or checked after the first store: every index was checked before. */
struct fused_undo {
    char *ring;                   /* the ring region's first byte, in the process's mapping */
    struct pm_domain ring_domain; /* how the ring's streamed stores become durable */
    const int64_t *recorded;      /* [V] the rows to record, sorted */
    Py_ssize_t recorded_count;
    Py_ssize_t chunk_rows, chunks;
    const int64_t *rec_offset;    /* [chunks] ring offset of the chunk's record; -1: none */
    const int64_t *rec_first;     /* [chunks + 1] */
    unsigned char *headers;       /* [chunks, header bytes] templates, checksum fields zero (filled in here) */
    uint32_t payload_seed;        /* the payload checksums' seed before the record's seq */
    uint32_t header_seed;         /* the header checksum's */
    const unsigned char *tails;   /* [2, tail bytes] the tail mark's two copies, seq_end and checksum zero */
    const uint32_t *tail_seeds;   /* [2] each copy's checksum seed */
    Py_ssize_t tail_offset;       /* the tail mark's ring offset */
    const char *weights, *state;  /* the table's rows (source of the capture) */
    Py_ssize_t row_bytes, state_bytes;
    struct undo_step steps[UNDO_MAX_STEPS];
    int n_steps, update_at, payload_at;
    Py_ssize_t stop_chunk;        /* crash tests: a stop step of this phase stops in this chunk */
    int stop_phase;
    int write_back_rows;          /* 1: the updated rows written back through `rows`; 0: by the caller */
    struct pm_domain rows;
    const int64_t *lookup_order;  /* [lookup_count] the lookups by row, or NULL */
    Py_ssize_t lookup_count;
    /* progress */
    Py_ssize_t next, next_start;  /* the chunk to capture next, and the unique row it starts at (-1: none) */
    int stopped;                  /* the phase a crash test stopped at (the update loop stops too) */
    Py_ssize_t flushed;           /* the update's first `flushed` unique rows are written back ... */
    Py_ssize_t flush_runs;        /* ... in this many runs of adjacent rows */
    /* a hot-row cache's slots, or NULL: their records, chunk by chunk of the same unique rows, each
     * written right after this part's record of the chunk (the next seq), before the chunk's stores */
    struct fused_undo *also;
};

/* Named fields (a dict) parsed as PyArg_ParseTupleAndKeywords parses keywords; format ends in
 * ":what" (the caller, for the errors). 0, or -1 with an exception set. */
int named_fields(PyObject *fields, const char *format, char **names, ...);

/* u from the writer's named fields (a dict, fused.py); the table's rows as the update has them.
 * 0, or -1 with an exception set. */
int undo_read(PyObject *fields, struct fused_undo *u, const char *weights, Py_ssize_t row_bytes, const char *state,
              Py_ssize_t state_bytes, int64_t table_rows);
/* At the update's unique row `count`, the first of chunk u->next: the rows updated so far written
 * back, then this chunk's record (and u->also's); 1: a crash test stops (the update loop stops too). */
int undo_next_chunk(struct fused_undo *u, const int64_t *updated, Py_ssize_t count);
/* The update's unique rows [flushed, count) written back (no fence: the commit drains, U2a). */
void undo_flush_rows(struct fused_undo *u, const int64_t *updated, Py_ssize_t count);
/* After the update loop: the steps after UNDO_STEP_UPDATE, chunk by chunk. */
void undo_finish(struct fused_undo *u);

PyObject *undo_chunk_counts(PyObject *self, PyObject *args);
PyObject *undo_chunk_headers(PyObject *self, PyObject *args);
/* UNDO_LAYOUT and UNDO_STEPS on the module; 0, or -1 with an exception set. */
int undo_add_constants(PyObject *module);

#endif
