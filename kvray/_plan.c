/* The planner's per-op loops in C: what numpy does in a few dozen calls, done in one pass each.
 *
 * Planning a request is short work on small arrays (thousands of ops), and in an engine it runs
 * right after the previous request's copy has flushed the caches: there every numpy call pays
 * for its setup and its cold data, more than the work itself costs.
 * These functions do the same work in one pass over the data. Each one has a numpy twin in
 * kvray/plan.py that gives the same answer (tests/unit/test_plan_native.py compares them), and
 * the Python side runs the twin whenever this module is not built or a check fails, so every
 * error message comes from one place.
 *
 * Every array argument is a C-contiguous buffer of native int64s; outputs are writable.
 *
 * sort_blocks(local_ids, remote_ids, local_pool, remote_pool, out_local, out_remote)
 *     -> None | (remote_min, remote_max)
 *   Checks that each side's ids lie in [0, pool) without repeats (None when they do not), and
 *   writes the pairs in ascending local id order: a counting sort over the local pool, or a
 *   sort of the pairs when the pools are large next to the request.
 * expand_ops(local_region, local_base, local_stride, remote_region, remote_base, remote_stride,
 *            row_nbytes, local_ids, remote_ids, out_lr, out_lo, out_rr, out_ro, out_n) -> bool
 *   One op per (row, block), rows outer: offset = base + id * stride on each side. Returns True
 *   when the ops come out in ascending local (region, offset) order. The caller has checked that
 *   every offset lies inside its region, so nothing here can overflow.
 * merge_ops(lr, lo, rr, ro, n, order, out_lr, out_lo, out_rr, out_ro, out_n) -> int
 *   Walks the ops in `order` (an int64 permutation, or None for as they are) and merges each
 *   op into the previous one where both its source and its destination continue the previous
 *   op's bytes; returns how many merged ops it wrote.
 * first_outside(region, offset, nbytes, region_lengths) -> int
 *   The index of the first op that names no region, is empty, or leaves its region; -1 if none.
 * rows_outside(region, base, stride, nbytes, low, high, region_lengths) -> int
 *   first_outside over the ops of every row at block ids `low` and `high` (offset = base +
 *   id * stride): the first row with one outside, or whose offset overflows int64; -1 if none.
 * plan_ids(local_ids, remote_ids, out, local_pool, remote_pool, local_rows, local_lengths,
 *          remote_rows, remote_lengths) -> bool
 *   What planning checks of a request, in one call: sort_blocks into `out` (local ids, then the
 *   paired remote ids: 2 x n), then, for each side, check_rows' checks at the smallest and
 *   largest id of that side. A side's rows are 4 x rows: region, base, stride, bytes. True when
 *   every check passes; False when one fails, or the ids are not 1-D (the numpy twin then says
 *   which).
 * placement_digest(region, start, nbytes, stride, blocks, shift) -> int
 *   The placement digest (kvray.placement) of the ranges [start + b * stride, + nbytes) of
 *   `region`, for every run (region, start, nbytes, stride: one entry a run) at every block id
 *   b of `blocks`: the sum over them of F(end) - F(start) mod 2**64, F SplitMix64's finalizer
 *   of the address mixed with (region + 1) << shift. `stride` and `blocks` None: the digest of
 *   the ranges themselves. Addresses wrap mod 2**64 as numpy's uint64 does.
 * check_ids(blocks, out, num_blocks) -> bool
 *   One side's block ids as `block_ids` checks them, from a list or tuple of Python ints: each
 *   an int in [0, num_blocks), none twice, written into `out` (int64, as long as `blocks`).
 *   False (with `out` partly written) where one is not, `blocks` is empty or neither a list
 *   nor a tuple, or the pool is past 2**24 blocks: the numpy twin then says which.
 * check_id_array(ids, num_blocks) -> bool
 *   Whether the int64 array `ids` holds one side's block ids as `block_ids` checks them: not
 *   empty, each in [0, num_blocks), none twice. False also where the pool is past 2**24 blocks
 *   (and the ids are more than 64): the numpy twin then decides, and says what is wrong.
 * held_digest(sums, held, parts, num_blocks, layer, part, salt, src_start, src_stride,
 *             dst_start, dst_stride, local_ids, remote_ids) -> int | None
 *   The content digest (kvray.content) of a transfer from content sums held per (layer, part,
 *   block): `sums` and `held` flat over (layers, parts, num_blocks) (int64 bit patterns, and
 *   bools), one row per (layer, part) moved with its pair salt and both sides' start and
 *   stride; block local_ids[i] goes to remote_ids[i]. None (and nothing changed) unless every
 *   sum the transfer needs is held; else the sum over rows and blocks of sum * (SplitMix64(salt
 *   ^ delta) | 1), delta the destination offset minus the source offset (mod 2**64), and those
 *   sums are no longer held (a push uses them once). ValueError where an index lies outside.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_placement.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    int64_t *data;
    Py_ssize_t len;
} Array;

/* Borrow an int64 buffer (writable when asked); 0 and a Python error on failure. */
static int take(PyObject *object, Array *array, int writable) {
    memset(array, 0, sizeof(*array));
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, &array->view, flags) != 0) {
        return 0;
    }
    const char *format = array->view.format;
    if (array->view.itemsize != 8 || format == NULL ||
        !(strcmp(format, "l") == 0 || strcmp(format, "q") == 0 || strcmp(format, "<l") == 0 ||
          strcmp(format, "<q") == 0 || strcmp(format, "=l") == 0 || strcmp(format, "=q") == 0)) {
        PyBuffer_Release(&array->view);
        array->view.obj = NULL;
        PyErr_SetString(PyExc_TypeError, "kvray._plan takes arrays of native int64");
        return 0;
    }
    array->data = (int64_t *)array->view.buf;
    array->len = array->view.len / 8;
    return 1;
}

static void give_back(Array *arrays, int count) {
    for (int i = 0; i < count; i++) {
        if (arrays[i].view.obj != NULL) {
            PyBuffer_Release(&arrays[i].view);
        }
    }
}

/* Borrow `count` arrays; the last `writable` of them writable. */
static int take_all(PyObject **objects, Array *arrays, int count, int writable) {
    for (int i = 0; i < count; i++) {
        if (!take(objects[i], &arrays[i], i >= count - writable)) {
            give_back(arrays, i);
            return 0;
        }
    }
    return 1;
}

static int lengths_are(Array *arrays, int count, Py_ssize_t len) {
    for (int i = 0; i < count; i++) {
        if (arrays[i].len != len) {
            PyErr_SetString(PyExc_ValueError, "kvray._plan: arrays of mismatched lengths");
            return 0;
        }
    }
    return 1;
}

typedef struct {
    int64_t local, remote;
} Pair;

/* Sort `pairs` (n of them) by `local` (every key in [0, 2**bits)), least significant byte first:
 * a pass per byte of the largest key, each a count of 256 and one stable scatter through `spare`.
 * Linear in n, where a comparison sort of a long request costs ten compares an id. */
static void radix_sort_pairs(Pair *pairs, Pair *spare, Py_ssize_t n, int bits) {
    for (int shift = 0; shift < bits; shift += 8) {
        Py_ssize_t count[257] = {0};
        for (Py_ssize_t i = 0; i < n; i++) {
            count[((uint64_t)pairs[i].local >> shift & 0xFF) + 1]++;
        }
        for (int d = 0; d < 256; d++) {
            count[d + 1] += count[d];
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            spare[count[(uint64_t)pairs[i].local >> shift & 0xFF]++] = pairs[i];
        }
        Pair *sorted = spare;
        spare = pairs;
        pairs = sorted;
    }
}

/* How many bits the ids of a pool of `pool` blocks need (ids are below it). */
static int id_bits(int64_t pool) {
    int bits = 0;
    while (bits < 63 && ((int64_t)1 << bits) < pool) {
        bits++;
    }
    return bits;
}

/* Below this many pool slots per id, a count over the pool beats sorting the ids. */
#define COUNTING_SLOTS_PER_ID 16

/* The pairs in ascending local id order, and the smallest and largest remote id: 1; 0 when an id
 * is outside its pool or repeats (or there are none); -1 and a Python error when memory runs out.
 * A counting sort over the local pool when the pools are small next to the request, else a sort
 * of the request's pairs (a request of 64 blocks in a pool of a million would otherwise clear
 * and scan megabytes): the same pairs either way, since local ids are unique. */
static int sort_pairs(const int64_t *local, const int64_t *remote, Py_ssize_t n, int64_t local_pool,
                      int64_t remote_pool, int64_t *out_local, int64_t *out_remote, int64_t *remote_min,
                      int64_t *remote_max) {
    *remote_min = INT64_MAX;
    *remote_max = INT64_MIN;
    if (n <= 0) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (local[i] < 0 || local[i] >= local_pool || remote[i] < 0 || remote[i] >= remote_pool) {
            return 0;
        }
        *remote_min = remote[i] < *remote_min ? remote[i] : *remote_min;
        *remote_max = remote[i] > *remote_max ? remote[i] : *remote_max;
    }
    int64_t slots = local_pool > remote_pool ? local_pool : remote_pool;
    if (slots / COUNTING_SLOTS_PER_ID <= (int64_t)n) {
        /* slot[local id] = 1 + index of the pair, 0 = unused; seen = bitmap of remote ids. */
        int64_t *slot = calloc((size_t)local_pool + 1, sizeof(int64_t));
        uint8_t *seen = calloc((size_t)remote_pool / 8 + 1, 1);
        if (slot == NULL || seen == NULL) {
            free(slot);
            free(seen);
            PyErr_NoMemory();
            return -1;
        }
        int ok = 1;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t l = local[i], r = remote[i];
            if (slot[l] != 0 || (seen[r >> 3] & (1u << (r & 7)))) {
                ok = 0;
                break;
            }
            slot[l] = (int64_t)i + 1;
            seen[r >> 3] |= (uint8_t)(1u << (r & 7));
        }
        if (ok) {
            Py_ssize_t k = 0;
            for (int64_t id = 0; id < local_pool && k < n; id++) {
                if (slot[id] != 0) {
                    out_local[k] = id;
                    out_remote[k] = remote[slot[id] - 1];
                    k++;
                }
            }
        }
        free(slot);
        free(seen);
        return ok;
    }
    /* Pairs sorted by local id, then (their halves swapped) by remote id: a repeat on either
     * side sits next to its twin. An even number of byte passes leaves each sort in `pairs`. */
    int local_bits = (id_bits(local_pool) + 15) / 16 * 16, remote_bits = (id_bits(remote_pool) + 15) / 16 * 16;
    Pair *pairs = malloc((size_t)n * sizeof(Pair));
    Pair *spare = malloc((size_t)n * sizeof(Pair));
    if (pairs == NULL || spare == NULL) {
        free(pairs);
        free(spare);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        pairs[i].local = remote[i];
        pairs[i].remote = 0;
    }
    radix_sort_pairs(pairs, spare, n, remote_bits);
    int ok = 1;
    for (Py_ssize_t i = 1; i < n && ok; i++) {
        ok = pairs[i].local != pairs[i - 1].local;
    }
    if (ok) {
        for (Py_ssize_t i = 0; i < n; i++) {
            pairs[i].local = local[i];
            pairs[i].remote = remote[i];
        }
        radix_sort_pairs(pairs, spare, n, local_bits);
        for (Py_ssize_t i = 1; i < n && ok; i++) {
            ok = pairs[i].local != pairs[i - 1].local;
        }
    }
    if (ok) {
        for (Py_ssize_t i = 0; i < n; i++) {
            out_local[i] = pairs[i].local;
            out_remote[i] = pairs[i].remote;
        }
    }
    free(pairs);
    free(spare);
    return ok;
}

static PyObject *sort_blocks(PyObject *self, PyObject *args) {
    PyObject *objects[4];
    long long local_pool, remote_pool;
    if (!PyArg_ParseTuple(args, "OOLLOO", &objects[0], &objects[1], &local_pool, &remote_pool, &objects[2],
                          &objects[3])) {
        return NULL;
    }
    Array a[4];
    if (!take_all(objects, a, 4, 2)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = a[0].len;
    if (!lengths_are(a, 4, n)) {
        goto done;
    }
    if (local_pool < 0 || remote_pool < 0) {
        PyErr_SetString(PyExc_ValueError, "kvray._plan.sort_blocks: negative pool size");
        goto done;
    }
    int64_t remote_min, remote_max;
    int sorted = sort_pairs(a[0].data, a[1].data, n, local_pool, remote_pool, a[2].data, a[3].data, &remote_min,
                            &remote_max);
    if (sorted < 0) {
        goto done;
    }
    if (sorted == 0) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else {
        result = Py_BuildValue("LL", (long long)remote_min, (long long)remote_max);
    }
done:
    give_back(a, 4);
    return result;
}

static PyObject *expand_ops(PyObject *self, PyObject *args) {
    PyObject *objects[14];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOO", &objects[0], &objects[1], &objects[2], &objects[3],
                          &objects[4], &objects[5], &objects[6], &objects[7], &objects[8], &objects[9],
                          &objects[10], &objects[11], &objects[12], &objects[13])) {
        return NULL;
    }
    Array a[14];
    if (!take_all(objects, a, 14, 5)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t rows = a[0].len, n = a[7].len;
    if (!lengths_are(a, 7, rows) || !lengths_are(a + 7, 2, n) || !lengths_are(a + 9, 5, rows * n)) {
        goto done;
    }
    const int64_t *l_region = a[0].data, *l_base = a[1].data, *l_stride = a[2].data;
    const int64_t *r_region = a[3].data, *r_base = a[4].data, *r_stride = a[5].data;
    const int64_t *row_nbytes = a[6].data, *l_ids = a[7].data, *r_ids = a[8].data;
    int64_t *out_lr = a[9].data, *out_lo = a[10].data, *out_rr = a[11].data, *out_ro = a[12].data;
    int64_t *out_n = a[13].data;
    int sorted = 1;
    int64_t last_region = INT64_MIN, last_offset = INT64_MIN;
    Py_ssize_t k = 0;
    for (Py_ssize_t row = 0; row < rows; row++) {
        int64_t lr = l_region[row], lb = l_base[row], ls = l_stride[row];
        int64_t rr = r_region[row], rb = r_base[row], rs = r_stride[row], nb = row_nbytes[row];
        for (Py_ssize_t i = 0; i < n; i++, k++) {
            int64_t lo = lb + l_ids[i] * ls;
            out_lr[k] = lr;
            out_lo[k] = lo;
            out_rr[k] = rr;
            out_ro[k] = rb + r_ids[i] * rs;
            out_n[k] = nb;
            if (lr < last_region || (lr == last_region && lo < last_offset)) {
                sorted = 0;
            }
            last_region = lr;
            last_offset = lo;
        }
    }
    result = PyBool_FromLong(sorted);
done:
    give_back(a, 14);
    return result;
}

static PyObject *merge_ops(PyObject *self, PyObject *args) {
    PyObject *objects[11];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOO", &objects[0], &objects[1], &objects[2], &objects[3],
                          &objects[4], &objects[5], &objects[6], &objects[7], &objects[8], &objects[9],
                          &objects[10])) {
        return NULL;
    }
    PyObject *order_object = objects[5];
    PyObject *in[10] = {objects[0], objects[1], objects[2], objects[3], objects[4],
                        objects[6], objects[7], objects[8], objects[9], objects[10]};
    Array a[10];
    Array order = {0};
    if (!take_all(in, a, 10, 5)) {
        return NULL;
    }
    PyObject *result = NULL;
    int have_order = order_object != Py_None;
    if (have_order && !take(order_object, &order, 0)) {
        goto done;
    }
    Py_ssize_t n = a[0].len;
    if (!lengths_are(a, 10, n) || (have_order && order.len != n)) {
        goto done;
    }
    if (have_order) {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (order.data[i] < 0 || order.data[i] >= n) {
                PyErr_SetString(PyExc_ValueError, "kvray._plan.merge_ops: order is not a permutation");
                goto done;
            }
        }
    }
    const int64_t *lr = a[0].data, *lo = a[1].data, *rr = a[2].data, *ro = a[3].data, *nb = a[4].data;
    int64_t *out_lr = a[5].data, *out_lo = a[6].data, *out_rr = a[7].data, *out_ro = a[8].data;
    int64_t *out_n = a[9].data;
    Py_ssize_t m = 0;
    Py_ssize_t previous = -1;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = have_order ? (Py_ssize_t)order.data[j] : j;
        if (previous >= 0 && lr[i] == lr[previous] && rr[i] == rr[previous] &&
            lo[i] == lo[previous] + nb[previous] && ro[i] == ro[previous] + nb[previous]) {
            out_n[m - 1] += nb[i];
        } else {
            out_lr[m] = lr[i];
            out_lo[m] = lo[i];
            out_rr[m] = rr[i];
            out_ro[m] = ro[i];
            out_n[m] = nb[i];
            m++;
        }
        previous = i;
    }
    result = PyLong_FromSsize_t(m);
done:
    if (order.view.obj != NULL) {
        PyBuffer_Release(&order.view);
    }
    give_back(a, 10);
    return result;
}

static PyObject *first_outside(PyObject *self, PyObject *args) {
    PyObject *objects[4];
    if (!PyArg_ParseTuple(args, "OOOO", &objects[0], &objects[1], &objects[2], &objects[3])) {
        return NULL;
    }
    Array a[4];
    if (!take_all(objects, a, 4, 0)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = a[0].len;
    if (!lengths_are(a, 3, n)) {
        goto done;
    }
    const int64_t *region = a[0].data, *offset = a[1].data, *nbytes = a[2].data, *lengths = a[3].data;
    Py_ssize_t regions = a[3].len;
    Py_ssize_t bad = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = region[i];
        if (r < 0 || r >= regions) {
            bad = i;
            break;
        }
        /* As check_ops: never an end computed, so no sum can overflow. */
        int64_t length = lengths[r];
        if (nbytes[i] <= 0 || nbytes[i] > length || offset[i] < 0 || offset[i] > length - nbytes[i]) {
            bad = i;
            break;
        }
    }
    result = PyLong_FromSsize_t(bad);
done:
    give_back(a, 4);
    return result;
}

/* The first of `rows` rows with an op at block id `low` or `high` outside its region (or whose
 * offset overflows int64); -1 if none. */
static Py_ssize_t first_row_outside(const int64_t *region, const int64_t *base, const int64_t *stride,
                                    const int64_t *nbytes, Py_ssize_t rows, int64_t low, int64_t high,
                                    const int64_t *lengths, Py_ssize_t regions) {
    const int64_t ends[2] = {low, high};
    for (Py_ssize_t i = 0; i < rows; i++) {
        int64_t r = region[i];
        if (r < 0 || r >= regions) {
            return i;
        }
        int64_t length = lengths[r];
        for (int end = 0; end < 2; end++) {
            int64_t step, offset;
            if (__builtin_mul_overflow(ends[end], stride[i], &step) || __builtin_add_overflow(base[i], step, &offset) ||
                nbytes[i] <= 0 || nbytes[i] > length || offset < 0 || offset > length - nbytes[i]) {
                return i;
            }
        }
    }
    return -1;
}

static PyObject *rows_outside(PyObject *self, PyObject *args) {
    PyObject *objects[5];
    long long ends[2];
    if (!PyArg_ParseTuple(args, "OOOOLLO", &objects[0], &objects[1], &objects[2], &objects[3], &ends[0],
                          &ends[1], &objects[4])) {
        return NULL;
    }
    Array a[5];
    if (!take_all(objects, a, 5, 0)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = a[0].len;
    if (!lengths_are(a, 4, n)) {
        goto done;
    }
    result = PyLong_FromSsize_t(
        first_row_outside(a[0].data, a[1].data, a[2].data, a[3].data, n, ends[0], ends[1], a[4].data, a[4].len));
done:
    give_back(a, 5);
    return result;
}

/* check_rows' checks for one side whose ids span [low, high]: 1 when every row passes. */
static int side_inside(const Array *rows, const Array *lengths, int64_t low, int64_t high) {
    Py_ssize_t count = rows->len / 4;
    const int64_t *region = rows->data, *base = region + count, *stride = base + count, *nbytes = stride + count;
    /* As check_rows: ids that could wrap an offset past 2**62 are refused before any row is read. */
    uint64_t largest_stride = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t magnitude = stride[i] < 0 ? (uint64_t)0 - (uint64_t)stride[i] : (uint64_t)stride[i];
        largest_stride = magnitude > largest_stride ? magnitude : largest_stride;
    }
    if (low < 0 || high < 0 || (__int128)high * (__int128)largest_stride >= ((__int128)1 << 62)) {
        return 0;
    }
    return first_row_outside(region, base, stride, nbytes, count, low, high, lengths->data, lengths->len) < 0;
}

static PyObject *plan_ids(PyObject *self, PyObject *args) {
    PyObject *objects[7];
    long long local_pool, remote_pool;
    if (!PyArg_ParseTuple(args, "OOOLLOOOO", &objects[0], &objects[1], &objects[2], &local_pool, &remote_pool,
                          &objects[3], &objects[4], &objects[5], &objects[6])) {
        return NULL;
    }
    /* local ids, remote ids, local rows, local lengths, remote rows, remote lengths; out last. */
    PyObject *in[7] = {objects[0], objects[1], objects[3], objects[4], objects[5], objects[6], objects[2]};
    Array a[7];
    if (!take_all(in, a, 7, 1)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = a[0].len;
    if (a[2].len % 4 != 0 || a[4].len % 4 != 0 || a[6].len != 2 * n) {
        PyErr_SetString(PyExc_ValueError, "kvray._plan.plan_ids: rows of 4 columns and an output of 2 x n");
        goto done;
    }
    if (local_pool < 0 || remote_pool < 0) {
        PyErr_SetString(PyExc_ValueError, "kvray._plan.plan_ids: negative pool size");
        goto done;
    }
    int ok = 0;
    /* Ids of another shape are the numpy twin's to refuse, in its words. */
    if (a[0].view.ndim == 1 && a[1].view.ndim == 1 && a[1].len == n) {
        int64_t *out_local = a[6].data, *out_remote = out_local + n;
        int64_t remote_min, remote_max;
        int sorted = sort_pairs(a[0].data, a[1].data, n, local_pool, remote_pool, out_local, out_remote,
                                &remote_min, &remote_max);
        if (sorted < 0) {
            goto done;
        }
        ok = sorted && side_inside(&a[2], &a[3], out_local[0], out_local[n - 1]) &&
             side_inside(&a[4], &a[5], remote_min, remote_max);
    }
    result = PyBool_FromLong(ok);
done:
    give_back(a, 7);
    return result;
}

/* The largest pool check_ids keeps a bitmap of (2 MiB). */
#define CHECK_IDS_MAX_POOL (1LL << 24)

static PyObject *check_ids(PyObject *self, PyObject *args) {
    PyObject *blocks, *out_object;
    long long num_blocks;
    if (!PyArg_ParseTuple(args, "OOL", &blocks, &out_object, &num_blocks)) {
        return NULL;
    }
    /* The bitmap is the pool's size: a pool past CHECK_IDS_MAX_POOL (a peer's claim, say) is
     * the numpy twin's, which sorts the ids instead. */
    if (!(PyList_CheckExact(blocks) || PyTuple_CheckExact(blocks)) || num_blocks <= 0 ||
        num_blocks > CHECK_IDS_MAX_POOL) {
        Py_RETURN_FALSE;
    }
    Array out;
    if (!take(out_object, &out, 1)) {
        return NULL;
    }
    /* A list the caller still holds cannot change under us: nothing here runs Python code. */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks);
    PyObject **items = PySequence_Fast_ITEMS(blocks);
    int ok = n > 0 && out.len == n;
    uint64_t *seen = NULL;
    if (ok) {
        seen = calloc((size_t)((num_blocks + 63) / 64), sizeof(uint64_t));
        if (seen == NULL) {
            give_back(&out, 1);
            return PyErr_NoMemory();
        }
    }
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            ok = 0;
            break;
        }
        int overflow = 0;
        long long id = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow != 0 || id < 0 || id >= num_blocks) {
            ok = 0;
            break;
        }
        uint64_t bit = 1ULL << (id & 63);
        if (seen[id >> 6] & bit) {
            ok = 0;
            break;
        }
        seen[id >> 6] |= bit;
        out.data[i] = (int64_t)id;
    }
    free(seen);
    give_back(&out, 1);
    return PyBool_FromLong(ok);
}

/* Up to this many ids, repeats are looked for pair by pair (no bitmap over the pool). */
#define CHECK_IDS_PAIRWISE 64

static PyObject *check_id_array(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *object;
    long long num_blocks;
    if (!PyArg_ParseTuple(args, "OL", &object, &num_blocks)) {
        return NULL;
    }
    Array ids;
    if (!take(object, &ids, 0)) {
        return NULL;
    }
    const int64_t *id = ids.data;
    Py_ssize_t n = ids.len;
    int ok = n > 0 && num_blocks > 0;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        ok = id[i] >= 0 && id[i] < num_blocks;
    }
    if (ok && n <= CHECK_IDS_PAIRWISE) {
        for (Py_ssize_t i = 1; ok && i < n; i++) {
            for (Py_ssize_t j = 0; ok && j < i; j++) {
                ok = id[i] != id[j];
            }
        }
    } else if (ok) {
        uint64_t *seen = num_blocks <= CHECK_IDS_MAX_POOL
                             ? calloc((size_t)((num_blocks + 63) / 64), sizeof(uint64_t))
                             : NULL;
        ok = seen != NULL; /* a pool past the bitmap's size: the numpy twin sorts instead */
        for (Py_ssize_t i = 0; ok && i < n; i++) {
            uint64_t bit = 1ULL << (id[i] & 63);
            ok = !(seen[id[i] >> 6] & bit);
            seen[id[i] >> 6] |= bit;
        }
        free(seen);
    }
    give_back(&ids, 1);
    return PyBool_FromLong(ok);
}

static PyObject *placement_digest(PyObject *self, PyObject *args) {
    PyObject *objects[5];
    unsigned int shift;
    if (!PyArg_ParseTuple(args, "OOOOOI", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4],
                          &shift)) {
        return NULL;
    }
    if (shift >= 64) {
        PyErr_SetString(PyExc_ValueError, "kvray._plan: a region shift of 64 bits or more");
        return NULL;
    }
    /* stride None: every run's stride 0; blocks None: one block, 0 (the ranges themselves). */
    int strided = objects[3] != Py_None, blocked = objects[4] != Py_None;
    Array a[5];
    memset(a, 0, sizeof(a));
    if (!take_all(objects, a, 3, 0) || (strided && !take(objects[3], &a[3], 0))) {
        give_back(a, 5);
        return NULL;
    }
    if (blocked && !take(objects[4], &a[4], 0)) {
        give_back(a, 5);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t runs = a[0].len;
    if (!lengths_are(a, strided ? 4 : 3, runs)) {
        goto done;
    }
    static const int64_t block_zero = 0;
    const int64_t *region = a[0].data, *start = a[1].data, *nbytes = a[2].data;
    const int64_t *stride = strided ? a[3].data : NULL;
    const int64_t *blocks = blocked ? a[4].data : &block_zero;
    Py_ssize_t count = blocked ? a[4].len : 1;
    uint64_t sum = 0;
    /* Let go of the GIL only for long work: taking it back may wait for another thread's turn. */
    PyThreadState *saved = (double)count * (double)runs >= 65536.0 ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t block = (uint64_t)blocks[i];
        for (Py_ssize_t r = 0; r < runs; r++) {
            uint64_t salt = ((uint64_t)region[r] + 1) << shift;
            uint64_t begin = (uint64_t)start[r] + (stride != NULL ? block * (uint64_t)stride[r] : 0);
            sum += range_worth(salt, begin, (uint64_t)nbytes[r]);
        }
    }
    if (saved != NULL) {
        PyEval_RestoreThread(saved);
    }
    result = PyLong_FromUnsignedLongLong(sum);
done:
    give_back(a, 5);
    return result;
}

/* Borrow a C-contiguous buffer of bools (numpy's "?"), writable. */
static int take_flags(PyObject *object, Py_buffer *view) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) != 0) {
        return 0;
    }
    if (view->itemsize != 1 || view->format == NULL || strcmp(view->format, "?") != 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "kvray._plan takes held flags as an array of bools");
        return 0;
    }
    return 1;
}

static PyObject *held_digest(PyObject *self, PyObject *args) {
    PyObject *objects[12];
    long long parts, num_blocks;
    if (!PyArg_ParseTuple(args, "OOLLOOOOOOOOO", &objects[0], &objects[11], &parts, &num_blocks, &objects[1],
                          &objects[2], &objects[3], &objects[4], &objects[5], &objects[6], &objects[7],
                          &objects[8], &objects[9])) {
        return NULL;
    }
    Array a[10];
    memset(a, 0, sizeof(a));
    if (!take_all(objects, a, 10, 0)) {
        return NULL;
    }
    Py_buffer flags;
    if (!take_flags(objects[11], &flags)) {
        give_back(a, 10);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t rows = a[1].len, count = a[8].len;
    if (!lengths_are(&a[1], 7, rows) || a[9].len != count) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "kvray._plan: arrays of mismatched lengths");
        }
        goto done;
    }
    if (parts <= 0 || num_blocks <= 0 || a[0].len % (parts * num_blocks) != 0 || flags.len != a[0].len) {
        PyErr_SetString(PyExc_ValueError, "kvray._plan: held sums of another shape");
        goto done;
    }
    const long long layers = a[0].len / (parts * num_blocks);
    const int64_t *layer = a[1].data, *part = a[2].data, *salt = a[3].data;
    const int64_t *src_start = a[4].data, *src_stride = a[5].data, *dst_start = a[6].data;
    const int64_t *dst_stride = a[7].data, *local = a[8].data, *remote = a[9].data;
    const uint64_t *sums = (const uint64_t *)a[0].data;
    char *held = (char *)flags.buf;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (layer[r] < 0 || layer[r] >= layers || part[r] < 0 || part[r] >= parts) {
            PyErr_SetString(PyExc_ValueError, "kvray._plan: a row outside the held sums");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (local[i] < 0 || local[i] >= num_blocks) {
            PyErr_SetString(PyExc_ValueError, "kvray._plan: a block outside the held sums");
            goto done;
        }
    }
    for (Py_ssize_t r = 0; r < rows; r++) {
        Py_ssize_t first = (Py_ssize_t)((layer[r] * parts + part[r]) * num_blocks);
        for (Py_ssize_t i = 0; i < count; i++) {
            if (!held[first + local[i]]) {
                result = Py_NewRef(Py_None);
                goto done;
            }
        }
    }
    uint64_t total = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        Py_ssize_t first = (Py_ssize_t)((layer[r] * parts + part[r]) * num_blocks);
        uint64_t row_salt = (uint64_t)salt[r];
        for (Py_ssize_t i = 0; i < count; i++) {
            uint64_t source = (uint64_t)src_start[r] + (uint64_t)local[i] * (uint64_t)src_stride[r];
            uint64_t target = (uint64_t)dst_start[r] + (uint64_t)remote[i] * (uint64_t)dst_stride[r];
            total += sums[first + local[i]] * (mix64(row_salt ^ (target - source)) | 1);
            held[first + local[i]] = 0;
        }
    }
    result = PyLong_FromUnsignedLongLong(total);
done:
    PyBuffer_Release(&flags);
    give_back(a, 10);
    return result;
}

static PyMethodDef methods[] = {
    {"check_ids", check_ids, METH_VARARGS, "One side's block ids checked into an int64 array."},
    {"check_id_array", check_id_array, METH_VARARGS, "Whether an int64 array holds valid block ids."},
    {"placement_digest", placement_digest, METH_VARARGS, "The placement digest of runs at blocks."},
    {"held_digest", held_digest, METH_VARARGS, "A transfer's content digest from held sums, or None."},
    {"sort_blocks", sort_blocks, METH_VARARGS,
     "Check both sides' block ids and order the pairs by local id (None when the ids are bad)."},
    {"expand_ops", expand_ops, METH_VARARGS, "One op per (row, block); True when sorted by local offset."},
    {"merge_ops", merge_ops, METH_VARARGS, "Merge ops that continue each other; the count written."},
    {"first_outside", first_outside, METH_VARARGS, "The first op outside its region, or -1."},
    {"rows_outside", rows_outside, METH_VARARGS, "The first row with an end op outside, or -1."},
    {"plan_ids", plan_ids, METH_VARARGS,
     "sort_blocks, then both sides' rows checked at their ends: True when every check passes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvray._plan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__plan(void) { return PyModule_Create(&module); }
