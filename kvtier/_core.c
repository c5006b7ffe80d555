/* Native core of kvtier's store: the extent allocator, and the copies of memory tiers.
 *
 * Buddy: the buddy allocator of kvtier/alloc/buddy.py, operation for operation. The
 * Python class there is the reference (and the fallback where no compiler was found);
 * tests/unit/test_buddy_native.py runs random operation sequences on both and checks
 * they hand out the same extents, in the same order, and refuse the same frees.
 *
 * The Python allocator keeps its free blocks in one dict per order and takes the first
 * one (the oldest inserted). To pick the same block, each order's free blocks form a
 * FIFO list here: push at the tail, take from the head, unlink from anywhere. Blocks are
 * found by their first unit: per unit, the order (plus one) of the free block or of the
 * allocated block that starts there, zero when none does. That costs 10 bytes per unit
 * of address space, taken by the kernel only where touched; the Python wrapper uses the
 * reference allocator above NATIVE_MAX_UNITS.
 *
 * Not thread-safe, as the reference: the owning tier serialises calls under its lock.
 * Every call is short (a few list operations per order), so none lets the GIL go.
 *
 * copy_slots: a host tier's read or write of a run of slots in one call (checks, then
 * one memcpy, or one per slot where values are shorter than slots), without the GIL
 * from 64 KiB up. It stands for Tier.write -> _check -> _write -> copy_in -> copy, each
 * a Python frame whose code comes back from memory after a large copy elsewhere.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_ORDERS 32 /* orders 0..31; units fit in int32 */

typedef struct {
    PyObject_HEAD
    int32_t capacity;
    int max_order;
    int64_t free_units;
    int64_t n_alloc;
    int8_t *alloc_ord; /* per unit: order + 1 of the allocated block starting here, or 0 */
    int8_t *free_ord;  /* per unit: order + 1 of the free block starting here, or 0 */
    int32_t *next, *prev; /* free-list links, valid where free_ord != 0; -1 ends a list */
    int32_t head[MAX_ORDERS], tail[MAX_ORDERS];
    PyObject *extent; /* the Extent class: what allocate() returns */
    PyObject *error;  /* the InputError class: what a refused call raises */
} Buddy;

/* ---- free lists ----------------------------------------------------------------------- */

static void push_free(Buddy *b, int32_t off, int k) {
    b->free_ord[off] = (int8_t)(k + 1);
    b->next[off] = -1;
    b->prev[off] = b->tail[k];
    if (b->tail[k] >= 0) b->next[b->tail[k]] = off;
    else b->head[k] = off;
    b->tail[k] = off;
}

static void pop_free(Buddy *b, int32_t off, int k) {
    int32_t p = b->prev[off], n = b->next[off];
    if (p >= 0) b->next[p] = n;
    else b->head[k] = n;
    if (n >= 0) b->prev[n] = p;
    else b->tail[k] = p;
    b->free_ord[off] = 0;
}

/* Offset of the block (of `ords`) that contains the aligned block (off, k), or -1. */
static int32_t container(Buddy *b, const int8_t *ords, int64_t off, int k) {
    for (int j = k; j <= b->max_order; j++) {
        int64_t base = off & ~(((int64_t)1 << j) - 1);
        if (base < b->capacity && ords[base] == j + 1) return (int32_t)base;
    }
    return -1;
}

static void coalesce(Buddy *b, int32_t off, int k) {
    while (k < b->max_order) {
        int32_t buddy = off ^ ((int32_t)1 << k);
        int32_t merged = off < buddy ? off : buddy;
        if (buddy >= b->capacity || b->free_ord[buddy] != k + 1 ||
            (int64_t)merged + ((int64_t)2 << k) > b->capacity)
            break;
        pop_free(b, buddy, k);
        off = merged;
        k++;
    }
    push_free(b, off, k);
}

/* The first free block of order k or more, split down to order k and allocated; -1 if none. */
static int32_t alloc_order(Buddy *b, int k) {
    int src = k;
    while (src <= b->max_order && b->head[src] < 0) src++;
    if (src > b->max_order) return -1;
    int32_t off = b->head[src];
    pop_free(b, off, src);
    while (src > k) {
        src--;
        push_free(b, off + ((int32_t)1 << src), src);
    }
    b->alloc_ord[off] = (int8_t)(k + 1);
    b->n_alloc++;
    b->free_units -= (int64_t)1 << k;
    return off;
}

/* Split allocated block `base` until (off, k) is an allocated block of its own. */
static void split_out(Buddy *b, int32_t base, int32_t off, int k) {
    int j = b->alloc_ord[base] - 1;
    while (j > k) {
        j--;
        int32_t half = (int32_t)1 << j;
        if (off >= base + half) {
            b->alloc_ord[base] = (int8_t)(j + 1);
            base += half;
        } else {
            b->alloc_ord[base + half] = (int8_t)(j + 1);
        }
        b->alloc_ord[base] = (int8_t)(j + 1);
        b->n_alloc++;
    }
}

/* [off, off + n) as maximal aligned blocks, in order; returns how many (at most 2 * 63). */
static int aligned_pieces(int64_t off, int64_t n, int64_t *po, int *pk) {
    int count = 0;
    int64_t end = off + n;
    while (off < end) {
        int align = off ? __builtin_ctzll((unsigned long long)off) : 62;
        int size = 63 - __builtin_clzll((unsigned long long)(end - off));
        int k = align < size ? align : size;
        po[count] = off;
        pk[count] = k;
        count++;
        off += (int64_t)1 << k;
    }
    return count;
}

/* Free an allocated aligned block (off, k) that lies inside allocated block `owner`. */
static void free_piece(Buddy *b, int32_t owner, int32_t off, int k) {
    split_out(b, owner, off, k);
    b->alloc_ord[off] = 0;
    b->n_alloc--;
    b->free_units += (int64_t)1 << k;
    coalesce(b, off, k);
}

/* ---- the type ------------------------------------------------------------------------- */

static int buddy_init(Buddy *b, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity_units", "max_order", "extent", "error", NULL};
    Py_ssize_t cap;
    int max_order;
    PyObject *extent, *error;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "niOO", kwlist, &cap, &max_order, &extent, &error))
        return -1;
    if (b->alloc_ord != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Buddy is already initialised");
        return -1;
    }
    if (cap < 1 || cap > INT32_MAX || max_order < 0) {
        PyErr_SetString(PyExc_ValueError, "capacity_units must be in [1, 2**31) and max_order >= 0");
        return -1;
    }
    int top = 63 - __builtin_clzll((unsigned long long)cap); /* bit_length - 1 */
    b->capacity = (int32_t)cap;
    b->max_order = max_order < top ? max_order : top;
    /* calloc: the kernel provides zero pages as they are first touched. */
    b->alloc_ord = calloc((size_t)cap, 1);
    b->free_ord = calloc((size_t)cap, 1);
    b->next = malloc((size_t)cap * sizeof(int32_t));
    b->prev = malloc((size_t)cap * sizeof(int32_t));
    if (!b->alloc_ord || !b->free_ord || !b->next || !b->prev) {
        free(b->alloc_ord);
        free(b->free_ord);
        free(b->next);
        free(b->prev);
        b->alloc_ord = b->free_ord = NULL;
        b->next = b->prev = NULL;
        PyErr_NoMemory();
        return -1;
    }
    for (int k = 0; k < MAX_ORDERS; k++) b->head[k] = b->tail[k] = -1;
    Py_INCREF(extent);
    Py_INCREF(error);
    b->extent = extent;
    b->error = error;
    /* The arena as its binary decomposition, largest blocks first (buddy.decompose). */
    int64_t off = 0, step = (int64_t)1 << b->max_order;
    for (; off + step <= cap; off += step) push_free(b, (int32_t)off, b->max_order);
    for (int k = b->max_order - 1; k >= 0; k--) {
        if ((cap - off) & ((int64_t)1 << k)) {
            push_free(b, (int32_t)off, k);
            off += (int64_t)1 << k;
        }
    }
    b->free_units = cap;
    return 0;
}

static void buddy_dealloc(Buddy *b) {
    free(b->alloc_ord);
    free(b->free_ord);
    free(b->next);
    free(b->prev);
    Py_XDECREF(b->extent);
    Py_XDECREF(b->error);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static int ready(Buddy *b) {
    if (b->alloc_ord == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Buddy is not initialised");
        return 0;
    }
    return 1;
}

static PyObject *make_extent(Buddy *b, int32_t off, int k) {
    return PyObject_CallFunction(b->extent, "ii", (int)off, k);
}

static PyObject *buddy_allocate(Buddy *b, PyObject *arg) {
    if (!ready(b)) return NULL;
    long k = PyLong_AsLong(arg);
    if (k == -1 && PyErr_Occurred()) return NULL;
    if (k < 0 || k > b->max_order)
        return PyErr_Format(b->error, "order %ld not in [0, %d]", k, b->max_order);
    int32_t off = alloc_order(b, (int)k);
    if (off < 0) Py_RETURN_NONE;
    return make_extent(b, off, (int)k);
}

static void free_range(Buddy *b, int64_t off, int64_t n); /* checked by the caller */

static PyObject *buddy_allocate_run(Buddy *b, PyObject *arg) {
    if (!ready(b)) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) return PyErr_Format(b->error, "allocate_run needs n_units >= 1, got %zd", n);
    if (n > b->free_units) Py_RETURN_NONE;
    /* A stack of orders, as the reference: the decomposition smallest at the bottom; a
     * piece that finds no block is pushed back as two of the next order down. */
    Py_ssize_t full = n >> b->max_order, cap = full + 2 * MAX_ORDERS + 8, top = 0;
    int *stack = PyMem_Malloc((size_t)cap * sizeof(int));
    int32_t *offs = PyMem_Malloc((size_t)(n < cap ? n : cap) * sizeof(int32_t) + sizeof(int32_t));
    int *ords = PyMem_Malloc((size_t)(n < cap ? n : cap) * sizeof(int) + sizeof(int));
    Py_ssize_t done = 0, room = n < cap ? n : cap;
    PyObject *out = NULL;
    if (!stack || !offs || !ords) {
        PyErr_NoMemory();
        goto end;
    }
    for (int k = 0; k < b->max_order; k++)
        if (n & ((Py_ssize_t)1 << k)) stack[top++] = k;
    for (Py_ssize_t i = 0; i < full; i++) stack[top++] = b->max_order;
    while (top > 0) {
        int k = stack[--top];
        int32_t off = alloc_order(b, k);
        if (off >= 0) {
            if (done == room) {
                room *= 2;
                int32_t *o2 = PyMem_Realloc(offs, (size_t)room * sizeof(int32_t));
                if (o2) offs = o2;
                int *k2 = PyMem_Realloc(ords, (size_t)room * sizeof(int));
                if (k2) ords = k2;
                if (!o2 || !k2) {
                    free_range(b, off, (int64_t)1 << k);
                    for (Py_ssize_t i = 0; i < done; i++) free_range(b, offs[i], (int64_t)1 << ords[i]);
                    PyErr_NoMemory();
                    goto end;
                }
            }
            offs[done] = off;
            ords[done] = k;
            done++;
        } else if (k > 0) {
            if (top + 2 > cap) {
                cap *= 2;
                int *s2 = PyMem_Realloc(stack, (size_t)cap * sizeof(int));
                if (!s2) {
                    for (Py_ssize_t i = 0; i < done; i++) free_range(b, offs[i], (int64_t)1 << ords[i]);
                    PyErr_NoMemory();
                    goto end;
                }
                stack = s2;
            }
            stack[top++] = k - 1;
            stack[top++] = k - 1;
        } else { /* unreachable while free_units >= n; kept as the reference keeps it */
            for (Py_ssize_t i = 0; i < done; i++) free_range(b, offs[i], (int64_t)1 << ords[i]);
            out = Py_None;
            Py_INCREF(out);
            goto end;
        }
    }
    out = PyList_New(done);
    if (out == NULL) goto end;
    for (Py_ssize_t i = 0; i < done; i++) {
        PyObject *e = make_extent(b, offs[i], ords[i]);
        if (e == NULL) {
            Py_CLEAR(out);
            goto end;
        }
        PyList_SET_ITEM(out, i, e);
    }
end:
    PyMem_Free(stack);
    PyMem_Free(offs);
    PyMem_Free(ords);
    return out;
}

/* Split [off, off + n) into pieces each inside one allocated block, as the reference
 * does; returns how many, or -1 (with *bad the unallocated unit) when a unit is not
 * allocated. */
static Py_ssize_t owned_pieces(Buddy *b, int64_t off, int64_t n, int64_t **po, int **pk,
                               int64_t *bad) {
    int64_t init_o[128];
    int init_k[128];
    int m = aligned_pieces(off, n, init_o, init_k);
    Py_ssize_t cap = m + 64, top = 0, count = 0, out_cap = 16;
    int64_t *so = PyMem_Malloc((size_t)cap * sizeof(int64_t));
    int *sk = PyMem_Malloc((size_t)cap * sizeof(int));
    int64_t *oo = PyMem_Malloc((size_t)out_cap * sizeof(int64_t));
    int *ok = PyMem_Malloc((size_t)out_cap * sizeof(int));
    if (!so || !sk || !oo || !ok) goto nomem;
    for (int i = m - 1; i >= 0; i--) { /* a stack, lowest offset on top */
        so[top] = init_o[i];
        sk[top] = init_k[i];
        top++;
    }
    while (top > 0) {
        top--;
        int64_t o = so[top];
        int k = sk[top];
        if (container(b, b->alloc_ord, o, k) >= 0) {
            if (count == out_cap) {
                out_cap *= 2;
                int64_t *o2 = PyMem_Realloc(oo, (size_t)out_cap * sizeof(int64_t));
                if (o2) oo = o2;
                int *k2 = PyMem_Realloc(ok, (size_t)out_cap * sizeof(int));
                if (k2) ok = k2;
                if (!o2 || !k2) goto nomem;
            }
            oo[count] = o;
            ok[count] = k;
            count++;
        } else if (k > 0) {
            if (top + 2 > cap) {
                cap *= 2;
                int64_t *o2 = PyMem_Realloc(so, (size_t)cap * sizeof(int64_t));
                if (o2) so = o2;
                int *k2 = PyMem_Realloc(sk, (size_t)cap * sizeof(int));
                if (k2) sk = k2;
                if (!o2 || !k2) goto nomem;
            }
            so[top] = o + ((int64_t)1 << (k - 1));
            sk[top] = k - 1;
            top++;
            so[top] = o;
            sk[top] = k - 1;
            top++;
        } else {
            *bad = o;
            PyMem_Free(so);
            PyMem_Free(sk);
            PyMem_Free(oo);
            PyMem_Free(ok);
            return -1;
        }
    }
    PyMem_Free(so);
    PyMem_Free(sk);
    *po = oo;
    *pk = ok;
    return count;
nomem:
    PyMem_Free(so);
    PyMem_Free(sk);
    PyMem_Free(oo);
    PyMem_Free(ok);
    PyErr_NoMemory();
    *bad = -1;
    return -2;
}

static void free_range(Buddy *b, int64_t off, int64_t n) {
    int64_t po[128];
    int pk[128];
    int m = aligned_pieces(off, n, po, pk);
    for (int i = 0; i < m; i++) {
        int32_t owner = container(b, b->alloc_ord, po[i], pk[i]);
        if (owner >= 0) free_piece(b, owner, (int32_t)po[i], pk[i]);
    }
}

static int range_args(Buddy *b, PyObject *const *args, Py_ssize_t nargs, const char *what,
                      int64_t *off, int64_t *n) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s(offset, n_units) takes 2 arguments", what);
        return -1;
    }
    long long o = PyLong_AsLongLong(args[0]);
    if (o == -1 && PyErr_Occurred()) return -1;
    long long u = PyLong_AsLongLong(args[1]);
    if (u == -1 && PyErr_Occurred()) return -1;
    if (u < 1 || o < 0 || o > (long long)b->capacity || u > (long long)b->capacity - o) {
        PyErr_Format(b->error, "%s range [%lld, %lld) outside the arena", what, o, o + u);
        return -1;
    }
    *off = o;
    *n = u;
    return 0;
}

static PyObject *buddy_free(Buddy *b, PyObject *const *args, Py_ssize_t nargs) {
    if (!ready(b)) return NULL;
    int64_t off, n, bad;
    if (range_args(b, args, nargs, "free", &off, &n) < 0) return NULL;
    int64_t *po;
    int *pk;
    Py_ssize_t m = owned_pieces(b, off, n, &po, &pk, &bad);
    if (m == -2) return NULL;
    if (m < 0)
        return PyErr_Format(b->error, "free of [%lld, %lld): not allocated (double free?)",
                            (long long)bad, (long long)bad + 1);
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t owner = container(b, b->alloc_ord, po[i], pk[i]); /* earlier pieces may split it */
        free_piece(b, owner, (int32_t)po[i], pk[i]);
    }
    PyMem_Free(po);
    PyMem_Free(pk);
    Py_RETURN_NONE;
}

static PyObject *buddy_claim(Buddy *b, PyObject *const *args, Py_ssize_t nargs) {
    if (!ready(b)) return NULL;
    int64_t off, n;
    if (range_args(b, args, nargs, "claim", &off, &n) < 0) return NULL;
    int64_t po[128];
    int pk[128];
    int m = aligned_pieces(off, n, po, pk);
    for (int i = 0; i < m; i++) {
        if (container(b, b->free_ord, po[i], pk[i]) < 0)
            return PyErr_Format(b->error, "claim of [%lld, %lld): not free", (long long)off,
                                (long long)(off + n));
    }
    for (int i = 0; i < m; i++) {
        int32_t base = container(b, b->free_ord, po[i], pk[i]);
        int j = b->free_ord[base] - 1;
        pop_free(b, base, j);
        while (j > pk[i]) {
            j--;
            int32_t half = (int32_t)1 << j;
            if (po[i] >= base + half) {
                push_free(b, base, j);
                base += half;
            } else {
                push_free(b, base + half, j);
            }
        }
        b->alloc_ord[po[i]] = (int8_t)(pk[i] + 1);
        b->n_alloc++;
        b->free_units -= (int64_t)1 << pk[i];
    }
    Py_RETURN_NONE;
}

/* Every block of `ords`, sorted by offset, as Extents. */
static PyObject *blocks(Buddy *b, const int8_t *ords) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (int32_t u = 0; u < b->capacity; u++) {
        if (ords[u] == 0) continue;
        PyObject *e = make_extent(b, u, ords[u] - 1);
        if (e == NULL || PyList_Append(out, e) < 0) {
            Py_XDECREF(e);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(e);
    }
    return out;
}

static PyObject *buddy_allocated_blocks(Buddy *b, PyObject *Py_UNUSED(ignored)) {
    if (!ready(b)) return NULL;
    return blocks(b, b->alloc_ord);
}

static PyObject *buddy_free_blocks(Buddy *b, PyObject *Py_UNUSED(ignored)) {
    if (!ready(b)) return NULL;
    return blocks(b, b->free_ord);
}

static PyObject *buddy_largest_free_order(Buddy *b, PyObject *Py_UNUSED(ignored)) {
    if (!ready(b)) return NULL;
    for (int k = b->max_order; k >= 0; k--)
        if (b->head[k] >= 0) return PyLong_FromLong(k);
    return PyLong_FromLong(-1);
}

static PyObject *get_capacity(Buddy *b, void *c) { return PyLong_FromLong(b->capacity); }
static PyObject *get_max_order(Buddy *b, void *c) { return PyLong_FromLong(b->max_order); }
static PyObject *get_free_units(Buddy *b, void *c) { return PyLong_FromLongLong(b->free_units); }
static PyObject *get_used_units(Buddy *b, void *c) {
    return PyLong_FromLongLong(b->capacity - b->free_units);
}
static PyObject *get_n_alloc(Buddy *b, void *c) { return PyLong_FromLongLong(b->n_alloc); }

static PyGetSetDef buddy_getset[] = {
    {"capacity_units", (getter)get_capacity, NULL, "Units in the arena.", NULL},
    {"max_order", (getter)get_max_order, NULL, "Largest extent order (clamped to the arena).", NULL},
    {"free_units", (getter)get_free_units, NULL, "Units inside free blocks.", NULL},
    {"used_units", (getter)get_used_units, NULL, "Units inside allocated blocks.", NULL},
    {"allocated_count", (getter)get_n_alloc, NULL, "Number of allocated blocks.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef buddy_methods[] = {
    {"allocate", (PyCFunction)buddy_allocate, METH_O, "One extent of 2**order units, or None."},
    {"allocate_run", (PyCFunction)buddy_allocate_run, METH_O,
     "Extents holding n units (binary decomposition), or None; all or nothing."},
    {"free", (PyCFunction)(void (*)(void))buddy_free, METH_FASTCALL,
     "free(offset, n_units): free a range inside allocated blocks; refused unchanged if not."},
    {"claim", (PyCFunction)(void (*)(void))buddy_claim, METH_FASTCALL,
     "claim(offset, n_units): mark a free range allocated; refused unchanged if not free."},
    {"allocated_blocks", (PyCFunction)buddy_allocated_blocks, METH_NOARGS, "Allocated blocks by offset."},
    {"free_blocks", (PyCFunction)buddy_free_blocks, METH_NOARGS, "Free blocks by offset."},
    {"largest_free_order", (PyCFunction)buddy_largest_free_order, METH_NOARGS,
     "Order of the largest free block, -1 when nothing is free."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BuddyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._core.Buddy",
    .tp_basicsize = sizeof(Buddy),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Buddy(capacity_units, max_order, extent, error): kvtier.alloc.buddy's allocator in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)buddy_init,
    .tp_dealloc = (destructor)buddy_dealloc,
    .tp_methods = buddy_methods,
    .tp_getset = buddy_getset,
};

/* ---- copies of memory tiers ---------------------------------------------------------- */

static PyObject *InputError; /* kvtier.errors.InputError, what Tier._check raises */

/* Copies of at least this many bytes run without the GIL (as _speedups.copy). */
#define COPY_NOGIL_BYTES (64 * 1024)

/* copy_slots(arena, slot_bytes, offset, n, value_bytes, buf, into_arena): the packed
 * values of n slots from slot `offset` of `arena`, to (into_arena false) or from `buf`. */
static PyObject *copy_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "copy_slots(arena, slot_bytes, offset, n, value_bytes, buf, into_arena)");
        return NULL;
    }
    Py_ssize_t v[4];
    for (int i = 0; i < 4; i++) {
        v[i] = PyNumber_AsSsize_t(args[1 + i], PyExc_OverflowError);
        if (v[i] == -1 && PyErr_Occurred()) return NULL;
    }
    Py_ssize_t slot = v[0], offset = v[1], n = v[2], value = v[3];
    int into = PyObject_IsTrue(args[6]);
    if (into < 0) return NULL;
    if (value > slot) {
        return PyErr_Format(InputError, "value of %zd B exceeds slot of %zd B", value, slot);
    }
    if (slot < 1 || value < 0 || offset < 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_slots: negative sizes or offsets");
        return NULL;
    }
    Py_buffer arena, buf;
    if (PyObject_GetBuffer(args[0], &arena, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[5], &buf, into ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&arena);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t nbytes = n * value;
    if (buf.len != nbytes) {
        PyErr_Format(InputError, "buffer of %zd B for a run of %zd B", buf.len, nbytes);
        goto end;
    }
    if (n > 0 && (offset > arena.len / slot || n > arena.len / slot - offset)) {
        PyErr_Format(PyExc_ValueError, "slots [%zd, %zd) outside an arena of %zd B", offset,
                     offset + n, arena.len);
        goto end;
    }
    char *a = (char *)arena.buf + offset * slot, *b = (char *)buf.buf;
    /* Values that fill their slots (or a single one) lie packed in the arena: one copy. */
    Py_ssize_t pieces = (value == slot || n == 1) ? 1 : n;
    Py_ssize_t piece = pieces == 1 ? nbytes : value, stride = pieces == 1 ? 0 : slot;
    if (nbytes >= COPY_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < pieces; i++) {
            if (into) memcpy(a + i * stride, b + i * piece, (size_t)piece);
            else memcpy(b + i * piece, a + i * stride, (size_t)piece);
        }
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < pieces; i++) {
            if (into) memcpy(a + i * stride, b + i * piece, (size_t)piece);
            else memcpy(b + i * piece, a + i * stride, (size_t)piece);
        }
    }
    out = Py_None;
    Py_INCREF(out);
end:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&arena);
    return out;
}

static PyMethodDef methods[] = {
    {"copy_slots", (PyCFunction)(void (*)(void))copy_slots, METH_FASTCALL,
     "copy_slots(arena, slot_bytes, offset, n, value_bytes, buf, into_arena): a memory "
     "tier's write (into_arena) or read of a run of slots."},
    {NULL, NULL, 0, NULL},
};

int core_index_init(PyObject *m); /* kvtier/_core_index.c */

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier._core", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void) {
    if (PyType_Ready(&BuddyType) < 0) return NULL;
    PyObject *errors = PyImport_ImportModule("kvtier.errors");
    if (errors == NULL) return NULL;
    InputError = PyObject_GetAttrString(errors, "InputError");
    Py_DECREF(errors);
    if (InputError == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&BuddyType);
    if (PyModule_AddObject(m, "Buddy", (PyObject *)&BuddyType) < 0) {
        Py_DECREF(&BuddyType);
        Py_DECREF(m);
        return NULL;
    }
    if (core_index_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
