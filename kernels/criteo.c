/*
 * Native Criteo line parser: cxltrain.kernels._criteo (a private module; call it through
 * cxltrain/data/lines.py, which checks the arrays before handing over addresses).
 *
 *   parse_lines(buffer, start, sep, num_tables, keys, rows, count, dense, ids, labels, present)
 *       -> (lines, end, status)
 *
 * Parses up to `count` lines of `buffer` from byte `start`: the label, the 13 integer counts as
 * float64 (missing = 0; the caller takes log1p(max(x, 0)), so the result is the Python parser's bit
 * for bit) and the first `num_tables` categorical hashes as row ids splitmix64(h ^ keys[t]) %
 * rows[t] (missing = row 0). With `rows` 0 it keeps the hashes h themselves instead (missing = 0)
 * and marks each field present (1) or missing (0) in `present` [count, num_tables] uint8: the
 * form `cxltrain data convert` stores, hashed to rows when read. It stops at the first line it
 * does not accept and returns status 1 with `end` at that line's first byte: the caller hands
 * that one line to the Python parser, which either reads it (a form only Python accepts, such as
 * a CSV count written "2.6e2") or raises the one-line error naming it. So the C path accepts a
 * subset of what Python accepts and gives the same values; every judgement about a bad line is
 * Python's. Status 0: `count` lines done, or the
 * buffer ended (a final line without a newline counts).
 *
 * The GIL is released while parsing, so a prefetch thread parses while training computes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define NUM_DENSE 13
#define NUM_CATEGORICAL 26
#define NUM_FIELDS (1 + NUM_DENSE + NUM_CATEGORICAL)

static inline uint64_t splitmix64(uint64_t x)
{
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static const int8_t hex_digit[256] = {
    ['0'] = 1, ['1'] = 2, ['2'] = 3, ['3'] = 4, ['4'] = 5, ['5'] = 6, ['6'] = 7, ['7'] = 8, ['8'] = 9,
    ['9'] = 10, ['a'] = 11, ['b'] = 12, ['c'] = 13, ['d'] = 14, ['e'] = 15, ['f'] = 16, ['A'] = 11,
    ['B'] = 12, ['C'] = 13, ['D'] = 14, ['E'] = 15, ['F'] = 16,
}; /* value + 1; 0 = not a hex digit */

/* A count: optional '-', 1..18 digits, optionally '.' and zeros (the CSV's "260.0"). Empty = 0.
 * Anything else (signs, exponents, spaces, longer numbers) is left to Python: returns 0. */
static inline int parse_count(const char *p, const char *e, double *out)
{
    if (p == e) {
        *out = 0.0;
        return 1;
    }
    int negative = 0;
    if (*p == '-') {
        negative = 1;
        p++;
    }
    const char *digits = p;
    int64_t v = 0;
    while (p < e && *p >= '0' && *p <= '9')
        v = v * 10 + (*p++ - '0');
    if (p == digits || p - digits > 18)
        return 0;
    if (p < e) {
        if (*p++ != '.')
            return 0;
        while (p < e && *p == '0')
            p++;
        if (p < e)
            return 0;
    }
    /* the value Python's float() reads; the caller applies max(x, 0) and log1p as the Python parser does */
    *out = negative ? -(double)v : (double)v;
    return 1;
}

/* One line [p, e) without its newline (a trailing '\r' already dropped). Returns 1 if accepted. */
static int parse_line(const char *p, const char *e, char sep, int num_tables, const uint64_t *keys,
                      const uint64_t *rows, double *dense, int64_t *ids, float *label, uint8_t *present)
{
    const char *field[NUM_FIELDS + 1];
    int n = 0;
    field[n++] = p;
    for (const char *q = p; q < e; q++) {
        unsigned char c = (unsigned char)*q;
        if (c == (unsigned char)sep) {
            if (n == NUM_FIELDS)
                return 0;
            field[n++] = q + 1;
        } else if (c >= 0x80) {
            return 0; /* Python decides about non-ASCII bytes (UTF-8 or not) */
        }
    }
    if (n != NUM_FIELDS)
        return 0;
    field[NUM_FIELDS] = e + 1;
#define FIELD_END(i) (field[(i) + 1] - 1)
    const char *l = field[0], *le = FIELD_END(0);
    if (le - l == 1 && (*l == '0' || *l == '1'))
        *label = (float)(*l - '0');
    else if (le - l == 3 && (*l == '0' || *l == '1') && l[1] == '.' && l[2] == '0')
        *label = (float)(*l - '0');
    else
        return 0;
    for (int j = 0; j < NUM_DENSE; j++)
        if (!parse_count(field[1 + j], FIELD_END(1 + j), &dense[j]))
            return 0;
    for (int t = 0; t < num_tables; t++) {
        const char *s = field[1 + NUM_DENSE + t], *se = FIELD_END(1 + NUM_DENSE + t);
        if (se - s > 16)
            return 0;
        if (s == se) {
            ids[t] = 0;
            if (!rows)
                present[t] = 0;
            continue;
        }
        uint64_t h = 0;
        for (; s < se; s++) {
            int d = hex_digit[(unsigned char)*s];
            if (!d)
                return 0;
            h = (h << 4) | (uint64_t)(d - 1);
        }
        if (rows) {
            ids[t] = (int64_t)(splitmix64(h ^ keys[t]) % rows[t]);
        } else {
            ids[t] = (int64_t)h; /* the bits of h; the caller reads them as uint64 */
            present[t] = 1;
        }
    }
#undef FIELD_END
    return 1;
}

static PyObject *parse_lines(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t start, count;
    int sep, num_tables;
    unsigned long long keys_addr, rows_addr, dense_addr, ids_addr, labels_addr, present_addr;
    if (!PyArg_ParseTuple(args, "y*nCiKKnKKKK", &buf, &start, &sep, &num_tables, &keys_addr, &rows_addr, &count,
                          &dense_addr, &ids_addr, &labels_addr, &present_addr))
        return NULL;
    if (num_tables < 1 || num_tables > NUM_CATEGORICAL || start < 0 || start > buf.len || count < 0 ||
        (!rows_addr && !present_addr)) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "parse_lines: bad arguments");
        return NULL;
    }
    const uint64_t *keys = (const uint64_t *)(uintptr_t)keys_addr, *rows = (const uint64_t *)(uintptr_t)rows_addr;
    double *dense = (double *)(uintptr_t)dense_addr;
    int64_t *ids = (int64_t *)(uintptr_t)ids_addr;
    float *labels = (float *)(uintptr_t)labels_addr;
    uint8_t *present = (uint8_t *)(uintptr_t)present_addr;
    const char *base = (const char *)buf.buf, *end = base + buf.len, *p = base + start;
    Py_ssize_t done = 0;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    while (done < count && p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *le = nl ? nl : end;
        const char *stop = (le > p && le[-1] == '\r') ? le - 1 : le;
        if (!parse_line(p, stop, (char)sep, num_tables, keys, rows, dense + done * NUM_DENSE, ids + done * num_tables,
                        labels + done, present ? present + done * num_tables : NULL)) {
            status = 1;
            break;
        }
        done++;
        p = nl ? nl + 1 : end;
    }
    Py_END_ALLOW_THREADS
    Py_ssize_t at = p - base;
    PyBuffer_Release(&buf);
    return Py_BuildValue("nni", done, at, status);
}

static PyMethodDef methods[] = {
    {"parse_lines", parse_lines, METH_VARARGS,
     "parse_lines(buffer, start, sep, num_tables, keys, rows, count, dense, ids, labels, present) -> "
     "(lines, end, status)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_criteo", "Native Criteo line parser (private).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__criteo(void) { return PyModule_Create(&module); }
