/* Batched memcpy for kvray's CPU transports: one call copies every op of a plan.
 *
 * scatter_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes[, salt]) -> int
 *   copies nbytes[i] bytes from src_base + src_offsets[i] to dst_base + dst_offsets[i]
 *   for every i, on the calling thread with the GIL released. The three arrays are native
 *   int64 buffers of one length. Bounds are the caller's job (kvray checks every op before it
 *   gets here). Returns the placement digest (`kvray.placement`, region mixed in as `salt`)
 *   of the destination ranges it stored to, taken from the addresses it used.
 *
 * start_copy(dst_base, src_base, dst_offsets, src_offsets, nbytes, threads, piece[, notice
 *   [, salt[, base]]]) -> CopyJob
 *   the same copy on `threads` threads of a pool of plain pthreads, returning at once. The
 *   ops (split into pieces of at most `piece` bytes) are copied into the job, so the arrays
 *   may go; the memory they point into may not until the job is over. Each thread claims
 *   the next few ops with an atomic increment until none is left: a thread the scheduler
 *   parks does not hold back the others' share, which a fixed split would. `notice`, a tuple
 *   (socket fd, peer path, message), is one datagram sent by the thread that completes the
 *   last op, the moment every byte is in place (the completion notice of a push, without a
 *   trip through Python); a fourth element, true, has that thread write the job's placement
 *   digest (`base` plus the digest of what the job stored) big-endian into the message's last
 *   8 bytes first. When every thread has left the job, its `fileno()` (an eventfd) becomes
 *   readable: that is what an event loop waits on; `placement` is then the job's digest.
 *
 * start_rows(dst_base, src_base, rows, ids, src_nbytes, dst_nbytes, threads, piece, notice, claim
 *   [, salt[, content[, seed[, pair_salt]]]]) -> CopyJob | None
 *   a request's whole copy planned here: `rows` holds five int64 columns (source start and block
 *   stride, destination start and block stride, bytes) of one row per (layer, part), `ids` the
 *   local then the remote block ids, paired. Every (row, pair) op is checked against both
 *   regions' lengths before a byte moves (ValueError), ops continuing each other at both ends are
 *   merged, and `claim` (board fd, slot, slots, board address, token) has the job take a shared
 *   lock on the request's slot in the decode engine's claim board, check the slot is open under
 *   the token (LookupError otherwise), and let go once every byte is in place, before the
 *   notice. None, having written nothing, while the engine holds the slot. `threads` 0: copied on
 *   the calling thread with the GIL released, before returning.
 *
 * The pool's threads never take the GIL: a pthread woken on a condition variable starts copying
 * sooner than a Python pool worker, which must wake and then get the GIL.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include "_placement.h"
#include "_copy_job.h"
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVRAY_STREAMING 1
#endif

/* Large copies whose destination this process will not read again (KV bound for another
 * process) go through non-temporal stores: no read-for-ownership of destination lines and no
 * eviction of the writer's cache, which is what lets glibc's memcpy of one big buffer beat a
 * loop of 16 KiB memcpys. Scattered blocks defeat the hardware prefetcher at every block
 * boundary, so while one block is copied the next block's source is prefetched, with the
 * non-temporal hint: the bytes are read once, and fetched into the nearest cache (the T0 hint)
 * they would push out the block being copied. 32-byte AVX2 stores where the CPU has them
 * (checked once at import), else 16-byte SSE2. Unaligned heads and tails fall back to memcpy. */
#ifdef KVRAY_STREAMING
static int have_avx2 = 0;

static inline void prefetch_ahead(const char *next, size_t next_n, size_t i) {
    if (next != NULL && i < next_n) {
        _mm_prefetch(next + i, _MM_HINT_NTA);
        _mm_prefetch(next + i + 64, _MM_HINT_NTA);
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


/* Faults only (kvray.faults.ExecutorOffsetBug, through set_executor_fault): an executor bug
 * under a correct plan. The last op of a batch of two or more is stored over the one before
 * it (clipped to the shorter), as a wrong offset would; the digest reports where it went. */
static int executor_fault = 0;

/* Content digests (kvray/content.py has the definition and why): a source byte at offset o
 * of its region adds byte << 8 * (o % 4) times the weight of word w = o / 4, which is
 * TABLE[w % 1024] (odd 32-bit values) times the odd 64-bit factor of its 4 KiB page w / 1024
 * and the region's seed; a stretch's sum is multiplied by the odd 64-bit factor of where it
 * goes. Sums wrap mod 2**64. Within a page the inner loop is a table load, a 32x32->64
 * multiply and an add per word; the page factor is applied once per page. */
#define CONTENT_TABLE_WORDS 1024
static uint32_t content_table[CONTENT_TABLE_WORDS];

static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6BU;
    h ^= h >> 13;
    h *= 0xC2B2AE35U;
    h ^= h >> 16;
    return h;
}

static void fill_content_table(void) {
    for (uint32_t j = 0; j < CONTENT_TABLE_WORDS; j++) {
        content_table[j] = fmix32(j * 0x9E3779B9U + 0x7F4A7C15U) | 1U;
    }
}

static inline uint64_t page_factor(uint32_t seed, uint64_t page) {
    return mix64((uint64_t)seed * 0x9E3779B97F4A7C15ULL + page) | 1ULL;
}

/* Bytes [start, end) of a region's offsets, scalar: for heads, tails and machines without AVX2. */
static uint64_t hash_scalar(const unsigned char *p, uint64_t start, uint64_t end, uint32_t seed) {
    uint64_t sum = 0;
    for (uint64_t o = start; o < end; o++) {
        uint64_t word = o >> 2;
        uint64_t weight = (uint64_t)content_table[word % CONTENT_TABLE_WORDS] * page_factor(seed, word / CONTENT_TABLE_WORDS);
        sum += ((uint64_t)p[o - start] << (8 * (o & 3))) * weight;
    }
    return sum;
}

#ifdef KVRAY_STREAMING
__attribute__((target("avx2"))) static inline uint64_t lanes_sum(__m256i even, __m256i odd) {
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(even, odd));
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

/* `runs` runs of 32 bytes starting at word index `word` (a multiple of 8), all inside one
 * page; copied to `dst` with streaming stores too unless it is NULL. The page's plain sum. */
__attribute__((target("avx2"))) static inline void hash_run(__m256i data, const uint32_t *weights, __m256i *even,
                                                            __m256i *odd) {
    __m256i w = _mm256_loadu_si256((const __m256i *)weights);
    *even = _mm256_add_epi64(*even, _mm256_mul_epu32(data, w));
    *odd = _mm256_add_epi64(*odd, _mm256_mul_epu32(_mm256_srli_epi64(data, 32), _mm256_srli_epi64(w, 32)));
}

__attribute__((target("avx2"))) static uint64_t hash_copy_page(char *dst, const char *src, uint64_t word,
                                                               uint64_t runs, const char *next, size_t next_n,
                                                               size_t done) {
    __m256i even0 = _mm256_setzero_si256(), odd0 = _mm256_setzero_si256();
    __m256i even1 = _mm256_setzero_si256(), odd1 = _mm256_setzero_si256();
    const uint32_t *weights = content_table + word % CONTENT_TABLE_WORDS;
    uint64_t r = 0;
    /* Four runs (128 bytes) a step, as the plain streaming copy does, two pairs of sums. */
    for (; r + 4 <= runs; r += 4) {
        prefetch_ahead(next, next_n, done + 32 * r);
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + 32 * r));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32 * r + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 32 * r + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 32 * r + 96));
        if (dst != NULL) {
            _mm256_stream_si256((__m256i *)(dst + 32 * r), a);
            _mm256_stream_si256((__m256i *)(dst + 32 * r + 32), b);
            _mm256_stream_si256((__m256i *)(dst + 32 * r + 64), c);
            _mm256_stream_si256((__m256i *)(dst + 32 * r + 96), d);
        }
        hash_run(a, weights + 8 * r, &even0, &odd0);
        hash_run(b, weights + 8 * r + 8, &even1, &odd1);
        hash_run(c, weights + 8 * r + 16, &even0, &odd0);
        hash_run(d, weights + 8 * r + 24, &even1, &odd1);
    }
    for (; r < runs; r++) {
        __m256i data = _mm256_loadu_si256((const __m256i *)(src + 32 * r));
        if (dst != NULL) {
            _mm256_stream_si256((__m256i *)(dst + 32 * r), data);
        }
        hash_run(data, weights + 8 * r, &even0, &odd0);
    }
    return lanes_sum(_mm256_add_epi64(even0, even1), _mm256_add_epi64(odd0, odd1));
}
#endif

/* The content sum of source bytes [offset, offset + n) of a region at `src` (`src` points at
 * the byte of that offset), copying them to `dst` as well unless it is NULL. */
static uint64_t hash_copy(char *dst, const char *src, uint64_t offset, uint64_t n, uint32_t seed,
                          const char *next, size_t next_n) {
    const unsigned char *p = (const unsigned char *)src;
#ifdef KVRAY_STREAMING
    if (have_avx2 && n >= 256) {
        /* Head to a 32-byte boundary of the bytes' offsets (so each run starts on 8 words of
         * the table), then whole 32-byte runs page by page, then the tail. The runs are stored
         * with streaming stores where the destination lines up too, else copied after hashing
         * (the page is still in cache). */
        uint64_t head = (32 - (offset & 31)) & 31;
        uint64_t sum = hash_scalar(p, offset, offset + head, seed);
        if (dst != NULL) {
            memcpy(dst, src, head);
        }
        uint64_t at = head;
        int streams = dst != NULL && n >= 4096 && (((uintptr_t)dst + head) & 31) == 0;
        while (n - at >= 32) {
            uint64_t word = (offset + at) >> 2;
            uint64_t page = word / CONTENT_TABLE_WORDS;
            uint64_t runs = (n - at) / 32;
            uint64_t room = ((page + 1) * CONTENT_TABLE_WORDS - word) / 8; /* runs left in the page */
            if (room < runs) {
                runs = room;
            }
            uint64_t plain = hash_copy_page(streams ? dst + at : NULL, src + at, word, runs, next, next_n, at);
            if (dst != NULL && !streams) {
                memcpy(dst + at, src + at, 32 * runs);
            }
            sum += plain * page_factor(seed, page);
            at += 32 * runs;
        }
        if (dst != NULL) {
            memcpy(dst + at, src + at, n - at);
        }
        return sum + hash_scalar(p + at, offset + at, offset + n, seed);
    }
#endif
    (void)next;
    (void)next_n;
    if (dst != NULL) {
        memcpy(dst, src, n);
    }
    return hash_scalar(p, offset, offset + n, seed);
}

static inline uint64_t destination_factor(uint64_t pair_salt, int64_t delta) {
    return mix64(pair_salt ^ (uint64_t)delta) | 1ULL;
}

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

static int check_columns(Py_buffer *dst_offsets, Py_buffer *src_offsets, Py_buffer *nbytes) {
    if (dst_offsets->len != src_offsets->len || dst_offsets->len != nbytes->len || nbytes->len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "scatter_copy needs three int64 arrays of one length");
        return -1;
    }
    Py_ssize_t count = nbytes->len / 8;
    const int64_t *dst_off = (const int64_t *)dst_offsets->buf;
    const int64_t *src_off = (const int64_t *)src_offsets->buf;
    const int64_t *lengths = (const int64_t *)nbytes->buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (dst_off[i] < 0 || src_off[i] < 0 || lengths[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "scatter_copy got a negative offset or length");
            return -1;
        }
    }
    return 0;
}

static PyObject *scatter_copy(PyObject *self, PyObject *args) {
    unsigned long long dst_base, src_base, salt = 0, pair_salt = 0;
    unsigned int seed = 0;
    int content = 0;
    Py_buffer dst_offsets, src_offsets, nbytes, logical = {0};
    if (!PyArg_ParseTuple(args, "KKy*y*y*|KIKpy*", &dst_base, &src_base, &dst_offsets, &src_offsets, &nbytes,
                          &salt, &seed, &pair_salt, &content, &logical)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (logical.buf != NULL && logical.len != nbytes.len) {
        PyErr_SetString(PyExc_ValueError, "scatter_copy's hash offsets must be as many as its ops");
    } else if (check_columns(&dst_offsets, &src_offsets, &nbytes) == 0) {
        const int64_t *hash_off = logical.buf != NULL ? (const int64_t *)logical.buf : NULL;
        Py_ssize_t count = nbytes.len / 8;
        const int64_t *dst_off = (const int64_t *)dst_offsets.buf;
        const int64_t *src_off = (const int64_t *)src_offsets.buf;
        const int64_t *lengths = (const int64_t *)nbytes.buf;
        uint64_t placement = 0, sum = 0;
        int faulty = __atomic_load_n(&executor_fault, __ATOMIC_RELAXED) && count >= 2;
        Py_BEGIN_ALLOW_THREADS
        char *dst = (char *)(uintptr_t)dst_base;
        const char *src = (const char *)(uintptr_t)src_base;
        for (Py_ssize_t i = 0; i < count; i++) {
            int more = i + 1 < count;
            int64_t to = dst_off[i], n = lengths[i];
            if (faulty && i == count - 1) {
                to = dst_off[i - 1];
                n = n < lengths[i - 1] ? n : lengths[i - 1];
            }
            if (content) {
                /* Hashed as the bytes at their source offset (a staged copy names it apart). */
                int64_t at = hash_off != NULL ? hash_off[i] : src_off[i];
                sum += destination_factor(pair_salt, to - at) *
                       hash_copy(dst + to, src + src_off[i], (uint64_t)at, (uint64_t)n, seed,
                                 more ? src + src_off[i + 1] : NULL, more ? (size_t)lengths[i + 1] : 0);
            } else {
                copy_block(dst + to, src + src_off[i], (size_t)n, more ? src + src_off[i + 1] : NULL,
                           more ? (size_t)lengths[i + 1] : 0);
            }
            placement += range_worth(salt, (uint64_t)to, (uint64_t)n);
        }
#ifdef KVRAY_STREAMING
        _mm_sfence(); /* streamed stores are visible before anyone is told the copy is done */
#endif
        Py_END_ALLOW_THREADS
        result = content ? Py_BuildValue("(KK)", (unsigned long long)placement, (unsigned long long)sum)
                         : PyLong_FromUnsignedLongLong(placement);
    }
    PyBuffer_Release(&dst_offsets);
    PyBuffer_Release(&src_offsets);
    PyBuffer_Release(&nbytes);
    if (logical.buf != NULL) {
        PyBuffer_Release(&logical);
    }
    return result;
}

/* ---- the copy pool ------------------------------------------------------------------------- */


static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static job *queue_head = NULL;
static job *queue_tail = NULL;
static int pool_threads = 0;
/* Tests only (set_worker_hook): called with the GIL before a thread copies the ops it claimed. */
static PyObject *worker_hook = NULL;

/* Drop the shared lock the job holds on its request's claim slot (`start_rows`): every byte
 * is in place (or the job ends incomplete), so the decode engine may close the slot and reuse
 * the blocks. Called once every op is done, by the thread that did the last, or once every
 * thread has left: the first call closes the descriptor, so the second finds nothing to do (the
 * thread of the first is still counted active when it calls). */
void kvray_claim_let_go(int claim_fd, int64_t slot) {
    struct flock lock = {0};
    lock.l_type = F_UNLCK;
    lock.l_whence = SEEK_SET;
    lock.l_start = (off_t)(slot * CLAIM_SLOT_NBYTES);
    lock.l_len = CLAIM_SLOT_NBYTES;
    (void)fcntl(claim_fd, F_OFD_SETLK, &lock);
    close(claim_fd);
}

static void release_claim(job *j) {
    if (j->claim_fd < 0) {
        return;
    }
    kvray_claim_let_go(j->claim_fd, j->claim_slot);
    j->claim_fd = -1;
}

void kvray_job_unref(job *j) {
    if (__atomic_sub_fetch(&j->refs, 1, __ATOMIC_ACQ_REL) != 0) {
        return;
    }
    if (j->event_fd >= 0) {
        close(j->event_fd);
    }
    if (j->notice_fd >= 0) {
        close(j->notice_fd);
    }
    free(j->notice);
    free(j->ops);
    free(j);
}

static void send_notice(job *j) {
    if (j->notice_fd < 0) {
        return;
    }
    if (j->notice_patch && j->notice_len >= 8) {
        uint64_t placement = __atomic_load_n(&j->placement, __ATOMIC_ACQUIRE);
        for (int k = 0; k < 8; k++) {
            j->notice[j->notice_len - 1 - k] = (char)(placement >> (8 * k));
        }
    }
    /* The content value sits before the placement: its 8 bytes, then 0xa9 "placement" 0xcf. */
    if (j->notice_patch == 2 && j->notice_len >= 27) {
        uint64_t content = __atomic_load_n(&j->content, __ATOMIC_ACQUIRE);
        for (int k = 0; k < 8; k++) {
            j->notice[j->notice_len - 20 - k] = (char)(content >> (8 * k));
        }
    }
    ssize_t sent = sendto(j->notice_fd, j->notice, j->notice_len, MSG_DONTWAIT | MSG_NOSIGNAL,
                          (struct sockaddr *)&j->notice_addr, j->notice_addr_len);
    __atomic_store_n(&j->notice_result, sent == (ssize_t)j->notice_len ? 0 : (sent < 0 ? errno : EMSGSIZE),
                     __ATOMIC_RELEASE);
}

/* Every byte of the job is in place: let go of the claim first, then send the notice. The
 * notice writes no byte into the request's blocks, and the decode engine that takes it closes
 * the slot next: it finds the slot free rather than waiting for this job to leave. */
static void all_in_place(job *j) {
    release_claim(j);
    send_notice(j);
}

static int hook_allows(const job *j, int64_t first, int64_t last) {
    unsigned long long low = ~0ULL, high = 0;
    long long nbytes = 0;
    for (int64_t i = first; i < last; i++) {
        unsigned long long start = (unsigned long long)(uintptr_t)j->dst + (unsigned long long)j->ops[i].dst;
        unsigned long long end = start + (unsigned long long)j->ops[i].nbytes;
        low = start < low ? start : low;
        high = end > high ? end : high;
        nbytes += j->ops[i].nbytes;
    }
    int allowed = 1;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *hook = worker_hook;
    if (hook != NULL) {
        Py_INCREF(hook);
        PyObject *answer = PyObject_CallFunction(hook, "KKL", low, high, nbytes);
        if (answer == NULL) {
            PyErr_WriteUnraisable(hook);
            allowed = 0;
        } else {
            allowed = PyObject_IsTrue(answer) == 1;
            Py_DECREF(answer);
        }
        Py_DECREF(hook);
    }
    PyGILState_Release(gil);
    return allowed;
}

static void run_task(job *j) {
    const int64_t count = j->count;
    const copy_op *ops = j->ops;
    for (int64_t first = __atomic_fetch_add(&j->next_op, CLAIM_OPS, __ATOMIC_RELAXED); first < count;
         first = __atomic_fetch_add(&j->next_op, CLAIM_OPS, __ATOMIC_RELAXED)) {
        int64_t last = first + CLAIM_OPS < count ? first + CLAIM_OPS : count;
        if (!j->inline_copy && __atomic_load_n(&worker_hook, __ATOMIC_ACQUIRE) != NULL &&
            !hook_allows(j, first, last)) {
            continue; /* a test's hook refused these ops: the job ends incomplete */
        }
        uint64_t placement = 0, sum = 0;
        for (int64_t i = first; i < last; i++) {
            int more = i + 1 < count;
            int64_t to = ops[i].dst, n = ops[i].nbytes;
            if (j->faulty && i == count - 1) {
                to = ops[i - 1].dst;
                n = n < ops[i - 1].nbytes ? n : ops[i - 1].nbytes;
            }
            if (j->content_on) {
                sum += destination_factor(j->pair_salt, to - ops[i].hsrc) *
                       hash_copy(j->dst + to, j->src + ops[i].src, (uint64_t)ops[i].hsrc, (uint64_t)n, j->seed,
                                 more ? j->src + ops[i + 1].src : NULL, more ? (size_t)ops[i + 1].nbytes : 0);
            } else {
                copy_block(j->dst + to, j->src + ops[i].src, (size_t)n, more ? j->src + ops[i + 1].src : NULL,
                           more ? (size_t)ops[i + 1].nbytes : 0);
            }
            placement += range_worth(j->salt, (uint64_t)to, (uint64_t)n);
        }
#ifdef KVRAY_STREAMING
        _mm_sfence(); /* this thread's streamed stores are visible before they count as done */
#endif
        /* Added before the ops count as done: whoever sees the last op done sees every sum. */
        __atomic_add_fetch(&j->placement, placement, __ATOMIC_RELEASE);
        __atomic_add_fetch(&j->content, sum, __ATOMIC_RELEASE);
        if (__atomic_add_fetch(&j->ops_done, last - first, __ATOMIC_ACQ_REL) == count) {
            all_in_place(j);
        }
    }
    if (__atomic_sub_fetch(&j->active, 1, __ATOMIC_ACQ_REL) == 0) {
        release_claim(j);
        if (j->on_over != NULL) {
            j->on_over(j);
        }
        if (j->event_fd >= 0) {
            uint64_t one = 1;
            ssize_t written;
            do {
                written = write(j->event_fd, &one, sizeof one);
            } while (written < 0 && errno == EINTR);
        }
    }
    kvray_job_unref(j);
}

static void *pool_thread(void *unused) {
    (void)unused;
    pthread_setname_np(pthread_self(), "kvray-copy"); /* what `top -H` and /proc show */
    for (;;) {
        pthread_mutex_lock(&pool_lock);
        while (queue_head == NULL) {
            pthread_cond_wait(&pool_wake, &pool_lock);
        }
        job *j = queue_head;
        if (--j->tasks_unstarted == 0) {
            queue_head = j->next_in_queue;
            if (queue_head == NULL) {
                queue_tail = NULL;
            }
        }
        pthread_mutex_unlock(&pool_lock);
        run_task(j);
    }
    return NULL;
}

/* A forked child has none of the parent's threads: it starts its own pool when it copies. */
static void pool_after_fork_in_child(void) {
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_wake, NULL);
    queue_head = queue_tail = NULL;
    pool_threads = 0;
}

/* Called with pool_lock held. The threads start with every signal blocked (they inherit the
 * mask in force at their creation), so signals keep going to the interpreter's threads. */
static int grow_pool(int wanted) {
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    int failed = 0;
    while (pool_threads < wanted) {
        pthread_attr_t attr;
        pthread_t thread;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        failed = pthread_create(&thread, &attr, pool_thread, NULL);
        pthread_attr_destroy(&attr);
        if (failed) {
            break;
        }
        pool_threads++;
    }
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    return failed;
}

typedef struct {
    PyObject_HEAD job *job;
} CopyJob;

static void CopyJob_dealloc(CopyJob *self) {
    if (self->job != NULL) {
        kvray_job_unref(self->job);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *CopyJob_fileno(CopyJob *self, PyObject *unused) {
    (void)unused;
    return PyLong_FromLong(self->job->event_fd);
}

static PyObject *CopyJob_over(CopyJob *self, void *unused) {
    (void)unused;
    return PyBool_FromLong(__atomic_load_n(&self->job->active, __ATOMIC_ACQUIRE) == 0);
}

static PyObject *CopyJob_complete(CopyJob *self, void *unused) {
    (void)unused;
    return PyBool_FromLong(__atomic_load_n(&self->job->ops_done, __ATOMIC_ACQUIRE) == self->job->count);
}

static PyObject *CopyJob_placement(CopyJob *self, void *unused) {
    (void)unused;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&self->job->placement, __ATOMIC_ACQUIRE));
}

static PyObject *CopyJob_content(CopyJob *self, void *unused) {
    (void)unused;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&self->job->content, __ATOMIC_ACQUIRE));
}

static PyObject *CopyJob_notice_sent(CopyJob *self, void *unused) {
    (void)unused;
    return PyBool_FromLong(__atomic_load_n(&self->job->notice_result, __ATOMIC_ACQUIRE) == 0);
}

static PyMethodDef CopyJob_methods[] = {
    {"fileno", (PyCFunction)CopyJob_fileno, METH_NOARGS, "An eventfd, readable once every thread left the job."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef CopyJob_getset[] = {
    {"over", (getter)CopyJob_over, NULL, "True once no thread copies for the job any more.", NULL},
    {"complete", (getter)CopyJob_complete, NULL, "True once every op was copied.", NULL},
    {"notice_sent", (getter)CopyJob_notice_sent, NULL, "True if the notice datagram was queued.", NULL},
    {"placement", (getter)CopyJob_placement, NULL, "The placement digest of what the job stored (with base).",
     NULL},
    {"content", (getter)CopyJob_content, NULL, "The content digest of what the job copied (with its base).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CopyJobType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvray._copy_pool.CopyJob",
    .tp_basicsize = sizeof(CopyJob),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A copy running on the pool (see start_copy).",
    .tp_dealloc = (destructor)CopyJob_dealloc,
    .tp_methods = CopyJob_methods,
    .tp_getset = CopyJob_getset,
};

static int take_notice(job *j, PyObject *notice) {
    int fd, patch = 0;
    Py_buffer path, message;
    if (!PyArg_ParseTuple(notice, "iy*y*|i", &fd, &path, &message, &patch)) {
        return -1;
    }
    j->notice_patch = patch;
    int status = -1;
    if (path.len <= 0 || (size_t)path.len >= sizeof j->notice_addr.sun_path) {
        PyErr_Format(PyExc_ValueError, "a notice path must have 1 to %zu bytes",
                     sizeof j->notice_addr.sun_path - 1);
        goto done;
    }
    j->notice = malloc(message.len > 0 ? (size_t)message.len : 1);
    if (j->notice == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(j->notice, message.buf, (size_t)message.len);
    j->notice_len = (size_t)message.len;
    j->notice_addr.sun_family = AF_UNIX;
    memcpy(j->notice_addr.sun_path, path.buf, (size_t)path.len);
    j->notice_addr.sun_path[path.len] = '\0';
    j->notice_addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + (size_t)path.len + 1);
    /* Our own descriptor: the socket's owner may close it while the job runs. */
    j->notice_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (j->notice_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    status = 0;
done:
    PyBuffer_Release(&path);
    PyBuffer_Release(&message);
    return status;
}

job *kvray_job_new(int64_t count) {
    job *j = calloc(1, sizeof *j);
    if (j == NULL) {
        return NULL;
    }
    j->event_fd = -1;
    j->notice_fd = -1;
    j->notice_result = -1;
    j->claim_fd = -1;
    j->refs = 1;
    j->ops = malloc((size_t)(count > 0 ? count : 1) * sizeof(copy_op));
    if (j->ops == NULL) {
        free(j);
        return NULL;
    }
    return j;
}

/* A job with room for `count` ops and nothing else yet (no notice, claim or eventfd); NULL
 * with a Python error. */
static job *new_job(int64_t count) {
    job *j = kvray_job_new(count);
    if (j == NULL) {
        PyErr_NoMemory();
    }
    return j;
}

/* Append the copy of `nbytes` bytes from `src` to `dst` (content hashed at source offset `hsrc`)
 * to `j`'s ops at index `op`, in pieces of at most `piece` bytes; the next free index. */
int64_t kvray_job_add(job *j, int64_t op, int64_t dst, int64_t src, int64_t hsrc, int64_t nbytes,
                      int64_t piece) {
    for (int64_t done = 0; done < nbytes; done += piece) {
        j->ops[op].dst = dst + done;
        j->ops[op].src = src + done;
        j->ops[op].hsrc = hsrc + done;
        j->ops[op].nbytes = nbytes - done < piece ? nbytes - done : piece;
        op++;
    }
    return op;
}

static int start_job(job *j, int threads);

/* Start job `j` (its ops, notice and claim filled in) on `threads` threads of the pool, or on
 * the calling thread with the GIL released when `threads` is 0; the CopyJob that owns it, or
 * NULL with a Python error (the job freed). */
static CopyJob *launch(job *j, int threads) {
    j->event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (j->event_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        kvray_job_unref(j);
        return NULL;
    }
    CopyJob *handle = PyObject_New(CopyJob, &CopyJobType);
    if (handle == NULL) {
        kvray_job_unref(j);
        return NULL;
    }
    handle->job = j;
    __atomic_add_fetch(&j->refs, 1, __ATOMIC_RELAXED); /* the pool's, taken by start_job */
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = start_job(j, threads);
    Py_END_ALLOW_THREADS
    if (failed) {
        Py_DECREF(handle); /* frees the job */
        errno = failed;
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    return handle;
}

/* Queue `j` on `threads` pool threads, or copy it on this thread (no GIL held) when `threads`
 * is 0 or there is nothing to copy; the caller's reference passes to the pool. 0, or the
 * errno of a pool that could not start a thread (the job's claim let go, its reference
 * dropped). */
static int start_job(job *j, int threads) {
    int tasks = j->count < threads ? (int)j->count : threads;
    if (j->count == 0 || threads == 0) {
        /* Nothing to copy, or a copy small enough for this thread: done before returning. */
        j->inline_copy = 1;
        j->active = 1;
        if (j->count == 0) {
            all_in_place(j);
        }
        run_task(j);
        return 0;
    }
    j->active = tasks;
    j->tasks_unstarted = tasks;
    __atomic_add_fetch(&j->refs, tasks - 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&pool_lock);
    int failed = grow_pool(tasks);
    if (failed && pool_threads == 0) {
        pthread_mutex_unlock(&pool_lock);
        j->active = 0;
        __atomic_sub_fetch(&j->refs, tasks - 1, __ATOMIC_RELAXED);
        release_claim(j);
        kvray_job_unref(j);
        return failed;
    }
    if (queue_tail != NULL) {
        queue_tail->next_in_queue = j;
    } else {
        queue_head = j;
    }
    queue_tail = j;
    if (tasks == 1) {
        pthread_cond_signal(&pool_wake);
    } else {
        pthread_cond_broadcast(&pool_wake);
    }
    pthread_mutex_unlock(&pool_lock);
    return 0;
}

int kvray_job_run(job *j, int threads) { return start_job(j, threads); }

static PyObject *start_copy(PyObject *self, PyObject *args) {
    unsigned long long dst_base, src_base, salt = 0, base = 0, pair_salt = 0, content_base = 0;
    unsigned int seed = 0;
    int content = 0;
    Py_buffer dst_offsets, src_offsets, nbytes, logical = {0};
    int threads;
    long long piece;
    PyObject *notice = Py_None;
    if (!PyArg_ParseTuple(args, "KKy*y*y*iL|OKKpIKKy*", &dst_base, &src_base, &dst_offsets, &src_offsets,
                          &nbytes, &threads, &piece, &notice, &salt, &base, &content, &seed, &pair_salt,
                          &content_base, &logical)) {
        return NULL;
    }
    job *j = NULL;
    CopyJob *handle = NULL;
    if (logical.buf != NULL && logical.len != nbytes.len) {
        PyErr_SetString(PyExc_ValueError, "start_copy's hash offsets must be as many as its ops");
        goto fail;
    }
    if (check_columns(&dst_offsets, &src_offsets, &nbytes) != 0) {
        goto fail;
    }
    const int64_t *hash_off = logical.buf != NULL ? (const int64_t *)logical.buf : NULL;
    if (threads < 1 || threads > MAX_POOL_THREADS || piece < 1) {
        PyErr_Format(PyExc_ValueError, "start_copy needs 1 to %d threads and pieces of at least one byte",
                     MAX_POOL_THREADS);
        goto fail;
    }
    Py_ssize_t given = nbytes.len / 8;
    const int64_t *dst_off = (const int64_t *)dst_offsets.buf;
    const int64_t *src_off = (const int64_t *)src_offsets.buf;
    const int64_t *lengths = (const int64_t *)nbytes.buf;
    int64_t count = 0;
    for (Py_ssize_t i = 0; i < given; i++) {
        count += (lengths[i] + piece - 1) / piece;
    }
    j = new_job(count);
    if (j == NULL) {
        goto fail;
    }
    int64_t op = 0;
    for (Py_ssize_t i = 0; i < given; i++) {
        int64_t hashed_at = hash_off != NULL ? hash_off[i] : src_off[i];
        op = kvray_job_add(j, op, dst_off[i], src_off[i], hashed_at, lengths[i], piece);
    }
    j->count = count;
    j->salt = salt;
    j->placement = base;
    j->content_on = content;
    j->seed = seed;
    j->pair_salt = pair_salt;
    j->content = content_base;
    j->faulty = __atomic_load_n(&executor_fault, __ATOMIC_RELAXED) && count >= 2;
    j->dst = (char *)(uintptr_t)dst_base;
    j->src = (const char *)(uintptr_t)src_base;
    if (notice != Py_None && take_notice(j, notice) != 0) {
        goto fail;
    }
    handle = launch(j, threads);
    j = NULL; /* the handle owns it now, or it was freed */
    goto done;
fail:
    if (j != NULL) {
        kvray_job_unref(j);
    }
    handle = NULL;
done:
    PyBuffer_Release(&dst_offsets);
    PyBuffer_Release(&src_offsets);
    PyBuffer_Release(&nbytes);
    if (logical.buf != NULL) {
        PyBuffer_Release(&logical);
    }
    return (PyObject *)handle;
}

/* Take the shared lock of a request's claim slot for job `j` and check that the slot is open
 * under `token`: 0 taken (the job holds it until every byte is in place), 1 the engine holds the
 * slot (it is closing it: the caller may wait and ask again), -1 with a Python error (the slot
 * is not open under the token: a LookupError, and nothing may be written). */
int kvray_claim_take(int fd, int64_t slot, int64_t slots, uint64_t board, uint64_t token, int *claim_fd) {
    if (slot < 0 || slot >= slots || board == 0) {
        return 2;
    }
    /* Our own descriptor of the board's open file description: its locks are the caller's. */
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) {
        return -errno;
    }
    struct flock lock = {0};
    lock.l_type = F_RDLCK;
    lock.l_whence = SEEK_SET;
    lock.l_start = (off_t)(slot * CLAIM_SLOT_NBYTES);
    lock.l_len = CLAIM_SLOT_NBYTES;
    if (fcntl(own, F_OFD_SETLK, &lock) != 0) {
        int error = errno;
        close(own);
        return error == EAGAIN || error == EACCES ? 1 : -error;
    }
    /* Only the engine writes the slot, and only while it holds the lock exclusively. */
    const volatile uint64_t *words = (const volatile uint64_t *)(uintptr_t)board + 2 * slot;
    if (words[0] != token || words[1] != CLAIM_OPEN) {
        kvray_claim_let_go(own, slot);
        return 2;
    }
    *claim_fd = own;
    return 0;
}

int kvray_job_claim(job *j, int fd, int64_t slot, int64_t slots, uint64_t board, uint64_t token) {
    int claim_fd = -1;
    int taken = kvray_claim_take(fd, slot, slots, board, token, &claim_fd);
    if (taken == 0) {
        j->claim_fd = claim_fd;
        j->claim_slot = slot;
    }
    return taken;
}

static int take_claim(job *j, PyObject *claim) {
    int fd;
    long long slot, slots;
    unsigned long long board, token;
    if (!PyArg_ParseTuple(claim, "iLLKK", &fd, &slot, &slots, &board, &token)) {
        return -1;
    }
    if (slot < 0 || slot >= slots || board == 0) {
        PyErr_Format(PyExc_LookupError, "claim slot %lld is not one of the board's %lld", slot, slots);
        return -1;
    }
    int taken = kvray_job_claim(j, fd, slot, slots, board, token);
    if (taken < 0) {
        errno = -taken;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (taken == 2) {
        PyErr_SetString(PyExc_LookupError, "the request's claim slot is not open under its token");
        return -1;
    }
    return taken;
}

int kvray_rows_check(const int64_t *rows, int64_t num_rows, const int64_t *local, const int64_t *remote, int64_t n,
                     int64_t src_len, int64_t dst_len, int64_t piece, int64_t *ops, int64_t *nbytes, int64_t *bad_row,
                     int64_t *bad_pair) {
    const int64_t *src_start = rows, *src_stride = src_start + num_rows;
    const int64_t *dst_start = src_stride + num_rows, *dst_stride = dst_start + num_rows;
    const int64_t *lengths = dst_stride + num_rows;
    /* Every op inside both regions before a byte moves (the planner checked the same; this is
     * the executor's own check, against the lengths it was given). */
    int64_t count = 0, total = 0;
    for (int64_t r = 0; r < num_rows; r++) {
        if (lengths[r] < 0) {
            *bad_row = r;
            return -1;
        }
        for (int64_t i = 0; i < n; i++) {
            int64_t from, to, from_end, to_end;
            if (__builtin_mul_overflow(local[i], src_stride[r], &from) ||
                __builtin_add_overflow(from, src_start[r], &from) ||
                __builtin_mul_overflow(remote[i], dst_stride[r], &to) ||
                __builtin_add_overflow(to, dst_start[r], &to) || __builtin_add_overflow(from, lengths[r], &from_end) ||
                __builtin_add_overflow(to, lengths[r], &to_end) || from < 0 || to < 0 || from_end > src_len ||
                to_end > dst_len) {
                *bad_row = r;
                *bad_pair = i;
                return -1;
            }
            count += (lengths[r] + piece - 1) / piece;
            total += lengths[r];
        }
    }
    *ops = count;
    if (nbytes != NULL) {
        *nbytes = total;
    }
    return 0;
}

job *kvray_rows_job(const int64_t *rows, int64_t num_rows, const int64_t *local, const int64_t *remote, int64_t n,
                    int64_t src_len, int64_t dst_len, int64_t piece, int64_t *nbytes, int64_t *bad_row,
                    int64_t *bad_pair) {
    const int64_t *src_start = rows, *src_stride = src_start + num_rows;
    const int64_t *dst_start = src_stride + num_rows, *dst_stride = dst_start + num_rows;
    const int64_t *lengths = dst_stride + num_rows;
    int64_t count = 0, total = 0;
    if (kvray_rows_check(rows, num_rows, local, remote, n, src_len, dst_len, piece, &count, &total, bad_row,
                         bad_pair) != 0) {
        return NULL;
    }
    job *j = kvray_job_new(count);
    if (j == NULL) {
        return NULL;
    }
    /* One op per (row, block pair), each continuing the previous one at both ends merged into
     * it, then cut into pieces. */
    int64_t op = 0;
    for (int64_t r = 0; r < num_rows; r++) {
        int64_t run_from = 0, run_to = 0, run_n = 0;
        for (int64_t i = 0; i <= n; i++) {
            int64_t from = 0, to = 0;
            if (i < n) {
                from = src_start[r] + local[i] * src_stride[r];
                to = dst_start[r] + remote[i] * dst_stride[r];
                if (run_n > 0 && from == run_from + run_n && to == run_to + run_n) {
                    run_n += lengths[r];
                    continue;
                }
            }
            op = kvray_job_add(j, op, run_to, run_from, run_from, run_n, piece);
            run_from = from;
            run_to = to;
            run_n = i < n ? lengths[r] : 0;
        }
    }
    j->count = op;
    if (nbytes != NULL) {
        *nbytes = total;
    }
    return j;
}

/* start_rows: see kvray/_copy_pool.pyi. */
static PyObject *start_rows(PyObject *self, PyObject *args) {
    unsigned long long dst_base, src_base, salt = 0, pair_salt = 0;
    long long src_len, dst_len, piece;
    unsigned int seed = 0;
    int threads, content = 0;
    Py_buffer rows, ids;
    PyObject *notice = Py_None, *claim = Py_None;
    if (!PyArg_ParseTuple(args, "KKy*y*LLiLOOKpIK", &dst_base, &src_base, &rows, &ids, &src_len, &dst_len,
                          &threads, &piece, &notice, &claim, &salt, &content, &seed, &pair_salt)) {
        return NULL;
    }
    job *j = NULL;
    PyObject *result = NULL;
    if (rows.len % (5 * 8) != 0 || ids.len % (2 * 8) != 0 || rows.len == 0) {
        PyErr_SetString(PyExc_ValueError, "start_rows takes 5 columns of rows and 2 of ids, int64");
        goto done;
    }
    if (threads < 0 || threads > MAX_POOL_THREADS || piece < 1 || src_len < 0 || dst_len < 0) {
        PyErr_Format(PyExc_ValueError, "start_rows needs 0 to %d threads, pieces of at least one byte and "
                     "region lengths", MAX_POOL_THREADS);
        goto done;
    }
    const int64_t num_rows = (int64_t)(rows.len / 40), n = (int64_t)(ids.len / 16);
    const int64_t *local = (const int64_t *)ids.buf, *remote = local + n;
    int64_t bad_row = -1, bad_pair = -1;
    j = kvray_rows_job((const int64_t *)rows.buf, num_rows, local, remote, n, src_len, dst_len, piece, NULL,
                       &bad_row, &bad_pair);
    if (j == NULL) {
        if (bad_row < 0) {
            PyErr_NoMemory();
        } else if (bad_pair < 0) {
            PyErr_SetString(PyExc_ValueError, "start_rows got a row of negative length");
        } else {
            PyErr_Format(PyExc_ValueError, "start_rows: row %lld of block pair %lld leaves a region",
                         (long long)bad_row, (long long)bad_pair);
        }
        goto done;
    }
    j->salt = salt;
    j->content_on = content;
    j->seed = seed;
    j->pair_salt = pair_salt;
    j->faulty = __atomic_load_n(&executor_fault, __ATOMIC_RELAXED) && j->count >= 2;
    j->dst = (char *)(uintptr_t)dst_base;
    j->src = (const char *)(uintptr_t)src_base;
    if (notice != Py_None && take_notice(j, notice) != 0) {
        goto done;
    }
    if (claim != Py_None) {
        int taken = take_claim(j, claim);
        if (taken < 0) {
            goto done;
        }
        if (taken > 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    result = (PyObject *)launch(j, threads);
    j = NULL; /* the handle owns it now, or it was freed */
done:
    if (j != NULL) {
        release_claim(j);
        kvray_job_unref(j);
    }
    PyBuffer_Release(&rows);
    PyBuffer_Release(&ids);
    return result;
}

static PyObject *set_worker_hook(PyObject *self, PyObject *hook) {
    PyObject *old = worker_hook;
    if (hook == Py_None) {
        __atomic_store_n(&worker_hook, NULL, __ATOMIC_RELEASE);
    } else {
        Py_INCREF(hook);
        __atomic_store_n(&worker_hook, hook, __ATOMIC_RELEASE);
    }
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* hash_ranges(base, offsets, nbytes, seed[, logical]) -> bytes: for each range [offsets[i],
 * +nbytes[i]) of the region at `base`, its content sum (kvray/content.py) as native uint64s,
 * GIL released; with `logical`, the bytes read there are hashed as at offset logical[i] (a
 * staged copy of them). */
static PyObject *hash_ranges(PyObject *self, PyObject *args) {
    unsigned long long base;
    unsigned int seed;
    Py_buffer offsets, nbytes, logical = {0};
    if (!PyArg_ParseTuple(args, "Ky*y*I|y*", &base, &offsets, &nbytes, &seed, &logical)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (offsets.len != nbytes.len || nbytes.len % 8 != 0 || (logical.buf != NULL && logical.len != nbytes.len)) {
        PyErr_SetString(PyExc_ValueError, "hash_ranges needs two int64 arrays of one length");
        goto done;
    }
    Py_ssize_t count = nbytes.len / 8;
    const int64_t *off = (const int64_t *)offsets.buf;
    const int64_t *lengths = (const int64_t *)nbytes.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (off[i] < 0 || lengths[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "hash_ranges got a negative offset or length");
            goto done;
        }
    }
    result = PyBytes_FromStringAndSize(NULL, count * 8);
    if (result == NULL) {
        goto done;
    }
    uint64_t *sums = (uint64_t *)PyBytes_AS_STRING(result);
    const int64_t *at = logical.buf != NULL ? (const int64_t *)logical.buf : off;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        int more = i + 1 < count;
        sums[i] = hash_copy(NULL, (const char *)(uintptr_t)base + off[i], (uint64_t)at[i], (uint64_t)lengths[i],
                            seed, more ? (const char *)(uintptr_t)base + off[i + 1] : NULL,
                            more ? (size_t)lengths[i + 1] : 0);
    }
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&nbytes);
    if (logical.buf != NULL) {
        PyBuffer_Release(&logical);
    }
    return result;
}

uint64_t kvray_hash_range(const char *base, int64_t offset, int64_t nbytes, uint32_t seed) {
    return hash_copy(NULL, base + offset, (uint64_t)offset, (uint64_t)nbytes, seed, NULL, 0);
}

int kvray_executor_fault(void) { return __atomic_load_n(&executor_fault, __ATOMIC_RELAXED); }

static PyObject *set_executor_fault(PyObject *self, PyObject *on) {
    int value = PyObject_IsTrue(on);
    if (value < 0) {
        return NULL;
    }
    __atomic_store_n(&executor_fault, value, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scatter_copy", scatter_copy, METH_VARARGS, "Copy many (dst, src, nbytes) ops with the GIL released."},
    {"start_copy", start_copy, METH_VARARGS, "Start a copy on the pool's threads; returns a CopyJob."},
    {"start_rows", start_rows, METH_VARARGS,
     "Start a copy of a request's rows and block ids under its claim slot; returns a CopyJob."},
    {"set_worker_hook", set_worker_hook, METH_O,
     "Tests only: hook(low, high, nbytes) -> bool runs (with the GIL) before a pool thread copies the ops "
     "it claimed (destination span [low, high), nbytes in all); False skips them."},
    {"hash_ranges", hash_ranges, METH_VARARGS, "Content sums of ranges of one region (kvray/content.py)."},
    {"set_executor_fault", set_executor_fault, METH_O,
     "Faults only: True stores the last op of each later batch over the op before it (kvray.faults)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvray._copy_pool", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy_pool(void) {
#ifdef KVRAY_STREAMING
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
    fill_content_table();
    if (PyType_Ready(&CopyJobType) < 0) {
        return NULL;
    }
    pthread_atfork(NULL, NULL, pool_after_fork_in_child);
    PyObject *created = PyModule_Create(&module);
    if (created == NULL) {
        return NULL;
    }
    Py_INCREF(&CopyJobType);
    if (PyModule_AddObject(created, "CopyJob", (PyObject *)&CopyJobType) < 0) {
        Py_DECREF(&CopyJobType);
        Py_DECREF(created);
        return NULL;
    }
    if (kvray_lane_add_types(created) < 0) {
        Py_DECREF(created);
        return NULL;
    }
    return created;
}
