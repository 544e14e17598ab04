/* The jsonl records of a columnar batch, straight from Arrow's buffers (snakellm/data/columnar_jsonl.py).
 *
 * records(buf, n, columns, skip) -> int: writes into the bytearray buf (grown as needed, never shrunk: one
 * buffer serves every batch of a chunk, so its pages are not faulted in again) and returns the bytes written:
 * for each row whose skip byte is 0, one line
 *   <prefix 0><value 0><prefix 1><value 1>...}\n
 * where each column is a tuple (prefix, kind, a, b, c, offset):
 *   kind 0 / 1: an Arrow utf8 / large_utf8 array: a = its data buffer, b = its offsets (int32 / int64),
 *               c = its validity bitmap or None, offset = the array's offset. A value is written as orjson
 *               writes a str: "..." with \" \\ \b \t \n \f \r and \u00XX for the other control characters,
 *               everything else (DEL, non-ASCII) as it is; a null as null.
 *   kind 2:     values already in JSON, each ended by '\n' (JSON has no raw newline): a = those bytes.
 * The UTF-8 of a string is checked as Python's decoder checks it (no overlongs, surrogates or > U+10FFFF);
 * a string that fails raises InvalidUTF8(column, row).
 *
 * The byte-for-byte equality with orjson is tests/test_columnar_jsonl.py's; the speed, docs/benchmarks.md's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__GNUC__) && !defined(__clang__)
#error "snakellm/data/_jsonl.c needs GCC or Clang (__builtin_ctzll); the chunk stage falls back to orjson"
#endif
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "snakellm/data/_jsonl.c assumes a little-endian machine; the chunk stage falls back to orjson"
#endif

static PyObject *InvalidUTF8;

typedef struct {
    PyObject *obj; /* the caller's bytearray, grown as it fills */
    char *p;
    Py_ssize_t len, cap;
} Out;

static int reserve(Out *o, Py_ssize_t need) {
    if (o->len + need <= o->cap) return 0;
    Py_ssize_t cap = o->cap * 2;
    if (cap < o->len + need) cap = o->len + need + (1 << 20);
    if (PyByteArray_Resize(o->obj, cap) < 0) return -1;
    o->p = PyByteArray_AS_STRING(o->obj);
    o->cap = cap;
    return 0;
}

static const char HEX[] = "0123456789abcdef";

/* Arrow's layout, read the same way by records() and text_codes(): whether value `at` of a validity bitmap is
 * set, and where string `at` starts and ends in its data buffer (32- or 64-bit offsets). */
static inline int valid_at(const void *bitmap, Py_ssize_t at) {
    return (((const uint8_t *)bitmap)[at >> 3] >> (at & 7)) & 1;
}

static inline void span_at(const void *offsets, int large, Py_ssize_t at, int64_t *lo, int64_t *hi) {
    if (large) {
        *lo = ((const int64_t *)offsets)[at];
        *hi = ((const int64_t *)offsets)[at + 1];
    } else {
        *lo = ((const int32_t *)offsets)[at];
        *hi = ((const int32_t *)offsets)[at + 1];
    }
}

/* The length of the valid UTF-8 sequence at s (s < e, *s >= 0x80), or 0. */
static inline int utf8_seq(const uint8_t *s, const uint8_t *e) {
    uint8_t c = s[0];
    if (c < 0xC2) return 0;
    if (c < 0xE0) return (e - s >= 2 && (s[1] & 0xC0) == 0x80) ? 2 : 0;
    if (c < 0xF0) {
        if (e - s < 3 || (s[2] & 0xC0) != 0x80) return 0;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c == 0xE0) lo = 0xA0;
        else if (c == 0xED) hi = 0x9F; /* no surrogates */
        return (s[1] >= lo && s[1] <= hi) ? 3 : 0;
    }
    if (c < 0xF5) {
        if (e - s < 4 || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80) return 0;
        uint8_t lo = 0x80, hi = 0xBF;
        if (c == 0xF0) lo = 0x90;
        else if (c == 0xF4) hi = 0x8F; /* <= U+10FFFF */
        return (s[1] >= lo && s[1] <= hi) ? 4 : 0;
    }
    return 0;
}

/* The high bit of each byte of x that is zero, exactly (no borrow between bytes). */
static inline uint64_t zero_bytes(uint64_t x) {
    const uint64_t low7 = 0x7F7F7F7F7F7F7F7FULL;
    return ~(((x & low7) + low7) | x | low7);
}

/* The high bit of each byte of x that leaves the plain run: < 0x20, '"', '\\' (escaped) or >= 0x80 (a UTF-8
 * sequence to check). */
static inline uint64_t special_bytes(uint64_t x) {
    const uint64_t ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL;
    return zero_bytes(x & (ones * 0xE0)) | zero_bytes(x ^ (ones * 0x22)) | zero_bytes(x ^ (ones * 0x5C)) | (x & high);
}

/* Append the JSON string of s[0:n] ("..." with orjson's escapes) to o; -2 on invalid UTF-8.
 * Eight bytes at a time: each word is stored as it is, then the output advances to its first special byte. */
static int put_string(Out *o, const uint8_t *s, Py_ssize_t n) {
    if (reserve(o, 6 * n + 2 + 8) < 0) return -1;
    char *w = o->p + o->len;
    const uint8_t *e = s + n;
    *w++ = '"';
    for (;;) {
        while (e - s >= 8) {
            uint64_t x, m;
            memcpy(&x, s, 8);
            memcpy(w, &x, 8);
            m = special_bytes(x);
            if (!m) {
                s += 8;
                w += 8;
                continue;
            }
            int k = __builtin_ctzll(m) >> 3; /* little-endian: the first special byte */
            s += k;
            w += k;
            break;
        }
        if (s >= e) break;
        uint8_t c = *s;
        if (c >= 0x20 && c != '"' && c != '\\' && c < 0x80) { /* the tail's plain bytes */
            *w++ = (char)c;
            s++;
            continue;
        }
        if (c >= 0x80) {
            int k = utf8_seq(s, e);
            if (!k) return -2;
            memcpy(w, s, k);
            w += k;
            s += k;
            continue;
        }
        *w++ = '\\';
        switch (c) {
        case '"': *w++ = '"'; break;
        case '\\': *w++ = '\\'; break;
        case '\b': *w++ = 'b'; break;
        case '\t': *w++ = 't'; break;
        case '\n': *w++ = 'n'; break;
        case '\f': *w++ = 'f'; break;
        case '\r': *w++ = 'r'; break;
        default:
            *w++ = 'u'; *w++ = '0'; *w++ = '0';
            *w++ = HEX[c >> 4]; *w++ = HEX[c & 15];
        }
        s++;
    }
    *w++ = '"';
    o->len = w - o->p;
    return 0;
}

typedef struct {
    const char *prefix;
    Py_ssize_t prefix_len;
    int kind;
    Py_buffer a, b, c;
    int has_a, has_b, has_c;
    Py_ssize_t offset;
    Py_ssize_t raw_pos; /* kind 2: where the next value starts */
} Col;

static void release(Col *cols, Py_ssize_t k) {
    for (Py_ssize_t j = 0; j < k; j++) {
        if (cols[j].has_a) PyBuffer_Release(&cols[j].a);
        if (cols[j].has_b) PyBuffer_Release(&cols[j].b);
        if (cols[j].has_c) PyBuffer_Release(&cols[j].c);
    }
}

static PyObject *records(PyObject *self, PyObject *args) {
    Py_ssize_t n;
    PyObject *columns, *skip_obj;
    PyObject *buf;
    if (!PyArg_ParseTuple(args, "O!nO!O", &PyByteArray_Type, &buf, &n, &PyList_Type, &columns, &skip_obj)) return NULL;
    Py_ssize_t k = PyList_GET_SIZE(columns);
    Col *cols = PyMem_Calloc(k ? k : 1, sizeof(Col));
    if (!cols) return PyErr_NoMemory();
    Py_buffer skip = {0};
    int has_skip = 0;
    Out o = {0};
    if (skip_obj != Py_None) {
        if (PyObject_GetBuffer(skip_obj, &skip, PyBUF_SIMPLE) < 0) goto fail;
        has_skip = 1;
        if (skip.len < n) {
            PyErr_SetString(PyExc_ValueError, "skip is shorter than the rows");
            goto fail;
        }
    }
    Py_ssize_t estimate = 64 + n * 4;
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *t = PyList_GET_ITEM(columns, j), *prefix, *a, *b, *c;
        Col *col = &cols[j];
        if (!PyArg_ParseTuple(t, "SiOOOn", &prefix, &col->kind, &a, &b, &c, &col->offset)) goto fail;
        col->prefix = PyBytes_AS_STRING(prefix);
        col->prefix_len = PyBytes_GET_SIZE(prefix);
        if (PyObject_GetBuffer(a, &col->a, PyBUF_SIMPLE) < 0) goto fail;
        col->has_a = 1;
        if (col->kind == 0 || col->kind == 1) {
            if (PyObject_GetBuffer(b, &col->b, PyBUF_SIMPLE) < 0) goto fail;
            col->has_b = 1;
            Py_ssize_t w = col->kind == 0 ? 4 : 8;
            if (col->offset < 0 || col->b.len < (col->offset + n + 1) * w) {
                PyErr_SetString(PyExc_ValueError, "offsets buffer too short");
                goto fail;
            }
            if (c != Py_None) {
                if (PyObject_GetBuffer(c, &col->c, PyBUF_SIMPLE) < 0) goto fail;
                col->has_c = 1;
                if (col->c.len * 8 < col->offset + n) {
                    PyErr_SetString(PyExc_ValueError, "validity bitmap too short");
                    goto fail;
                }
            }
        } else if (col->kind != 2) {
            PyErr_SetString(PyExc_ValueError, "column kind must be 0, 1 or 2");
            goto fail;
        }
        estimate += col->a.len + n * (col->prefix_len + 2);
    }
    o.obj = buf;
    o.cap = PyByteArray_GET_SIZE(buf);
    o.p = PyByteArray_AS_STRING(buf);
    if (reserve(&o, estimate) < 0) goto fail;
    const uint8_t *sk = has_skip ? (const uint8_t *)skip.buf : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int keep = !sk || !sk[i];
        for (Py_ssize_t j = 0; j < k; j++) {
            Col *col = &cols[j];
            if (col->kind == 2) {
                const char *base = (const char *)col->a.buf;
                const char *nl = memchr(base + col->raw_pos, '\n', col->a.len - col->raw_pos);
                if (!nl) {
                    PyErr_Format(PyExc_ValueError, "column %zd has fewer than %zd values", j, n);
                    goto fail;
                }
                Py_ssize_t len = nl - (base + col->raw_pos);
                if (keep) {
                    if (reserve(&o, col->prefix_len + len + 2) < 0) goto fail;
                    memcpy(o.p + o.len, col->prefix, col->prefix_len);
                    memcpy(o.p + o.len + col->prefix_len, base + col->raw_pos, len);
                    o.len += col->prefix_len + len;
                }
                col->raw_pos += len + 1;
                continue;
            }
            if (!keep) continue;
            if (reserve(&o, col->prefix_len + 6) < 0) goto fail;
            memcpy(o.p + o.len, col->prefix, col->prefix_len);
            o.len += col->prefix_len;
            Py_ssize_t at = col->offset + i;
            if (col->has_c && !valid_at(col->c.buf, at)) {
                memcpy(o.p + o.len, "null", 4);
                o.len += 4;
                continue;
            }
            int64_t lo, hi;
            span_at(col->b.buf, col->kind == 1, at, &lo, &hi);
            if (lo < 0 || hi < lo || hi > col->a.len) {
                PyErr_Format(PyExc_ValueError, "column %zd row %zd: offsets outside the data buffer", j, i);
                goto fail;
            }
            int r = put_string(&o, (const uint8_t *)col->a.buf + lo, (Py_ssize_t)(hi - lo));
            if (r == -1) goto fail;
            if (r == -2) {
                PyObject *exc_args = Py_BuildValue("(nn)", j, i);
                if (exc_args) {
                    PyErr_SetObject(InvalidUTF8, exc_args);
                    Py_DECREF(exc_args);
                }
                goto fail;
            }
        }
        if (keep) {
            if (reserve(&o, 2) < 0) goto fail;
            o.p[o.len++] = '}';
            o.p[o.len++] = '\n';
        }
    }
    release(cols, k);
    PyMem_Free(cols);
    if (has_skip) PyBuffer_Release(&skip);
    return PyLong_FromSsize_t(o.len);
fail:
    release(cols, k);
    PyMem_Free(cols);
    if (has_skip) PyBuffer_Release(&skip);
    return NULL;
}

/* Whether the code point at s (s < e, valid UTF-8 or not) is one str.isspace() is true for. */
static int starts_with_space(const uint8_t *s, const uint8_t *e) {
    uint8_t c = s[0];
    if (c < 0x80) return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
    int k = utf8_seq(s, e);
    uint32_t u;
    if (k == 2) u = ((uint32_t)(c & 0x1F) << 6) | (s[1] & 0x3F);
    else if (k == 3) u = ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    else return 0; /* no four-byte code point is whitespace; invalid UTF-8 is the writer's to report */
    return u == 0x85 || u == 0xA0 || u == 0x1680 || (u >= 0x2000 && u <= 0x200A) || u == 0x2028 ||
           u == 0x2029 || u == 0x202F || u == 0x205F || u == 0x3000;
}

/* text_codes(data, offsets, validity, offset, n, large, limit) -> bytes: per row 0 (a document), 1 (null),
 * 2 (empty), 3 (more than limit bytes; limit < 0: none) or 4 (starts with whitespace: str.isspace decides). */
static PyObject *text_codes(PyObject *self, PyObject *args) {
    PyObject *a, *b, *c;
    Py_ssize_t offset, n, limit;
    int large;
    if (!PyArg_ParseTuple(args, "OOOnnpn", &a, &b, &c, &offset, &n, &large, &limit)) return NULL;
    Py_buffer data, offs, valid = {0};
    if (PyObject_GetBuffer(a, &data, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(b, &offs, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    int has_valid = 0;
    PyObject *out = NULL;
    if (c != Py_None) {
        if (PyObject_GetBuffer(c, &valid, PyBUF_SIMPLE) < 0) goto done;
        has_valid = 1;
    }
    if (offset < 0 || n < 0 || offs.len < (offset + n + 1) * (large ? 8 : 4) || (has_valid && valid.len * 8 < offset + n)) {
        PyErr_SetString(PyExc_ValueError, "buffers too short for the rows");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, n);
    if (!out) goto done;
    uint8_t *w = (uint8_t *)PyBytes_AS_STRING(out);
    const uint8_t *d = (const uint8_t *)data.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t at = offset + i;
        if (has_valid && !valid_at(valid.buf, at)) {
            w[i] = 1;
            continue;
        }
        int64_t lo, hi;
        span_at(offs.buf, large, at, &lo, &hi);
        if (lo < 0 || hi < lo || hi > data.len) {
            PyErr_Format(PyExc_ValueError, "row %zd: offsets outside the data buffer", i);
            Py_CLEAR(out);
            goto done;
        }
        if (hi == lo) w[i] = 2;
        else if (starts_with_space(d + lo, d + hi)) w[i] = 4;
        else if (limit >= 0 && hi - lo > limit) w[i] = 3;
        else w[i] = 0;
    }
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&offs);
    if (has_valid) PyBuffer_Release(&valid);
    return out;
}

static PyMethodDef methods[] = {
    {"text_codes", text_codes, METH_VARARGS, "text_codes(data, offsets, validity, offset, n, large, limit) -> bytes"},
    {"records", records, METH_VARARGS, "records(buf, n, columns, skip) -> int: n rows of Arrow columns as jsonl in buf"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jsonl", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jsonl(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    /* a snakellm.errors.DataError, as every exception of the package is (tests/test_steps.py) */
    PyObject *errors = PyImport_ImportModule("snakellm.errors");
    PyObject *base = errors ? PyObject_GetAttrString(errors, "DataError") : NULL;
    Py_XDECREF(errors);
    if (!base) {
        Py_DECREF(m);
        return NULL;
    }
    InvalidUTF8 = PyErr_NewException("snakellm.data._jsonl.InvalidUTF8", base, NULL);
    Py_DECREF(base);
    if (!InvalidUTF8 || PyModule_AddObject(m, "InvalidUTF8", InvalidUTF8) < 0) {
        Py_XDECREF(InvalidUTF8);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
