/*
 * Generic persistence primitives (PMDK's pmem.c layer): copy, write back, fence. They know no log
 * format and no table: the undo writer (undo.c) and the row kernels (rows.c) build on them.
 *
 * A pm_domain is how one device's stores become durable, as its NativePersistence says
 * (kernels/native.py, handed over by cxltrain/devices):
 *
 *   kind         pm_write_back(range)                          pm_persist(range, PM_STREAMED)
 *   PM_LINES     the flush at `flush` on the range (libpmem's  a fence: the stores went around the
 *                pmem_flush; NULL: the CPU's CLWB/CLFLUSHOPT)  caches (pmem_memcpy_persist's drain)
 *   PM_MEDIA     the power-loss emulator: the range's whole    a fence, then the lines copied too
 *                64-byte lines copied from `view` to `media`
 *   PM_NONE      nothing: stores need no write-back            a fence
 *
 * pm_fence is SFENCE on x86-64: it orders non-temporal stores and CLWB/CLFLUSHOPT before whatever
 * follows (pmem_drain). pm_persist without PM_STREAMED is write back, then fence (pmem_persist).
 * On the emulator the caller holds the media lock while these copy lines. A domain's on_fence, when
 * set, is called after every pm_persist (its fence done and, on the emulator, its lines copied).
 */
#ifndef CXLTRAIN_PERSIST_H
#define CXLTRAIN_PERSIST_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define CACHE_LINE 64

typedef void (*pm_flush_fn)(const void *, size_t);

/* kernels/native.py NativePersistence.LINES, MEDIA, NONE */
enum pm_kind { PM_LINES = 1, PM_MEDIA = 2, PM_NONE = 3 };

struct pm_domain {
    int kind;           /* enum pm_kind */
    pm_flush_fn flush;  /* PM_LINES: this flush of each range */
    const char *view;   /* PM_MEDIA: whole lines copied from the mapping at view ... */
    char *media;        /* ... to its media mapping, ... */
    size_t map_size;    /* ... never past this size */
    void (*on_fence)(void); /* NULL, or called after each pm_persist: a crash-state recorder's view of
                             * the fences (jobs/crash_states.py); it takes the GIL itself */
};

/* pm_copy and pm_persist flags */
enum pm_flags {
    PM_STREAMED = 1,   /* non-temporal stores (pm_copy), or a range written with them (pm_persist) */
    PM_PERSIST = 2,    /* pm_copy: then persist what was stored */
};

/* Copy n bytes around the caches (a multiple of 4, both ends 4-byte aligned); weakly ordered until
 * pm_fence. Other CPUs: ordinary stores (their callers persist the range anyway). */
static inline void pm_stream_copy(char *dst, const char *src, size_t n)
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
    memcpy(dst, src, n);
}

static inline void pm_fence(void)
{
#if defined(__x86_64__)
    _mm_sfence();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/* Detect the CPU's line flush (once, at module load). */
void pm_init(void);
/* "clwb", "clflushopt" or "none": the flush used where a domain's `flush` is NULL. */
const char *pm_cpu_flush_name(void);
/* `given`, or where that is NULL the CPU's own line flush; NULL: the CPU has none. */
pm_flush_fn pm_flush_or_cpu(pm_flush_fn given);
/* Copy the whole lines of [start, end) (offsets from `view`, line aligned) to `media`, never past `limit`. */
void pm_copy_lines(const char *view, char *media, size_t start, size_t end, size_t limit);
/* Start writing [at, at + n) back as the domain does it; no fence. Nothing for an empty range (a
 * flush rounds its start down to a line, so it would write back a neighbour's line). */
void pm_write_back(const struct pm_domain *d, const char *at, size_t n);
/* Make [at, at + n) durable: write back and fence, or (PM_STREAMED) fence, and on the emulator copy. */
void pm_persist(const struct pm_domain *d, const char *at, size_t n, unsigned flags);
/* Store n bytes at dst (PM_STREAMED: around the caches), then with PM_PERSIST make them durable. */
void pm_copy(const struct pm_domain *d, char *dst, const char *src, size_t n, unsigned flags);

#ifdef Py_PYTHON_H
/* d from a NativePersistence's named fields (kind, flush, media_offset, map_start, map_end); 0, or -1
 * with an exception set whose message starts with `who`. */
int pm_domain_from(PyObject *persistence, struct pm_domain *d, const char *who);
/* Whether the n bytes from `at` lie inside the domain's mapping (always, but for PM_MEDIA). */
int pm_domain_holds(const struct pm_domain *d, const void *at, size_t n);
#endif

#endif
