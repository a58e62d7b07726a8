/* The quick reader: a small restore into host regions -- the directory's pins, the read with
 * each page's CRC-32C checked, the unpins -- in one native call (gdskv/quick_calls.py,
 * QuickRestore; docs/native.md, "Quick restores in C").
 *
 * The same steps in Python (PageDirectory.pin_for_read, the posix backend's
 * read_checked_on_caller, PageDirectory.unpin) cost a 1-page restore about 20 us of host time
 * under the GIL on the development machine, and under the GIL that is what caps many threads'
 * pages/s. Here they run on the directory's own state, under its own lock:
 *
 *   - the lock: the directory's (`lock`: its acquire and release methods, so the same
 *     YieldingLock or threading.Lock every other directory step takes);
 *   - the key -> slot dict and the LRU clock: the directory's `_index` and `_clock`, read per
 *     call (load() replaces the dict);
 *   - per slot: its numpy arrays (state, pins, last use, checksum, checksum algorithm), whose
 *     memory this object holds for its life.
 *
 * A call does only what a restore that goes right needs. It answers 0 (nothing pinned, nothing
 * read) where a hit's checksum was made by another algorithm or its pin count is full, and 1
 * where it read and some page did not come back whole and equal, so that the caller's general
 * path settles the call; a page being evicted meanwhile (EVICTING, its last pin) is unpinned
 * by `release_evicting(slots)`, the directory's own unpin, which frees and journals it. */
#include "engine.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* PageState values (gdskv/directory.py) */
#define STATE_READY 2
#define STATE_EVICTING 3
/* the directory's pin counts are uint16 */
#define MOST_PINS 0xFFFF
/* scratch for the slots' tails: 4 KiB aligned, as O_DIRECT wants */
#define SCRATCH_ALIGN 4096
/* a call of up to this many pages keeps its per-page state on the stack */
#define FEW_PAGES 8

typedef struct {
    PyObject_HEAD
    PyObject *directory, *acquire, *release, *backend, *release_evicting;
    Py_buffer state, pins, last_use, checksum, algorithm, fds;
    long long num_slots, num_files, stripe_slots, slot_bytes, page_bytes, readahead;
    int algorithm_id;
} QuickReader;

/* One hit of a call. */
typedef struct {
    long long slot, position;
    unsigned char *region;
    int evicting; /* at its unpin: EVICTING with this its last pin (the directory frees it) */
} Hit;

static PyObject *index_name, *clock_name, *maps_name;

/* ---------------------------------------------------------------------------------------- */
/* The directory                                                                            */
/* ---------------------------------------------------------------------------------------- */

static int
call_lock(PyObject *method)
{
    PyObject *r = PyObject_CallNoArgs(method);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* Release the directory's lock keeping any error set (the error is what the call returns). */
static void
unlock_keeping_error(QuickReader *self)
{
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    if (call_lock(self->release) < 0)
        PyErr_Clear(); /* (a lock held by this thread: it lets go) */
    PyErr_Restore(type, value, trace);
}

/* Under the directory's lock: the READY pages among `keys` into `hits`, pinned and touched
 * as PageDirectory.pin_for_read does. Returns the count, -1 on an error (nothing pinned),
 * -2 where the call is not one for this path (nothing pinned). */
static Py_ssize_t
pin_hits(QuickReader *self, PyObject *keys, Py_ssize_t n, Hit *hits)
{
    PyObject *index = PyObject_GetAttr(self->directory, index_name);
    PyObject *clock_obj = index == NULL ? NULL : PyObject_GetAttr(self->directory, clock_name);
    if (clock_obj == NULL) {
        Py_XDECREF(index);
        return -1;
    }
    unsigned long long clock = PyLong_AsUnsignedLongLong(clock_obj);
    Py_DECREF(clock_obj);
    if (clock == (unsigned long long)-1 && PyErr_Occurred()) {
        Py_DECREF(index);
        return -1;
    }
    const unsigned char *state = self->state.buf, *algorithm = self->algorithm.buf;
    uint16_t *pins = self->pins.buf;
    Py_ssize_t count = 0;
    int other = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GetItem(keys, i);
        Py_XINCREF(key); /* (a key's __hash__ may run Python code) */
        PyObject *found = key == NULL ? NULL : PyDict_GetItemWithError(index, key);
        Py_XDECREF(key);
        if (found == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(index);
                return -1;
            }
            continue;
        }
        long long slot = PyLong_AsLongLong(found);
        if (slot < 0 || slot >= self->num_slots) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_RuntimeError, "directory slot %lld out of range", slot);
            Py_DECREF(index);
            return -1;
        }
        if (state[slot] != STATE_READY)
            continue;
        if (algorithm[slot] != self->algorithm_id || pins[slot] > MOST_PINS - n)
            other = 1;
        hits[count].slot = slot;
        hits[count].position = i;
        count++;
    }
    Py_DECREF(index);
    if (other || count == 0)
        return other ? -2 : 0;
    PyObject *now = PyLong_FromUnsignedLongLong(clock + (unsigned long long)count);
    if (now == NULL || PyObject_SetAttr(self->directory, clock_name, now) < 0) {
        Py_XDECREF(now);
        return -1;
    }
    Py_DECREF(now);
    uint64_t *last_use = self->last_use.buf;
    for (Py_ssize_t k = 0; k < count; k++) {
        pins[hits[k].slot]++;
        last_use[hits[k].slot] = ++clock;
    }
    return count;
}

/* Drop the pins of `hits`, as PageDirectory.unpin does: a page asked to go while pinned
 * (EVICTING) goes at its last unpin, which the directory's own unpin does (it frees the slot
 * and the caller journals it): those are left pinned here and handed to release_evicting.
 * Never fails to unpin; returns -1 with an error set where taking the lock or
 * release_evicting raised (the pins are dropped all the same). */
static int
unpin_hits(QuickReader *self, Hit *hits, Py_ssize_t count)
{
    PyObject *type = NULL, *value = NULL, *trace = NULL;
    /* the pins must go: a signal handler's exception while waiting for the lock is kept and
     * raised once they have */
    while (call_lock(self->acquire) < 0) {
        if (type == NULL)
            PyErr_Fetch(&type, &value, &trace);
        else
            PyErr_Clear();
    }
    const unsigned char *state = self->state.buf;
    uint16_t *pins = self->pins.buf;
    Py_ssize_t last = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        long long slot = hits[k].slot;
        /* (two hits of one slot: only its last pin is the last) */
        hits[k].evicting = pins[slot] == 1 && state[slot] == STATE_EVICTING;
        if (hits[k].evicting)
            last++;
        else
            pins[slot]--;
    }
    if (call_lock(self->release) < 0)
        PyErr_Clear();
    int rc = 0;
    if (last) { /* (rare) */
        PyObject *slots = PyList_New(0);
        for (Py_ssize_t k = 0; slots != NULL && k < count; k++) {
            PyObject *s = hits[k].evicting ? PyLong_FromLongLong(hits[k].slot) : NULL;
            if (hits[k].evicting && (s == NULL || PyList_Append(slots, s) < 0))
                Py_CLEAR(slots);
            Py_XDECREF(s);
        }
        /* (without a list -- no memory -- the pins stay: never freed while the tier runs,
         * the page is not served (EVICTING) and its slot is reused after a
         * restart) */
        PyObject *r = slots == NULL ? NULL
                                    : PyObject_CallFunctionObjArgs(self->release_evicting,
                                                                   slots, NULL);
        Py_XDECREF(slots);
        Py_XDECREF(r);
        rc = r == NULL ? -1 : 0;
    }
    if (type != NULL) {
        PyErr_Restore(type, value, trace);
        rc = -1;
    }
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* The read                                                                                 */
/* ---------------------------------------------------------------------------------------- */

static double
seconds_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int
by_slot(const void *a, const void *b)
{
    long long x = ((const Hit *)a)->slot, y = ((const Hit *)b)->slot;
    return (x > y) - (x < y);
}

/* The mappings of the files the hits are in, or 0 where one of them is not mapped (the call
 * then reads them with preadv, as the posix backend does). Fills `maps` and `fds` (one per
 * distinct file, in `files`) and each hit's source index into `source`. -1 on an error. */
static int
get_maps(QuickReader *self, const Hit *hits, Py_ssize_t count, const long long *file,
         Buffers *maps, int *fds, long long *files, long long *source)
{
    PyObject *all = PyObject_GetAttr(self->backend, maps_name);
    if (all == NULL)
        return -1;
    Py_ssize_t distinct = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        Py_ssize_t j = 0;
        while (j < distinct && files[j] != file[k])
            j++;
        if (j == distinct)
            files[distinct++] = file[k];
        source[k] = j;
    }
    if (alloc_views(maps, distinct) < 0) {
        Py_DECREF(all);
        return -1;
    }
    int mapped = 1;
    for (Py_ssize_t j = 0; j < distinct && mapped == 1; j++) {
        PyObject *entry = PySequence_GetItem(all, (Py_ssize_t)files[j]);
        PyObject *fd = NULL, *map = NULL;
        if (entry == NULL) {
            mapped = -1;
        } else if (entry == Py_None) {
            mapped = 0;
        } else if ((fd = PySequence_GetItem(entry, 0)) == NULL ||
                   (map = PySequence_GetItem(entry, 1)) == NULL) {
            mapped = -1;
        } else {
            long value = PyLong_AsLong(fd);
            if (value < 0 || value > INT_MAX) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "mapping of file %lld: fd %ld", files[j],
                                 value);
                mapped = -1;
            } else if (PyObject_GetBuffer(map, &maps->views[j], PyBUF_C_CONTIGUOUS) < 0) {
                mapped = -1;
            } else {
                fds[j] = (int)value;
                maps->count = j + 1;
            }
        }
        Py_XDECREF(fd);
        Py_XDECREF(map);
        Py_XDECREF(entry);
    }
    Py_DECREF(all);
    if (mapped != 1)
        release_all(maps);
    return mapped;
}

/* Read the pinned `hits` (in slot order) into their regions, each slot's tail (padding and
 * trailer) into scratch, each payload's CRC-32C compared with its stored one. Returns 0 when
 * every page came back whole and equal, 1 when one did not, -1 on an error; `*seconds`: the
 * I/O's time. */
static int
read_hits(QuickReader *self, const Hit *hits, Py_ssize_t count, double *seconds)
{
    long long sb = self->slot_bytes, pb = self->page_bytes, tail = sb - pb;
    const long long *fd_of = self->fds.buf;
    const uint64_t *stored = self->checksum.buf;
    /* per page: file, want, sum, status; per segment (2 a page): row, result */
    size_t need = (size_t)count * (3 * sizeof(long long) + sizeof(uint64_t) * 2 + 1) +
                  (size_t)count * 2 * (sizeof(Segment) + sizeof(Moved));
    unsigned char *block = PyMem_Malloc(need);
    void *scratch = NULL;
    if (block == NULL || posix_memalign(&scratch, SCRATCH_ALIGN, (size_t)(count * tail))) {
        PyMem_Free(block);
        PyErr_NoMemory();
        return -1;
    }
    Segment *segs = (Segment *)block;
    Moved *res = (Moved *)(segs + 2 * count);
    long long *file = (long long *)(res + 2 * count), *files = file + count,
              *source = files + count;
    uint64_t *want = (uint64_t *)(source + count), *sums = want + count;
    unsigned char *status = (unsigned char *)(sums + count);
    for (Py_ssize_t k = 0; k < count; k++) {
        long long stripe = hits[k].slot / self->stripe_slots,
                  within = hits[k].slot % self->stripe_slots;
        file[k] = stripe % self->num_files;
        long long offset = ((stripe / self->num_files) * self->stripe_slots + within) * sb;
        segs[2 * k] = (Segment){fd_of[file[k]], offset, pb};
        segs[2 * k + 1] = (Segment){fd_of[file[k]], offset + pb, tail};
        want[k] = stored[hits[k].slot];
    }
    Buffers mem = {NULL, 0, {{0}}}, maps = {NULL, 0, {{0}}};
    int fds_small[FEW_PAGES], *fds = count <= FEW_PAGES ? fds_small
                                    : PyMem_Malloc((size_t)count * sizeof(int));
    int rc = -1, mapped = -1;
    if (fds == NULL) {
        PyErr_NoMemory();
    } else if (alloc_views(&mem, 2 * count) == 0) {
        for (Py_ssize_t k = 0; k < 2 * count; k++) {
            Py_buffer *v = &mem.views[k];
            memset(v, 0, sizeof *v); /* obj NULL: nothing to release */
            v->buf = k % 2 ? (unsigned char *)scratch + (k / 2) * tail : hits[k / 2].region;
            v->len = (Py_ssize_t)(k % 2 ? tail : pb);
            v->itemsize = 1;
        }
        mem.count = 2 * count;
        mapped = get_maps(self, hits, count, file, &maps, fds, files, source);
        if (mapped == 1 && install_bus_handler() < 0) {
            release_all(&maps);
            mapped = -1;
        }
    }
    if (mapped == 1) { /* copies from the mappings: a segment's row names its source */
        long long *limits = PyMem_Malloc((size_t)maps.count * sizeof(long long));
        if (limits == NULL) {
            PyErr_NoMemory();
        } else {
            for (Py_ssize_t k = 0; k < 2 * count; k++)
                segs[k].fd = source[k / 2];
            double t0 = seconds_now();
            PyThreadState *gil = release_gil_for(count * sb);
            copy_frame(&maps, fds, limits, segs, &mem, res, count, sb, pb, want, sums, status);
            regain_gil(gil);
            *seconds = seconds_now() - t0;
            PyMem_Free(limits);
            rc = 0;
        }
        release_all(&maps);
    } else if (mapped == 0) { /* preadv, with the GIL released (it may wait on a disk) */
        double t0 = seconds_now();
        Py_BEGIN_ALLOW_THREADS
        move_all(0, segs, mem.views, res, 2 * count, self->readahead);
        settle_pages(&mem, res, count, sb, pb, want, sums, status, 0);
        Py_END_ALLOW_THREADS
        *seconds = seconds_now() - t0;
        rc = 0;
    }
    for (Py_ssize_t k = 0; rc == 0 && k < count; k++)
        if (status[k])
            rc = 1;
    release_all(&mem);
    if (fds != fds_small)
        PyMem_Free(fds);
    free(scratch);
    PyMem_Free(block);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* The type                                                                                 */
/* ---------------------------------------------------------------------------------------- */

static PyObject *
reader_read(PyObject *obj, PyObject *args)
{
    QuickReader *self = (QuickReader *)obj;
    PyObject *keys, *addresses;
    if (!PyArg_ParseTuple(args, "O!O!:read", &PyList_Type, &keys, &PyList_Type, &addresses))
        return NULL;
    Py_ssize_t n = PyList_Size(keys);
    if (n != PyList_Size(addresses)) {
        PyErr_Format(PyExc_ValueError, "%zd keys and %zd addresses", n,
                     PyList_Size(addresses));
        return NULL;
    }
    Hit few[FEW_PAGES], *hits = n <= FEW_PAGES ? few : PyMem_Malloc((size_t)n * sizeof(Hit));
    unsigned char **regions = NULL;
    PyObject *out = NULL;
    if (hits == NULL || (regions = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(void *))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        regions[i] = PyLong_AsVoidPtr(PyList_GetItem(addresses, i));
        if (regions[i] == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "address %zd is 0", i);
            goto done;
        }
    }
    if (call_lock(self->acquire) < 0)
        goto done;
    Py_ssize_t count = pin_hits(self, keys, n, hits);
    if (count == -1) {
        unlock_keeping_error(self);
        goto done;
    }
    if (call_lock(self->release) < 0)
        PyErr_Clear();
    if (count == -2) { /* nothing pinned, nothing read: the general path's call */
        out = PyLong_FromLong(0);
        goto done;
    }
    double seconds = 0.0;
    int read = 0;
    if (count > 0) {
        for (Py_ssize_t k = 0; k < count; k++)
            hits[k].region = regions[hits[k].position];
        if (count > 1)
            qsort(hits, (size_t)count, sizeof(Hit), by_slot);
        read = read_hits(self, hits, count, &seconds);
        if (read < 0) { /* the pins still go */
            PyObject *type, *value, *trace;
            PyErr_Fetch(&type, &value, &trace);
            if (unpin_hits(self, hits, count) < 0)
                PyErr_Clear();
            PyErr_Restore(type, value, trace);
            goto done;
        }
        if (unpin_hits(self, hits, count) < 0)
            goto done;
    }
    if (read == 1) { /* read, and some page did not come back whole and equal */
        out = PyLong_FromLong(1);
        goto done;
    }
    PyObject *results = PyList_New(n);
    if (results == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(Py_False);
        PyList_SetItem(results, i, Py_False);
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        Py_INCREF(Py_True);
        PyList_SetItem(results, hits[k].position, Py_True);
    }
    out = Py_BuildValue("(Nnd)", results, count, seconds);
done:
    if (hits != few)
        PyMem_Free(hits);
    PyMem_Free(regions);
    return out;
}

static int
get_slot_array(PyObject *obj, const char *name, Py_ssize_t itemsize, long long count,
               Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->itemsize != itemsize || view->len != count * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected %lld items of %zd bytes, got %zd bytes of "
                     "items of %zd bytes", name, count, itemsize, view->len, view->itemsize);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return 0;
}

static void
release_views(QuickReader *self)
{
    Py_buffer *views[] = {&self->state, &self->pins, &self->last_use, &self->checksum,
                          &self->algorithm, &self->fds};
    for (size_t i = 0; i < sizeof views / sizeof views[0]; i++)
        if (views[i]->obj != NULL) {
            PyBuffer_Release(views[i]);
            views[i]->obj = NULL;
        }
}

static PyObject *
reader_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"directory", "lock", "state", "pins", "last_use", "checksum",
                            "algorithm", "backend", "fds", "stripe_slots", "slot_bytes",
                            "page_bytes", "readahead", "algorithm_id", "release_evicting",
                            NULL};
    PyObject *directory, *lock, *state, *pins, *last_use, *checksum, *algorithm, *backend,
        *fds, *release_evicting;
    long long stripe_slots, slot_bytes, page_bytes, readahead;
    int algorithm_id;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOOLLLLiO:QuickReader", names,
                                     &directory, &lock, &state, &pins, &last_use, &checksum,
                                     &algorithm, &backend, &fds, &stripe_slots, &slot_bytes,
                                     &page_bytes, &readahead, &algorithm_id, &release_evicting))
        return NULL;
    if (stripe_slots <= 0 || page_bytes <= 0 || slot_bytes <= page_bytes) {
        PyErr_Format(PyExc_ValueError, "stripe_slots must be > 0 and 0 < page_bytes < "
                     "slot_bytes, got %lld, %lld and %lld", stripe_slots, page_bytes,
                     slot_bytes);
        return NULL;
    }
    if (!PyCallable_Check(release_evicting)) {
        PyErr_SetString(PyExc_TypeError, "release_evicting must be callable");
        return NULL;
    }
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    QuickReader *self = (QuickReader *)alloc(type, 0);
    if (self == NULL)
        return NULL;
    /* (tp_alloc zeroed the object: views with obj NULL are not held) */
    PyObject *probe = NULL;
    if (PyObject_GetBuffer(state, &self->state, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    Py_ssize_t n = self->state.len;
    if (self->state.itemsize != 1 || n == 0 ||
        get_slot_array(pins, "pins", 2, n, &self->pins) < 0 ||
        get_slot_array(last_use, "last_use", 8, n, &self->last_use) < 0 ||
        get_slot_array(checksum, "checksum", 8, n, &self->checksum) < 0 ||
        get_slot_array(algorithm, "algorithm", 1, n, &self->algorithm) < 0 ||
        PyObject_GetBuffer(fds, &self->fds, PyBUF_C_CONTIGUOUS) < 0 ||
        (probe = PyObject_GetAttrString(lock, "acquire")) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "state: one uint8 per slot, at least one slot");
        Py_DECREF(self);
        return NULL;
    }
    self->acquire = probe;
    if ((self->release = PyObject_GetAttrString(lock, "release")) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    if (self->fds.itemsize != 8 || self->fds.len < 8 || self->fds.len % 8) {
        PyErr_Format(PyExc_ValueError, "fds: expected int64, one per file, got %zd bytes of "
                     "items of %zd bytes", self->fds.len, self->fds.itemsize);
        Py_DECREF(self);
        return NULL;
    }
    self->num_slots = n;
    self->num_files = self->fds.len / 8;
    self->stripe_slots = stripe_slots;
    self->slot_bytes = slot_bytes;
    self->page_bytes = page_bytes;
    self->readahead = readahead;
    self->algorithm_id = algorithm_id;
    Py_INCREF(directory);
    self->directory = directory;
    Py_INCREF(backend);
    self->backend = backend;
    Py_INCREF(release_evicting);
    self->release_evicting = release_evicting;
    return (PyObject *)self;
}

static int
reader_traverse(PyObject *obj, visitproc visit, void *arg)
{
    QuickReader *self = (QuickReader *)obj;
    Py_VISIT(Py_TYPE(obj));
    Py_VISIT(self->directory);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    Py_VISIT(self->backend);
    Py_VISIT(self->release_evicting);
    return 0;
}

static int
reader_clear(PyObject *obj)
{
    QuickReader *self = (QuickReader *)obj;
    Py_CLEAR(self->directory);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    Py_CLEAR(self->backend);
    Py_CLEAR(self->release_evicting);
    return 0;
}

static void
reader_dealloc(PyObject *obj)
{
    PyTypeObject *type = Py_TYPE(obj);
    PyObject_GC_UnTrack(obj);
    reader_clear(obj);
    release_views((QuickReader *)obj);
    freefunc free_ = (freefunc)PyType_GetSlot(type, Py_tp_free);
    free_(obj);
    Py_DECREF(type);
}

static PyMethodDef reader_methods[] = {
    {"read", reader_read, METH_VARARGS,
     "read(keys, addresses) -> (hits, count, seconds), or 0 / 1 for the general path: restore "
     "the READY pages of the list `keys` into the regions at the list `addresses` (one "
     "page_bytes region each, in place and alive for the call), each page's CRC-32C checked. "
     "hits: per key whether it was restored; 0: nothing was read (a page of another checksum "
     "algorithm); 1: a page did not read back whole and equal."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot reader_slots[] = {
    {Py_tp_new, reader_new},
    {Py_tp_dealloc, reader_dealloc},
    {Py_tp_traverse, reader_traverse},
    {Py_tp_clear, reader_clear},
    {Py_tp_methods, reader_methods},
    {Py_tp_doc, "QuickReader(directory, lock, state, pins, last_use, checksum, algorithm, "
                "backend, fds, stripe_slots, slot_bytes, page_bytes, readahead, algorithm_id, "
                "release_evicting): a tier's small restores into host regions in one call "
                "each (gdskv.quick_calls)."},
    {0, NULL},
};

static PyType_Spec reader_spec = {
    "gdskv.native._pages.QuickReader", sizeof(QuickReader), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, reader_slots,
};

int
add_quick_reader(PyObject *module)
{
    if ((index_name = PyUnicode_InternFromString("_index")) == NULL ||
        (clock_name = PyUnicode_InternFromString("_clock")) == NULL ||
        (maps_name = PyUnicode_InternFromString("_maps")) == NULL)
        return -1;
    PyObject *type = PyType_FromSpec(&reader_spec);
    if (type == NULL)
        return -1;
    if (PyModule_AddObject(module, "QuickReader", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}
