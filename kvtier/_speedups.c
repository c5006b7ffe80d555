/* Optional C speedups for kvtier. Pure-Python fallbacks live in kvtier/keys.py.
 *
 * pack_i32(seq) -> bytes: token ids (a list or tuple of ints) as little-endian int32.
 * Converting a Python list to bytes is the dominant cost of chunk-key computation
 * (array.array spends ~20 ns per item in its generic setitem; this loop ~3 ns).
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

static PyMethodDef methods[] = {
    {"pack_i32", pack_i32, METH_O, "Token ids as little-endian int32 bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier._speedups", NULL, -1, methods};

PyMODINIT_FUNC PyInit__speedups(void) { return PyModule_Create(&module); }
