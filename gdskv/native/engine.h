/* What the page engine's C files share (gdskv/native/_pages.c has the engine, quick_read.c the
 * quick reader over it, trailer.c the slot trailers, records.c the journal's records). Internal to the extension: built with -fvisibility=hidden. */
#ifndef GDSKV_ENGINE_H
#define GDSKV_ENGINE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The buffers of one call, held (and their memory valid) until release_all. */
typedef struct {
    Py_buffer *views;
    Py_ssize_t count;
    Py_buffer small[4];
} Buffers;

/* A segment of a file (a row of `segments`), or of a source's mapping (copy_pages). */
typedef struct {
    long long fd, offset, length;
} Segment;

/* What a segment moved: bytes, and 0, an errno or -1 (the file ended). */
typedef struct {
    long long done, error;
} Moved;

void release_all(Buffers *b);
int alloc_views(Buffers *out, Py_ssize_t n);

/* Without the GIL: read_pages' and copy_pages' work on checked arguments (_pages.c). */
long long move_all(int write, const Segment *segs, const Py_buffer *mem, Moved *res,
                   Py_ssize_t count, long long readahead);
void settle_pages(const Buffers *mem, const Moved *res, long long pages, long long slot_bytes,
                  long long page_bytes, const uint64_t *want, uint64_t *sums,
                  unsigned char *status, int summed);
long long copy_frame(const Buffers *maps, const int *fds, long long *limits, const Segment *rows,
                     const Buffers *mem, Moved *out, long long pages, long long slot_bytes,
                     long long page_bytes, const uint64_t *want, uint64_t *sums,
                     unsigned char *status);

/* With the GIL: the SIGBUS handler copies from mappings need, installed once. */
int install_bus_handler(void);
/* The GIL given up for work on `bytes` bytes, as the engine's own calls give it up. */
PyThreadState *release_gil_for(long long bytes);
void regain_gil(PyThreadState *state);

/* CRC-32C of p[0:n], continuing `value`, as crc32c() computes it (_pages.c). */
uint32_t engine_crc32c(uint32_t value, const unsigned char *p, size_t n);

/* trailer.c: v's low `bytes` bytes at p, little-endian; a page key's bytes (str: its UTF-8,
 * living as long as the key) and type (0 str, 1 bytes), or -1 with TypeError (neither) or a
 * UnicodeEncodeError set. */
void engine_put_le(unsigned char *p, uint64_t v, int bytes);
int engine_key_bytes(PyObject *key, const char **data, Py_ssize_t *len, int *type);
/* trailer.c: item i of a sequence as an unsigned 64-bit integer ((unsigned long long)-1 with an
 * error set where it is not one). */
unsigned long long engine_item_u64(PyObject *seq, Py_ssize_t i);

/* quick_read.c: the QuickReader type, added to the module. */
int add_quick_reader(PyObject *module);
/* trailer.c: seal_slots (a spill's slot trailers) and blake2b_128, added to the module. */
int add_trailer_functions(PyObject *module);
/* records.c: encode_records (journal records from columns), added to the module. */
int add_record_functions(PyObject *module);

#endif
