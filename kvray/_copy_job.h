/* The copy pool's jobs as the rest of the extension sees them (kvray/_copy_pool.c runs them,
 * kvray/_lane.c starts them from its own thread): every function here runs without the GIL
 * and sets no Python error. */
#ifndef KVRAY_COPY_JOB_H
#define KVRAY_COPY_JOB_H

#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>

#define MAX_POOL_THREADS 8
/* Ops a thread claims at a time: cheap to count, and the next op's source (usually this
 * thread's own) can be prefetched. */
#define CLAIM_OPS 4
/* A decode engine's claim board (kvray/notice/claims.py): slot i is bytes [16 i, 16 i + 16),
 * the request's token then its state (1: open). */
#define CLAIM_SLOT_NBYTES 16
#define CLAIM_OPEN 1

typedef struct {
    int64_t dst;
    int64_t src;
    int64_t nbytes;
    int64_t hsrc; /* the source offset its bytes are hashed at (src unless staged) */
} copy_op;

typedef struct job {
    struct job *next_in_queue;
    char *dst;
    const char *src;
    copy_op *ops;
    int64_t count;
    int64_t next_op;  /* atomic: the claim cursor */
    uint64_t salt;    /* the destination region's, for the placement digest */
    uint64_t placement; /* atomic: the digest of what was stored, added before ops_done */
    int faulty;       /* executor_fault when the job started */
    int content_on;   /* also hash what is copied (content digest) */
    uint32_t seed;    /* the source region's content seed */
    uint64_t pair_salt; /* the (source, destination) regions' salt for destination factors */
    uint64_t content; /* atomic: the content digest of what was copied, added before ops_done */
    int64_t ops_done; /* atomic */
    int tasks_unstarted; /* under pool_lock: threads yet to take the job from the queue */
    int active;       /* atomic: threads not yet out of the job */
    int refs;         /* atomic: the CopyJob object and every thread not yet out */
    int event_fd;
    int notice_fd;    /* -1: no notice */
    struct sockaddr_un notice_addr;
    socklen_t notice_addr_len;
    char *notice;
    size_t notice_len;
    int notice_result; /* atomic: -1 not sent (yet), 0 sent, else the errno of sendto */
    int notice_patch;  /* write the placement digest into the notice's last 8 bytes */
    int inline_copy;   /* copied by the thread that started it (no test hook: it holds the loop) */
    int claim_fd;      /* -1: no claim; else this job's descriptor of the claim board's file */
    int64_t claim_slot; /* the slot whose shared lock the job holds until every byte is in place */
    void (*on_over)(struct job *); /* called once every thread has left (the claim let go first) */
    void *owner;      /* what on_over needs (a lane's ask) */
} job;

/* A job with room for `count` ops and nothing else yet; NULL when out of memory. */
job *kvray_job_new(int64_t count);
/* Append a copy of `nbytes` from `src` to `dst` (hashed at source offset `hsrc`) in pieces of
 * at most `piece` bytes at op index `op`; the next free index. */
int64_t kvray_job_add(job *j, int64_t op, int64_t dst, int64_t src, int64_t hsrc, int64_t nbytes, int64_t piece);
/* A job copying, for every (row, block pair), a row's bytes of block local[i] to block remote[i]
 * (`rows`: 5 columns of `num_rows`, source start and stride, destination start and stride,
 * bytes), runs continuing each other at both ends merged, in pieces of at most `piece` bytes;
 * every op checked against both regions' lengths first. NULL: *bad_row and *bad_pair say which
 * op leaves a region (*bad_pair -1: the row has a negative length; both -1: out of memory).
 * `nbytes` (may be NULL) gets the bytes it copies. */
job *kvray_rows_job(const int64_t *rows, int64_t num_rows, const int64_t *local, const int64_t *remote, int64_t n,
                    int64_t src_len, int64_t dst_len, int64_t piece, int64_t *nbytes, int64_t *bad_row,
                    int64_t *bad_pair);
/* Check, without building a job, what `kvray_rows_job` checks: 0 with *ops (pieces of `piece`)
 * and *nbytes (may be NULL), else -1 with *bad_row and *bad_pair as there. */
int kvray_rows_check(const int64_t *rows, int64_t num_rows, const int64_t *local, const int64_t *remote, int64_t n,
                     int64_t src_len, int64_t dst_len, int64_t piece, int64_t *ops, int64_t *nbytes, int64_t *bad_row,
                     int64_t *bad_pair);
/* `kvray_job_claim` for a copy that is not a job (a lane's GPU copy): the lock is held through
 * *claim_fd, a descriptor of the caller's, until `kvray_claim_let_go` (which closes it). */
int kvray_claim_take(int fd, int64_t slot, int64_t slots, uint64_t board, uint64_t token, int *claim_fd);
void kvray_claim_let_go(int claim_fd, int64_t slot);
/* Take the shared lock of claim slot `slot` of a board (its file `fd`, `slots` slots mapped at
 * `board`) and check it is open under `token`: 0 taken (held until every byte is in place), 1
 * the engine holds the slot, 2 the slot is not open under the token, else -errno. */
int kvray_job_claim(job *j, int fd, int64_t slot, int64_t slots, uint64_t board, uint64_t token);
/* Run the job: on `threads` pool threads, or on this thread when `threads` is 0 (returns once
 * it is over). 0, or an errno when no pool thread could start (the job is then freed). The
 * job's reference passes to the pool. */
int kvray_job_run(job *j, int threads);
void kvray_job_unref(job *j);
/* The content sum (kvray/content.py) of `nbytes` at `offset` of the region at `base`. */
uint64_t kvray_hash_range(const char *base, int64_t offset, int64_t nbytes, uint32_t seed);
/* Faults only (kvray.faults): whether jobs started now store their last op over the one before. */
int kvray_executor_fault(void);
/* kvray/_lane.c: the Lane type and the decode side's calls, added to the module. */
int kvray_lane_add_types(PyObject *module);

#endif
