/* Batched memcpy for kvray's CPU transports: one call copies every op of a plan.
 *
 * scatter_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes[, cursor]) -> None | bool
 *   copies nbytes[i] bytes from src_base + src_offsets[i] to dst_base + dst_offsets[i]
 *   for every i, with the GIL released. The three arrays are native int64 buffers of one
 *   length. Bounds are the caller's job (kvray checks every op before it gets here).
 *   With `cursor` (a writable buffer of two int64s, zero at the start: next op, ops done),
 *   several threads call it on the same ops and each claims the next few ops with an atomic
 *   increment until none is left: a thread the scheduler parks does not hold back the others'
 *   share, which a fixed split would (on a busy 2-core machine the slowest share decides the
 *   copy's time). It returns True in the one call that completed the batch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVRAY_STREAMING 1
#endif

/* Large copies whose destination this process will not read again (KV bound for another
 * process) go through non-temporal stores: no read-for-ownership of destination lines and no
 * eviction of the writer's cache, which is what lets glibc's memcpy of one big buffer beat a
 * loop of 16 KiB memcpys. Scattered blocks defeat the hardware prefetcher at every block
 * boundary, so while one block is copied the next block's source is prefetched. 32-byte AVX2
 * stores where the CPU has them (checked once at import), else 16-byte SSE2. Unaligned heads
 * and tails fall back to memcpy. */
#ifdef KVRAY_STREAMING
static int have_avx2 = 0;

static inline void prefetch_ahead(const char *next, size_t next_n, size_t i) {
    if (next != NULL && i < next_n) {
        _mm_prefetch(next + i, _MM_HINT_T0);
        _mm_prefetch(next + i + 64, _MM_HINT_T0);
    }
}

__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, size_t body,
                                                        const char *next, size_t next_n) {
    for (size_t i = 0; i < body; i += 128) {
        prefetch_ahead(next, next_n, i);
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
}

static void stream_sse2(char *dst, const char *src, size_t body, const char *next, size_t next_n) {
    for (size_t i = 0; i < body; i += 128) {
        prefetch_ahead(next, next_n, i);
        for (size_t j = i; j < i + 128; j += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + j));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + j + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + j + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + j + 48));
            _mm_stream_si128((__m128i *)(dst + j), a);
            _mm_stream_si128((__m128i *)(dst + j + 16), b);
            _mm_stream_si128((__m128i *)(dst + j + 32), c);
            _mm_stream_si128((__m128i *)(dst + j + 48), d);
        }
    }
}
#endif

/* Copy one op; `next`/`next_n` is the source of the op copied after it (NULL: none). */
static void copy_block(char *dst, const char *src, size_t n, const char *next, size_t next_n) {
#ifdef KVRAY_STREAMING
    if (n >= 4096) {
        size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t body = n & ~(size_t)127;
        if (have_avx2) {
            stream_avx2(dst, src, body, next, next_n);
        } else {
            stream_sse2(dst, src, body, next, next_n);
        }
        memcpy(dst + body, src + body, n - body);
        return;
    }
#endif
    (void)next;
    (void)next_n;
    memcpy(dst, src, n);
}

static PyObject *scatter_copy(PyObject *self, PyObject *args) {
    unsigned long long dst_base, src_base;
    Py_buffer dst_offsets, src_offsets, nbytes;
    Py_buffer cursor = {0};
    if (!PyArg_ParseTuple(args, "KKy*y*y*|w*", &dst_base, &src_base, &dst_offsets, &src_offsets, &nbytes,
                          &cursor)) {
        return NULL;
    }
    PyObject *result = NULL;
    int finished = 0;
    if (cursor.buf != NULL && (cursor.len < 16 || ((uintptr_t)cursor.buf & 7) != 0)) {
        PyErr_SetString(PyExc_ValueError, "scatter_copy's cursor must be two aligned int64s");
        goto done;
    }
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
    if (cursor.buf == NULL) {
        for (Py_ssize_t i = 0; i < count; i++) {
            int more = i + 1 < count;
            copy_block(dst + dst_off[i], src + src_off[i], (size_t)lengths[i],
                       more ? src + src_off[i + 1] : NULL, more ? (size_t)lengths[i + 1] : 0);
        }
    } else {
        /* Claims of a few ops at a time: cheap to count, and the next op's source, usually this
         * thread's own, can be prefetched. After each claim the stores are fenced and counted
         * done; the call whose count completes the batch returns True. */
        const int64_t claim = 4;
        int64_t *next = (int64_t *)cursor.buf;
        int64_t *done = next + 1;
        for (int64_t first = __atomic_fetch_add(next, claim, __ATOMIC_RELAXED); first < count;
             first = __atomic_fetch_add(next, claim, __ATOMIC_RELAXED)) {
            int64_t last = first + claim < count ? first + claim : count;
            for (int64_t i = first; i < last; i++) {
                int more = i + 1 < count;
                copy_block(dst + dst_off[i], src + src_off[i], (size_t)lengths[i],
                           more ? src + src_off[i + 1] : NULL, more ? (size_t)lengths[i + 1] : 0);
            }
#ifdef KVRAY_STREAMING
            _mm_sfence();
#endif
            if (__atomic_add_fetch(done, last - first, __ATOMIC_RELEASE) == count) {
                finished = 1;
            }
        }
    }
#ifdef KVRAY_STREAMING
    _mm_sfence(); /* streamed stores are visible before anyone is told the copy is done */
#endif
    Py_END_ALLOW_THREADS
    if (cursor.buf != NULL) {
        result = PyBool_FromLong(finished);
    } else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    PyBuffer_Release(&dst_offsets);
    PyBuffer_Release(&src_offsets);
    PyBuffer_Release(&nbytes);
    if (cursor.buf != NULL) {
        PyBuffer_Release(&cursor);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"scatter_copy", scatter_copy, METH_VARARGS,
     "Copy many (dst, src, nbytes) ops with the GIL released (several threads: share a cursor)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvray._copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy(void) {
#ifdef KVRAY_STREAMING
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
