/* Optional C speedups for kvtier. Pure-Python fallbacks live beside their users.
 *
 * pack_i32(seq) -> bytes: token ids (a list or tuple of ints) as little-endian int32
 * (fallback in kvtier/keys.py). Converting a Python list to bytes is the dominant cost of
 * chunk-key computation (array.array spends ~20 ns per item in its generic setitem; this
 * loop ~3 ns).
 *
 * WorkQueue: the task queue of the store's I/O threads (kvtier/store/executor.py, whose
 * fallback is a ThreadPoolExecutor). Its workers wait, and find out whether a task is
 * left for them, without holding the GIL: a task that its waiter took back (take())
 * costs the woken worker no GIL hand-over, which on a small machine costs more than the
 * copy of a 256 KiB value. A task becomes due `grace` seconds after put() (or at once,
 * after hurry()), so a caller that waits at once takes its task before a worker starts it.
 *
 * copy(dst, dst_off, src, src_off, n): memcpy between two contiguous buffers, without the
 * GIL from 64 KiB up (fallback: numpy, in kvtier/tiers/host.py). A host-tier put or get
 * through numpy builds three arrays and runs numpy's generic copy set-up; with the caches
 * cold (a store call after large copies elsewhere) that set-up, not the copy, was most of
 * a 4 KiB operation's time.
 *
 * keys16(keys) -> list | None: ``keys`` (a list or tuple) as a new list when every item is
 * bytes of 16 (a chunk key), else None; the caller then finds the culprit and raises
 * (kvtier/keys.py). Every store call checks its keys.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *pack_i32(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "token ids must be a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) { Py_DECREF(seq); return NULL; }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        long v;
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
        /* CPython 3.11: an exact int of at most one 30-bit digit is read directly;
         * the function call of PyLong_AsLong costs more than the conversion. */
        if (PyLong_CheckExact(item) && Py_SIZE(item) >= -1 && Py_SIZE(item) <= 1) {
            v = (long)((PyLongObject *)item)->ob_digit[0] * (long)Py_SIZE(item);
        } else
#endif
        {
            v = PyLong_AsLong(item);
            if (v == -1 && PyErr_Occurred()) { Py_DECREF(seq); Py_DECREF(out); return NULL; }
        }
        if (v < INT32_MIN || v > INT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "token id %ld does not fit in int32", v);
            Py_DECREF(seq); Py_DECREF(out); return NULL;
        }
        uint32_t u = (uint32_t)(int32_t)v;
        p[4 * i] = (unsigned char)(u & 0xff);
        p[4 * i + 1] = (unsigned char)((u >> 8) & 0xff);
        p[4 * i + 2] = (unsigned char)((u >> 16) & 0xff);
        p[4 * i + 3] = (unsigned char)((u >> 24) & 0xff);
    }
    Py_DECREF(seq);
    return out;
}

/* ---- WorkQueue ------------------------------------------------------------------------ */

#include <errno.h>
#include <pthread.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    PyObject **items; /* a ring; NULL marks a task taken back by its waiter */
    double *due;      /* CLOCK_MONOTONIC seconds from which a worker may start it */
    Py_ssize_t cap, head, len, live;
    double grace;
    double last_put; /* when the latest task was queued: idle workers linger after it */
    int timed;       /* workers in a timed wait: each wakes by the next task's due time */
    int closed;
    int ready; /* mu and cv initialised */
} WorkQueue;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int wq_init(WorkQueue *q, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"grace", NULL};
    double grace = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|d", kwlist, &grace)) return -1;
    if (!(grace >= 0.0 && grace <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "grace must be within [0, 1] seconds");
        return -1;
    }
    if (q->ready) {
        PyErr_SetString(PyExc_RuntimeError, "WorkQueue is already initialised");
        return -1;
    }
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) != 0 || pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_condattr failed");
        return -1;
    }
    int rc = pthread_cond_init(&q->cv, &attr);
    pthread_condattr_destroy(&attr);
    if (rc != 0 || pthread_mutex_init(&q->mu, NULL) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread mutex or condition init failed");
        return -1;
    }
    q->cap = 16;
    q->items = PyMem_Calloc((size_t)q->cap, sizeof(PyObject *));
    q->due = PyMem_Calloc((size_t)q->cap, sizeof(double));
    if (q->items == NULL || q->due == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    q->grace = grace;
    q->ready = 1;
    return 0;
}

static void wq_dealloc(WorkQueue *q) {
    if (q->items != NULL) {
        for (Py_ssize_t i = 0; i < q->len; i++) Py_XDECREF(q->items[(q->head + i) % q->cap]);
    }
    PyMem_Free(q->items);
    PyMem_Free(q->due);
    if (q->ready) {
        pthread_mutex_destroy(&q->mu);
        pthread_cond_destroy(&q->cv);
    }
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static int wq_check(WorkQueue *q) {
    if (!q->ready) {
        PyErr_SetString(PyExc_RuntimeError, "WorkQueue is not initialised");
        return -1;
    }
    return 0;
}

/* Grow the ring when full. Called with mu held and the GIL held (PyMem needs it). */
static int wq_grow(WorkQueue *q) {
    Py_ssize_t cap = q->cap * 2;
    PyObject **items = PyMem_Calloc((size_t)cap, sizeof(PyObject *));
    double *due = PyMem_Calloc((size_t)cap, sizeof(double));
    if (items == NULL || due == NULL) {
        PyMem_Free(items);
        PyMem_Free(due);
        return -1;
    }
    for (Py_ssize_t i = 0; i < q->len; i++) {
        items[i] = q->items[(q->head + i) % q->cap];
        due[i] = q->due[(q->head + i) % q->cap];
    }
    PyMem_Free(q->items);
    PyMem_Free(q->due);
    q->items = items;
    q->due = due;
    q->cap = cap;
    q->head = 0;
    return 0;
}

static PyObject *wq_put(WorkQueue *q, PyObject *task) {
    if (wq_check(q) < 0) return NULL;
    pthread_mutex_lock(&q->mu);
    if (q->closed) {
        pthread_mutex_unlock(&q->mu);
        PyErr_SetString(PyExc_RuntimeError, "cannot schedule new work after shutdown");
        return NULL;
    }
    if (q->len == q->cap && wq_grow(q) < 0) {
        pthread_mutex_unlock(&q->mu);
        return PyErr_NoMemory();
    }
    Py_INCREF(task);
    Py_ssize_t at = (q->head + q->len) % q->cap;
    q->items[at] = task;
    q->due[at] = now_s() + q->grace;
    q->len++;
    q->live++;
    q->last_put = q->due[at] - q->grace;
    /* A worker in a timed wait wakes by this task's due time anyway (its deadline is an
     * earlier task's due time, or a linger step of one grace): no signal, so a caller
     * that takes its task back at once costs the worker no wake-up. */
    if (q->timed == 0) pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
    Py_RETURN_NONE;
}

/* The ring position of task, or -1. mu held. */
static Py_ssize_t wq_find(WorkQueue *q, PyObject *task) {
    for (Py_ssize_t i = 0; i < q->len; i++) {
        Py_ssize_t at = (q->head + i) % q->cap;
        if (q->items[at] == task) return at;
    }
    return -1;
}

static PyObject *wq_take(WorkQueue *q, PyObject *task) {
    if (wq_check(q) < 0) return NULL;
    pthread_mutex_lock(&q->mu);
    Py_ssize_t at = wq_find(q, task);
    if (at >= 0) {
        q->items[at] = NULL;
        q->live--;
        while (q->len > 0 && q->items[q->head] == NULL) { /* no worker may come to drop it */
            q->head = (q->head + 1) % q->cap;
            q->len--;
        }
    }
    pthread_mutex_unlock(&q->mu);
    if (at < 0) Py_RETURN_FALSE;
    Py_DECREF(task); /* the queue's reference; the caller holds its own */
    Py_RETURN_TRUE;
}

static PyObject *wq_hurry(WorkQueue *q, PyObject *task) {
    if (wq_check(q) < 0) return NULL;
    pthread_mutex_lock(&q->mu);
    Py_ssize_t at = wq_find(q, task);
    if (at >= 0) {
        q->due[at] = 0.0;
        pthread_cond_signal(&q->cv);
    }
    pthread_mutex_unlock(&q->mu);
    Py_RETURN_NONE;
}

/* How long, in graces, an idle worker keeps waking on its own after the latest put. */
#define LINGER_GRACES 10.0

/* Wait on cv until the monotonic time `until` (or a signal), counted in q->timed. mu held. */
static void wq_timedwait(WorkQueue *q, double until) {
    struct timespec ts;
    ts.tv_sec = (time_t)until;
    ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec += 1;
        ts.tv_nsec -= 1000000000L;
    }
    q->timed++;
    pthread_cond_timedwait(&q->cv, &q->mu, &ts);
    q->timed--;
}

/* Next task for a worker, or None once closed and empty. Waits without the GIL. */
static PyObject *wq_get(WorkQueue *q, PyObject *Py_UNUSED(ignored)) {
    if (wq_check(q) < 0) return NULL;
    PyObject *task = NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (q->len > 0 && q->items[q->head] == NULL) { /* drop taken-back tasks */
            q->head = (q->head + 1) % q->cap;
            q->len--;
        }
        if (q->live == 0) {
            if (q->closed) break;
            double now = now_s();
            if (q->grace > 0.0 && now < q->last_put + LINGER_GRACES * q->grace) {
                /* Tasks came lately: wait in steps of one grace, so the next put
                 * need not wake this worker (see wq_put). */
                wq_timedwait(q, now + q->grace);
            } else {
                pthread_cond_wait(&q->cv, &q->mu);
            }
            continue;
        }
        /* The first due task in queue order, else wait for the earliest due time. */
        double now = now_s(), earliest = 0.0;
        Py_ssize_t pick = -1;
        for (Py_ssize_t i = 0; i < q->len; i++) {
            Py_ssize_t at = (q->head + i) % q->cap;
            if (q->items[at] == NULL) continue;
            if (q->closed || q->due[at] <= now) {
                pick = at;
                break;
            }
            if (earliest == 0.0 || q->due[at] < earliest) earliest = q->due[at];
        }
        if (pick < 0) {
            wq_timedwait(q, earliest);
            continue;
        }
        task = q->items[pick];
        q->items[pick] = NULL;
        q->live--;
        /* Puts do not wake a worker while one waits timed: hand the rest on, so tasks
         * queued together still run on as many workers as there are. */
        if (q->live > 0) pthread_cond_signal(&q->cv);
        break;
    }
    pthread_mutex_unlock(&q->mu);
    Py_END_ALLOW_THREADS
    if (task == NULL) Py_RETURN_NONE;
    return task; /* the queue's reference passes to the worker */
}

static PyObject *wq_close(WorkQueue *q, PyObject *Py_UNUSED(ignored)) {
    if (wq_check(q) < 0) return NULL;
    pthread_mutex_lock(&q->mu);
    q->closed = 1;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    Py_RETURN_NONE;
}

static PyObject *wq_pending(WorkQueue *q, PyObject *Py_UNUSED(ignored)) {
    if (wq_check(q) < 0) return NULL;
    pthread_mutex_lock(&q->mu);
    Py_ssize_t live = q->live;
    pthread_mutex_unlock(&q->mu);
    return PyLong_FromSsize_t(live);
}

static PyMethodDef wq_methods[] = {
    {"put", (PyCFunction)wq_put, METH_O, "Queue a task; it is due after the grace period."},
    {"take", (PyCFunction)wq_take, METH_O, "Remove a queued task for its waiter to run: True if it was still queued."},
    {"hurry", (PyCFunction)wq_hurry, METH_O, "Make a queued task due now."},
    {"get", (PyCFunction)wq_get, METH_NOARGS, "The next due task (waits without the GIL); None once closed and drained."},
    {"close", (PyCFunction)wq_close, METH_NOARGS, "Refuse new tasks; workers drain what is queued, then get() returns None."},
    {"pending", (PyCFunction)wq_pending, METH_NOARGS, "Tasks queued and not taken."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WorkQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._speedups.WorkQueue",
    .tp_basicsize = sizeof(WorkQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Task queue whose workers wait without the GIL (see the module comment).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)wq_init,
    .tp_dealloc = (destructor)wq_dealloc,
    .tp_methods = wq_methods,
};

/* Copies of at least this many bytes run without the GIL: below it, handing the GIL over
 * and back costs more than the copy keeps other threads waiting. */
#define COPY_NOGIL_BYTES (64 * 1024)

static PyObject *copy_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, dst_off, src, src_off, n) takes 5 arguments");
        return NULL;
    }
    /* Any integer-like offset (numpy integers too), as numpy's slicing took. */
    Py_ssize_t dst_off = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (dst_off == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t src_off = PyNumber_AsSsize_t(args[3], PyExc_OverflowError);
    if (src_off == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyNumber_AsSsize_t(args[4], PyExc_OverflowError);
    if (n == -1 && PyErr_Occurred()) return NULL;
    Py_buffer dst, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &src, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst_off < 0 || src_off < 0 || n < 0 || dst_off > dst.len - n || src_off > src.len - n) {
        PyErr_Format(PyExc_ValueError,
                     "copy of %zd B: [%zd, +%zd) of %zd B into [%zd, +%zd) of %zd B is out of range",
                     n, src_off, n, src.len, dst_off, n, dst.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    char *d = (char *)dst.buf + dst_off;
    const char *s = (const char *)src.buf + src_off;
    if (n >= COPY_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        memmove(d, s, (size_t)n);
        Py_END_ALLOW_THREADS
    } else {
        memmove(d, s, (size_t)n);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

static PyObject *keys16(PyObject *self, PyObject *arg) {
    if (!PyList_Check(arg) && !PyTuple_Check(arg)) Py_RETURN_NONE;
    PyObject *out = PySequence_List(arg);
    if (out == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(out, i);
        if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) != 16) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
    }
    return out;
}

static PyMethodDef methods[] = {
    {"pack_i32", pack_i32, METH_O, "Token ids as little-endian int32 bytes."},
    {"copy", (PyCFunction)(void (*)(void))copy_bytes, METH_FASTCALL,
     "copy(dst, dst_off, src, src_off, n): memmove between contiguous buffers."},
    {"keys16", keys16, METH_O, "A list or tuple of 16-byte keys as a new list, else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier._speedups", NULL, -1, methods};

PyMODINIT_FUNC PyInit__speedups(void) {
    if (PyType_Ready(&WorkQueueType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&WorkQueueType);
    if (PyModule_AddObject(m, "WorkQueue", (PyObject *)&WorkQueueType) < 0) {
        Py_DECREF(&WorkQueueType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
