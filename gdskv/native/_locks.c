/* gdskv.native._locks: YieldingLock, a lock whose waiters give up the GIL instead of sleeping
 * in the lock (see gdskv/yielding_lock.py for why: lock convoys under the GIL).
 *
 * In C rather than Python for two reasons: `with lock:` must take the lock and return without
 * running Python code in between (a signal handler's exception -- Ctrl-C -- raised between a
 * Python-level acquire and its return would leave the lock held for good), and a 1-page data
 * call passes through a few such locks, where a Python-level __enter__/__exit__ cost about
 * 0.13 us each.
 *
 * A thread takes the lock only while it holds the GIL: it tries without waiting; while the
 * lock is held, it gives up the GIL and yields the CPU (so that the owner, which may be
 * waiting for the GIL, runs on to its release) and tries again, `yields` times; then it
 * blocks like threading.Lock, in slices, to run signal handlers between them. Not reentrant;
 * any thread may release it, as threading.Lock. Plain C on the CPython limited API. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <time.h>

/* how many times a waiter yields before it blocks; the Python-visible default */
#define DEFAULT_YIELDS 100
/* a blocked waiter wakes this often to run signal handlers (Ctrl-C) */
#define SLICE_US 50000

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    int yields;
    Py_ssize_t blocking_waits; /* waits that gave up yielding and blocked */
} LockObject;

static double
now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int
lock_init(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"yields", NULL};
    LockObject *self = (LockObject *)op;
    int yields = DEFAULT_YIELDS;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|i:YieldingLock", names, &yields))
        return -1;
    if (yields < 0) {
        PyErr_SetString(PyExc_ValueError, "yields must be >= 0");
        return -1;
    }
    if (self->lock == NULL && (self->lock = PyThread_allocate_lock()) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->yields = yields;
    return 0;
}

static void
lock_dealloc(PyObject *op)
{
    LockObject *self = (LockObject *)op;
    PyTypeObject *type = Py_TYPE(op);
    if (self->lock != NULL) {
        /* free it before freeing it (held or not), as threading.Lock does */
        PyThread_acquire_lock(self->lock, NOWAIT_LOCK);
        PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(op);
    Py_DECREF(type);
}

/* 1 taken, 0 not (the timeout passed, or not blocking), -1 a signal handler raised. */
static int
take(LockObject *self, int blocking, double timeout)
{
    if (PyThread_acquire_lock(self->lock, NOWAIT_LOCK))
        return 1;
    if (!blocking || timeout == 0)
        return 0;
    double deadline = timeout > 0 ? now_s() + timeout : 0;
    /* What time.sleep(0) does: off the GIL for a moment -- a zero-length sleep lasts the
     * kernel's timer slack, 50 us by default -- long enough for the owner, woken when the GIL
     * was let go, to win it (a sched_yield() came back before the owner woke, and took the
     * GIL again: 4 in 10 waits then blocked on the development machine, against 1 in 100). */
    const struct timespec moment = {0, 0};
    for (int i = 0; i < self->yields; i++) {
        Py_BEGIN_ALLOW_THREADS
        nanosleep(&moment, NULL);
        Py_END_ALLOW_THREADS
        if (PyThread_acquire_lock(self->lock, NOWAIT_LOCK))
            return 1;
        if (PyErr_CheckSignals() < 0)
            return -1;
        if (timeout > 0 && now_s() >= deadline)
            return 0;
    }
    self->blocking_waits++;
    for (;;) {
        PY_TIMEOUT_T slice = SLICE_US;
        if (timeout > 0) {
            double left = deadline - now_s();
            if (left <= 0)
                return 0;
            if (left * 1e6 < (double)slice)
                slice = (PY_TIMEOUT_T)(left * 1e6) + 1;
        }
        PyLockStatus got;
        Py_BEGIN_ALLOW_THREADS
        got = PyThread_acquire_lock_timed(self->lock, slice, 0);
        Py_END_ALLOW_THREADS
        if (got == PY_LOCK_ACQUIRED)
            return 1;
        if (PyErr_CheckSignals() < 0)
            return -1;
    }
}

static PyObject *
lock_acquire(PyObject *op, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pd:acquire", names, &blocking, &timeout))
        return NULL;
    if (!blocking && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return NULL;
    }
    if (timeout < 0 && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
        return NULL;
    }
    int r = take((LockObject *)op, blocking, timeout);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

static PyObject *
lock_enter(PyObject *op, PyObject *unused)
{
    if (take((LockObject *)op, 1, -1) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *
lock_release(PyObject *op, PyObject *unused)
{
    LockObject *self = (LockObject *)op;
    /* held or not, told without waiting: a free lock cannot be released */
    if (PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        PyThread_release_lock(self->lock);
        PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
        return NULL;
    }
    PyThread_release_lock(self->lock);
    Py_RETURN_NONE;
}

static PyObject *
lock_exit(PyObject *op, PyObject *args)
{
    return lock_release(op, NULL);
}

static PyObject *
lock_locked(PyObject *op, PyObject *unused)
{
    LockObject *self = (LockObject *)op;
    if (PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        PyThread_release_lock(self->lock);
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *
lock_repr(PyObject *op)
{
    PyObject *held = lock_locked(op, NULL);
    if (held == NULL)
        return NULL;
    PyObject *out = PyUnicode_FromFormat("<YieldingLock %s>",
                                         held == Py_True ? "locked" : "unlocked");
    Py_DECREF(held);
    return out;
}

static PyObject *
lock_get_blocking_waits(PyObject *op, void *closure)
{
    return PyLong_FromSsize_t(((LockObject *)op)->blocking_waits);
}

static PyObject *
lock_get_yields(PyObject *op, void *closure)
{
    return PyLong_FromLong(((LockObject *)op)->yields);
}

static PyMethodDef lock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))lock_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> bool, as threading.Lock.acquire."},
    {"release", lock_release, METH_NOARGS, "release(): free the lock (RuntimeError if free)."},
    {"locked", lock_locked, METH_NOARGS, "locked() -> bool: whether it is held."},
    {"__enter__", lock_enter, METH_NOARGS, "acquire()"},
    {"__exit__", lock_exit, METH_VARARGS, "release()"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef lock_getset[] = {
    {"blocking_waits", lock_get_blocking_waits, NULL,
     "waits that yielded `yields` times in vain and then blocked", NULL},
    {"yields", lock_get_yields, NULL, "how many times a waiter yields before it blocks", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot lock_slots[] = {
    {Py_tp_doc, "YieldingLock(yields=100): threading.Lock's interface; a waiter gives up the "
                "GIL and yields instead of sleeping in the lock (gdskv.yielding_lock)."},
    {Py_tp_init, lock_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, lock_dealloc},
    {Py_tp_repr, lock_repr},
    {Py_tp_methods, lock_methods},
    {Py_tp_getset, lock_getset},
    {0, NULL},
};

static PyType_Spec lock_spec = {
    "gdskv.native._locks.YieldingLock", sizeof(LockObject), 0, Py_TPFLAGS_DEFAULT, lock_slots,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_locks", "gdskv's yielding lock (see gdskv.yielding_lock).", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__locks(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *type = PyType_FromSpec(&lock_spec);
    if (type == NULL || PyModule_AddObject(m, "YieldingLock", type) < 0) {
        Py_XDECREF(type);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "DEFAULT_YIELDS", DEFAULT_YIELDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
