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
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KVRAY_STREAMING 1
#endif

/* Large copies whose destination this process will not read again (KV bound for another
 * process) go through non-temporal stores: no read-for-ownership of destination lines and no
 * eviction of the writer's cache, which is what lets glibc's memcpy of one big buffer beat a
 * loop of 16 KiB memcpys. Unaligned heads and tails fall back to memcpy. */
static void copy_block(char *dst, const char *src, size_t n) {
#ifdef KVRAY_STREAMING
    if (n >= 4096) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t body = n & ~(size_t)63;
        if (((uintptr_t)src & 15) == 0) {
            for (size_t i = 0; i < body; i += 64) {
                __m128i a = _mm_load_si128((const __m128i *)(src + i));
                __m128i b = _mm_load_si128((const __m128i *)(src + i + 16));
                __m128i c = _mm_load_si128((const __m128i *)(src + i + 32));
                __m128i d = _mm_load_si128((const __m128i *)(src + i + 48));
                _mm_stream_si128((__m128i *)(dst + i), a);
                _mm_stream_si128((__m128i *)(dst + i + 16), b);
                _mm_stream_si128((__m128i *)(dst + i + 32), c);
                _mm_stream_si128((__m128i *)(dst + i + 48), d);
            }
        } else {
            for (size_t i = 0; i < body; i += 64) {
                __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
                __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
                __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
                __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
                _mm_stream_si128((__m128i *)(dst + i), a);
                _mm_stream_si128((__m128i *)(dst + i + 16), b);
                _mm_stream_si128((__m128i *)(dst + i + 32), c);
                _mm_stream_si128((__m128i *)(dst + i + 48), d);
            }
        }
        memcpy(dst + body, src + body, n - body);
        return;
    }
#endif
    memcpy(dst, src, n);
}

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
        copy_block(dst + dst_off[i], src + src_off[i], (size_t)lengths[i]);
    }
#ifdef KVRAY_STREAMING
    _mm_sfence(); /* streamed stores are visible before anyone is told the copy is done */
#endif
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
