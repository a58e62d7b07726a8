/* Journal records in C: a call's COMMITs, or the EVICTs of the pages it made room with, encoded
 * from columns in one call (gdskv/journal.py has the format, and its encode_records is the
 * Python twin; gdskv/persistence.py calls it).
 *
 * A record (little-endian): [u32 body length][u32 CRC-32C of the body][body], the body
 *   [u8 kind][u64 seq][u64 slot][u64 page checksum][u8 checksum algorithm][u8 key type][key]
 * In Python each record cost a struct pack, a CRC call and a join: about 5-6 us of a 1-page
 * spill's 140 on the H200 host, once for its COMMIT and once for the EVICT of the page it
 * replaced. */
#include "engine.h"

#include <stdlib.h>
#include <string.h>

#define HEAD_BYTES 8
#define BODY_BYTES 27 /* kind 1, seq 8, slot 8, checksum 8, algorithm 1, key type 1 */
#define MAX_KEY_BYTES (64 << 10) /* journal.MAX_KEY_BYTES: replay refuses longer bodies */

typedef struct {
    PyObject *key; /* held: its bytes live as long as it does */
    const char *data;
    Py_ssize_t len;
    int type;
} Key;

static void
release_keys(Key *keys, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        Py_XDECREF(keys[i].key);
    free(keys);
}

/* encode_records(kind, keys, slots, sums, algorithm, seqs) -> bytes */
static PyObject *
py_encode_records(PyObject *self, PyObject *args)
{
    int kind, algorithm;
    PyObject *keys_obj, *slots, *sums, *seqs;
    if (!PyArg_ParseTuple(args, "iOOOiO:encode_records", &kind, &keys_obj, &slots, &sums,
                          &algorithm, &seqs))
        return NULL;
    if (kind < 0 || kind > 0xFF || algorithm < 0 || algorithm > 0xFF) {
        PyErr_Format(PyExc_ValueError, "encode_records: kind %d or algorithm %d out of range",
                     kind, algorithm);
        return NULL;
    }
    Py_ssize_t n = PySequence_Size(keys_obj), n_slots = PySequence_Size(slots),
               n_seqs = PySequence_Size(seqs),
               n_sums = sums == Py_None ? n : PySequence_Size(sums);
    if (n < 0 || n_slots < 0 || n_seqs < 0 || n_sums < 0)
        return NULL;
    if (n_slots != n || n_seqs != n || n_sums != n) {
        PyErr_Format(PyExc_ValueError, "encode_records: %zd keys, %zd slots, %zd seqs and %zd "
                     "checksums (one each)", n, n_slots, n_seqs, n_sums);
        return NULL;
    }
    Key *keys = calloc(n ? (size_t)n : 1, sizeof *keys);
    if (keys == NULL)
        return PyErr_NoMemory();
    PyObject *out = NULL;
    Py_ssize_t total = 0, got = 0;
    for (; got < n; got++) {
        Key *k = &keys[got];
        k->key = PySequence_GetItem(keys_obj, got);
        if (k->key == NULL || engine_key_bytes(k->key, &k->data, &k->len, &k->type) < 0)
            goto done;
        if (k->len > MAX_KEY_BYTES) {
            PyErr_Format(PyExc_ValueError, "page key of %zd B is longer than %d B", k->len,
                         MAX_KEY_BYTES);
            goto done;
        }
        total += HEAD_BYTES + BODY_BYTES + k->len;
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        goto done;
    unsigned char *p = (unsigned char *)PyBytes_AsString(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long seq = engine_item_u64(seqs, i);
        unsigned long long slot = PyErr_Occurred() ? 0 : engine_item_u64(slots, i);
        unsigned long long csum = PyErr_Occurred() || sums == Py_None ? 0
                                                                        : engine_item_u64(sums, i);
        if (PyErr_Occurred()) {
            Py_CLEAR(out);
            goto done;
        }
        unsigned char *body = p + HEAD_BYTES;
        Py_ssize_t body_len = BODY_BYTES + keys[i].len;
        body[0] = (unsigned char)kind;
        engine_put_le(body + 1, seq, 8);
        engine_put_le(body + 9, slot, 8);
        engine_put_le(body + 17, csum, 8);
        body[25] = (unsigned char)algorithm;
        body[26] = (unsigned char)keys[i].type;
        memcpy(body + BODY_BYTES, keys[i].data, (size_t)keys[i].len);
        engine_put_le(p, (uint64_t)body_len, 4);
        engine_put_le(p + 4, engine_crc32c(0, body, (size_t)body_len), 4);
        p += HEAD_BYTES + body_len;
    }
done:
    release_keys(keys, got < n ? got + 1 : n);
    return out;
}

static PyMethodDef record_methods[] = {
    {"encode_records", py_encode_records, METH_VARARGS,
     "encode_records(kind, keys, slots, sums, algorithm, seqs) -> bytes: journal records of "
     "one kind from columns (sums None: all 0), one after the other (gdskv.journal's format)."},
    {NULL, NULL, 0, NULL},
};

int
add_record_functions(PyObject *module)
{
    return PyModule_AddFunctions(module, record_methods);
}
