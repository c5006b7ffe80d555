/* Native core of kvtier's store, part two: the index's hot verbs.
 *
 * kvtier/store/index.py's StoreIndex is the reference. NativeStoreIndex there derives
 * from IndexVerbs (this file) and from StoreIndex: the verbs that every put, get and
 * delete runs (present_run, prepare_load, complete_load, prepare_store, add_stored,
 * complete_store, remove) are these C functions, working on the very same state as the
 * Python ones (the entries dict, the eviction policies, the counters, the free batch),
 * so every other verb (moves, evictions, quotas, adoption, recovery) stays in Python and
 * sees what these did. tests/store/test_index_native.py runs random verb sequences on
 * both indexes and checks they answer, evict, announce and release alike.
 *
 * Why: cold, each Python frame on the path of a store operation costs microseconds (its
 * code comes back from memory after a large copy elsewhere); these verbs were a dozen
 * frames per operation. Slot and Entry are C types here for the same reason (building
 * one was a Python __init__ each).
 *
 * Where a verb needs what this file does not do, it calls the Python method it stands
 * for (StoreIndex.<verb>): with quotas, where the eviction policy is not the built-in
 * LRU, ... (see `plain` below). Callbacks (the placement's hooks, events, releases to
 * tiers) are called as the reference calls them, in the same order, under the lock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* ---- Slot and Entry ------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *key;
    Py_ssize_t tier, offset, value_bytes, readers;
    char retired;
} Slot;

static int slot_init(Slot *s, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"key", "tier", "offset", "value_bytes", NULL};
    PyObject *key;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onnn", kwlist, &key, &s->tier, &s->offset,
                                     &s->value_bytes))
        return -1;
    Py_INCREF(key);
    Py_XSETREF(s->key, key);
    s->readers = 0;
    s->retired = 0;
    return 0;
}

static void slot_dealloc(Slot *s) {
    Py_XDECREF(s->key);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMemberDef slot_members[] = {
    {"key", T_OBJECT_EX, offsetof(Slot, key), 0, "The chunk's key."},
    {"tier", T_PYSSIZET, offsetof(Slot, tier), 0, "Tier position."},
    {"offset", T_PYSSIZET, offsetof(Slot, offset), 0, "Slot number in the tier."},
    {"value_bytes", T_PYSSIZET, offsetof(Slot, value_bytes), 0, "Bytes of the value."},
    {"readers", T_PYSSIZET, offsetof(Slot, readers), 0, "Holds of gets and movers in flight."},
    {"retired", T_BOOL, offsetof(Slot, retired), 0, "The index no longer points here."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SlotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._core.Slot",
    .tp_basicsize = sizeof(Slot),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Slot(key, tier, offset, value_bytes): kvtier.store.index.Slot in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)slot_init,
    .tp_dealloc = (destructor)slot_dealloc,
    .tp_members = slot_members,
};

typedef struct {
    PyObject_HEAD
    PyObject *slot;
    Py_ssize_t pins;
    char moving;
} Entry;

static int entry_init(Entry *e, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"slot", NULL};
    PyObject *slot;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", kwlist, &slot)) return -1;
    Py_INCREF(slot);
    Py_XSETREF(e->slot, slot);
    e->pins = 0;
    e->moving = 0;
    return 0;
}

static void entry_dealloc(Entry *e) {
    Py_XDECREF(e->slot);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyMemberDef entry_members[] = {
    {"slot", T_OBJECT_EX, offsetof(Entry, slot), 0, "The chunk's current slot."},
    {"pins", T_PYSSIZET, offsetof(Entry, pins), 0, "Pins held."},
    {"moving", T_BOOL, offsetof(Entry, moving), 0, "A mover claimed the chunk."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._core.Entry",
    .tp_basicsize = sizeof(Entry),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Entry(slot): kvtier.store.index.Entry in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)entry_init,
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_members = entry_members,
};

static Slot *new_slot(PyObject *key, Py_ssize_t tier, Py_ssize_t offset, Py_ssize_t value_bytes) {
    Slot *s = PyObject_New(Slot, &SlotType);
    if (s == NULL) return NULL;
    Py_INCREF(key);
    s->key = key;
    s->tier = tier;
    s->offset = offset;
    s->value_bytes = value_bytes;
    s->readers = 0;
    s->retired = 0;
    return s;
}

static Entry *new_entry(PyObject *slot) {
    Entry *e = PyObject_New(Entry, &EntryType);
    if (e == NULL) return NULL;
    Py_INCREF(slot);
    e->slot = slot;
    e->pins = 0;
    e->moving = 0;
    return e;
}

#define SLOT(o) ((Slot *)(o))
#define ENTRY(o) ((Entry *)(o))

/* The verbs read records as these structs: anything else in the index is a bug, refused. */
static int bad_record(PyObject *o, PyTypeObject *type) {
    if (Py_IS_TYPE(o, type) && (type != &EntryType || Py_IS_TYPE(ENTRY(o)->slot, &SlotType)))
        return 0;
    PyErr_Format(PyExc_TypeError, "the native index holds a %s where a %s belongs",
                 Py_TYPE(o)->tp_name, type->tp_name);
    return -1;
}

/* ---- names and helpers ---------------------------------------------------------------- */

static PyObject *s_entries, *s_pending, *s_evict, *s_counts, *s_lock, *s_acquire, *s_release,
    *s_frees, *s_release_runs, *s_plain, *s_emit, *s_tiers, *s_name, *s_placement, *s_on_hit,
    *s_should_promote, *s_tier_hits, *s_order, *s_move_to_end, *s_pop, *s_keys, *s_gone,
    *s_gets, *s_get_chunks, *s_get_bytes, *s_puts, *s_put_present, *s_put_chunks,
    *s_put_rejected, *s_hooks, *s_event, *s_indexed, *s_unindexed, *s_persistent, *one;

/* Python's method of StoreIndex named `name`, called on self: the reference, for what this
 * file does not do. */
static PyObject *reference(PyObject *self, const char *name, PyObject *const *args,
                           Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *cls = PyObject_GetAttrString((PyObject *)Py_TYPE(self), "_reference");
    if (cls == NULL) return NULL;
    PyObject *fn = PyObject_GetAttrString(cls, name);
    Py_DECREF(cls);
    if (fn == NULL) return NULL;
    PyObject *stack[8];
    stack[0] = self;
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    if (total > 7) { /* no verb of the reference takes as many */
        Py_DECREF(fn);
        PyErr_Format(PyExc_TypeError, "%s() takes at most 7 arguments", name);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < total; i++) stack[i + 1] = args[i];
    PyObject *out = PyObject_Vectorcall(fn, stack, nargs + 1, kwnames);
    Py_DECREF(fn);
    return out;
}

/* Whether the index runs the plain configuration these verbs do natively (no quotas, the
 * built-in LRU in every tier): NativeStoreIndex sets `_plain` once. */
static int plain(PyObject *self) {
    PyObject *v = PyObject_GetAttr(self, s_plain);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static int lock(PyObject *self, PyObject **lk) {
    *lk = PyObject_GetAttr(self, s_lock);
    if (*lk == NULL) return -1;
    PyObject *r = PyObject_CallMethodNoArgs(*lk, s_acquire);
    if (r == NULL) {
        Py_CLEAR(*lk);
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* Release the lock, keeping any error raised before. */
static void unlock(PyObject *lk) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *r = PyObject_CallMethodNoArgs(lk, s_release);
    Py_XDECREF(r);
    if (et != NULL) PyErr_Restore(et, ev, tb);
    else if (r == NULL) PyErr_WriteUnraisable(lk);
    Py_DECREF(lk);
}

/* counts.<name> += delta */
static int add_count(PyObject *counts, PyObject *name, Py_ssize_t delta) {
    if (delta == 0) return 0;
    PyObject *v = PyObject_GetAttr(counts, name);
    if (v == NULL) return -1;
    PyObject *d = PyLong_FromSsize_t(delta);
    PyObject *nv = d ? PyNumber_Add(v, d) : NULL;
    Py_DECREF(v);
    Py_XDECREF(d);
    if (nv == NULL) return -1;
    int r = PyObject_SetAttr(counts, name, nv);
    Py_DECREF(nv);
    return r;
}

/* The built-in LRU's order (an OrderedDict) of tier t. */
static PyObject *lru_order(PyObject *self, Py_ssize_t t) {
    PyObject *evict = PyObject_GetAttr(self, s_evict);
    if (evict == NULL) return NULL;
    PyObject *pol = PyList_GetItem(evict, t); /* borrowed */
    PyObject *order = pol ? PyObject_GetAttr(pol, s_order) : NULL;
    Py_DECREF(evict);
    return order;
}

/* LRUEviction.touch / insert: to the end, inserting when `insert`. */
static int lru_to_end(PyObject *self, Py_ssize_t t, PyObject *key, int insert) {
    PyObject *order = lru_order(self, t);
    if (order == NULL) return -1;
    int r = 0;
    int has = PyDict_Contains(order, key);
    if (has < 0) r = -1;
    else if (!has && insert) r = PyObject_SetItem(order, key, Py_None);
    else if (has) {
        PyObject *x = PyObject_CallMethodOneArg(order, s_move_to_end, key);
        if (x == NULL) r = -1;
        Py_XDECREF(x);
    }
    Py_DECREF(order);
    return r;
}

static int lru_remove(PyObject *self, Py_ssize_t t, PyObject *key) {
    PyObject *order = lru_order(self, t);
    if (order == NULL) return -1;
    PyObject *x = PyObject_CallMethodObjArgs(order, s_pop, key, Py_None, NULL);
    Py_DECREF(order);
    if (x == NULL) return -1;
    Py_DECREF(x);
    return 0;
}

/* A slot whose last reader is gone and that the index no longer points at: into the open
 * free batch, or into `frees` (released at the verb's end). */
static int free_slot(PyObject *self, PyObject *sl, PyObject *frees) {
    PyObject *open = PyObject_GetAttr(self, s_frees);
    if (open == NULL) return -1;
    int r = PyList_Append(open != Py_None ? open : frees, sl);
    Py_DECREF(open);
    return r;
}

static int unread(PyObject *self, PyObject *sl, PyObject *frees) {
    SLOT(sl)->readers -= 1;
    if (SLOT(sl)->retired && SLOT(sl)->readers == 0) return free_slot(self, sl, frees);
    return 0;
}

/* End of a free batch (`_FreeBatch.__exit__`, then `_release_runs`): each run of
 * consecutive slots of one tier and length goes back to its tier in one release. Frees
 * out of order, or in a persistent tier (which must forget them too), take the Python
 * `_release_runs`. */
static int release_frees(PyObject *self, PyObject *frees) {
    Py_ssize_t n = PyList_GET_SIZE(frees);
    if (n == 0) return 0;
    PyObject *persistent = PyObject_GetAttr(self, s_persistent);
    if (persistent == NULL) return -1;
    int simple = 1;
    for (Py_ssize_t i = 0; i < n && simple; i++) {
        Slot *a = SLOT(PyList_GET_ITEM(frees, i));
        PyObject *keeper = PyList_GetItem(persistent, a->tier);
        if (keeper == NULL) {
            Py_DECREF(persistent);
            return -1;
        }
        if (keeper != Py_None) simple = 0;
        if (i > 0) {
            Slot *p = SLOT(PyList_GET_ITEM(frees, i - 1));
            if (p->tier > a->tier || (p->tier == a->tier && p->offset >= a->offset)) simple = 0;
        }
    }
    Py_DECREF(persistent);
    if (!simple) {
        PyObject *r = PyObject_CallMethodOneArg(self, s_release_runs, frees);
        if (r == NULL) return -1;
        Py_DECREF(r);
        return 0;
    }
    PyObject *tiers = PyObject_GetAttr(self, s_tiers);
    if (tiers == NULL) return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0;) {
        Slot *first = SLOT(PyList_GET_ITEM(frees, i));
        Py_ssize_t j = i + 1;
        while (j < n) {
            Slot *b = SLOT(PyList_GET_ITEM(frees, j));
            if (b->tier != first->tier || b->offset != first->offset + (j - i) ||
                b->value_bytes != first->value_bytes)
                break;
            j++;
        }
        PyObject *tier = PyTuple_GetItem(tiers, first->tier);
        PyObject *r = tier ? PyObject_CallMethod(tier, "release", "nn", first->offset, j - i) : NULL;
        if (r == NULL) rc = -1;
        Py_XDECREF(r);
        i = j;
    }
    Py_DECREF(tiers);
    return rc;
}

/* _emit_keys: one event of kind `self.<kind_attr>` for `keys` of tier t. */
static int emit_keys(PyObject *self, PyObject *kind_attr, Py_ssize_t t, PyObject *keys,
                     Py_ssize_t nbytes) {
    PyObject *tiers = PyObject_GetAttr(self, s_tiers);
    if (tiers == NULL) return -1;
    PyObject *tier = PyTuple_GetItem(tiers, t);
    PyObject *name = tier ? PyObject_GetAttr(tier, s_name) : NULL;
    Py_DECREF(tiers);
    if (name == NULL) return -1;
    PyObject *kind = PyObject_GetAttr(self, kind_attr);
    if (kind == NULL) {
        Py_DECREF(name);
        return -1;
    }
    PyObject *cls = PyObject_GetAttr(self, s_event);
    PyObject *ev = NULL;
    if (cls != NULL) {
        PyObject *kw = Py_BuildValue("{OO}", s_keys, keys);
        PyObject *args = Py_BuildValue("(OOnn)", kind, name, PyTuple_GET_SIZE(keys), nbytes);
        if (kw && args) ev = PyObject_Call(cls, args, kw);
        Py_XDECREF(kw);
        Py_XDECREF(args);
        Py_DECREF(cls);
    }
    Py_DECREF(name);
    Py_DECREF(kind);
    if (ev == NULL) return -1;
    PyObject *emit = PyObject_GetAttr(self, s_emit);
    PyObject *r = emit ? PyObject_CallOneArg(emit, ev) : NULL;
    Py_XDECREF(emit);
    Py_DECREF(ev);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* _emit_gone_locked: one UNINDEXED event per tier for the slots removed since the last. */
static int emit_gone(PyObject *self) {
    PyObject *gone = PyObject_GetAttr(self, s_gone);
    if (gone == NULL) return -1;
    Py_ssize_t n = PyList_GET_SIZE(gone);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bad_record(PyList_GET_ITEM(gone, i), &SlotType) < 0) {
            Py_DECREF(gone);
            return -1;
        }
    }
    if (n == 0) {
        Py_DECREF(gone);
        return 0;
    }
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL || PyObject_SetAttr(self, s_gone, fresh) < 0) {
        Py_XDECREF(fresh);
        Py_DECREF(gone);
        return -1;
    }
    Py_DECREF(fresh);
    int rc = 0;
    char *done = PyMem_Calloc((size_t)n, 1); /* slots already announced */
    if (done == NULL) rc = -1;
    /* Tiers in the order they first appear, as the reference's dict of lists. */
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        if (done[i]) continue;
        Py_ssize_t t = SLOT(PyList_GET_ITEM(gone, i))->tier, count = 0, nbytes = 0;
        for (Py_ssize_t j = i; j < n; j++) {
            Slot *sl = SLOT(PyList_GET_ITEM(gone, j));
            if (sl->tier == t) count++;
        }
        PyObject *keys = PyTuple_New(count);
        if (keys == NULL) {
            rc = -1;
            break;
        }
        for (Py_ssize_t j = i, k = 0; j < n; j++) {
            Slot *sl = SLOT(PyList_GET_ITEM(gone, j));
            if (sl->tier != t) continue;
            done[j] = 1;
            nbytes += sl->value_bytes;
            Py_INCREF(sl->key);
            PyTuple_SET_ITEM(keys, k++, sl->key);
        }
        rc = emit_keys(self, s_unindexed, t, keys, nbytes);
        Py_DECREF(keys);
    }
    PyMem_Free(done);
    Py_DECREF(gone);
    return rc;
}

/* ---- the verbs ------------------------------------------------------------------------ */

#define DELEGATE_UNLESS_PLAIN(name)                                            \
    do {                                                                       \
        int p_ = plain(self);                                                  \
        if (p_ < 0) return NULL;                                               \
        if (!p_) return reference(self, name, args, nargs, kwnames);           \
    } while (0)

static PyObject *v_present_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    if (nargs != 1 || kwnames) return reference(self, "present_run", args, nargs, kwnames);
    PyObject *keys = PySequence_Fast(args[0], "keys must be a sequence");
    if (keys == NULL) return NULL;
    PyObject *lk, *out = NULL, *entries = NULL;
    if (lock(self, &lk) < 0) goto end0;
    entries = PyObject_GetAttr(self, s_entries);
    if (entries == NULL) goto end;
    out = PyList_New(0);
    if (out == NULL) goto end;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(keys); i++) {
        PyObject *e = PyDict_GetItemWithError(entries, PySequence_Fast_GET_ITEM(keys, i));
        if (e == NULL) {
            if (PyErr_Occurred()) Py_CLEAR(out);
            break;
        }
        if (bad_record(e, &EntryType) < 0 || PyList_Append(out, ENTRY(e)->slot) < 0) {
            Py_CLEAR(out);
            break;
        }
    }
end:
    Py_XDECREF(entries);
    unlock(lk);
end0:
    Py_DECREF(keys);
    return out;
}

static PyObject *v_prepare_load(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
    if (nargs != 1 || kwnames) return reference(self, "prepare_load", args, nargs, kwnames);
    DELEGATE_UNLESS_PLAIN("prepare_load");
    PyObject *keys = PySequence_Fast(args[0], "keys must be a sequence");
    if (keys == NULL) return NULL;
    PyObject *lk, *out = NULL, *entries = NULL, *counts = NULL;
    if (lock(self, &lk) < 0) goto end0;
    entries = PyObject_GetAttr(self, s_entries);
    counts = entries ? PyObject_GetAttr(self, s_counts) : NULL;
    out = counts ? PyList_New(0) : NULL;
    if (out == NULL) goto end;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(keys); i++) {
        PyObject *e = PyDict_GetItemWithError(entries, PySequence_Fast_GET_ITEM(keys, i));
        if (e == NULL) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        if (bad_record(e, &EntryType) < 0) goto fail;
        SLOT(ENTRY(e)->slot)->readers += 1;
        if (PyList_Append(out, ENTRY(e)->slot) < 0) goto fail;
    }
    for (Py_ssize_t i = PyList_GET_SIZE(out) - 1; i >= 0; i--) { /* head most recent */
        PyObject *sl = PyList_GET_ITEM(out, i);
        if (lru_to_end(self, SLOT(sl)->tier, SLOT(sl)->key, 0) < 0) goto fail;
    }
    if (add_count(counts, s_gets, 1) < 0) goto fail;
    goto end;
fail:
    Py_CLEAR(out); /* as the reference, an error leaves the holds taken */
end:
    Py_XDECREF(entries);
    Py_XDECREF(counts);
    unlock(lk);
end0:
    Py_DECREF(keys);
    return out;
}

/* complete_load(slots, served, nbytes, *, promote) */
static PyObject *v_complete_load(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames) {
    if (nargs != 3 || kwnames == NULL || PyTuple_GET_SIZE(kwnames) != 1 ||
        PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "promote") != 0)
        return reference(self, "complete_load", args, nargs, kwnames);
    DELEGATE_UNLESS_PLAIN("complete_load");
    int promote = PyObject_IsTrue(args[3]);
    if (promote < 0) return NULL;
    Py_ssize_t served = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (served == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t nbytes = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    /* A tuple of our own: the hooks below run Python code, which may change a list. */
    PyObject *slots = PySequence_Tuple(args[0]);
    if (slots == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(slots);
    PyObject **items = PySequence_Fast_ITEMS(slots);
    if (served > n) served = n;
    if (served < 0) served = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bad_record(items[i], &SlotType) < 0) {
            Py_DECREF(slots);
            return NULL;
        }
    }
    PyObject *lk, *out = NULL, *frees = NULL, *counts = NULL, *hits = NULL, *by_tier = NULL,
                  *placement = NULL, *hooks = NULL;
    if (lock(self, &lk) < 0) goto end0;
    frees = PyList_New(0);
    if (frees == NULL) goto end;
    for (Py_ssize_t i = 0; i < n; i++)
        if (unread(self, items[i], frees) < 0) goto end;
    if (release_frees(self, frees) < 0) goto end;
    /* _note_hits */
    counts = PyObject_GetAttr(self, s_counts);
    hits = counts ? PyObject_GetAttr(self, s_tier_hits) : NULL;
    by_tier = hits ? PyDict_New() : NULL;
    if (by_tier == NULL) goto end;
    if (add_count(counts, s_get_chunks, served) < 0 || add_count(counts, s_get_bytes, nbytes) < 0)
        goto end;
    for (Py_ssize_t i = 0; i < served; i++) {
        Slot *sl = SLOT(items[i]);
        PyObject *old = PyList_GetItem(hits, sl->tier);
        if (old == NULL) goto end;
        PyObject *nv = PyNumber_Add(old, one);
        if (nv == NULL || PyList_SetItem(hits, sl->tier, nv) < 0) goto end;
        PyObject *t = PyLong_FromSsize_t(sl->tier);
        if (t == NULL) goto end;
        PyObject *ks = PyDict_GetItemWithError(by_tier, t);
        if (ks == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(t);
                goto end;
            }
            ks = PyList_New(0);
            if (ks == NULL || PyDict_SetItem(by_tier, t, ks) < 0) {
                Py_XDECREF(ks);
                Py_DECREF(t);
                goto end;
            }
            Py_DECREF(ks); /* the dict holds it */
        }
        Py_DECREF(t);
        if (PyList_Append(ks, sl->key) < 0) goto end;
    }
    /* The placement's hooks, in the reference's order; `_hooks` says which it overrides. */
    placement = PyObject_GetAttr(self, s_placement);
    hooks = placement ? PyObject_GetAttr(self, s_hooks) : NULL;
    if (hooks == NULL) goto end;
    int on_hit = PySequence_Contains(hooks, s_on_hit);
    if (on_hit < 0) goto end;
    PyObject *t, *ks;
    Py_ssize_t pos = 0;
    while (on_hit && PyDict_Next(by_tier, &pos, &t, &ks)) {
        PyObject *r = PyObject_CallMethodObjArgs(placement, s_on_hit, t, ks, NULL);
        if (r == NULL) goto end;
        Py_DECREF(r);
    }
    out = PyList_New(0);
    if (out == NULL) goto end;
    pos = 0;
    while (promote && PyDict_Next(by_tier, &pos, &t, &ks)) {
        if (PyLong_AsSsize_t(t) <= 0) continue;
        PyObject *r = PyObject_CallMethodObjArgs(placement, s_should_promote, t, ks, NULL);
        int yes = r ? PyObject_IsTrue(r) : -1;
        Py_XDECREF(r);
        if (yes < 0 || (yes && PyList_Append(out, ks) < 0)) {
            Py_CLEAR(out);
            goto end;
        }
    }
end:
    Py_XDECREF(frees);
    Py_XDECREF(counts);
    Py_XDECREF(hits);
    Py_XDECREF(by_tier);
    Py_XDECREF(placement);
    Py_XDECREF(hooks);
    unlock(lk);
end0:
    Py_DECREF(slots);
    return out;
}

static PyObject *v_prepare_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames) {
    if (nargs != 1 || kwnames) return reference(self, "prepare_store", args, nargs, kwnames);
    DELEGATE_UNLESS_PLAIN("prepare_store");
    PyObject *keys = PySequence_Fast(args[0], "keys must be a sequence");
    if (keys == NULL) return NULL;
    PyObject *lk, *out = NULL, *entries = NULL, *pending = NULL, *counts = NULL, *seen = NULL;
    if (lock(self, &lk) < 0) goto end0;
    entries = PyObject_GetAttr(self, s_entries);
    pending = entries ? PyObject_GetAttr(self, s_pending) : NULL;
    counts = pending ? PyObject_GetAttr(self, s_counts) : NULL;
    seen = counts ? PySet_New(NULL) : NULL;
    out = seen ? PyList_New(0) : NULL;
    if (out == NULL) goto end;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PySequence_Fast_GET_ITEM(keys, i);
        int in = PyDict_Contains(entries, k);
        if (in == 0) in = PySet_Contains(pending, k);
        if (in == 0) in = PySet_Contains(seen, k);
        if (in < 0) goto fail;
        if (in) continue; /* a key twice in one call is stored once */
        PyObject *pair = Py_BuildValue("(nO)", i, k);
        if (pair == NULL || PyList_Append(out, pair) < 0 || PySet_Add(seen, k) < 0) {
            Py_XDECREF(pair);
            goto fail;
        }
        Py_DECREF(pair);
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(out); i++)
        if (PySet_Add(pending, PyTuple_GET_ITEM(PyList_GET_ITEM(out, i), 1)) < 0) goto fail;
    if (add_count(counts, s_puts, 1) < 0 ||
        add_count(counts, s_put_present, n - PyList_GET_SIZE(out)) < 0)
        goto fail;
    goto end;
fail:
    Py_CLEAR(out);
end:
    Py_XDECREF(entries);
    Py_XDECREF(pending);
    Py_XDECREF(counts);
    Py_XDECREF(seen);
    unlock(lk);
end0:
    Py_DECREF(keys);
    return out;
}

/* add_stored(t, written, value_bytes): written is (key, slot number) in sequence order. */
static PyObject *v_add_stored(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    if (nargs != 3 || kwnames) return reference(self, "add_stored", args, nargs, kwnames);
    DELEGATE_UNLESS_PLAIN("add_stored");
    Py_ssize_t t = PyNumber_AsSsize_t(args[0], PyExc_OverflowError);
    if (t == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t vb = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    if (vb == -1 && PyErr_Occurred()) return NULL;
    PyObject *written = PySequence_Fast(args[1], "written must be a sequence");
    if (written == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(written);
    PyObject *lk, *out = NULL, *entries = NULL, *keys = NULL;
    if (lock(self, &lk) < 0) goto end0;
    entries = PyObject_GetAttr(self, s_entries);
    keys = entries ? PyTuple_New(n) : NULL;
    if (keys == NULL) goto end;
    /* Newest-last in eviction order, tail first (as the reference's _add_locked). */
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *pair = PySequence_Fast_GET_ITEM(written, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "written items must be (key, slot number)");
            goto end;
        }
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        Py_ssize_t off = PyNumber_AsSsize_t(PyTuple_GET_ITEM(pair, 1), PyExc_OverflowError);
        if (off == -1 && PyErr_Occurred()) goto end;
        Slot *sl = new_slot(key, t, off, vb);
        Entry *e = sl ? new_entry((PyObject *)sl) : NULL;
        Py_XDECREF(sl);
        if (e == NULL) goto end;
        int r = PyDict_SetItem(entries, key, (PyObject *)e);
        Py_DECREF(e);
        if (r < 0 || lru_to_end(self, t, key, 1) < 0) goto end;
        Py_INCREF(key);
        PyTuple_SET_ITEM(keys, i, key);
    }
    if (n > 0 && emit_keys(self, s_indexed, t, keys, n * vb) < 0) goto end;
    out = Py_None;
    Py_INCREF(out);
end:
    Py_XDECREF(entries);
    Py_XDECREF(keys);
    unlock(lk);
end0:
    Py_DECREF(written);
    return out;
}

/* complete_store(claimed, stored, failed) */
static PyObject *v_complete_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames) {
    if (nargs != 3 || kwnames) return reference(self, "complete_store", args, nargs, kwnames);
    DELEGATE_UNLESS_PLAIN("complete_store");
    Py_ssize_t stored = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (stored == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t failed = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    if (failed == -1 && PyErr_Occurred()) return NULL;
    PyObject *claimed = PySequence_Fast(args[0], "claimed must be a sequence");
    if (claimed == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(claimed);
    PyObject *lk, *out = NULL, *pending = NULL, *counts = NULL;
    if (lock(self, &lk) < 0) goto end0;
    pending = PyObject_GetAttr(self, s_pending);
    counts = pending ? PyObject_GetAttr(self, s_counts) : NULL;
    if (counts == NULL) goto end;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(claimed, i);
        PyObject *k = PySequence_GetItem(pair, 1);
        if (k == NULL) goto end;
        int r = PySet_Discard(pending, k);
        Py_DECREF(k);
        if (r < 0) goto end;
    }
    if (add_count(counts, s_put_chunks, stored) < 0 ||
        add_count(counts, s_put_rejected, n - stored - failed) < 0)
        goto end;
    out = Py_None;
    Py_INCREF(out);
end:
    Py_XDECREF(pending);
    Py_XDECREF(counts);
    unlock(lk);
end0:
    Py_DECREF(claimed);
    return out;
}

/* remove(keys) -> the keys that were present */
static PyObject *v_remove(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    if (nargs != 1 || kwnames) return reference(self, "remove", args, nargs, kwnames);
    DELEGATE_UNLESS_PLAIN("remove");
    PyObject *keys = PySequence_Fast(args[0], "keys must be a sequence");
    if (keys == NULL) return NULL;
    PyObject *lk, *out = NULL, *entries = NULL, *frees = NULL, *gone = NULL;
    if (lock(self, &lk) < 0) goto end0;
    entries = PyObject_GetAttr(self, s_entries);
    gone = entries ? PyObject_GetAttr(self, s_gone) : NULL;
    frees = gone ? PyList_New(0) : NULL;
    out = frees ? PyList_New(0) : NULL;
    if (out == NULL) goto end;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(keys); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
        PyObject *e = PyDict_GetItemWithError(entries, key);
        if (e == NULL) {
            if (PyErr_Occurred()) goto fail;
            continue;
        }
        if (bad_record(e, &EntryType) < 0) goto fail;
        PyObject *sl = ENTRY(e)->slot;
        Py_INCREF(sl);
        Py_INCREF(key);
        /* _remove_locked: out of the index and the LRU, into `gone`, retired. */
        int bad = PyDict_DelItem(entries, key) < 0 || lru_remove(self, SLOT(sl)->tier, key) < 0 ||
                  PyList_Append(gone, sl) < 0;
        if (!bad) {
            SLOT(sl)->retired = 1;
            if (SLOT(sl)->readers == 0) bad = free_slot(self, sl, frees) < 0;
        }
        if (!bad) bad = PyList_Append(out, key) < 0;
        Py_DECREF(sl);
        Py_DECREF(key);
        if (bad) goto fail;
    }
    if (emit_gone(self) < 0 || release_frees(self, frees) < 0) goto fail;
    goto end;
fail:
    Py_CLEAR(out);
end:
    Py_XDECREF(entries);
    Py_XDECREF(gone);
    Py_XDECREF(frees);
    unlock(lk);
end0:
    Py_DECREF(keys);
    return out;
}

static PyMethodDef verbs_methods[] = {
    {"present_run", (PyCFunction)(void (*)(void))v_present_run, METH_FASTCALL | METH_KEYWORDS,
     "StoreIndex.present_run, natively."},
    {"prepare_load", (PyCFunction)(void (*)(void))v_prepare_load, METH_FASTCALL | METH_KEYWORDS,
     "StoreIndex.prepare_load, natively."},
    {"complete_load", (PyCFunction)(void (*)(void))v_complete_load, METH_FASTCALL | METH_KEYWORDS,
     "StoreIndex.complete_load, natively."},
    {"prepare_store", (PyCFunction)(void (*)(void))v_prepare_store, METH_FASTCALL | METH_KEYWORDS,
     "StoreIndex.prepare_store, natively."},
    {"add_stored", (PyCFunction)(void (*)(void))v_add_stored, METH_FASTCALL | METH_KEYWORDS,
     "StoreIndex.add_stored, natively."},
    {"complete_store", (PyCFunction)(void (*)(void))v_complete_store, METH_FASTCALL | METH_KEYWORDS,
     "StoreIndex.complete_store, natively."},
    {"remove", (PyCFunction)(void (*)(void))v_remove, METH_FASTCALL | METH_KEYWORDS,
     "StoreIndex.remove, natively."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject VerbsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._core.IndexVerbs",
    .tp_basicsize = sizeof(PyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The hot verbs of kvtier.store.index.StoreIndex in C (a base of NativeStoreIndex).",
    .tp_new = PyType_GenericNew,
    .tp_methods = verbs_methods,
};

#define INTERN(var, text)                                  \
    do {                                                   \
        if ((var = PyUnicode_InternFromString(text)) == NULL) return -1; \
    } while (0)

int core_index_init(PyObject *m) {
    INTERN(s_entries, "_entries");
    INTERN(s_pending, "_pending");
    INTERN(s_evict, "_evict");
    INTERN(s_counts, "_counts");
    INTERN(s_lock, "lock");
    INTERN(s_acquire, "acquire");
    INTERN(s_release, "release");
    INTERN(s_frees, "_frees");
    INTERN(s_release_runs, "_release_runs");
    INTERN(s_plain, "_plain");
    INTERN(s_emit, "_emit");
    INTERN(s_tiers, "tiers");
    INTERN(s_name, "name");
    INTERN(s_placement, "_placement");
    INTERN(s_on_hit, "on_hit");
    INTERN(s_should_promote, "should_promote");
    INTERN(s_tier_hits, "_tier_hits");
    INTERN(s_order, "_order");
    INTERN(s_move_to_end, "move_to_end");
    INTERN(s_pop, "pop");
    INTERN(s_keys, "keys");
    INTERN(s_gone, "_gone");
    INTERN(s_gets, "gets");
    INTERN(s_get_chunks, "get_chunks");
    INTERN(s_get_bytes, "get_bytes");
    INTERN(s_puts, "puts");
    INTERN(s_put_present, "put_present");
    INTERN(s_put_chunks, "put_chunks");
    INTERN(s_put_rejected, "put_rejected");
    INTERN(s_hooks, "_hooks");
    INTERN(s_event, "_event_type");
    INTERN(s_indexed, "_indexed");
    if ((one = PyLong_FromLong(1)) == NULL) return -1;
    INTERN(s_unindexed, "_unindexed");
    INTERN(s_persistent, "_persistent");
    if (PyType_Ready(&SlotType) < 0 || PyType_Ready(&EntryType) < 0 || PyType_Ready(&VerbsType) < 0)
        return -1;
    PyTypeObject *types[] = {&SlotType, &EntryType, &VerbsType};
    const char *names[] = {"Slot", "Entry", "IndexVerbs"};
    for (int i = 0; i < 3; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            return -1;
        }
    }
    return 0;
}
