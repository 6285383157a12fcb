/* Batched memcpy for kvray's CPU transports: one call copies every op of a plan.
 *
 * scatter_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes)
 *   copies nbytes[i] bytes from src_base + src_offsets[i] to dst_base + dst_offsets[i]
 *   for every i, with the GIL released. The three arrays are native int64 buffers of one
 *   length. Bounds are the caller's job (kvray checks every op before it gets here).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *scatter_copy(PyObject *self, PyObject *args) {
    unsigned long long dst_base, src_base;
    Py_buffer dst_offsets, src_offsets, nbytes;
    if (!PyArg_ParseTuple(args, "KKy*y*y*", &dst_base, &src_base, &dst_offsets, &src_offsets, &nbytes)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (dst_offsets.len != src_offsets.len || dst_offsets.len != nbytes.len || nbytes.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "scatter_copy needs three int64 arrays of one length");
        goto done;
    }
    Py_ssize_t count = nbytes.len / 8;
    const int64_t *dst_off = (const int64_t *)dst_offsets.buf;
    const int64_t *src_off = (const int64_t *)src_offsets.buf;
    const int64_t *lengths = (const int64_t *)nbytes.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (dst_off[i] < 0 || src_off[i] < 0 || lengths[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "scatter_copy got a negative offset or length");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    char *dst = (char *)(uintptr_t)dst_base;
    const char *src = (const char *)(uintptr_t)src_base;
    for (Py_ssize_t i = 0; i < count; i++) {
        memcpy(dst + dst_off[i], src + src_off[i], (size_t)lengths[i]);
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&dst_offsets);
    PyBuffer_Release(&src_offsets);
    PyBuffer_Release(&nbytes);
    return result;
}

static PyMethodDef methods[] = {
    {"scatter_copy", scatter_copy, METH_VARARGS, "Copy many (dst, src, nbytes) ops with the GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvray._copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy(void) { return PyModule_Create(&module); }
