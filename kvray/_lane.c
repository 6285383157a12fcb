/* The hand-off's native lane (kvray/agent/handoff/lane.py has the protocol and why): a prefill
 * engine's thread that takes decode engines' asks for held requests and pushes them with the
 * copy pool, without Python; and the decode side's two calls, an ask and the read of answers.
 *
 * Lane(listen_fd, incarnation, src_base, src_len, src_pool, threads, piece, inline_max, park_s=0, cuda=None)
 *   a thread serving the bound and listening SOCK_SEQPACKET socket `listen_fd` (duplicated).
 *   With `cuda` ((the CUDA driver's calls, as `cuda_calls` lists them, by address), the source
 *   GPU's context) the caches are on GPUs: pairs are `add_cuda_pair`'s, a copy is a row copy
 *   captured for the pair (kvray/transport/cuda_ipc/lane.py), launched by the lane thread and
 *   waited for by a second thread, the finisher, which answers.
 *   Each record on a connection is one ask (below), MAC'd under the key of the pair it names;
 *   one whose MAC fails closes its connection unanswered. An ask for a hold not here yet waits
 *   (parked) up to `park_s` seconds for it, or until the hold is settled: a decode engine may
 *   ask before the prefill engine's step has held the request it just finished.
 *   .add_pair(decode_incarnation, key, (dst_base, dst_len, dst_pool, file_fd, file_end), rows,
 *             stretch, (board_fd, slots, board_address), salt, seed, pair_salt, checked)
 *   .add_cuda_pair(decode_incarnation, key, (dst_len, dst_pool, context, stream), rows, stretch,
 *                  (board_fd, slots, board_address), graphs, checked)
 *                                              graphs: (size, graph exec, staging, produced,
 *                                              done, digest cell) of each captured copy
 *   .remove_pair(decode_incarnation) -> bool   returns once no copy of the pair runs
 *   .hold(key, ids, sums, held, stream=0) -> bool
 *                                              a request's blocks (and their held sums); on GPUs
 *                                              its copy waits for the work queued on `stream`
 *   .settle(key) -> bool                       asks waiting for `key` are answered now: served if
 *                                              it is held, else "not held" (False: none waited)
 *   .unhold(key) -> bool                       False: not held (an ask took it, or never held)
 *   .done() -> list[(key, status, nbytes, seconds, decode_incarnation, first, count)]
 *                                              pushes ended (fileno() wakes): the hold's count
 *                                              blocks from first
 *   .close()
 * lane_ask(fd, key, prefill_incarnation, decode_incarnation, hold, token, slot, first_block, ask_id, ids,
 *          checked)
 * lane_answers(fd) -> (list[(ask_id, status, token, placement, content, reference, flags, nbytes, arrived)],
 *                     ended)   arrived: when the answer came, on the monotonic clock
 * lane_stamp(fd)   the kernel stamps each answer the socket receives (for `arrived`)
 *
 * An ask (little-endian): magic (uint32), version and flags (uint16 each; flag 1: the decode
 * engine checks content), n and first_block (uint32 each), the prefill's
 * and the decode engine's incarnations, the ask id, the token, the slot (uint64 each), the
 * hold's 16-byte key, n int64 decode block ids, then SipHash-2-4 (uint64) of everything before
 * it under the pair's 16-byte key. An answer: magic, status (uint32), ask id, token, placement,
 * content, reference, flags, nbytes (uint64).
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include "_copy_job.h"
#include "_placement.h"
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ASK_MAGIC 0x4b564c41u    /* "KVLA" */
#define ANSWER_MAGIC 0x4b564c52u /* "KVLR" */
#define LANE_VERSION 1u
#define ASK_HEADER 72
#define ASK_MAX_IDS 8192
#define ASK_MAX (ASK_HEADER + 8 * ASK_MAX_IDS + 8)
#define ANSWER_NBYTES 64
#define MAX_CONNECTIONS 1024
#define MAX_HOLDS (1 << 16)
#define HOLD_BUCKETS 4096
#define CLAIM_SLOT_NBYTES_LANE 16
#define MAX_PARKED 1024

/* Answers (kvray.agent.handoff.lane.Answer has their meanings). */
enum {
    LANE_DONE = 0,
    LANE_FAILED = 1,      /* the copy ended incomplete */
    LANE_NOT_HELD = 2,    /* no such hold here (yet, or any more): ask the usual way */
    LANE_UNKNOWN_PAIR = 3,/* this engine has no lane to the asking incarnation */
    LANE_STALE = 4,       /* the ask names another incarnation of this engine */
    LANE_REFUSED = 5,     /* ids that do not fit the hold, the pool or the regions: nothing written */
    LANE_NOT_OPEN = 6,    /* the slot is not open under the token: nothing written */
    LANE_CLOSING = 7,     /* the engine is closing the slot: nothing written */
    LANE_UNCHECKED = 8,   /* a checked push whose blocks' digests are not all held: ask the usual way */
    LANE_BUSY = 9,        /* the copy could not start: ask the usual way */
    LANE_GONE = 10,       /* the decode engine's memory was removed or shrank: nothing written */
};

/* ---- SipHash-2-4 (Aumasson and Bernstein), 64-bit output ------------------------------- */

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                                    \
    do {                                                                                           \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);                                  \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                                                     \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                                                     \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);                                  \
    } while (0)

static uint64_t load64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* x86-64 and aarch64 Linux: little-endian */
}

static uint64_t siphash24(const unsigned char key[16], const unsigned char *in, size_t len) {
    uint64_t k0 = load64(key), k1 = load64(key + 8);
    uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1;
    uint64_t v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
    const unsigned char *end = in + len - (len % 8);
    for (; in != end; in += 8) {
        uint64_t m = load64(in);
        v3 ^= m;
        SIPROUND;
        SIPROUND;
        v0 ^= m;
    }
    uint64_t b = ((uint64_t)len) << 56;
    for (size_t left = len & 7; left > 0; left--) {
        b |= ((uint64_t)in[left - 1]) << (8 * (left - 1));
    }
    v3 ^= b;
    SIPROUND;
    SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

/* ---- the CUDA driver, for a lane of GPU caches --------------------------------------------- */

/* The driver calls a GPU lane makes, at addresses Python hands it (libcuda's own, or a test's):
 * each returns a CUresult (0: success). Handles are the driver's (CUcontext, CUstream, CUevent,
 * CUgraphExec). */
typedef struct cuda_calls {
    int (*ctx_set_current)(void *ctx);
    int (*ctx_push_current)(void *ctx);
    int (*ctx_pop_current)(void **ctx);
    int (*event_create)(void **event, unsigned flags);
    int (*event_destroy)(void *event);
    int (*event_record)(void *event, void *stream);
    int (*event_synchronize)(void *event);
    int (*stream_wait_event)(void *stream, void *event, unsigned flags);
    int (*graph_launch)(void *exec, void *stream);
} cuda_calls;

#define CUDA_CALLS 9
#define CU_EVENT_DISABLE_TIMING 2u
/* How long an ask waits for one of its pair's captured copies of its size to be free. */
#define GRAPH_WAIT_S 1.0

/* A row copy captured for a pair (kvray/transport/cuda_ipc/graphs.py `capture_rows`): the
 * block ids go into its pinned `staging` (count, `capacity` source ids, `capacity` destination
 * ids), it waits for `produced` and records `done`; `cell` is where its fold leaves the
 * content then the placement digest (two pinned int64). One copy at a time (`busy`, under the
 * lane's lock). */
typedef struct lane_graph {
    int64_t capacity;
    void *exec;
    int64_t *staging;
    void *produced, *done;
    const volatile uint64_t *cell;
    int busy;
} lane_graph;

/* ---- what a lane keeps -------------------------------------------------------------------- */

typedef struct pair {
    struct pair *next;
    uint64_t incarnation; /* the decode engine's */
    unsigned char key[16];
    char *dst;
    int64_t dst_len, dst_pool;
    int64_t num_rows, *rows;     /* 5 columns: src start, src stride, dst start, dst stride, bytes */
    int64_t num_stretch, *stretch; /* 6 columns: held row, salt, src start, src stride, dst start, dst stride */
    int board_fd;
    int file_fd;      /* the decode engine's shared-memory file: asked before every copy */
    int64_t file_end; /* the file must keep this many bytes (touching past its end is SIGBUS) */
    int64_t board_slots;
    uint64_t board;
    uint64_t salt, pair_salt;
    uint32_t seed;
    int checked;
    unsigned char *seen; /* the lane thread's bitmap over the decode pool (repeated ids) */
    int refs;            /* atomic: the lane's list, and each ask being pushed */
    /* A pair of GPU caches (`add_cuda_pair`): the context and stream its copies run in, and
     * its captured row copies; dst, file_fd and the salts are then unused. */
    int cuda;
    void *ctx, *stream;
    int num_graphs;
    lane_graph *graphs;
} pair;

typedef struct hold {
    struct hold *next;
    unsigned char key[16];
    int64_t n, *ids;
    int64_t held_rows; /* rows of sums: 0 when none were held */
    uint64_t *sums;    /* held_rows x n */
    unsigned char *held;
    /* A GPU lane's hold: an event recorded after the work that wrote its blocks (a copy of
     * them waits for it), destroyed with the hold in `ctx` through `cu`. */
    void *ready, *ctx;
    const cuda_calls *cu;
    int dropped; /* let go of while its sums were being taken (the hasher frees it) */
} hold;

typedef struct done_entry {
    struct done_entry *next;
    unsigned char key[16];
    int status;
    int64_t nbytes;
    double seconds;
    uint64_t pair;        /* the decode engine's incarnation */
    int64_t first, count; /* the hold's blocks pushed: count from first */
} done_entry;

/* An ask waiting for its hold (the lane thread serves it once the hold comes). */
typedef struct parked {
    struct parked *next;
    pair *pair; /* a reference */
    int fd;     /* the connection's, duplicated: it may close meanwhile */
    uint32_t n;
    int settled;     /* 1: answer now (served if held), 2: answer now, unserved */
    double deadline; /* on the monotonic clock, in seconds */
    unsigned char rec[]; /* the ask, as it came (its MAC checked) */
} parked;

typedef struct lane {
    pthread_mutex_t lock; /* pairs, holds, done, parked */
    pair *pairs;
    parked *parked;
    int64_t num_parked;
    double park_s;
    hold *buckets[HOLD_BUCKETS];
    int64_t holds;
    done_entry *done_head, *done_tail;
    int listen_fd, epoll_fd, wake_fd, done_fd;
    int stopping;
    uint64_t incarnation;
    char *src;
    int64_t src_len, src_pool;
    int threads;
    int64_t piece, inline_max;
    pthread_t thread;
    int started;
    int connections;
    int refs; /* atomic: the Lane object and each ask being pushed */
    /* A lane of GPU caches: the driver's calls, the source's context, and the finisher, a
     * thread that waits for each launched copy in turn (`cuda_pending`, first launched first),
     * then lets go of its claim and its captured copy and answers. */
    int cuda;
    cuda_calls cu;
    void *ctx;
    pthread_cond_t graph_free;   /* a captured copy became free (under lock) */
    pthread_cond_t cuda_wake;    /* a copy was launched, or the finisher stops (under lock) */
    struct ask_ctx *cuda_head, *cuda_tail;
    int finisher_stop;
    pthread_t finisher;
    int finisher_started;
    /* Holds whose sums the lane takes itself (`hash_rows`, `hold(..., hashed=True)`): queued
     * for the hasher thread, which hashes their blocks' rows and then lets asks take them. */
    int64_t *hash_rows; /* 4 x R, column-major: held row, start, block stride, bytes */
    int64_t num_hash_rows, held_rows_total;
    uint32_t hash_seed;
    hold *hash_head, *hash_tail, *hashing_now;
    int64_t hashing; /* queued or being hashed */
    pthread_cond_t hash_wake;
    pthread_t hasher;
    int hasher_started, hasher_stop;
} lane;

typedef struct conn {
    int fd;
    uint64_t pair; /* the decode incarnation its first good ask named (0: none yet) */
} conn;

typedef struct ask_ctx {
    struct ask_ctx *next; /* the finisher's queue */
    lane_graph *graph;    /* a GPU copy's captured copy (its claim in claim_fd, slot) */
    int claim_fd;
    int64_t slot;
    lane *lane;
    pair *pair;
    hold *hold;
    int answer_fd;
    uint64_t ask_id, token, reference;
    int has_reference;
    int64_t nbytes, first, count;
    double started; /* on the monotonic clock, in seconds */
} ask_ctx;

static void lane_unref(lane *l);

static void pair_unref(pair *p) {
    if (__atomic_sub_fetch(&p->refs, 1, __ATOMIC_ACQ_REL) != 0) {
        return;
    }
    close(p->board_fd);
    if (p->file_fd >= 0) {
        close(p->file_fd);
    }
    free(p->rows);
    free(p->stretch);
    free(p->seen);
    free(p->graphs);
    free(p);
}

static void hold_free(hold *h) {
    if (h == NULL) {
        return;
    }
    if (h->ready != NULL) {
        void *previous;
        if (h->cu->ctx_push_current(h->ctx) == 0) {
            (void)h->cu->event_destroy(h->ready);
            (void)h->cu->ctx_pop_current(&previous);
        }
    }
    free(h->ids);
    free(h->sums);
    free(h->held);
    free(h);
}

static unsigned bucket_of(const unsigned char key[16]) {
    uint64_t k;
    memcpy(&k, key, 8);
    return (unsigned)(mix64(k) % HOLD_BUCKETS);
}

/* Under l->lock: the hold of `key`, unlinked (NULL: none). */
static hold *take_hold(lane *l, const unsigned char key[16]) {
    hold **at = &l->buckets[bucket_of(key)];
    for (; *at != NULL; at = &(*at)->next) {
        if (memcmp((*at)->key, key, 16) == 0) {
            hold *h = *at;
            *at = h->next;
            h->next = NULL;
            l->holds--;
            return h;
        }
    }
    return NULL;
}

/* Under l->lock: `h` back in the table (an ask that could not use it). */
static void put_hold(lane *l, hold *h) {
    unsigned b = bucket_of(h->key);
    h->next = l->buckets[b];
    l->buckets[b] = h;
    l->holds++;
}

static void post_done(lane *l, const unsigned char key[16], int status, int64_t nbytes, double seconds,
                      uint64_t pair, int64_t first, int64_t count) {
    done_entry *e = calloc(1, sizeof *e);
    pthread_mutex_lock(&l->lock);
    if (e != NULL) {
        memcpy(e->key, key, 16);
        e->status = status;
        e->nbytes = nbytes;
        e->seconds = seconds;
        e->pair = pair;
        e->first = first;
        e->count = count;
        if (l->done_tail != NULL) {
            l->done_tail->next = e;
        } else {
            l->done_head = e;
        }
        l->done_tail = e;
    }
    pthread_mutex_unlock(&l->lock);
    uint64_t one = 1;
    ssize_t written;
    do {
        written = write(l->done_fd, &one, sizeof one);
    } while (written < 0 && errno == EINTR);
}

static void put_u32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put_u64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get_u32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static void answer(int fd, int status, uint64_t ask_id, uint64_t token, uint64_t placement, uint64_t content,
                   uint64_t reference, uint64_t flags, int64_t nbytes) {
    unsigned char out[ANSWER_NBYTES];
    put_u32(out, ANSWER_MAGIC);
    put_u32(out + 4, (uint32_t)status);
    put_u64(out + 8, ask_id);
    put_u64(out + 16, token);
    put_u64(out + 24, placement);
    put_u64(out + 32, content);
    put_u64(out + 40, reference);
    put_u64(out + 48, flags);
    put_u64(out + 56, (uint64_t)nbytes);
    /* A decode engine that does not read its answers loses them, not this thread's time. */
    (void)send(fd, out, sizeof out, MSG_DONTWAIT | MSG_NOSIGNAL);
}

/* A clock's time in seconds. */
static double clock_s(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Every thread has left the ask's copy (its claim let go): answer, report, let go. */
static void ask_over(job *j) {
    ask_ctx *c = j->owner;
    int complete = __atomic_load_n(&j->ops_done, __ATOMIC_ACQUIRE) == j->count;
    uint64_t placement = __atomic_load_n(&j->placement, __ATOMIC_ACQUIRE);
    uint64_t content = __atomic_load_n(&j->content, __ATOMIC_ACQUIRE);
    answer(c->answer_fd, complete ? LANE_DONE : LANE_FAILED, c->ask_id, c->token, placement, content,
           c->reference, (uint64_t)c->has_reference, c->nbytes);
    post_done(c->lane, c->hold->key, complete ? LANE_DONE : LANE_FAILED, c->nbytes, clock_s(CLOCK_MONOTONIC) - c->started,
              c->pair->incarnation, c->first, c->count);
    close(c->answer_fd);
    hold_free(c->hold);
    pair_unref(c->pair);
    lane_unref(c->lane);
    j->owner = NULL;
    free(c);
}

/* The content digest the writer's held sums give the ask's stretches (kvray._plan.held_digest):
 * 0 with *ok = 0 where a sum is not held. */
static uint64_t held_reference(const pair *p, const hold *h, int64_t first, const int64_t *remote, int64_t n,
                               int *ok) {
    uint64_t total = 0;
    *ok = 0;
    if (h->held_rows == 0) {
        return 0;
    }
    for (int64_t r = 0; r < p->num_stretch; r++) {
        const int64_t *s = p->stretch + 6 * r;
        int64_t row = s[0];
        if (row < 0 || row >= h->held_rows) {
            return 0;
        }
        const uint64_t *sums = h->sums + row * h->n;
        const unsigned char *held = h->held + row * h->n;
        for (int64_t i = 0; i < n; i++) {
            int64_t at = first + i;
            if (!held[at]) {
                return 0;
            }
            uint64_t source = (uint64_t)s[2] + (uint64_t)h->ids[at] * (uint64_t)s[3];
            uint64_t target = (uint64_t)s[4] + (uint64_t)remote[i] * (uint64_t)s[5];
            total += sums[at] * (mix64((uint64_t)s[1] ^ (target - source)) | 1);
        }
    }
    *ok = 1;
    return total;
}

static void serve_hold(lane *l, pair *p, int fd, const unsigned char *rec, uint32_t n, hold *h);

static size_t ask_nbytes(uint32_t n) { return ASK_HEADER + 8 * (size_t)n + 8; }

/* One ask that passed its MAC, from connection `fd`, for pair `p` (a reference taken): served
 * now if its hold is here, else parked for it (or answered "not held" where none may wait). */
static void serve_ask(lane *l, pair *p, int fd, const unsigned char *rec, uint32_t n) {
    uint64_t ask_id = load64(rec + 32), token = load64(rec + 40);
    if (load64(rec + 16) != l->incarnation) {
        answer(fd, LANE_STALE, ask_id, token, 0, 0, 0, 0, 0);
        pair_unref(p);
        return;
    }
    pthread_mutex_lock(&l->lock);
    hold *h = take_hold(l, rec + 56);
    pthread_mutex_unlock(&l->lock);
    parked *w = NULL;
    if (h == NULL && l->park_s > 0 && (w = malloc(sizeof *w + ask_nbytes(n))) != NULL) {
        w->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        w->pair = p;
        w->n = n;
        w->settled = 0;
        w->deadline = clock_s(CLOCK_MONOTONIC) + l->park_s;
        memcpy(w->rec, rec, ask_nbytes(n));
        /* The hold may have come since it was looked for: looked for again under the lock that
         * `hold` takes to see whether anything waits (so no wake is lost). */
        pthread_mutex_lock(&l->lock);
        h = take_hold(l, rec + 56);
        int parks = h == NULL && w->fd >= 0 && l->num_parked < MAX_PARKED;
        if (parks) {
            w->next = l->parked;
            l->parked = w;
            l->num_parked++;
        }
        pthread_mutex_unlock(&l->lock);
        if (parks) {
            return;
        }
        if (w->fd >= 0) {
            close(w->fd);
        }
        free(w);
    }
    if (h == NULL) {
        answer(fd, LANE_NOT_HELD, ask_id, token, 0, 0, 0, 0, 0);
        pair_unref(p);
        return;
    }
    serve_hold(l, p, fd, rec, n, h);
}

/* The lane thread looks at its parked asks again (and at whether it stops). */
static void wake(lane *l) {
    uint64_t one = 1;
    (void)!write(l->wake_fd, &one, sizeof one);
}

/* The lane thread's turn over parked asks: each whose hold came is served, each settled or
 * past its deadline (or every one, when `all`) answered "not held". Returns the epoll timeout
 * until the next deadline (-1: none waits). */
static int serve_parked(lane *l, int all) {
    double now = clock_s(CLOCK_MONOTONIC);
    parked *ready = NULL, *over = NULL;
    hold *holds = NULL;
    int timeout = -1;
    pthread_mutex_lock(&l->lock);
    for (parked **at = &l->parked; *at != NULL;) {
        parked *w = *at;
        hold *h = all || w->settled == 2 ? NULL : take_hold(l, w->rec + 56);
        if (h != NULL || all || w->settled || now >= w->deadline) {
            *at = w->next;
            l->num_parked--;
            if (h != NULL) {
                h->next = holds;
                holds = h;
                w->next = ready;
                ready = w;
            } else {
                w->next = over;
                over = w;
            }
            continue;
        }
        int ms = (int)(1e3 * (w->deadline - now)) + 1;
        timeout = timeout < 0 || ms < timeout ? ms : timeout;
        at = &w->next;
    }
    pthread_mutex_unlock(&l->lock);
    while (ready != NULL) {
        parked *w = ready;
        hold *h = holds;
        ready = w->next;
        holds = h->next;
        h->next = NULL;
        serve_hold(l, w->pair, w->fd, w->rec, w->n, h);
        close(w->fd);
        free(w);
    }
    while (over != NULL) {
        parked *w = over;
        over = w->next;
        answer(w->fd, LANE_NOT_HELD, load64(w->rec + 32), load64(w->rec + 40), 0, 0, 0, 0, 0);
        pair_unref(w->pair);
        close(w->fd);
        free(w);
    }
    return timeout;
}

/* What an ask's copy keeps until it is answered, its answer going to a descriptor of its own
 * (NULL: out of memory or descriptors). The caller takes a reference of the lane once the copy
 * starts. */
static ask_ctx *new_ask(lane *l, pair *p, hold *h, int fd, uint64_t ask_id, uint64_t token, uint64_t reference,
                        int has_reference, int64_t nbytes, uint32_t first, uint32_t n, double started) {
    ask_ctx *c = calloc(1, sizeof *c);
    int answer_fd = c == NULL ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (answer_fd < 0) {
        free(c);
        return NULL;
    }
    c->lane = l;
    c->pair = p;
    c->hold = h;
    c->answer_fd = answer_fd;
    c->ask_id = ask_id;
    c->token = token;
    c->reference = reference;
    c->has_reference = has_reference;
    c->nbytes = nbytes;
    c->first = first;
    c->count = n;
    c->started = started;
    return c;
}

/* ---- a lane of GPU caches ---------------------------------------------------------------- */

/* The free captured copy of the smallest size that fits `n` block pairs, taken (NULL: the pair
 * has none that large, or none came free within GRAPH_WAIT_S). */
static lane_graph *take_graph(lane *l, pair *p, int64_t n) {
    int64_t fits = -1;
    for (int i = 0; i < p->num_graphs; i++) {
        int64_t c = p->graphs[i].capacity;
        if (c >= n && (fits < 0 || c < fits)) {
            fits = c;
        }
    }
    if (fits < 0) {
        return NULL;
    }
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)GRAPH_WAIT_S;
    lane_graph *taken = NULL;
    pthread_mutex_lock(&l->lock);
    while (taken == NULL && !__atomic_load_n(&l->stopping, __ATOMIC_ACQUIRE)) {
        for (int i = 0; i < p->num_graphs && taken == NULL; i++) {
            if (p->graphs[i].capacity == fits && !p->graphs[i].busy) {
                taken = &p->graphs[i];
                taken->busy = 1;
            }
        }
        if (taken == NULL && pthread_cond_timedwait(&l->graph_free, &l->lock, &until) == ETIMEDOUT) {
            break;
        }
    }
    pthread_mutex_unlock(&l->lock);
    return taken;
}

static void give_graph(lane *l, lane_graph *g) {
    pthread_mutex_lock(&l->lock);
    g->busy = 0;
    pthread_cond_broadcast(&l->graph_free);
    pthread_mutex_unlock(&l->lock);
}

/* A GPU pair's copy of the hold's `n` blocks from `first` into `remote` (ids and reference
 * checked): every op checked against both regions, the request's claim slot taken, the ids put
 * into a free captured copy's staging, which is launched after the hold's `ready` on the pair's
 * stream; the finisher answers once it is done. -1: launched; else the answer (nothing written,
 * the hold to be put back). */
static int serve_cuda(lane *l, pair *p, int fd, hold *h, uint32_t first, uint32_t n, const int64_t *remote,
                      uint64_t ask_id, uint64_t token, uint64_t slot, uint64_t reference, int has_reference,
                      double started) {
    int64_t ops = 0, nbytes = 0, bad_row = -1, bad_pair = -1;
    if (kvray_rows_check(p->rows, p->num_rows, h->ids + first, remote, (int64_t)n, l->src_len, p->dst_len,
                         (int64_t)1 << 40, &ops, &nbytes, &bad_row, &bad_pair) != 0) {
        return LANE_REFUSED;
    }
    lane_graph *g = take_graph(l, p, (int64_t)n);
    if (g == NULL) {
        return LANE_BUSY;
    }
    int claim_fd = -1;
    int claimed = kvray_claim_take(p->board_fd, (int64_t)slot, p->board_slots, p->board, token, &claim_fd);
    if (claimed != 0) {
        give_graph(l, g);
        return claimed == 1 ? LANE_CLOSING : claimed == 2 ? LANE_NOT_OPEN : LANE_BUSY;
    }
    ask_ctx *c = new_ask(l, p, h, fd, ask_id, token, reference, has_reference, nbytes, first, n, started);
    if (c == NULL) {
        kvray_claim_let_go(claim_fd, (int64_t)slot);
        give_graph(l, g);
        return LANE_BUSY;
    }
    int64_t *staging = g->staging, capacity = g->capacity;
    staging[0] = n;
    memcpy(staging + 1, h->ids + first, 8 * (size_t)n);
    memcpy(staging + 1 + capacity, remote, 8 * (size_t)n);
    if (kvray_executor_fault() && n >= 2) {
        staging[capacity + n] = staging[capacity + n - 1]; /* faults only: the last pair stores over the one before */
    }
    /* Published before the launch: the copy reads the staging from host memory as it runs. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    const cuda_calls *cu = &l->cu;
    int failed = cu->ctx_set_current(p->ctx) != 0 ||
                 (h->ready != NULL && cu->stream_wait_event(p->stream, h->ready, 0) != 0) ||
                 cu->event_record(g->produced, p->stream) != 0 || cu->graph_launch(g->exec, p->stream) != 0;
    if (failed) {
        /* Nothing was launched (a launch that fails queues nothing): nothing was written. */
        close(c->answer_fd);
        free(c);
        kvray_claim_let_go(claim_fd, (int64_t)slot);
        give_graph(l, g);
        return LANE_BUSY;
    }
    c->graph = g;
    c->claim_fd = claim_fd;
    c->slot = (int64_t)slot;
    __atomic_add_fetch(&l->refs, 1, __ATOMIC_ACQ_REL);
    pthread_mutex_lock(&l->lock);
    if (l->cuda_tail != NULL) {
        l->cuda_tail->next = c;
    } else {
        l->cuda_head = c;
    }
    l->cuda_tail = c;
    pthread_cond_signal(&l->cuda_wake);
    pthread_mutex_unlock(&l->lock);
    return -1;
}

/* The finisher: each launched copy in turn, once done (or failed: the device's error ends it,
 * and nothing of it runs after), lets go of its claim, then of its captured copy, and is
 * answered with the digests its fold left. Stops once told to and nothing is left to wait for. */
static void *finisher_thread(void *arg) {
    lane *l = arg;
    pthread_setname_np(pthread_self(), "kvray-lane-gpu");
    for (;;) {
        pthread_mutex_lock(&l->lock);
        while (l->cuda_head == NULL && !l->finisher_stop) {
            pthread_cond_wait(&l->cuda_wake, &l->lock);
        }
        ask_ctx *c = l->cuda_head;
        if (c != NULL) {
            l->cuda_head = c->next;
            if (l->cuda_head == NULL) {
                l->cuda_tail = NULL;
            }
        }
        pthread_mutex_unlock(&l->lock);
        if (c == NULL) {
            break;
        }
        const cuda_calls *cu = &l->cu;
        lane_graph *g = c->graph;
        int complete = cu->ctx_set_current(c->pair->ctx) == 0 && cu->event_synchronize(g->done) == 0;
        uint64_t content = g->cell[0], placement = g->cell[1];
        kvray_claim_let_go(c->claim_fd, c->slot);
        give_graph(l, g);
        answer(c->answer_fd, complete ? LANE_DONE : LANE_FAILED, c->ask_id, c->token, complete ? placement : 0,
               complete ? content : 0, c->reference, (uint64_t)c->has_reference, c->nbytes);
        post_done(l, c->hold->key, complete ? LANE_DONE : LANE_FAILED, c->nbytes,
                  clock_s(CLOCK_MONOTONIC) - c->started, c->pair->incarnation, c->first, c->count);
        close(c->answer_fd);
        hold_free(c->hold);
        pair_unref(c->pair);
        lane_unref(c->lane);
        free(c);
    }
    return NULL;
}

/* An ask for pair `p` (a reference, handed on) with its hold `h` taken (its push is timed from
 * here: a wait for the hold is the prefill engine's step, not the push). */
static void serve_hold(lane *l, pair *p, int fd, const unsigned char *rec, uint32_t n, hold *h) {
    uint32_t first = get_u32(rec + 12);
    uint64_t ask_id = load64(rec + 32), token = load64(rec + 40), slot = load64(rec + 48);
    const int64_t *remote = (const int64_t *)(rec + ASK_HEADER);
    double started = clock_s(CLOCK_MONOTONIC);
    int status = LANE_REFUSED;
    job *j = NULL;
    /* The decode engine's ids: as many as the hold has from `first`, each in its pool, none
     * twice (the bitmap is this thread's alone, cleared again below). */
    if ((int64_t)first + (int64_t)n > h->n || n == 0) {
        goto give_back;
    }
    uint32_t checked_ids = 0;
    for (; checked_ids < n; checked_ids++) {
        int64_t b = remote[checked_ids];
        if (b < 0 || b >= p->dst_pool || (p->seen[b >> 3] >> (b & 7)) & 1) {
            break;
        }
        p->seen[b >> 3] |= (unsigned char)(1u << (b & 7));
    }
    for (uint32_t i = 0; i < checked_ids; i++) {
        p->seen[remote[i] >> 3] = 0;
    }
    if (checked_ids != n) {
        goto give_back;
    }
    int has_reference = 0;
    uint64_t reference = 0;
    int checked = p->checked || (get_u32(rec + 4) >> 16) & 1;
    if (checked) {
        reference = held_reference(p, h, first, remote, n, &has_reference);
        if (!has_reference) {
            status = LANE_UNCHECKED;
            goto give_back;
        }
    }
    if (p->cuda) {
        status = serve_cuda(l, p, fd, h, first, n, remote, ask_id, token, slot, reference, has_reference, started);
        if (status < 0) {
            return; /* launched: the finisher answers */
        }
        goto give_back;
    }
    /* Every op inside both regions before a byte moves (the decode block ids came from the
     * record, checked above; the hold's own ids were checked when it was held). */
    int64_t nbytes = 0, bad_row = -1, bad_pair = -1;
    j = kvray_rows_job(p->rows, p->num_rows, h->ids + first, remote, (int64_t)n, l->src_len, p->dst_len, l->piece,
                       &nbytes, &bad_row, &bad_pair);
    if (j == NULL) {
        status = bad_row < 0 ? LANE_BUSY : LANE_REFUSED;
        goto give_back;
    }
    j->salt = p->salt;
    j->content_on = checked;
    j->seed = p->seed;
    j->pair_salt = p->pair_salt;
    j->dst = p->dst;
    j->src = l->src;
    j->faulty = kvray_executor_fault() && j->count >= 2;
    struct stat file;
    if (fstat(p->file_fd, &file) != 0 || file.st_nlink == 0 || file.st_size < p->file_end) {
        status = LANE_GONE;
        goto give_back;
    }
    int claimed = kvray_job_claim(j, p->board_fd, (int64_t)slot, p->board_slots, p->board, token);
    if (claimed != 0) {
        status = claimed == 1 ? LANE_CLOSING : claimed == 2 ? LANE_NOT_OPEN : LANE_BUSY;
        goto give_back;
    }
    ask_ctx *c = new_ask(l, p, h, fd, ask_id, token, reference, has_reference, nbytes, first, n, started);
    if (c == NULL) {
        status = LANE_BUSY;
        goto give_back;
    }
    __atomic_add_fetch(&l->refs, 1, __ATOMIC_ACQ_REL);
    j->owner = c;
    j->on_over = ask_over;
    int failed = kvray_job_run(j, nbytes <= l->inline_max ? 0 : l->threads);
    if (failed) {
        /* The job (and its claim) is gone, ask_over never ran: nothing was written. */
        close(c->answer_fd);
        free(c);
        lane_unref(l);
        j = NULL;
        status = LANE_BUSY;
        goto give_back;
    }
    return;
give_back:
    if (j != NULL) {
        kvray_job_unref(j); /* frees it (a claim it failed to take is let go already) */
    }
    /* Nothing was written: the hold stays for an ask that fits it, or for its lease to end. */
    pthread_mutex_lock(&l->lock);
    put_hold(l, h);
    pthread_mutex_unlock(&l->lock);
    answer(fd, status, ask_id, token, 0, 0, 0, 0, 0);
    pair_unref(p);
}

/* Under nothing: the pair a record names, a reference taken (NULL: none). */
static pair *find_pair(lane *l, uint64_t incarnation) {
    pthread_mutex_lock(&l->lock);
    pair *p = l->pairs;
    while (p != NULL && p->incarnation != incarnation) {
        p = p->next;
    }
    if (p != NULL) {
        __atomic_add_fetch(&p->refs, 1, __ATOMIC_ACQ_REL);
    }
    pthread_mutex_unlock(&l->lock);
    return p;
}

/* One record from connection `c`: 0 to keep the connection, -1 to close it (malformed, or a
 * MAC that fails: unanswered). */
static int take_record(lane *l, conn *c, const unsigned char *rec, ssize_t len) {
    if (len < ASK_HEADER + 8 || get_u32(rec) != ASK_MAGIC || (get_u32(rec + 4) & 0xffffu) != LANE_VERSION) {
        return -1;
    }
    uint32_t n = get_u32(rec + 8);
    if (n > ASK_MAX_IDS || (ssize_t)(ASK_HEADER + 8 * (size_t)n + 8) != len) {
        return -1;
    }
    uint64_t decode = load64(rec + 24);
    if (c->pair != 0 && c->pair != decode) {
        return -1;
    }
    pair *p = find_pair(l, decode);
    if (p == NULL) {
        answer(c->fd, LANE_UNKNOWN_PAIR, load64(rec + 32), load64(rec + 40), 0, 0, 0, 0, 0);
        return 0;
    }
    if (siphash24(p->key, rec, (size_t)len - 8) != load64(rec + len - 8)) {
        pair_unref(p);
        return -1;
    }
    c->pair = decode;
    serve_ask(l, p, c->fd, rec, n);
    return 0;
}

static void *lane_thread(void *arg) {
    lane *l = arg;
    pthread_setname_np(pthread_self(), "kvray-lane");
    conn *conns = calloc(MAX_CONNECTIONS, sizeof *conns);
    unsigned char *rec = malloc(ASK_MAX + 1);
    if (conns == NULL || rec == NULL) {
        free(conns);
        free(rec);
        return NULL;
    }
    for (int i = 0; i < MAX_CONNECTIONS; i++) {
        conns[i].fd = -1;
    }
    struct epoll_event events[64];
    int timeout = -1; /* until the next parked ask's deadline */
    while (!__atomic_load_n(&l->stopping, __ATOMIC_ACQUIRE)) {
        int ready = epoll_wait(l->epoll_fd, events, 64, timeout);
        if (ready < 0) {
            if (errno == EINTR) {
                continue;
            }
            break;
        }
        for (int e = 0; e < ready; e++) {
            int64_t tag = (int64_t)events[e].data.u64;
            if (tag == -1) {
                uint64_t count;
                (void)!read(l->wake_fd, &count, sizeof count);
                continue; /* the wake: stopping, or a hold that parked asks may wait for */
            }
            if (tag == -2) {
                for (;;) {
                    int fd = accept4(l->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                    if (fd < 0) {
                        break;
                    }
                    int slot = 0;
                    while (slot < MAX_CONNECTIONS && conns[slot].fd >= 0) {
                        slot++;
                    }
                    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.u64 = (uint64_t)slot};
                    if (slot == MAX_CONNECTIONS || epoll_ctl(l->epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
                        close(fd);
                        continue;
                    }
                    conns[slot].fd = fd;
                    conns[slot].pair = 0;
                }
                continue;
            }
            conn *c = &conns[tag];
            int keep = c->fd >= 0;
            while (keep) {
                ssize_t got = recv(c->fd, rec, ASK_MAX + 1, MSG_DONTWAIT);
                if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                    break;
                }
                if (got < 0 && errno == EINTR) {
                    continue;
                }
                keep = got > 0 && take_record(l, c, rec, got) == 0;
            }
            if (!keep && c->fd >= 0) {
                epoll_ctl(l->epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
                close(c->fd);
                c->fd = -1;
            }
        }
        timeout = serve_parked(l, 0);
    }
    serve_parked(l, 1); /* the lane stops: whatever waits goes the usual way */
    for (int i = 0; i < MAX_CONNECTIONS; i++) {
        if (conns[i].fd >= 0) {
            close(conns[i].fd);
        }
    }
    free(conns);
    free(rec);
    return NULL;
}

/* ---- holds whose sums the lane takes -------------------------------------------------------- */

/* Every hash row of every block of `h`, from the source region as it is now: a sum only where
 * the row lies inside the region (else it stays not held, and a checked ask is "unchecked"). */
static void hash_hold(lane *l, hold *h) {
    const int64_t *held_row = l->hash_rows, *start = held_row + l->num_hash_rows;
    const int64_t *stride = start + l->num_hash_rows, *nbytes = stride + l->num_hash_rows;
    for (int64_t r = 0; r < l->num_hash_rows; r++) {
        for (int64_t i = 0; i < h->n; i++) {
            int64_t at, end;
            if (__builtin_mul_overflow(h->ids[i], stride[r], &at) || __builtin_add_overflow(at, start[r], &at) ||
                __builtin_add_overflow(at, nbytes[r], &end) || at < 0 || end > l->src_len) {
                continue;
            }
            int64_t slot = held_row[r] * h->n + i;
            h->sums[slot] = kvray_hash_range(l->src, at, nbytes[r], l->hash_seed);
            h->held[slot] = 1;
        }
    }
}

static void *hasher_thread(void *arg) {
    lane *l = arg;
    pthread_setname_np(pthread_self(), "kvray-lane-hash");
    for (;;) {
        pthread_mutex_lock(&l->lock);
        while (l->hash_head == NULL && !l->hasher_stop) {
            pthread_cond_wait(&l->hash_wake, &l->lock);
        }
        hold *h = l->hash_head;
        if (h == NULL) {
            pthread_mutex_unlock(&l->lock);
            break;
        }
        l->hash_head = h->next;
        if (l->hash_head == NULL) {
            l->hash_tail = NULL;
        }
        h->next = NULL;
        int stopping = l->hasher_stop;
        l->hashing_now = h;
        pthread_mutex_unlock(&l->lock);
        if (!stopping) {
            hash_hold(l, h);
        }
        pthread_mutex_lock(&l->lock);
        l->hashing_now = NULL;
        l->hashing--;
        int keep = !h->dropped && !stopping && l->holds < MAX_HOLDS;
        if (keep) {
            put_hold(l, h);
        }
        int waited = l->parked != NULL;
        pthread_mutex_unlock(&l->lock);
        if (!keep) {
            hold_free(h);
        } else if (waited) {
            wake(l); /* an ask may wait for it */
        }
    }
    return NULL;
}

/* Under l->lock: whether `key` is held, queued for its sums or being hashed (not let go of). */
static int knows_key(lane *l, const unsigned char key[16]) {
    for (hold *q = l->buckets[bucket_of(key)]; q != NULL; q = q->next) {
        if (memcmp(q->key, key, 16) == 0) {
            return 1;
        }
    }
    for (hold *q = l->hash_head; q != NULL; q = q->next) {
        if (memcmp(q->key, key, 16) == 0) {
            return 1;
        }
    }
    return l->hashing_now != NULL && !l->hashing_now->dropped && memcmp(l->hashing_now->key, key, 16) == 0;
}

/* Under l->lock: let go of `key`'s hold while its sums are taken: 1 if it was queued or being
 * hashed. */
static int drop_hashing(lane *l, const unsigned char key[16]) {
    for (hold **at = &l->hash_head, *prev = NULL; *at != NULL; prev = *at, at = &(*at)->next) {
        if (memcmp((*at)->key, key, 16) == 0) {
            hold *h = *at;
            *at = h->next;
            if (l->hash_tail == h) {
                l->hash_tail = prev;
            }
            l->hashing--;
            h->next = NULL;
            hold_free(h);
            return 1;
        }
    }
    if (l->hashing_now != NULL && !l->hashing_now->dropped && memcmp(l->hashing_now->key, key, 16) == 0) {
        l->hashing_now->dropped = 1;
        return 1;
    }
    return 0;
}

/* ---- the Lane object ---------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD lane *lane;
} Lane;

static void lane_unref(lane *l) {
    if (__atomic_sub_fetch(&l->refs, 1, __ATOMIC_ACQ_REL) != 0) {
        return;
    }
    for (int b = 0; b < HOLD_BUCKETS; b++) {
        while (l->buckets[b] != NULL) {
            hold *h = l->buckets[b];
            l->buckets[b] = h->next;
            hold_free(h);
        }
    }
    while (l->done_head != NULL) {
        done_entry *e = l->done_head;
        l->done_head = e->next;
        free(e);
    }
    close(l->done_fd);
    free(l->hash_rows);
    pthread_cond_destroy(&l->graph_free);
    pthread_cond_destroy(&l->cuda_wake);
    pthread_cond_destroy(&l->hash_wake);
    pthread_mutex_destroy(&l->lock);
    free(l);
}

/* Tell a worker thread of the lane (the finisher, the hasher) to stop, and wait for it. */
static void stop_worker(lane *l, int *stop, pthread_cond_t *wake, pthread_t thread) {
    pthread_mutex_lock(&l->lock);
    *stop = 1;
    pthread_cond_signal(wake);
    pthread_mutex_unlock(&l->lock);
    pthread_join(thread, NULL);
}

/* Stop the thread and drop every pair (waiting for their copies); idempotent. */
static void lane_stop(lane *l) {
    if (l->started) {
        __atomic_store_n(&l->stopping, 1, __ATOMIC_RELEASE);
        pthread_mutex_lock(&l->lock);
        pthread_cond_broadcast(&l->graph_free); /* an ask waiting for a captured copy gives up */
        pthread_mutex_unlock(&l->lock);
        wake(l);
        pthread_join(l->thread, NULL);
        l->started = 0;
    }
    if (l->hasher_started) {
        /* What waits for its sums is let go of: no ask takes a hold any more. */
        stop_worker(l, &l->hasher_stop, &l->hash_wake, l->hasher);
        l->hasher_started = 0;
    }
    if (l->finisher_started) {
        /* No copy is launched any more: the finisher waits out those launched, then stops. */
        stop_worker(l, &l->finisher_stop, &l->cuda_wake, l->finisher);
        l->finisher_started = 0;
    }
    for (;;) {
        pthread_mutex_lock(&l->lock);
        pair *p = l->pairs;
        if (p != NULL) {
            l->pairs = p->next;
        }
        pthread_mutex_unlock(&l->lock);
        if (p == NULL) {
            break;
        }
        while (__atomic_load_n(&p->refs, __ATOMIC_ACQUIRE) > 1) {
            usleep(100);
        }
        pair_unref(p);
    }
    if (l->epoll_fd >= 0) {
        close(l->epoll_fd);
        close(l->wake_fd);
        close(l->listen_fd);
        l->epoll_fd = l->wake_fd = l->listen_fd = -1;
    }
}

static void Lane_dealloc(Lane *self) {
    if (self->lane != NULL) {
        Py_BEGIN_ALLOW_THREADS
        lane_stop(self->lane);
        Py_END_ALLOW_THREADS
        lane_unref(self->lane);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Lane_init(Lane *self, PyObject *args, PyObject *kwargs) {
    int listen_fd, threads;
    unsigned long long incarnation, src_base;
    long long src_len, src_pool, piece, inline_max;
    double park_s = 0;
    PyObject *cuda = Py_None;
    static char *names[] = {"listen_fd", "incarnation", "src_base", "src_len", "src_pool", "threads", "piece",
                            "inline_max", "park_s", "cuda", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iKKLLiLL|dO", names, &listen_fd, &incarnation, &src_base,
                                     &src_len, &src_pool, &threads, &piece, &inline_max, &park_s, &cuda)) {
        return -1;
    }
    /* cuda: (the driver's calls as CUDA_CALLS addresses, in `cuda_calls` order; the source's
     * context) for a lane of GPU caches. */
    void *calls[CUDA_CALLS] = {0};
    unsigned long long ctx = 0;
    if (cuda != Py_None) {
        PyObject *addresses;
        if (!PyArg_ParseTuple(cuda, "OK", &addresses, &ctx)) {
            return -1;
        }
        PyObject *seq = PySequence_Fast(addresses, "the driver's calls are a sequence of addresses");
        if (seq == NULL) {
            return -1;
        }
        int bad = PySequence_Fast_GET_SIZE(seq) != CUDA_CALLS;
        for (int i = 0; !bad && i < CUDA_CALLS; i++) {
            calls[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(seq, i));
            bad = calls[i] == NULL;
        }
        Py_DECREF(seq);
        if (bad) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "a GPU lane takes %d driver calls, none of them NULL", CUDA_CALLS);
            }
            return -1;
        }
    }
    if (self->lane != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Lane starts once");
        return -1;
    }
    if (threads < 0 || threads > 8 || piece < 1 || src_len < 0 || src_pool < 1 || src_base == 0 || !(park_s >= 0) ||
        park_s > 60) {
        PyErr_SetString(PyExc_ValueError,
                        "a Lane needs 0 to 8 threads, pieces of a byte or more, a source and 0 to 60 s of parking");
        return -1;
    }
    lane *l = calloc(1, sizeof *l);
    if (l == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    pthread_mutex_init(&l->lock, NULL);
    pthread_condattr_t monotonic;
    pthread_condattr_init(&monotonic);
    pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC);
    pthread_cond_init(&l->graph_free, &monotonic);
    pthread_condattr_destroy(&monotonic);
    pthread_cond_init(&l->cuda_wake, NULL);
    pthread_cond_init(&l->hash_wake, NULL);
    if (cuda != Py_None) {
        l->cuda = 1;
        memcpy(&l->cu, calls, sizeof l->cu); /* the struct is CUDA_CALLS function pointers, in order */
        l->ctx = (void *)(uintptr_t)ctx;
    }
    l->refs = 1;
    l->incarnation = incarnation;
    l->src = (char *)(uintptr_t)src_base;
    l->src_len = src_len;
    l->src_pool = src_pool;
    l->threads = threads;
    l->piece = piece;
    l->inline_max = inline_max;
    l->park_s = park_s;
    l->listen_fd = fcntl(listen_fd, F_DUPFD_CLOEXEC, 0);
    l->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    l->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    l->done_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    int flags = l->listen_fd < 0 ? -1 : fcntl(l->listen_fd, F_GETFL);
    struct epoll_event wake = {.events = EPOLLIN, .data.u64 = (uint64_t)-1};
    struct epoll_event listen = {.events = EPOLLIN, .data.u64 = (uint64_t)-2};
    if (l->listen_fd < 0 || l->epoll_fd < 0 || l->wake_fd < 0 || l->done_fd < 0 || flags < 0 ||
        fcntl(l->listen_fd, F_SETFL, flags | O_NONBLOCK) != 0 ||
        epoll_ctl(l->epoll_fd, EPOLL_CTL_ADD, l->wake_fd, &wake) != 0 ||
        epoll_ctl(l->epoll_fd, EPOLL_CTL_ADD, l->listen_fd, &listen) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    int failed = l->cuda ? pthread_create(&l->finisher, NULL, finisher_thread, l) : 0;
    l->finisher_started = l->cuda && !failed;
    if (!failed) {
        failed = pthread_create(&l->thread, NULL, lane_thread, l);
    }
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    if (failed) {
        if (l->finisher_started) {
            stop_worker(l, &l->finisher_stop, &l->cuda_wake, l->finisher);
        }
        errno = failed;
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    l->started = 1;
    self->lane = l;
    return 0;
fail:
    for (int *fd = &l->listen_fd; fd <= &l->done_fd; fd++) {
        if (*fd >= 0) {
            close(*fd);
        }
    }
    pthread_cond_destroy(&l->graph_free);
    pthread_cond_destroy(&l->cuda_wake);
    pthread_cond_destroy(&l->hash_wake);
    pthread_mutex_destroy(&l->lock);
    free(l);
    return -1;
}

static lane *open_lane(Lane *self) {
    if (self->lane == NULL || !self->lane->started) {
        PyErr_SetString(PyExc_RuntimeError, "the lane is closed");
        return NULL;
    }
    return self->lane;
}

/* Copy a buffer of int64 (or uint64) values, `columns` of them a row; NULL with an error. */
static int64_t *take_int64s(PyObject *object, int64_t columns, int64_t *rows_out) {
    Py_buffer view;
    if (PyObject_GetBuffer(object, &view, PyBUF_C_CONTIGUOUS) != 0) {
        return NULL;
    }
    int64_t *copy = NULL;
    if (view.len % (8 * columns) != 0) {
        PyErr_SetString(PyExc_ValueError, "an int64 array of another shape");
    } else if ((copy = malloc(view.len > 0 ? (size_t)view.len : 8)) == NULL) {
        PyErr_NoMemory();
    } else {
        memcpy(copy, view.buf, (size_t)view.len);
        *rows_out = (int64_t)(view.len / (8 * columns));
    }
    PyBuffer_Release(&view);
    return copy;
}

static int take_key(PyObject *object, unsigned char key[16]) {
    char *bytes;
    Py_ssize_t len;
    if (PyBytes_AsStringAndSize(object, &bytes, &len) != 0) {
        return -1;
    }
    if (len != 16) {
        PyErr_SetString(PyExc_ValueError, "a lane key has 16 bytes");
        return -1;
    }
    memcpy(key, bytes, 16);
    return 0;
}

/* What every pair has, made from its arguments (NULL with an error): the MAC key, the rows and
 * stretches, the decode engine's region and pool, and its claim board. */
static pair *new_pair(PyObject *key, long long dst_len, long long dst_pool, PyObject *rows, PyObject *stretch,
                      int board_fd, long long board_slots, unsigned long long board_addr) {
    if (dst_len < 0 || dst_pool < 1 || dst_pool > (1LL << 26) || board_slots < 1 || board_addr == 0) {
        PyErr_SetString(PyExc_ValueError, "a lane pair needs a region, a pool of 1 to 2**26 blocks and a board");
        return NULL;
    }
    pair *p = calloc(1, sizeof *p);
    if (p == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    p->board_fd = -1;
    p->file_fd = -1;
    p->refs = 1;
    if (take_key(key, p->key) != 0 || (p->rows = take_int64s(rows, 5, &p->num_rows)) == NULL ||
        (p->stretch = take_int64s(stretch, 1, &p->num_stretch)) == NULL) {
        goto fail;
    }
    if (p->num_stretch % 6 != 0 || p->num_rows == 0) {
        PyErr_SetString(PyExc_ValueError, "a lane pair takes 5 columns of rows and 6 of stretches");
        goto fail;
    }
    p->num_stretch /= 6;
    /* The columns came as 5 x R and 6 x S (column-major): the rows are used column-major, the
     * stretches row by row. */
    int64_t *by_row = malloc((size_t)(p->num_stretch > 0 ? p->num_stretch : 1) * 6 * 8);
    if (by_row == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int64_t r = 0; r < p->num_stretch; r++) {
        for (int k = 0; k < 6; k++) {
            by_row[6 * r + k] = p->stretch[k * p->num_stretch + r];
        }
    }
    free(p->stretch);
    p->stretch = by_row;
    p->seen = calloc((size_t)(dst_pool + 7) / 8, 1);
    p->board_fd = fcntl(board_fd, F_DUPFD_CLOEXEC, 0);
    if (p->seen == NULL || p->board_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    p->dst_len = dst_len;
    p->dst_pool = dst_pool;
    p->board_slots = board_slots;
    p->board = board_addr;
    return p;
fail:
    if (p->board_fd < 0) {
        p->board_fd = open("/dev/null", O_RDONLY | O_CLOEXEC); /* pair_unref closes one */
    }
    pair_unref(p);
    return NULL;
}

/* `p` serves asks of decode incarnation `incarnation` from now on: True, or False (and `p`
 * dropped) where the lane has that incarnation already. */
static PyObject *add_to_lane(lane *l, pair *p, unsigned long long incarnation) {
    p->incarnation = incarnation;
    pthread_mutex_lock(&l->lock);
    int known = 0;
    for (pair *q = l->pairs; q != NULL; q = q->next) {
        known |= q->incarnation == incarnation;
    }
    if (!known) {
        p->next = l->pairs;
        l->pairs = p;
    }
    pthread_mutex_unlock(&l->lock);
    if (known) {
        pair_unref(p);
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *Lane_add_pair(Lane *self, PyObject *args) {
    lane *l = open_lane(self);
    unsigned long long incarnation, dst_base, salt, seed, pair_salt, board_addr;
    long long dst_len, dst_pool, board_slots, file_end;
    int board_fd, file_fd, checked;
    PyObject *key, *rows, *stretch;
    if (l == NULL || !PyArg_ParseTuple(args, "KS(KLLiL)OO(iLK)KKKp", &incarnation, &key, &dst_base, &dst_len,
                                       &dst_pool, &file_fd, &file_end, &rows, &stretch, &board_fd, &board_slots,
                                       &board_addr, &salt, &seed, &pair_salt, &checked)) {
        return NULL;
    }
    if (l->cuda || dst_base == 0) {
        PyErr_SetString(PyExc_ValueError, "a pair of host caches needs a region, in a lane of host caches");
        return NULL;
    }
    pair *p = new_pair(key, dst_len, dst_pool, rows, stretch, board_fd, board_slots, board_addr);
    if (p == NULL) {
        return NULL;
    }
    p->file_fd = fcntl(file_fd, F_DUPFD_CLOEXEC, 0);
    if (p->file_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        pair_unref(p);
        return NULL;
    }
    p->file_end = file_end;
    p->dst = (char *)(uintptr_t)dst_base;
    p->salt = salt;
    p->seed = (uint32_t)seed;
    p->pair_salt = pair_salt;
    p->checked = checked;
    return add_to_lane(l, p, incarnation);
}

static PyObject *Lane_add_cuda_pair(Lane *self, PyObject *args) {
    lane *l = open_lane(self);
    unsigned long long incarnation, ctx, stream, board_addr;
    long long dst_len, dst_pool, board_slots;
    int board_fd, checked;
    PyObject *key, *rows, *stretch, *graphs;
    if (l == NULL || !PyArg_ParseTuple(args, "KS(LLKK)OO(iLK)Op", &incarnation, &key, &dst_len, &dst_pool, &ctx,
                                       &stream, &rows, &stretch, &board_fd, &board_slots, &board_addr, &graphs,
                                       &checked)) {
        return NULL;
    }
    if (!l->cuda || ctx == 0) {
        PyErr_SetString(PyExc_ValueError, "a pair of GPU caches needs a context, in a lane of GPU caches");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(graphs, "a GPU pair takes a sequence of captured copies");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    pair *p = NULL;
    if (count < 1 || count > 256) {
        PyErr_SetString(PyExc_ValueError, "a GPU pair takes 1 to 256 captured copies");
        goto fail;
    }
    p = new_pair(key, dst_len, dst_pool, rows, stretch, board_fd, board_slots, board_addr);
    if (p == NULL || (p->graphs = calloc((size_t)count, sizeof *p->graphs)) == NULL) {
        if (p != NULL) {
            PyErr_NoMemory();
        }
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        long long capacity;
        unsigned long long exec, staging, produced, done, cell;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "LKKKKK", &capacity, &exec, &staging, &produced,
                              &done, &cell)) {
            goto fail;
        }
        if (capacity < 1 || capacity > ASK_MAX_IDS * 2LL || exec == 0 || staging == 0 || produced == 0 || done == 0 ||
            cell == 0) {
            PyErr_SetString(PyExc_ValueError, "a captured copy needs a size, a graph, staging, two events and a cell");
            goto fail;
        }
        lane_graph *g = &p->graphs[i];
        g->capacity = capacity;
        g->exec = (void *)(uintptr_t)exec;
        g->staging = (int64_t *)(uintptr_t)staging;
        g->produced = (void *)(uintptr_t)produced;
        g->done = (void *)(uintptr_t)done;
        g->cell = (const volatile uint64_t *)(uintptr_t)cell;
    }
    Py_DECREF(seq);
    p->num_graphs = (int)count;
    p->cuda = 1;
    p->ctx = (void *)(uintptr_t)ctx;
    p->stream = (void *)(uintptr_t)stream;
    p->checked = checked;
    return add_to_lane(l, p, incarnation);
fail:
    Py_DECREF(seq);
    if (p != NULL) {
        pair_unref(p);
    }
    return NULL;
}

static PyObject *Lane_remove_pair(Lane *self, PyObject *arg) {
    lane *l = self->lane;
    unsigned long long incarnation = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (l == NULL) {
        Py_RETURN_FALSE;
    }
    pthread_mutex_lock(&l->lock);
    pair **at = &l->pairs, *p = NULL;
    for (; *at != NULL; at = &(*at)->next) {
        if ((*at)->incarnation == incarnation) {
            p = *at;
            *at = p->next;
            break;
        }
    }
    int waited = 0;
    for (parked *w = l->parked; p != NULL && w != NULL; w = w->next) {
        if (w->pair == p) {
            w->settled = 2; /* answered at once, not served: the pair is going */
            waited = 1;
        }
    }
    pthread_mutex_unlock(&l->lock);
    if (p == NULL) {
        Py_RETURN_FALSE;
    }
    if (waited) {
        wake(l);
    }
    /* Copies into the pair's region are bounded: wait them out before its memory may go. */
    Py_BEGIN_ALLOW_THREADS
    while (__atomic_load_n(&p->refs, __ATOMIC_ACQUIRE) > 1) {
        usleep(50);
    }
    Py_END_ALLOW_THREADS
    pair_unref(p);
    Py_RETURN_TRUE;
}

static PyObject *Lane_hold(Lane *self, PyObject *args) {
    lane *l = open_lane(self);
    PyObject *key, *ids, *sums, *held;
    unsigned long long stream = 0;
    int hashed = 0;
    if (l == NULL || !PyArg_ParseTuple(args, "SOOO|Kp", &key, &ids, &sums, &held, &stream, &hashed)) {
        return NULL;
    }
    if (hashed && (l->hash_rows == NULL || sums != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "a hold the lane hashes needs its hash rows, and no sums of its own");
        return NULL;
    }
    hold *h = calloc(1, sizeof *h);
    if (h == NULL) {
        return PyErr_NoMemory();
    }
    if (take_key(key, h->key) != 0 || (h->ids = take_int64s(ids, 1, &h->n)) == NULL) {
        goto fail;
    }
    if (h->n == 0) {
        PyErr_SetString(PyExc_ValueError, "a lane hold has blocks");
        goto fail;
    }
    for (int64_t i = 0; i < h->n; i++) {
        if (h->ids[i] < 0 || h->ids[i] >= l->src_pool) {
            PyErr_Format(PyExc_ValueError, "block %lld is not one of this engine's %lld", (long long)h->ids[i],
                         (long long)l->src_pool);
            goto fail;
        }
    }
    if (hashed) {
        size_t count = (size_t)l->held_rows_total * (size_t)h->n;
        h->sums = calloc(count > 0 ? count : 1, sizeof *h->sums);
        h->held = calloc(count > 0 ? count : 1, 1);
        if (h->sums == NULL || h->held == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        h->held_rows = l->held_rows_total;
    } else if (sums != Py_None) {
        int64_t count = 0;
        h->sums = (uint64_t *)take_int64s(sums, 1, &count);
        if (h->sums == NULL) {
            goto fail;
        }
        Py_buffer flags;
        if (PyObject_GetBuffer(held, &flags, PyBUF_C_CONTIGUOUS) != 0) {
            goto fail;
        }
        if (count % h->n != 0 || flags.len != count) {
            PyBuffer_Release(&flags);
            PyErr_SetString(PyExc_ValueError, "held sums and flags of another shape than the blocks");
            goto fail;
        }
        h->held = malloc((size_t)count > 0 ? (size_t)count : 1);
        if (h->held == NULL) {
            PyBuffer_Release(&flags);
            PyErr_NoMemory();
            goto fail;
        }
        memcpy(h->held, flags.buf, (size_t)count);
        PyBuffer_Release(&flags);
        h->held_rows = count / h->n;
    }
    if (l->cuda) {
        /* A copy of these blocks waits for the work queued on `stream` so far (what wrote them). */
        void *previous, *ready = NULL;
        int failed = l->cu.ctx_push_current(l->ctx);
        if (failed == 0) {
            failed = l->cu.event_create(&ready, CU_EVENT_DISABLE_TIMING);
            if (failed == 0 && (failed = l->cu.event_record(ready, (void *)(uintptr_t)stream)) != 0) {
                (void)l->cu.event_destroy(ready);
            }
            (void)l->cu.ctx_pop_current(&previous);
        }
        if (failed != 0) {
            PyErr_Format(PyExc_OSError, "the CUDA driver failed to record a hold's event (CUresult %d)", failed);
            goto fail;
        }
        h->ready = ready;
        h->ctx = l->ctx;
        h->cu = &l->cu;
    }
    pthread_mutex_lock(&l->lock);
    int known = knows_key(l, h->key);
    int full = l->holds + l->hashing >= MAX_HOLDS;
    if (!known && !full && hashed) {
        /* Asks for it wait (parked) until the hasher has taken its sums. */
        if (l->hash_tail != NULL) {
            l->hash_tail->next = h;
        } else {
            l->hash_head = h;
        }
        l->hash_tail = h;
        l->hashing++;
        pthread_cond_signal(&l->hash_wake);
    } else if (!known && !full) {
        put_hold(l, h);
    }
    int waited = l->parked != NULL && !hashed;
    pthread_mutex_unlock(&l->lock);
    if (known || full) {
        hold_free(h);
        Py_RETURN_FALSE;
    }
    if (waited) {
        wake(l);
    }
    Py_RETURN_TRUE;
fail:
    hold_free(h);
    return NULL;
}

/* The lane, with the 16-byte key `arg` names in `key`: NULL with an error for a bad key, NULL
 * alone once the lane is closed (the call then answers False). */
static lane *keyed(Lane *self, PyObject *arg, unsigned char key[16]) {
    return take_key(arg, key) != 0 ? NULL : self->lane;
}

static PyObject *Lane_unhold(Lane *self, PyObject *arg) {
    unsigned char key[16];
    lane *l = keyed(self, arg, key);
    if (l == NULL) {
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    }
    pthread_mutex_lock(&l->lock);
    hold *h = take_hold(l, key);
    int dropped = h == NULL && drop_hashing(l, key);
    pthread_mutex_unlock(&l->lock);
    hold_free(h);
    return PyBool_FromLong(h != NULL || dropped);
}

static PyObject *Lane_hash_rows(Lane *self, PyObject *args) {
    lane *l = open_lane(self);
    PyObject *rows;
    long long total;
    unsigned int seed;
    if (l == NULL || !PyArg_ParseTuple(args, "OLI", &rows, &total, &seed)) {
        return NULL;
    }
    if (l->cuda || l->hash_rows != NULL) {
        PyErr_SetString(PyExc_ValueError, "a lane of host caches takes its hash rows once");
        return NULL;
    }
    int64_t count = 0;
    int64_t *taken = take_int64s(rows, 4, &count);
    if (taken == NULL) {
        return NULL;
    }
    for (int64_t r = 0; r < count; r++) {
        if (taken[r] < 0 || taken[r] >= total || taken[count + r] < 0 || taken[2 * count + r] < 0 ||
            taken[3 * count + r] < 0) {
            free(taken);
            PyErr_SetString(PyExc_ValueError, "hash rows: a held row of the total, and no negative offset or size");
            return NULL;
        }
    }
    pthread_mutex_lock(&l->lock);
    l->hash_rows = taken;
    l->num_hash_rows = count;
    l->held_rows_total = total;
    l->hash_seed = seed;
    pthread_mutex_unlock(&l->lock);
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    int failed = pthread_create(&l->hasher, NULL, hasher_thread, l);
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    if (failed) {
        errno = failed;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    l->hasher_started = 1;
    Py_RETURN_NONE;
}

static PyObject *Lane_settle(Lane *self, PyObject *arg) {
    unsigned char key[16];
    lane *l = keyed(self, arg, key);
    if (l == NULL) {
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_False);
    }
    int waited = 0;
    pthread_mutex_lock(&l->lock);
    for (parked *w = l->parked; w != NULL; w = w->next) {
        if (memcmp(w->rec + 56, key, 16) == 0) {
            w->settled = w->settled ? w->settled : 1;
            waited = 1;
        }
    }
    pthread_mutex_unlock(&l->lock);
    if (waited) {
        wake(l);
    }
    return PyBool_FromLong(waited);
}

static PyObject *Lane_done(Lane *self, PyObject *unused) {
    (void)unused;
    lane *l = self->lane;
    PyObject *out = PyList_New(0);
    if (out == NULL || l == NULL) {
        return out;
    }
    uint64_t count;
    (void)!read(l->done_fd, &count, sizeof count);
    pthread_mutex_lock(&l->lock);
    done_entry *e = l->done_head;
    l->done_head = l->done_tail = NULL;
    pthread_mutex_unlock(&l->lock);
    while (e != NULL) {
        done_entry *next = e->next;
        PyObject *item = Py_BuildValue("(y#iLdKLL)", (const char *)e->key, (Py_ssize_t)16, e->status,
                                       (long long)e->nbytes, e->seconds, (unsigned long long)e->pair,
                                       (long long)e->first, (long long)e->count);
        if (item == NULL || PyList_Append(out, item) != 0) {
            Py_XDECREF(item);
            Py_CLEAR(out);
        } else {
            Py_DECREF(item);
        }
        free(e);
        e = next;
    }
    return out;
}

static PyObject *Lane_fileno(Lane *self, PyObject *unused) {
    (void)unused;
    lane *l = open_lane(self);
    return l == NULL ? NULL : PyLong_FromLong(l->done_fd);
}

static PyObject *Lane_close(Lane *self, PyObject *unused) {
    (void)unused;
    lane *l = self->lane;
    if (l != NULL) {
        Py_BEGIN_ALLOW_THREADS
        lane_stop(l);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

/* An int64 count of the lane's (at `offset` in it), read under its lock; 0 once closed. */
static PyObject *lane_count(Lane *self, size_t offset) {
    lane *l = self->lane;
    if (l == NULL) {
        return PyLong_FromLong(0);
    }
    pthread_mutex_lock(&l->lock);
    long long count = (long long)*(const int64_t *)((const char *)l + offset);
    pthread_mutex_unlock(&l->lock);
    return PyLong_FromLongLong(count);
}

static PyObject *Lane_parked(Lane *self, void *unused) {
    (void)unused;
    return lane_count(self, offsetof(lane, num_parked));
}

static PyObject *Lane_hashing(Lane *self, void *unused) {
    (void)unused;
    return lane_count(self, offsetof(lane, hashing));
}

static PyObject *Lane_holds(Lane *self, void *unused) {
    (void)unused;
    return lane_count(self, offsetof(lane, holds));
}

static PyMethodDef Lane_methods[] = {
    {"add_pair", (PyCFunction)Lane_add_pair, METH_VARARGS, "A decode engine incarnation this lane pushes into."},
    {"add_cuda_pair", (PyCFunction)Lane_add_cuda_pair, METH_VARARGS,
     "A decode engine incarnation this lane of GPU caches pushes into, by captured copies."},
    {"remove_pair", (PyCFunction)Lane_remove_pair, METH_O, "Forget a pair once no copy into it runs."},
    {"hold", (PyCFunction)Lane_hold, METH_VARARGS, "A request's blocks (and held sums) an ask may take."},
    {"unhold", (PyCFunction)Lane_unhold, METH_O, "Forget a hold; False if an ask took it (or none was)."},
    {"hash_rows", (PyCFunction)Lane_hash_rows, METH_VARARGS,
     "The rows (4 x R: held row, start, block stride, bytes), rows in all and seed of holds the lane hashes."},
    {"settle", (PyCFunction)Lane_settle, METH_O, "Answer the asks waiting for a hold now (False: none)."},
    {"done", (PyCFunction)Lane_done, METH_NOARGS, "The pushes ended since the last call."},
    {"fileno", (PyCFunction)Lane_fileno, METH_NOARGS, "An eventfd, readable when pushes ended."},
    {"close", (PyCFunction)Lane_close, METH_NOARGS, "Stop serving; returns once no copy runs."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Lane_getset[] = {
    {"holds", (getter)Lane_holds, NULL, "How many holds an ask may take now.", NULL},
    {"parked", (getter)Lane_parked, NULL, "How many asks wait for their holds now.", NULL},
    {"hashing", (getter)Lane_hashing, NULL, "How many holds wait for the lane to take their sums.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvray._copy_pool.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A prefill engine's native hand-off lane (see kvray/_lane.c).",
    .tp_dealloc = (destructor)Lane_dealloc,
    .tp_init = (initproc)Lane_init,
    .tp_new = PyType_GenericNew,
    .tp_methods = Lane_methods,
    .tp_getset = Lane_getset,
};

/* ---- the decode side's calls -------------------------------------------------------------- */

static PyObject *lane_ask(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    PyObject *key, *hold_key, *ids;
    unsigned long long prefill, decode, token, slot, ask_id;
    unsigned int first;
    int checked;
    if (!PyArg_ParseTuple(args, "iSKKSKKIKOp", &fd, &key, &prefill, &decode, &hold_key, &token, &slot, &first,
                          &ask_id, &ids, &checked)) {
        return NULL;
    }
    unsigned char mac_key[16], hk[16];
    if (take_key(key, mac_key) != 0 || take_key(hold_key, hk) != 0) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(ids, &view, PyBUF_C_CONTIGUOUS) != 0) {
        return NULL;
    }
    PyObject *result = NULL;
    size_t n = (size_t)view.len / 8;
    if (view.len % 8 != 0 || n == 0 || n > ASK_MAX_IDS) {
        PyErr_Format(PyExc_ValueError, "a lane ask carries 1 to %d int64 block ids", ASK_MAX_IDS);
        goto done;
    }
    size_t len = ASK_HEADER + 8 * n + 8;
    unsigned char *rec = malloc(len);
    if (rec == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    put_u32(rec, ASK_MAGIC);
    put_u32(rec + 4, LANE_VERSION | (checked ? 1u << 16 : 0u));
    put_u32(rec + 8, (uint32_t)n);
    put_u32(rec + 12, first);
    put_u64(rec + 16, prefill);
    put_u64(rec + 24, decode);
    put_u64(rec + 32, ask_id);
    put_u64(rec + 40, token);
    put_u64(rec + 48, slot);
    memcpy(rec + 56, hk, 16);
    memcpy(rec + ASK_HEADER, view.buf, 8 * n);
    put_u64(rec + len - 8, siphash24(mac_key, rec, len - 8));
    ssize_t sent = send(fd, rec, len, MSG_DONTWAIT | MSG_NOSIGNAL);
    int error = errno;
    free(rec);
    if (sent != (ssize_t)len) {
        errno = sent < 0 ? error : EMSGSIZE;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyObject *lane_answers(PyObject *self, PyObject *arg) {
    (void)self;
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    int ended = 0;
    unsigned char in[ANSWER_NBYTES + 1];
    /* When each answer came (the kernel's stamp, where `lane_stamp` asked for one), on the
     * monotonic clock: a read long after the answer does not count as the ask's time. */
    double now = clock_s(CLOCK_MONOTONIC), real = clock_s(CLOCK_REALTIME);
    for (;;) {
        struct iovec iov = {.iov_base = in, .iov_len = sizeof in};
        union {
            struct cmsghdr align;
            char bytes[CMSG_SPACE(sizeof(struct timespec))];
        } control;
        struct msghdr message = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = &control,
                                 .msg_controllen = sizeof control};
        ssize_t got = recvmsg((int)fd, &message, MSG_DONTWAIT);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            break;
        }
        if (got <= 0) {
            ended = 1; /* the prefill engine closed the lane, or is gone */
            break;
        }
        if (got != ANSWER_NBYTES || get_u32(in) != ANSWER_MAGIC) {
            ended = 1; /* not a lane: trust nothing more from it */
            break;
        }
        double arrived = now;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&message); c != NULL; c = CMSG_NXTHDR(&message, c)) {
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS &&
                c->cmsg_len >= CMSG_LEN(sizeof(struct timespec))) {
                struct timespec stamp;
                memcpy(&stamp, CMSG_DATA(c), sizeof stamp);
                double ago = real - ((double)stamp.tv_sec + 1e-9 * (double)stamp.tv_nsec);
                arrived = ago > 0 ? now - ago : now;
            }
        }
        PyObject *item = Py_BuildValue("(KIKKKKKKd)", load64(in + 8), get_u32(in + 4), load64(in + 16), load64(in + 24),
                                       load64(in + 32), load64(in + 40), load64(in + 48), load64(in + 56), arrived);
        if (item == NULL || PyList_Append(out, item) != 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    PyObject *result = Py_BuildValue("(Oi)", out, ended);
    Py_DECREF(out);
    return result;
}

static PyObject *lane_stamp(PyObject *self, PyObject *arg) {
    (void)self;
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int on = 1;
    if (setsockopt((int)fd, SOL_SOCKET, SO_TIMESTAMPNS, &on, sizeof on) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *lane_siphash(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *key;
    Py_buffer data;
    unsigned char k[16];
    if (!PyArg_ParseTuple(args, "Sy*", &key, &data)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (take_key(key, k) == 0) {
        result = PyLong_FromUnsignedLongLong(siphash24(k, data.buf, (size_t)data.len));
    }
    PyBuffer_Release(&data);
    return result;
}

PyMethodDef kvray_lane_functions[] = {
    {"lane_ask", lane_ask, METH_VARARGS, "Send a lane ask (one record, MAC'd) on a connected lane socket."},
    {"lane_answers", lane_answers, METH_O, "Every answer waiting on a lane socket, and whether it ended."},
    {"lane_stamp", lane_stamp, METH_O, "Have the kernel stamp each answer a lane socket receives."},
    {"lane_siphash", lane_siphash, METH_VARARGS, "SipHash-2-4 of bytes under a 16-byte key (tests)."},
    {NULL, NULL, 0, NULL},
};

int kvray_lane_add_types(PyObject *module) {
    if (PyType_Ready(&LaneType) < 0) {
        return -1;
    }
    Py_INCREF(&LaneType);
    if (PyModule_AddObject(module, "Lane", (PyObject *)&LaneType) < 0) {
        Py_DECREF(&LaneType);
        return -1;
    }
    return PyModule_AddFunctions(module, kvray_lane_functions);
}
