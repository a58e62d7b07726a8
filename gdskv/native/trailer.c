/* Slot trailers in C: a spill's trailers encoded into the rows that follow its pages' payloads
 * (gdskv/slot_trailer.py has the format and is the Python twin; gdskv/quick_calls.py calls it).
 *
 * A trailer (320 bytes, little-endian) ends every written slot:
 *   [magic "GKVT"][u16 version][u8 algorithm][u8 key type][u32 key length][u64 store id]
 *   [u64 sequence number][u64 payload checksum][u64 slot][16 B BLAKE2b-128 of the key]
 *   [u32 CRC-32C of all the rest][key: up to 256 bytes, zero padded]
 * A spill of 256 pages spent about 5 us a page encoding them in Python (struct, hashlib,
 * crc32c and a numpy copy each) on the development machine; here a page costs one BLAKE2b
 * compression of its key and a CRC of 316 bytes.
 *
 * BLAKE2b is written here from RFC 7693 (unkeyed, 16-byte digest: hashlib.blake2b(digest_size=16),
 * which tests/test_native.py checks it against). */
#include "engine.h"

#include <string.h>

#define TRAILER_BYTES 320
#define FIXED_BYTES 60
#define KEY_BYTES 256

static const uint64_t blake2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const unsigned char blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static uint64_t
get_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

void
engine_put_le(unsigned char *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++, v >>= 8)
        p[i] = (unsigned char)v;
}

static inline uint64_t
rotr64(uint64_t x, int n)
{
    return x >> n | x << (64 - n);
}

#define MIX(a, b, c, d, x, y)                                                                      \
    do {                                                                                           \
        v[a] += v[b] + (x);                                                                        \
        v[d] = rotr64(v[d] ^ v[a], 32);                                                            \
        v[c] += v[d];                                                                              \
        v[b] = rotr64(v[b] ^ v[c], 24);                                                            \
        v[a] += v[b] + (y);                                                                        \
        v[d] = rotr64(v[d] ^ v[a], 16);                                                            \
        v[c] += v[d];                                                                              \
        v[b] = rotr64(v[b] ^ v[c], 63);                                                            \
    } while (0)

/* One compression of a 128-byte block; `bytes` counted so far (the block's end), `last`. */
static void
blake2b_compress(uint64_t h[8], const unsigned char block[128], uint64_t bytes, int last)
{
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = blake2b_iv[i];
    }
    v[12] ^= bytes; /* (the counter's high word, v[13], stays: keys are short) */
    if (last)
        v[14] = ~v[14];
    for (int i = 0; i < 16; i++)
        m[i] = get_le64(block + 8 * i);
    for (int r = 0; r < 12; r++) {
        const unsigned char *s = blake2b_sigma[r];
        MIX(0, 4, 8, 12, m[s[0]], m[s[1]]);
        MIX(1, 5, 9, 13, m[s[2]], m[s[3]]);
        MIX(2, 6, 10, 14, m[s[4]], m[s[5]]);
        MIX(3, 7, 11, 15, m[s[6]], m[s[7]]);
        MIX(0, 5, 10, 15, m[s[8]], m[s[9]]);
        MIX(1, 6, 11, 12, m[s[10]], m[s[11]]);
        MIX(2, 7, 8, 13, m[s[12]], m[s[13]]);
        MIX(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b-128 of `n` bytes (no key): hashlib.blake2b(data, digest_size=16).digest(). */
static void
blake2b_128(const unsigned char *in, size_t n, unsigned char out[16])
{
    uint64_t h[8];
    unsigned char block[128];
    uint64_t done = 0;
    memcpy(h, blake2b_iv, sizeof h);
    h[0] ^= 0x01010000ULL ^ 16; /* depth 1, fanout 1, no key, 16-byte digest */
    for (; n > 128; n -= 128, in += 128) {
        done += 128;
        blake2b_compress(h, in, done, 0);
    }
    memset(block, 0, sizeof block);
    memcpy(block, in, n);
    blake2b_compress(h, block, done + n, 1);
    engine_put_le(out, h[0], 8);
    engine_put_le(out + 8, h[1], 8);
}

/* A key's bytes and type as the trailer keeps them: str as UTF-8 (0), bytes as they are (1). */
int
engine_key_bytes(PyObject *key, const char **data, Py_ssize_t *len, int *type)
{
    if (PyUnicode_Check(key)) {
        *data = PyUnicode_AsUTF8AndSize(key, len);
        *type = 0;
        return *data == NULL ? -1 : 0;
    }
    if (PyBytes_Check(key)) {
        *type = 1;
        return PyBytes_AsStringAndSize(key, (char **)data, len);
    }
    PyErr_Format(PyExc_TypeError, "page keys must be str or bytes, got %R",
                 (PyObject *)Py_TYPE(key));
    return -1;
}

/* Encode one trailer at `out` (TRAILER_BYTES). */
static void
encode_trailer(unsigned char *out, int version, int algorithm, int key_type, const char *key,
               Py_ssize_t key_len, uint64_t store_id, uint64_t seq, uint64_t checksum,
               uint64_t slot)
{
    memcpy(out, "GKVT", 4);
    engine_put_le(out + 4, (uint64_t)version, 2);
    out[6] = (unsigned char)algorithm;
    out[7] = (unsigned char)key_type;
    engine_put_le(out + 8, (uint64_t)key_len, 4);
    engine_put_le(out + 12, store_id, 8);
    engine_put_le(out + 20, seq, 8);
    engine_put_le(out + 28, checksum, 8);
    engine_put_le(out + 36, slot, 8);
    blake2b_128((const unsigned char *)key, (size_t)key_len, out + 44);
    unsigned char *tail = out + FIXED_BYTES + 4;
    memset(tail, 0, KEY_BYTES);
    if (key_len <= KEY_BYTES) /* (a longer key is kept as its digest and length only) */
        memcpy(tail, key, (size_t)key_len);
    uint32_t crc = engine_crc32c(0, out, FIXED_BYTES);
    crc = engine_crc32c(crc, tail, KEY_BYTES);
    engine_put_le(out + FIXED_BYTES, crc, 4);
}

/* seal_slots(rows, version, algorithm, store_id, keys, slots, seqs, sums): each row of `rows`
 * (n rows of the slot's bytes after its payload, laid end to end) zeroed, then page i's trailer
 * at its end: key keys[i], slot slots[i], sequence number seqs[i], checksum sums[i] (uint64). */
/* Item `i` of `seq` as an unsigned 64-bit integer (-1 with an exception set: see PyErr_Occurred).
 * Any integer with __index__ counts (numpy's too), as struct.pack takes them in the Python twins:
 * a slot number from a numpy array must not fail a journal record. */
unsigned long long
engine_item_u64(PyObject *seq, Py_ssize_t i)
{
    PyObject *item = PySequence_GetItem(seq, i);
    if (item == NULL)
        return (unsigned long long)-1;
    PyObject *index = PyNumber_Index(item);
    Py_DECREF(item);
    if (index == NULL)
        return (unsigned long long)-1;
    unsigned long long v = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    return v;
}

static PyObject *
py_seal_slots(PyObject *self, PyObject *args)
{
    PyObject *rows_obj, *keys, *slots, *seqs, *sums_obj;
    int version, algorithm;
    unsigned long long store_id;
    if (!PyArg_ParseTuple(args, "OiiKOOOO:seal_slots", &rows_obj, &version, &algorithm,
                          &store_id, &keys, &slots, &seqs, &sums_obj))
        return NULL;
    if (version < 0 || version > 0xFFFF || algorithm < 0 || algorithm > 0xFF) {
        PyErr_Format(PyExc_ValueError, "seal_slots: version %d or algorithm %d out of range",
                     version, algorithm);
        return NULL;
    }
    Py_ssize_t n = PySequence_Size(keys), n_slots = PySequence_Size(slots),
               n_seqs = PySequence_Size(seqs);
    if (n < 0 || n_slots < 0 || n_seqs < 0)
        return NULL;
    Py_buffer rows, sums;
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(sums_obj, &sums, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t tail = n ? rows.len / n : 0;
    if (n_slots != n || n_seqs != n || sums.itemsize != 8 || sums.len != 8 * n ||
        (n && (rows.len % n || tail < TRAILER_BYTES))) {
        PyErr_Format(PyExc_ValueError,
                     "seal_slots: %zd keys, %zd slots, %zd seqs, %zd bytes of sums (8 each) and "
                     "%zd bytes of rows (at least %d a key, the same for each)", n, n_slots,
                     n_seqs, sums.len, rows.len, TRAILER_BYTES);
        goto done;
    }
    const uint64_t *sum = sums.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PySequence_GetItem(keys, i);
        const char *data;
        Py_ssize_t key_len;
        int key_type;
        if (key == NULL)
            goto done;
        /* (the key's bytes live as long as the key: str keeps its UTF-8, bytes its buffer) */
        int bad = engine_key_bytes(key, &data, &key_len, &key_type) < 0;
        unsigned long long slot = bad ? 0 : engine_item_u64(slots, i);
        unsigned long long seq = bad ? 0 : engine_item_u64(seqs, i);
        if (!bad && !PyErr_Occurred()) {
            unsigned char *row = (unsigned char *)rows.buf + i * tail;
            memset(row, 0, (size_t)(tail - TRAILER_BYTES));
            encode_trailer(row + tail - TRAILER_BYTES, version, algorithm, key_type, data,
                           key_len, store_id, seq, sum[i], slot);
        }
        Py_DECREF(key);
        if (bad || PyErr_Occurred())
            goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&sums);
    PyBuffer_Release(&rows);
    return result;
}

/* blake2b_128(data) -> bytes: the key digest, for tests. */
static PyObject *
py_blake2b_128(PyObject *self, PyObject *args)
{
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*:blake2b_128", &data))
        return NULL;
    unsigned char out[16];
    blake2b_128(data.buf, (size_t)data.len, out);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, sizeof out);
}

static PyMethodDef trailer_methods[] = {
    {"seal_slots", py_seal_slots, METH_VARARGS,
     "seal_slots(rows, version, algorithm, store_id, keys, slots, seqs, sums): zero each "
     "row and encode page i's slot trailer at its end (gdskv.slot_trailer's format)."},
    {"blake2b_128", py_blake2b_128, METH_VARARGS,
     "blake2b_128(data) -> bytes: BLAKE2b with a 16-byte digest, no key (the trailer's key "
     "digest; tests)."},
    {NULL, NULL, 0, NULL},
};

int
add_trailer_functions(PyObject *module)
{
    return PyModule_AddFunctions(module, trailer_methods);
}
