/* gdskv's native page engine: a call's page I/O and page checksums with the GIL released.
 *
 * Plain C on the CPython limited API (one abi3 module for every CPython >= 3.11; built
 * without the limited API on 3.10, whose limited API lacks the buffer protocol). gdskv/native/
 * __init__.py loads it, or falls back to gdskv/native/fallback.py, which has the same five
 * functions in Python and is the test oracle:
 *
 *   crc32c(data, value=0)                            CRC-32C of a buffer, continuing `value`
 *   page_sums(memory, slot_bytes, page_bytes, sums)  CRC-32C of each page of a frame
 *   read_pages(segments, memory, result, slot_bytes, page_bytes, want, sums, status,
 *              readahead)                            preadv, then each page's CRC-32C checked
 *   copy_pages(sources, segments, memory, result, slot_bytes, page_bytes, want, sums,
 *              status)                               read_pages from (fd, mapping) sources:
 *                                                    one copy-and-CRC pass, no preadv
 *   write_pages(segments, memory, result)            pwritev
 *
 * A call's memory is a sequence of buffers laid end to end: its "frame". Page k of a frame is
 * the frame's bytes [k * slot_bytes, (k + 1) * slot_bytes); its checksum covers the first
 * page_bytes of them (the payload; the rest is padding and the slot trailer). `segments` is an
 * int64 array of rows (fd, file offset, length), one per buffer of `memory`: segment i moves
 * memory[i] to or from its file range. Consecutive segments that continue each other in one
 * file are moved by one preadv/pwritev (at most IOV_MAX buffers each, going on after partial
 * transfers). `result` (int64 rows, one per segment) receives (bytes moved, error): error 0,
 * an errno, or -1 where the file gave no more (end of file). A segment after a failure in
 * its run is not tried (error set, 0 bytes moved); other runs still are.
 *
 * Checksums are CRC-32C (Castagnoli, the crc32c package's values): SSE4.2 or ARMv8 CRC
 * instructions where the CPU has them (checked at import), three interleaved streams combined
 * by a multiplication in GF(2)[x] / P, else a slicing-by-8 table. copy_pages stores each word
 * as it sums it: the bytes of a file held in memory (tmpfs) are loaded once, where a preadv
 * (the kernel's copy) and then the checksum load them twice.
 */
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define GDSKV_X86 1
#elif defined(__aarch64__)
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#if defined(__has_include)
#if __has_include(<arm_acle.h>)
#include <arm_acle.h>
#define GDSKV_ARM 1
#endif
#endif
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#endif

/* ---------------------------------------------------------------------------------------- */
/* CRC-32C                                                                                  */
/* ---------------------------------------------------------------------------------------- */

/* The Castagnoli polynomial, bit-reflected: bit 31 - i of a register is the coefficient of x^i */
#define CRC32C_POLY 0x82F63B78u
/* bytes per stream in a round of three interleaved streams (long inputs, then short tails) */
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256

static uint32_t crc_table[8][256];        /* slicing-by-8: entry [k][b] = b followed by k zeros */
static uint32_t shift_long[4][256];       /* register * x^(8 * LONG_BLOCK) mod P, by byte */
static uint32_t shift_short[4][256];      /* register * x^(8 * SHORT_BLOCK) mod P, by byte */

/* v * x mod P */
static uint32_t
mul_x(uint32_t v)
{
    return (v >> 1) ^ ((v & 1u) ? CRC32C_POLY : 0u);
}

/* a * b mod P (both bit-reflected polynomials) */
static uint32_t
gf_mul(uint32_t a, uint32_t b)
{
    uint32_t p = 0;
    for (int i = 0; i < 32; i++) {
        if (a & (0x80000000u >> i))
            p ^= b;
        b = mul_x(b);
    }
    return p;
}

/* Processing n zero bytes multiplies a CRC register by x^(8n) mod P; the register is linear
 * in the message, so the register after A|B is shift(register after A, |B|) ^ (register of B
 * from 0). A table per shift makes it four lookups. */
static void
make_shift_table(uint32_t table[4][256], size_t nbytes)
{
    uint32_t k = 0x80000000u; /* x^0 */
    for (size_t i = 0; i < 8 * nbytes; i++)
        k = mul_x(k);
    for (int j = 0; j < 4; j++)
        for (uint32_t b = 0; b < 256; b++)
            table[j][b] = gf_mul(b << (8 * j), k);
}

static inline uint32_t
shift(uint32_t table[4][256], uint32_t r)
{
    return table[0][r & 0xff] ^ table[1][(r >> 8) & 0xff] ^ table[2][(r >> 16) & 0xff] ^
           table[3][r >> 24];
}

static void
make_tables(void)
{
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t r = b;
        for (int i = 0; i < 8; i++)
            r = mul_x(r);
        crc_table[0][b] = r;
    }
    for (int k = 1; k < 8; k++)
        for (uint32_t b = 0; b < 256; b++) {
            uint32_t r = crc_table[k - 1][b];
            crc_table[k][b] = (r >> 8) ^ crc_table[0][r & 0xff];
        }
    make_shift_table(shift_long, LONG_BLOCK);
    make_shift_table(shift_short, SHORT_BLOCK);
}

static inline uint64_t
load64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The register after `p[0:n]`, from register `r` (no inversion), by table. */
static uint32_t
crc_table_update(uint32_t r, const unsigned char *p, size_t n)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v = load64(p) ^ r;
        r = crc_table[7][v & 0xff] ^ crc_table[6][(v >> 8) & 0xff] ^
            crc_table[5][(v >> 16) & 0xff] ^ crc_table[4][(v >> 24) & 0xff] ^
            crc_table[3][(v >> 32) & 0xff] ^ crc_table[2][(v >> 40) & 0xff] ^
            crc_table[1][(v >> 48) & 0xff] ^ crc_table[0][v >> 56];
    }
#endif
    for (; n; n--, p++)
        r = (r >> 8) ^ crc_table[0][(r ^ *p) & 0xff];
    return r;
}

/* The hardware forms: one 8-byte step `STEP64(r, v)` and one byte `STEP8(r, b)`, compiled for
 * the instruction set extension alone, used only when the CPU reports it. */
#define DEFINE_HW_UPDATE(name, attr, STEP64, STEP8)                                           \
    static attr uint32_t name##_streams(uint32_t r, const unsigned char *p, size_t block,     \
                                        uint32_t table[4][256])                         \
    {                                                                                         \
        uint64_t a = r, b = 0, c = 0;                                                         \
        const unsigned char *pb = p + block, *pc = p + 2 * block;                             \
        for (size_t i = 0; i < block; i += 8) {                                               \
            a = STEP64(a, load64(p + i));                                                     \
            b = STEP64(b, load64(pb + i));                                                    \
            c = STEP64(c, load64(pc + i));                                                    \
        }                                                                                     \
        return shift(table, shift(table, (uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;           \
    }                                                                                         \
    static attr uint32_t name(uint32_t r, const unsigned char *p, size_t n)                   \
    {                                                                                         \
        for (; n && ((uintptr_t)p & 7); n--, p++)                                             \
            r = STEP8(r, *p);                                                                 \
        for (; n >= 3 * LONG_BLOCK; n -= 3 * LONG_BLOCK, p += 3 * LONG_BLOCK)                 \
            r = name##_streams(r, p, LONG_BLOCK, shift_long);                                 \
        for (; n >= 3 * SHORT_BLOCK; n -= 3 * SHORT_BLOCK, p += 3 * SHORT_BLOCK)              \
            r = name##_streams(r, p, SHORT_BLOCK, shift_short);                               \
        uint64_t r64 = r;                                                                     \
        for (; n >= 8; n -= 8, p += 8)                                                        \
            r64 = STEP64(r64, load64(p));                                                     \
        r = (uint32_t)r64;                                                                    \
        for (; n; n--, p++)                                                                   \
            r = STEP8(r, *p);                                                                 \
        return r;                                                                             \
    }                                                                                         \
    /* the streams again, each word stored to `d` as it is summed: one pass over the bytes */ \
    static attr uint32_t name##_copy_streams(uint32_t r, unsigned char *d,                    \
                                             const unsigned char *p, size_t block,            \
                                             uint32_t table[4][256])                          \
    {                                                                                         \
        uint64_t a = r, b = 0, c = 0;                                                         \
        for (size_t i = 0; i < block; i += 8) {                                               \
            uint64_t x = load64(p + i), y = load64(p + block + i),                            \
                     z = load64(p + 2 * block + i);                                           \
            a = STEP64(a, x);                                                                 \
            b = STEP64(b, y);                                                                 \
            c = STEP64(c, z);                                                                 \
            memcpy(d + i, &x, 8);                                                             \
            memcpy(d + block + i, &y, 8);                                                     \
            memcpy(d + 2 * block + i, &z, 8);                                                 \
        }                                                                                     \
        return shift(table, shift(table, (uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;           \
    }                                                                                         \
    static attr uint32_t name##_copy(uint32_t r, unsigned char *d, const unsigned char *p,    \
                                     size_t n)                                                \
    {                                                                                         \
        for (; n >= 3 * LONG_BLOCK; n -= 3 * LONG_BLOCK, p += 3 * LONG_BLOCK,                 \
                                    d += 3 * LONG_BLOCK)                                      \
            r = name##_copy_streams(r, d, p, LONG_BLOCK, shift_long);                         \
        memcpy(d, p, n);                                                                      \
        return name(r, d, n);                                                                 \
    }

#if defined(GDSKV_X86) && defined(__x86_64__)
#define SSE42_STEP64(r, v) _mm_crc32_u64((r), (v))
#define SSE42_STEP8(r, b) _mm_crc32_u8((r), (b))
DEFINE_HW_UPDATE(crc_sse42_update, __attribute__((target("sse4.2"))), SSE42_STEP64, SSE42_STEP8)
#define HAVE_HW_CRC 1
#elif defined(GDSKV_ARM)
#define ARM_STEP64(r, v) __crc32cd((uint32_t)(r), (v))
#define ARM_STEP8(r, b) __crc32cb((r), (b))
#if defined(__ARM_FEATURE_CRC32)
#define ARM_CRC_ATTR
#elif defined(__clang__)
#define ARM_CRC_ATTR __attribute__((target("crc")))
#else
#define ARM_CRC_ATTR __attribute__((target("+crc")))
#endif
DEFINE_HW_UPDATE(crc_armv8_update, ARM_CRC_ATTR, ARM_STEP64, ARM_STEP8)
#define HAVE_HW_CRC 1
#endif

/* The register after `p[0:n]` copied to `d`: the copy, then its CRC (the portable form). */
static uint32_t
crc_table_copy(uint32_t r, unsigned char *d, const unsigned char *p, size_t n)
{
    memcpy(d, p, n);
    return crc_table_update(r, d, n);
}

typedef uint32_t (*crc_update_fn)(uint32_t, const unsigned char *, size_t);
typedef uint32_t (*crc_copy_fn)(uint32_t, unsigned char *, const unsigned char *, size_t);
static crc_update_fn crc_update = crc_table_update;
static crc_copy_fn crc_copy = crc_table_copy;
static const char *crc_implementation = "table";

static void
choose_crc(void)
{
#if defined(GDSKV_X86) && defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        crc_update = crc_sse42_update;
        crc_copy = crc_sse42_update_copy;
        crc_implementation = "sse4.2";
    }
#elif defined(GDSKV_ARM) && defined(__ARM_FEATURE_CRC32)
    crc_update = crc_armv8_update; /* built for CPUs that all have it (e.g. Apple's) */
    crc_copy = crc_armv8_update_copy;
    crc_implementation = "armv8-crc";
#elif defined(GDSKV_ARM) && defined(__linux__)
    if (getauxval(AT_HWCAP) & HWCAP_CRC32) {
        crc_update = crc_armv8_update;
        crc_copy = crc_armv8_update_copy;
        crc_implementation = "armv8-crc";
    }
#endif
}

/* CRC-32C of p[0:n], continuing `value` (crc32c()'s convention: not inverted in or out). */
uint32_t
engine_crc32c(uint32_t value, const unsigned char *p, size_t n)
{
    return ~crc_update(~value, p, n);
}

/* ---------------------------------------------------------------------------------------- */
/* Arguments                                                                                */
/* ---------------------------------------------------------------------------------------- */

void
release_all(Buffers *b)
{
    for (Py_ssize_t i = 0; i < b->count; i++)
        PyBuffer_Release(&b->views[i]);
    if (b->views != b->small)
        PyMem_Free(b->views);
    b->views = NULL;
    b->count = 0;
}

int
alloc_views(Buffers *out, Py_ssize_t n)
{
    out->count = 0;
    out->views = out->small;
    if (n > (Py_ssize_t)(sizeof out->small / sizeof out->small[0])) {
        out->views = PyMem_Malloc((size_t)n * sizeof(Py_buffer));
        if (out->views == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

/* `memory` given as an int64 array of (address, length) rows: the memory itself, not objects
 * holding it (no buffer to get or release for each region; the caller keeps it alive and in
 * place for the call). */
static int
get_memory_rows(PyObject *memory, Buffers *out)
{
    Py_buffer rows;
    if (PyObject_GetBuffer(memory, &rows, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    /* native-order int64: "q" or "l", with at most a native-order prefix ('@', '=', '<' on a
     * little-endian machine: every machine this builds for) */
    const char *fmt = rows.format != NULL ? rows.format : "B";
    if (*fmt == '@' || *fmt == '=' || *fmt == '<')
        fmt++;
    if (rows.itemsize != 8 || rows.len % 16 || (strcmp(fmt, "q") && strcmp(fmt, "l"))) {
        PyErr_Format(PyExc_ValueError, "memory: expected int64 (address, length) rows, got %zd "
                     "bytes of items of %zd bytes", rows.len, rows.itemsize);
        PyBuffer_Release(&rows);
        return -1;
    }
    Py_ssize_t n = rows.len / 16;
    const long long *r = rows.buf;
    int rc = alloc_views(out, n);
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        if (r[2 * i + 1] < 0 || (r[2 * i] == 0 && r[2 * i + 1] > 0)) {
            PyErr_Format(PyExc_ValueError, "memory row %zd: (%lld, %lld) is no memory", i,
                         r[2 * i], r[2 * i + 1]);
            rc = -1;
            break;
        }
        Py_buffer *v = &out->views[i];
        memset(v, 0, sizeof *v); /* obj NULL: nothing to release */
        v->buf = (void *)(uintptr_t)r[2 * i];
        v->len = (Py_ssize_t)r[2 * i + 1];
        v->itemsize = 1;
        out->count = i + 1;
    }
    PyBuffer_Release(&rows);
    if (rc < 0)
        release_all(out);
    return rc;
}

/* Each item of the sequence `memory` as a contiguous buffer (writable when asked), or
 * get_memory_rows where `memory` is itself a buffer (an array of rows). */
static int
get_memory(PyObject *memory, int writable, Buffers *out)
{
    out->count = 0;
    out->views = out->small;
    if (PyObject_CheckBuffer(memory))
        return get_memory_rows(memory, out);
    Py_ssize_t n = PySequence_Size(memory);
    if (n < 0 || alloc_views(out, n) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(memory, i);
        if (item == NULL) {
            release_all(out);
            return -1;
        }
        int rc = PyObject_GetBuffer(item, &out->views[i],
                                    writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS
                                             : PyBUF_C_CONTIGUOUS);
        Py_DECREF(item);
        if (rc < 0) {
            release_all(out);
            return -1;
        }
        out->count = i + 1;
    }
    return 0;
}

/* A contiguous buffer of `count` items of `itemsize` bytes (at least `count` with `at_least`),
 * or None where allowed (view->buf NULL then). */
static int
get_array(PyObject *obj, const char *name, Py_ssize_t itemsize, Py_ssize_t count, int at_least,
          int writable, int allow_none, Py_buffer *view)
{
    view->buf = NULL;
    view->obj = NULL;
    if (obj == Py_None && allow_none)
        return 0;
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS |
                                          PyBUF_FORMAT) < 0)
        return -1;
    Py_ssize_t items = view->len / itemsize;
    if (view->itemsize != itemsize || (at_least ? items < count : items != count)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: expected %s%zd items of %zd bytes, got %zd bytes of items of %zd bytes",
                     name, at_least ? "at least " : "", count, itemsize, view->len,
                     view->itemsize);
        PyBuffer_Release(view);
        view->buf = NULL;
        view->obj = NULL;
        return -1;
    }
    return 0;
}

static void
release_array(Py_buffer *view)
{
    if (view->obj != NULL)
        PyBuffer_Release(view);
}

/* ---------------------------------------------------------------------------------------- */
/* Frames: buffers laid end to end, cut into pages                                          */
/* ---------------------------------------------------------------------------------------- */

typedef struct {
    const Py_buffer *views;
    Py_ssize_t count;
    Py_ssize_t seg;       /* the segment holding `at` */
    long long seg_start;  /* frame offset of segment `seg` */
} Cursor;

/* Move the cursor to the segment holding frame offset `at` (forwards only). */
static void
seek(Cursor *c, long long at)
{
    while (c->seg < c->count && c->seg_start + c->views[c->seg].len <= at) {
        c->seg_start += c->views[c->seg].len;
        c->seg++;
    }
}

/* CRC-32C (inverted in and out, as crc32c() returns it) of frame bytes [at, at + n). */
static uint32_t
frame_crc(Cursor *c, long long at, long long n)
{
    uint32_t r = 0xFFFFFFFFu;
    seek(c, at);
    Py_ssize_t seg = c->seg;
    long long start = c->seg_start;
    while (n > 0 && seg < c->count) {
        long long off = at - start, len = c->views[seg].len;
        long long take = len - off < n ? len - off : n;
        if (take > 0) {
            r = crc_update(r, (const unsigned char *)c->views[seg].buf + off, (size_t)take);
            n -= take;
            at += take;
        }
        start += len;
        seg++;
    }
    return ~r;
}

static long long
frame_length(const Buffers *b)
{
    long long total = 0;
    for (Py_ssize_t i = 0; i < b->count; i++)
        total += b->views[i].len;
    return total;
}

static int
check_pages(long long total, long long slot_bytes, long long page_bytes, long long *pages)
{
    if (slot_bytes <= 0 || page_bytes < 0 || page_bytes > slot_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "slot_bytes must be > 0 and page_bytes in 0..slot_bytes, got %lld and %lld",
                     slot_bytes, page_bytes);
        return -1;
    }
    if (total % slot_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "the buffers hold %lld bytes, not a whole number of %lld-byte slots", total,
                     slot_bytes);
        return -1;
    }
    *pages = total / slot_bytes;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* I/O                                                                                      */
/* ---------------------------------------------------------------------------------------- */

#ifdef IOV_MAX
#define MOST_IOV (IOV_MAX < 1024 ? IOV_MAX : 1024)
#else
#define MOST_IOV 1024
#endif

/* Move segments [first, end) -- one run, continuing each other in one file -- with as few
 * preadv/pwritev as IOV_MAX allows. Returns the bytes moved. */
static long long
move_run(int write, const Segment *segs, const Py_buffer *mem, Moved *res, Py_ssize_t first,
         Py_ssize_t end, long long readahead)
{
    struct iovec iov[MOST_IOV];
    int fd = (int)segs[first].fd;
    long long offset = segs[first].offset, moved = 0, into = 0; /* into: done of `first` */
#ifdef POSIX_FADV_WILLNEED
    if (!write && readahead > 0) {
        long long total = segs[end - 1].offset + segs[end - 1].length - offset;
        if (total > readahead)
            (void)posix_fadvise(fd, (off_t)offset, (off_t)total, POSIX_FADV_WILLNEED);
    }
#endif
    while (first < end && segs[first].length == 0)
        first++;
    while (first < end) {
        int n = 0;
        for (Py_ssize_t k = first; k < end && n < MOST_IOV; k++) {
            long long skip = k == first ? into : 0;
            if (segs[k].length - skip == 0)
                continue;
            iov[n].iov_base = (char *)mem[k].buf + skip;
            iov[n].iov_len = (size_t)(segs[k].length - skip);
            n++;
        }
        ssize_t got = write ? pwritev(fd, iov, n, (off_t)offset) : preadv(fd, iov, n, (off_t)offset);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) {
            long long error = got < 0 ? errno : -1;
            for (Py_ssize_t k = first; k < end; k++)
                if (segs[k].length)
                    res[k].error = error;
            break;
        }
        offset += got;
        moved += got;
        while (got > 0) {
            long long take = segs[first].length - into;
            if (take > got)
                take = got;
            res[first].done += take;
            into += take;
            got -= (ssize_t)take;
            if (into == segs[first].length) {
                first++;
                into = 0;
                while (first < end && segs[first].length == 0)
                    first++;
            }
        }
    }
    return moved;
}

long long
move_all(int write, const Segment *segs, const Py_buffer *mem, Moved *res, Py_ssize_t count,
         long long readahead)
{
    long long moved = 0;
    Py_ssize_t first = 0;
    for (Py_ssize_t k = 0; k < count; k++)
        res[k].done = res[k].error = 0;
    for (Py_ssize_t k = 1; k <= count; k++) {
        if (k < count && segs[k].fd == segs[k - 1].fd &&
            segs[k].offset == segs[k - 1].offset + segs[k - 1].length)
            continue;
        moved += move_run(write, segs, mem, res, first, k, readahead);
        first = k;
    }
    return moved;
}

/* Check segments (int64 rows of 3) against memory before any I/O: one row per buffer, its
 * length the buffer's, sane numbers. */
static int
check_segments(const Py_buffer *rows, const Buffers *mem)
{
    const Segment *segs = rows->buf;
    Py_ssize_t count = rows->len / (Py_ssize_t)sizeof(Segment);
    if (rows->len % (Py_ssize_t)sizeof(Segment)) {
        PyErr_Format(PyExc_ValueError, "segments: rows of 3 int64 (fd, offset, length), got "
                     "%zd bytes", rows->len);
        return -1;
    }
    if (mem->count != count) {
        PyErr_Format(PyExc_ValueError, "memory: %zd buffers for %zd segments", mem->count, count);
        return -1;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        if (segs[k].fd < 0 || segs[k].fd > INT_MAX || segs[k].offset < 0 ||
            segs[k].length != mem->views[k].len) {
            PyErr_Format(PyExc_ValueError,
                         "segment %zd: (fd %lld, offset %lld, length %lld) for a buffer of %zd "
                         "bytes",
                         k, segs[k].fd, segs[k].offset, segs[k].length, mem->views[k].len);
            return -1;
        }
    }
    return 0;
}

/* The bytes of frame range [start, end) that did not move: none (0) or some (1). */
static int
missing(const Buffers *mem, const Moved *res, Cursor *c, long long start, long long end)
{
    seek(c, start);
    long long seg_start = c->seg_start;
    for (Py_ssize_t k = c->seg; k < mem->count && seg_start < end; k++) {
        long long len = mem->views[k].len;
        if (res[k].done < len && seg_start + res[k].done < end)
            return 1;
        seg_start += len;
    }
    return 0;
}

/* The arrays of one read_pages, write_pages or copy_pages call, released together. */
typedef struct {
    Py_buffer segs, res, want, sums, status;
} CallArrays;

static void
release_call_arrays(CallArrays *a)
{
    release_array(&a->status);
    release_array(&a->sums);
    release_array(&a->want);
    release_array(&a->res);
    release_array(&a->segs);
}

/* A call's arrays: `segments` (rows for the buffers of `mem`, checked against them), `result`
 * and, for a read with page_bytes > 0, `pages` from the frame's length and `want` (or None),
 * `sums` and `status`, each at least `pages` items. On failure, what was got is released. */
static int
get_call_arrays(const Buffers *mem, PyObject *segments_obj, PyObject *result_obj,
                long long slot_bytes, long long page_bytes, PyObject *want_obj, PyObject *sums_obj,
                PyObject *status_obj, long long *pages, CallArrays *a)
{
    *pages = 0;
    int failed = get_array(segments_obj, "segments", 8, 0, 1, 0, 0, &a->segs) < 0 ||
                 check_segments(&a->segs, mem) < 0 ||
                 get_array(result_obj, "result", 8, 2 * mem->count, 0, 1, 0, &a->res) < 0;
    if (!failed && page_bytes > 0)
        failed = check_pages(frame_length(mem), slot_bytes, page_bytes, pages) < 0 ||
                 get_array(want_obj, "want", 8, *pages, 1, 0, 1, &a->want) < 0 ||
                 get_array(sums_obj, "sums", 8, *pages, 1, 1, 0, &a->sums) < 0 ||
                 get_array(status_obj, "status", 1, *pages, 1, 1, 0, &a->status) < 0;
    if (failed)
        release_call_arrays(a);
    return failed ? -1 : 0;
}

/* Each page's checksum and status once the I/O is done: status 2 (sum 0) where some of its bytes
 * did not move, else its CRC-32C -- taken here from the frame, or (`summed`) finished from the
 * register the copy left in `sums` -- and 1 where it differs from `want`, 0 where not. */
void
settle_pages(const Buffers *mem, const Moved *res, long long pages, long long slot_bytes,
             long long page_bytes, const uint64_t *want, uint64_t *sums, unsigned char *status,
             int summed)
{
    Cursor c = {mem->views, mem->count, 0, 0}, gaps = {mem->views, mem->count, 0, 0};
    for (long long k = 0; k < pages; k++) {
        long long start = k * slot_bytes;
        if (missing(mem, res, &gaps, start, start + slot_bytes)) {
            sums[k] = 0;
            status[k] = 2;
            continue;
        }
        sums[k] = summed ? (uint64_t)(uint32_t)~(uint32_t)sums[k]
                         : frame_crc(&c, start, page_bytes);
        status[k] = want != NULL && sums[k] != want[k];
    }
}

/* ---------------------------------------------------------------------------------------- */
/* The GIL                                                                                  */
/* ---------------------------------------------------------------------------------------- */

/* Work on fewer bytes than this runs with the GIL held. Where other threads wait for the GIL,
 * a thread that gives it up for a short copy waits long to win it back: 1-page restores of
 * 256 KiB from 16 threads on an H200 host took 2.0-2.5 ms at p50 giving it up, 72-81 us
 * keeping it, and made 1.7x the pages/s (gdskv.native, "The GIL"). Only for work bounded by
 * the memory's speed (checksums, copies from mappings, whose fstat of each file waits on no
 * disk): a read or write system call, which may wait on a disk, always runs without it. */
#define HOLD_GIL_BELOW_DEFAULT (1024 * 1024)
static long long hold_gil_below = HOLD_GIL_BELOW_DEFAULT;

/* The GIL released for work on `bytes` bytes (NULL: kept); give the result to regain_gil. */
PyThreadState *
release_gil_for(long long bytes)
{
    return bytes >= hold_gil_below ? PyEval_SaveThread() : NULL;
}

void
regain_gil(PyThreadState *state)
{
    if (state != NULL)
        PyEval_RestoreThread(state);
}

/* ---------------------------------------------------------------------------------------- */
/* Module functions                                                                         */
/* ---------------------------------------------------------------------------------------- */

static PyObject *
py_crc32c(PyObject *self, PyObject *args)
{
    PyObject *obj;
    unsigned long long value = 0;
    if (!PyArg_ParseTuple(args, "O|K:crc32c", &obj, &value))
        return NULL;
    if (value > 0xFFFFFFFFull) {
        PyErr_Format(PyExc_ValueError, "value: a CRC-32C is below 2**32, got %llu", value);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    PyThreadState *state = release_gil_for(view.len);
    uint32_t r = crc_update(~(uint32_t)value, view.buf, (size_t)view.len);
    regain_gil(state);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(~r);
}

static PyObject *
py_crc32c_table(PyObject *self, PyObject *args)
{
    PyObject *obj;
    unsigned long long value = 0;
    if (!PyArg_ParseTuple(args, "O|K:crc32c_table", &obj, &value))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    uint32_t r = crc_table_update(~(uint32_t)value, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(~r);
}

static PyObject *
py_page_sums(PyObject *self, PyObject *args)
{
    PyObject *memory, *sums_obj;
    long long slot_bytes, page_bytes, pages;
    if (!PyArg_ParseTuple(args, "OLLO:page_sums", &memory, &slot_bytes, &page_bytes, &sums_obj))
        return NULL;
    Buffers mem;
    if (get_memory(memory, 0, &mem) < 0)
        return NULL;
    Py_buffer sums;
    if (check_pages(frame_length(&mem), slot_bytes, page_bytes, &pages) < 0 ||
        get_array(sums_obj, "sums", 8, pages, 1, 1, 0, &sums) < 0) {
        release_all(&mem);
        return NULL;
    }
    PyThreadState *state = release_gil_for(pages * page_bytes);
    Cursor c = {mem.views, mem.count, 0, 0};
    uint64_t *out = sums.buf;
    for (long long k = 0; k < pages; k++)
        out[k] = frame_crc(&c, k * slot_bytes, page_bytes);
    regain_gil(state);
    release_array(&sums);
    release_all(&mem);
    Py_RETURN_NONE;
}

static PyObject *
move_pages(int write, PyObject *args)
{
    PyObject *segments_obj, *memory, *result_obj;
    PyObject *want_obj = Py_None, *sums_obj = Py_None, *status_obj = Py_None;
    long long slot_bytes = 1, page_bytes = 0, readahead = 0, pages = 0, moved = 0;
    if (write) {
        if (!PyArg_ParseTuple(args, "OOO:write_pages", &segments_obj, &memory, &result_obj))
            return NULL;
    } else if (!PyArg_ParseTuple(args, "OOOLLOOOL:read_pages", &segments_obj, &memory,
                                 &result_obj, &slot_bytes, &page_bytes, &want_obj, &sums_obj,
                                 &status_obj, &readahead)) {
        return NULL;
    }
    Buffers mem;
    if (get_memory(memory, !write, &mem) < 0)
        return NULL;
    CallArrays a;
    memset(&a, 0, sizeof a);
    int failed = get_call_arrays(&mem, segments_obj, result_obj, slot_bytes, page_bytes, want_obj,
                                 sums_obj, status_obj, &pages, &a) < 0;
    if (!failed) {
        Py_BEGIN_ALLOW_THREADS
        moved = move_all(write, a.segs.buf, mem.views, a.res.buf, mem.count, readahead);
        settle_pages(&mem, a.res.buf, pages, slot_bytes, page_bytes, a.want.buf, a.sums.buf,
                     a.status.buf, 0);
        Py_END_ALLOW_THREADS
        release_call_arrays(&a);
    }
    release_all(&mem);
    return failed ? NULL : PyLong_FromLongLong(moved);
}

/* ---------------------------------------------------------------------------------------- */
/* Copies from files' mappings                                                              */
/* ---------------------------------------------------------------------------------------- */

/* `sources`: a sequence of (fd, buffer) pairs, each buffer the file's mapping from offset 0.
 * Fills `maps` (held until release_all) and `fds` (PyMem; freed by the caller). */
static int
get_sources(PyObject *sources, Buffers *maps, int **fds)
{
    *fds = NULL;
    PyObject *buffers = NULL;
    Py_ssize_t n = PySequence_Size(sources);
    if (n < 0 || (buffers = PyList_New(n)) == NULL)
        return -1;
    *fds = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int));
    if (*fds == NULL) {
        Py_DECREF(buffers);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PySequence_GetItem(sources, i);
        PyObject *fd = NULL, *buffer = NULL;
        long value = -1;
        if (pair != NULL && PySequence_Size(pair) == 2) {
            fd = PySequence_GetItem(pair, 0);
            buffer = PySequence_GetItem(pair, 1);
            if (fd != NULL)
                value = PyLong_AsLong(fd);
        }
        Py_XDECREF(pair);
        Py_XDECREF(fd);
        if (buffer == NULL || value < 0 || value > INT_MAX) {
            Py_XDECREF(buffer);
            Py_DECREF(buffers);
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "sources[%zd]: expected (fd, mapping)", i);
            return -1;
        }
        (*fds)[i] = (int)value;
        PyList_SetItem(buffers, i, buffer); /* steals the reference */
    }
    int rc = get_memory(buffers, 0, maps);
    Py_DECREF(buffers);
    return rc;
}

/* Segment k's bytes [0, n) from `src` to its buffer, at frame offset `at`: each part inside a
 * page's payload copied and summed into that page's register in one pass, the rest copied. */
static void
copy_segment(unsigned char *dst, const unsigned char *src, long long n, long long at,
             long long slot_bytes, long long page_bytes, uint64_t *registers)
{
    if (registers == NULL) {
        memcpy(dst, src, (size_t)n);
        return;
    }
    for (long long i = 0; i < n;) {
        long long page = (at + i) / slot_bytes, in_slot = (at + i) % slot_bytes, take;
        if (in_slot < page_bytes) {
            take = page_bytes - in_slot < n - i ? page_bytes - in_slot : n - i;
            registers[page] = crc_copy((uint32_t)registers[page], dst + i, src + i, (size_t)take);
        } else {
            take = slot_bytes - in_slot < n - i ? slot_bytes - in_slot : n - i;
            memcpy(dst + i, src + i, (size_t)take);
        }
        i += take;
    }
}

/* A copy from a mapping faults (SIGBUS) where another process cut the file after the call took
 * its size. The copying thread's fault jumps back out of its copy (guarded_copy), which is then
 * reported as a read that found the file's end, as preadv would; a SIGBUS anywhere else goes to
 * the handler that was there before (or the default action). Installed by the first
 * copy_pages call. SA_NODEFER: the jump leaves the handler with SIGBUS not blocked. */
/* initial-exec: the handler reads it without a first-use allocation of the thread's TLS */
static __thread sigjmp_buf *copy_fault __attribute__((tls_model("initial-exec")));
static struct sigaction previous_bus;
static int bus_handler_installed;
static int take_sizes = 1; /* 0 only in tests (_take_sizes): so that a cut file faults */

static void
on_bus(int sig, siginfo_t *info, void *context)
{
    sigjmp_buf *jump = copy_fault;
    if (jump != NULL) {
        copy_fault = NULL;
        siglongjmp(*jump, 1);
    }
    if (previous_bus.sa_flags & SA_SIGINFO) {
        previous_bus.sa_sigaction(sig, info, context);
    } else if (previous_bus.sa_handler != SIG_DFL && previous_bus.sa_handler != SIG_IGN) {
        previous_bus.sa_handler(sig);
    } else { /* the default action, once the faulting access runs again */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(SIGBUS, &dfl, NULL);
    }
}

/* With the GIL held: the handler, once. */
int
install_bus_handler(void)
{
    if (bus_handler_installed)
        return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_bus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous_bus) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    bus_handler_installed = 1;
    return 0;
}

/* One segment's copy (copy_segment's arguments). */
typedef struct {
    unsigned char *dst;
    const unsigned char *src;
    long long n, at, slot_bytes, page_bytes;
    uint64_t *registers;
} CopyJob;

/* copy_segment, left where its source faults: 0, or -1 after a fault. (Nothing local changes
 * between the sigsetjmp and a jump back to it: the job is read through a pointer.) */
static int
guarded_copy(const CopyJob *job)
{
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0))
        return -1;
    copy_fault = &jump;
    copy_segment(job->dst, job->src, job->n, job->at, job->slot_bytes, job->page_bytes,
                 job->registers);
    copy_fault = NULL;
    return 0;
}

/* copy_pages' work once its arguments are checked (GIL as the caller chose; the SIGBUS handler
 * installed): segment rows (source index, offset, length) of `mem` from the mappings `maps`
 * of the files `fds`; `limits`, one per source, is scratch. Returns the bytes copied. */
long long
copy_frame(const Buffers *maps, const int *fds, long long *limits, const Segment *rows,
           const Buffers *mem, Moved *out, long long pages, long long slot_bytes,
           long long page_bytes, const uint64_t *want, uint64_t *sums, unsigned char *status)
{
    long long moved = 0;
    for (Py_ssize_t i = 0; i < maps->count; i++) {
        struct stat st;
        /* an errno as a negative limit: nothing of that file is copied */
        limits[i] = !take_sizes ? (long long)maps->views[i].len
                    : fstat(fds[i], &st) < 0 ? -(long long)errno
                    : st.st_size < maps->views[i].len ? (long long)st.st_size
                                                      : (long long)maps->views[i].len;
    }
    uint64_t *registers = pages ? sums : NULL;
    for (long long k = 0; k < pages; k++)
        registers[k] = 0xFFFFFFFFu;
    long long at = 0;
    for (Py_ssize_t k = 0; k < mem->count; k++) {
        long long limit = limits[rows[k].fd], n = 0, error = 0;
        if (limit < 0)
            error = -limit;
        else if ((n = limit - rows[k].offset) < rows[k].length)
            error = -1;
        n = n < 0 ? 0 : n > rows[k].length ? rows[k].length : n;
        CopyJob job = {mem->views[k].buf,
                       n > 0 ? (const unsigned char *)maps->views[rows[k].fd].buf +
                                   rows[k].offset
                             : NULL,
                       n, at, slot_bytes, page_bytes, registers};
        if (n > 0 && guarded_copy(&job) < 0) {
            /* the file was cut during the copy: nothing of this segment counts, and the
             * rest of that file is past its end */
            n = 0;
            error = -1;
            limits[rows[k].fd] = 0;
        }
        out[k].done = n;
        out[k].error = n < rows[k].length ? error : 0;
        moved += n;
        at += rows[k].length;
    }
    settle_pages(mem, out, pages, slot_bytes, page_bytes, want, sums, status, 1);
    return moved;
}

/* copy_pages: read_pages' work from files' mappings (files held in memory: tmpfs), one pass
 * over each byte where read_pages makes two (the kernel's copy, then the checksum). A segment
 * row is (source index, offset, length). Each file's size is taken (fstat) before the copies:
 * bytes past its end are not touched (a mapping there would fault) and count as a read that
 * found the end (error -1), as preadv would report them. */
static PyObject *
py_copy_pages(PyObject *self, PyObject *args)
{
    PyObject *sources_obj, *segments_obj, *memory, *result_obj, *want_obj, *sums_obj,
        *status_obj;
    long long slot_bytes, page_bytes, pages = 0, moved = 0;
    if (!PyArg_ParseTuple(args, "OOOOLLOOO:copy_pages", &sources_obj, &segments_obj, &memory,
                          &result_obj, &slot_bytes, &page_bytes, &want_obj, &sums_obj,
                          &status_obj))
        return NULL;
    Buffers maps, mem;
    int *fds = NULL;
    if (get_sources(sources_obj, &maps, &fds) < 0) {
        PyMem_Free(fds);
        return NULL;
    }
    if (get_memory(memory, 1, &mem) < 0) {
        release_all(&maps);
        PyMem_Free(fds);
        return NULL;
    }
    CallArrays a;
    memset(&a, 0, sizeof a);
    long long *limits = NULL;
    int got = get_call_arrays(&mem, segments_obj, result_obj, slot_bytes, page_bytes, want_obj,
                              sums_obj, status_obj, &pages, &a) == 0;
    int failed = !got;
    for (Py_ssize_t k = 0; !failed && k < mem.count; k++) {
        const Segment *row = (const Segment *)a.segs.buf + k;
        if (row->fd >= maps.count) {
            PyErr_Format(PyExc_ValueError, "segment %zd: source %lld of %zd", k, row->fd,
                         maps.count);
            failed = 1;
        }
    }
    if (!failed && install_bus_handler() < 0)
        failed = 1;
    if (!failed && (limits = PyMem_Malloc((size_t)(maps.count ? maps.count : 1) *
                                          sizeof(long long))) == NULL) {
        PyErr_NoMemory();
        failed = 1;
    }
    if (!failed) {
        PyThreadState *state = release_gil_for(frame_length(&mem));
        moved = copy_frame(&maps, fds, limits, a.segs.buf, &mem, a.res.buf, pages, slot_bytes,
                           page_bytes, a.want.buf, a.sums.buf, a.status.buf);
        regain_gil(state);
    }
    PyMem_Free(limits);
    if (got)
        release_call_arrays(&a);
    release_all(&mem);
    release_all(&maps);
    PyMem_Free(fds);
    return failed ? NULL : PyLong_FromLongLong(moved);
}

static PyObject *
py_read_pages(PyObject *self, PyObject *args)
{
    return move_pages(0, args);
}

static PyObject *
py_write_pages(PyObject *self, PyObject *args)
{
    return move_pages(1, args);
}

/* Append all of `data` (which may be empty: a sync alone) to `fd` (opened O_APPEND), then
 * fdatasync it where `sync`. A file on a file system held in memory (`in_memory`) waits on no
 * disk, so a short append there keeps the GIL: a journal append takes two system calls under
 * the journal's lock, and with the GIL given up for each, threads of small spills handed the GIL
 * and the lock back and forth (gdskv.journal). On failure raises OSError with the errno; some
 * bytes may have been written (the caller cuts them off). */
static PyObject *
py_append_file(PyObject *self, PyObject *args)
{
    int fd, sync = 0, in_memory = 0;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "iy*p|p:append_file", &fd, &data, &sync, &in_memory))
        return NULL;
    int error = 0;
    PyThreadState *state = in_memory ? release_gil_for(data.len) : PyEval_SaveThread();
    const char *p = data.buf;
    Py_ssize_t left = data.len;
    while (left > 0) {
        ssize_t n = write(fd, p, (size_t)left);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            error = errno;
            break;
        }
        p += n;
        left -= n;
    }
    if (!error && sync && fdatasync(fd) < 0)
        error = errno;
    regain_gil(state);
    PyBuffer_Release(&data);
    if (error) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* Which of these files are gone from their store (gdskv.store, removed_files): each
 * descriptor of `fds` whose file has no link left (or fails fstat), then each path of `paths`
 * that no longer names the inode of `inodes` (lstat). The indices, the paths' after the fds'.
 * Asked before every spill is acknowledged; `in_memory` (the files are on tmpfs/ramfs) keeps
 * the GIL, as a short write there does (each brief give-up woke a thread waiting for it). */
static PyObject *
py_unlinked(PyObject *self, PyObject *args)
{
    PyObject *fds_obj, *paths_obj, *inodes_obj;
    int in_memory = 0;
    if (!PyArg_ParseTuple(args, "OOO|p:unlinked", &fds_obj, &paths_obj, &inodes_obj, &in_memory))
        return NULL;
    Py_ssize_t nf = PySequence_Size(fds_obj), np = PySequence_Size(paths_obj);
    if (nf < 0 || np < 0)
        return NULL;
    if (PySequence_Size(inodes_obj) != np) {
        PyErr_SetString(PyExc_ValueError, "unlinked: paths and inodes differ in length");
        return NULL;
    }
    Py_ssize_t n = nf + np;
    long long *fds = PyMem_Malloc((size_t)(nf ? nf : 1) * sizeof *fds);
    unsigned long long *inodes = PyMem_Malloc((size_t)(np ? np : 1) * sizeof *inodes);
    PyObject **names = PyMem_Calloc((size_t)(np ? np : 1), sizeof *names);
    unsigned char *gone = PyMem_Calloc((size_t)(n ? n : 1), 1);
    PyObject *out = NULL;
    if (fds == NULL || inodes == NULL || names == NULL || gone == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nf; i++) {
        PyObject *item = PySequence_GetItem(fds_obj, i);
        fds[i] = item == NULL ? -1 : PyLong_AsLongLong(item);
        Py_XDECREF(item);
        if (PyErr_Occurred())
            goto done;
    }
    for (Py_ssize_t j = 0; j < np; j++) {
        PyObject *path = PySequence_GetItem(paths_obj, j), *inode = NULL;
        int ok = path != NULL && PyUnicode_FSConverter(path, &names[j]);
        Py_XDECREF(path);
        if (ok && (inode = PySequence_GetItem(inodes_obj, j)) != NULL) {
            inodes[j] = PyLong_AsUnsignedLongLong(inode);
            Py_DECREF(inode);
        }
        if (!ok || inode == NULL || PyErr_Occurred())
            goto done;
    }
    PyThreadState *state = in_memory ? NULL : PyEval_SaveThread();
    struct stat st;
    for (Py_ssize_t i = 0; i < nf; i++)
        gone[i] = fds[i] < 0 || fds[i] > INT_MAX || fstat((int)fds[i], &st) < 0 ||
                  st.st_nlink == 0;
    for (Py_ssize_t j = 0; j < np; j++)
        gone[nf + j] = lstat(PyBytes_AsString(names[j]), &st) < 0 ||
                       (unsigned long long)st.st_ino != inodes[j];
    regain_gil(state);
    if ((out = PyList_New(0)) == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!gone[k])
            continue;
        PyObject *index = PyLong_FromSsize_t(k);
        if (index == NULL || PyList_Append(out, index) < 0) {
            Py_XDECREF(index);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(index);
    }
done:
    if (names != NULL)
        for (Py_ssize_t j = 0; j < np; j++)
            Py_XDECREF(names[j]);
    PyMem_Free(names);
    PyMem_Free(inodes);
    PyMem_Free(fds);
    PyMem_Free(gone);
    return out;
}

static PyObject *
py_take_sizes(PyObject *self, PyObject *args)
{
    int on;
    if (!PyArg_ParseTuple(args, "p:_take_sizes", &on))
        return NULL;
    take_sizes = on;
    Py_RETURN_NONE;
}

static PyObject *
py_hold_gil_below(PyObject *self, PyObject *args)
{
    long long bytes = -1;
    if (!PyArg_ParseTuple(args, "|L:hold_gil_below", &bytes))
        return NULL;
    long long before = hold_gil_below;
    if (bytes >= 0)
        hold_gil_below = bytes;
    return PyLong_FromLongLong(before);
}

static PyObject *
py_implementation(PyObject *self, PyObject *unused)
{
    return PyUnicode_FromString(crc_implementation);
}

static PyMethodDef methods[] = {
    {"crc32c", py_crc32c, METH_VARARGS,
     "crc32c(data, value=0) -> int: CRC-32C of data, continuing the CRC `value`."},
    {"crc32c_table", py_crc32c_table, METH_VARARGS,
     "crc32c_table(data, value=0) -> int: crc32c() by the portable table (for tests)."},
    {"page_sums", py_page_sums, METH_VARARGS,
     "page_sums(memory, slot_bytes, page_bytes, sums): CRC-32C of each page's payload."},
    {"read_pages", py_read_pages, METH_VARARGS,
     "read_pages(segments, memory, result, slot_bytes, page_bytes, want, sums, status, "
     "readahead) -> bytes read; each page's CRC-32C and status (0 ok, 1 mismatch, 2 not read)."},
    {"copy_pages", py_copy_pages, METH_VARARGS,
     "copy_pages(sources, segments, memory, result, slot_bytes, page_bytes, want, sums, status)"
     " -> bytes copied; read_pages from (fd, mapping) sources, rows (source, offset, length)."},
    {"write_pages", py_write_pages, METH_VARARGS,
     "write_pages(segments, memory, result) -> bytes written."},
    {"append_file", py_append_file, METH_VARARGS,
     "append_file(fd, data, sync, in_memory=False): write all of data to fd (O_APPEND), then "
     "fdatasync it where sync; in_memory: under hold_gil_below() bytes the GIL is kept. "
     "Raises OSError."},
    {"unlinked", py_unlinked, METH_VARARGS,
     "unlinked(fds, paths, inodes, in_memory=False) -> list: indices of the descriptors whose "
     "file has no link left, then (after len(fds)) of the paths that no longer name their "
     "inode; in_memory: the GIL is kept."},
    {"_take_sizes", py_take_sizes, METH_VARARGS,
     "_take_sizes(on): for tests only; off, copy_pages does not take files' sizes first, so "
     "a file cut shorter faults the copy, which must then report the file's end."},
    {"hold_gil_below", py_hold_gil_below, METH_VARARGS,
     "hold_gil_below(bytes=-1) -> int: the size below which checksums and copies from "
     "mappings keep the GIL; sets it where bytes >= 0 (benchmarks, tests); the old value."},
    {"implementation", py_implementation, METH_NOARGS,
     "implementation() -> str: the CRC-32C instructions in use (sse4.2, armv8-crc or table)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pages", "gdskv's native page engine (see gdskv.native).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__pages(void)
{
    make_tables();
    choose_crc();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (add_quick_reader(m) < 0 || add_trailer_functions(m) < 0 ||
                      add_record_functions(m) < 0))
        Py_CLEAR(m);
    return m;
}
