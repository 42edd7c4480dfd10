/* Generic persistence primitives: persist.h says what each does on each kind of domain. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "persist.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

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

void pm_init(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned eax, ebx, ecx, edx;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx))
        cpu_flush = (ebx & (1u << 24)) ? CPU_FLUSH_CLWB : (ebx & (1u << 23)) ? CPU_FLUSH_CLFLUSHOPT : CPU_FLUSH_NONE;
#endif
}

const char *pm_cpu_flush_name(void)
{
    static const char *names[] = {"none", "clflushopt", "clwb"};
    return names[cpu_flush];
}

pm_flush_fn pm_flush_or_cpu(pm_flush_fn given)
{
#if defined(__x86_64__) && defined(__GNUC__)
    if (!given)
        return cpu_flush == CPU_FLUSH_CLWB ? clwb_range : cpu_flush == CPU_FLUSH_CLFLUSHOPT ? clflushopt_range : NULL;
#endif
    return given;
}

/* As CLWB writes back: the whole lines the range touches (neighbours sharing its first and last line go along). */
void pm_copy_lines(const char *view, char *media, size_t start, size_t end, size_t limit)
{
    start &= ~(size_t)(CACHE_LINE - 1);
    end = (end + CACHE_LINE - 1) & ~(size_t)(CACHE_LINE - 1);
    if (end > limit)
        end = limit;
    memcpy(media + start, view + start, end - start);
}

void pm_write_back(const struct pm_domain *d, const char *at, size_t n)
{
    if (!n)
        return;
    if (d->kind == PM_LINES) {
        d->flush(at, n);
    } else if (d->kind == PM_MEDIA) {
        const size_t start = (size_t)(at - d->view);
        pm_copy_lines(d->view, d->media, start, start + n, d->map_size);
    }
}

void pm_persist(const struct pm_domain *d, const char *at, size_t n, unsigned flags)
{
    if (flags & PM_STREAMED) {
        pm_fence(); /* the non-temporal stores are complete; on the emulator they are then copied */
        if (d->kind == PM_MEDIA)
            pm_write_back(d, at, n);
    } else {
        pm_write_back(d, at, n);
        pm_fence();
    }
    if (d->on_fence)
        d->on_fence();
}

void pm_copy(const struct pm_domain *d, char *dst, const char *src, size_t n, unsigned flags)
{
    if (flags & PM_STREAMED)
        pm_stream_copy(dst, src, n);
    else
        memcpy(dst, src, n);
    if (flags & PM_PERSIST)
        pm_persist(d, dst, n, flags & PM_STREAMED);
}

static int read_field(PyObject *from, const char *name, long long *out)
{
    PyObject *value = PyObject_GetAttrString(from, name);
    if (value == NULL)
        return -1;
    *out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

int pm_domain_from(PyObject *persistence, struct pm_domain *d, const char *who)
{
    long long kind, flush, media_offset, map_start, map_end, on_fence;
    if (read_field(persistence, "kind", &kind) < 0 || read_field(persistence, "flush", &flush) < 0
        || read_field(persistence, "media_offset", &media_offset) < 0
        || read_field(persistence, "map_start", &map_start) < 0 || read_field(persistence, "map_end", &map_end) < 0
        || read_field(persistence, "on_fence", &on_fence) < 0)
        return -1;
    *d = (struct pm_domain){.kind = (int)kind, .on_fence = (void (*)(void))(uintptr_t)on_fence};
    if (kind == PM_LINES) {
        d->flush = pm_flush_or_cpu((pm_flush_fn)(uintptr_t)flush);
        if (!d->flush) {
            PyErr_Format(PyExc_RuntimeError, "%s: a write-back of cache lines, and libpmem is absent and the CPU has "
                         "neither CLWB nor CLFLUSHOPT", who);
            return -1;
        }
    } else if (kind == PM_MEDIA) {
        if (map_start % CACHE_LINE || map_end < map_start || !map_start || !media_offset) {
            PyErr_Format(PyExc_ValueError, "%s: the mapping a media copy is told of is not line-aligned, or has "
                         "no media; nothing was written", who);
            return -1;
        }
        d->view = (const char *)(uintptr_t)map_start;
        d->media = (char *)(uintptr_t)(map_start + media_offset);
        d->map_size = (size_t)(map_end - map_start);
    } else if (kind != PM_NONE) {
        PyErr_Format(PyExc_ValueError, "%s: unknown persistence kind %lld", who, kind);
        return -1;
    }
    return 0;
}

int pm_domain_holds(const struct pm_domain *d, const void *at, size_t n)
{
    if (d->kind != PM_MEDIA)
        return 1;
    const uintptr_t start = (uintptr_t)d->view, end = start + d->map_size, from = (uintptr_t)at;
    return from >= start && from <= end && n <= end - from;
}
