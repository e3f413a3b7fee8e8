/* kvxfer's fused copy-and-hash loop: the CPU copy engine's inner loop without the GIL.
 *
 * One call moves a batch of blocks between two arrays of fixed-size rows (a pool
 * and a host tier: a block is `rows_per_block` rows, copied row by row) and
 * returns the XXH3-64 of each block, hashed right after its step was copied, while
 * the bytes are still in the core's cache. The batch is cut into steps of
 * `step_blocks` blocks; the calling thread and up to `threads - 1` helper threads
 * take steps in turn. Helpers are started once and kept: after a batch they spin
 * for a short while (the next request usually follows at once), then sleep. A batch
 * of one step, or for one thread, runs in the caller alone (no lock, no wake-up).
 *
 * Each block's checksum is kvxfer's (kvxfer/geometry/block_checksum.py): the hash of the
 * little-endian hashes of its pieces of `piece_bytes`. A block larger than a piece is
 * copied a piece at a time, each piece hashed right after its copy (so a 2 MiB block is
 * hashed from L2, not L3). The hash function is passed in (python-xxhash's XXH3 entry
 * point, found by ctypes), so this file implements no hash of its own. It is loaded through
 * ctypes (kvxfer/transfer/native.py), which releases the GIL for the call; it
 * includes no Python header. Indices are trusted: the engine checks bounds first.
 * A batch of zero rows per block only hashes (a GPU's DMA engine copied the bytes); a batch
 * with no `hashed` array only copies (a tensor-parallel rank's pieces of a block that is
 * hashed whole once every rank's pieces are in).
 *
 * A batch of at least STREAM_MIN_BYTES, of rows no smaller than a piece, is stored past the cache
 * (x86-64's non-temporal stores): a copy much larger than the cache would otherwise read every
 * destination line before writing it (half as much memory traffic again), and nothing here reads the
 * destination again. Each piece is then hashed from the side the loop just read (still in cache):
 * on a restore the tier itself, on an offload the source, whose bytes the piece's copy holds
 * unless the engine wrote them meanwhile; then the checksum does not match the copy, and a restore
 * of it fails its check, where a copy hashed afterwards would pass a torn block on.
 *
 * A guarded call (kvx_copy_hash_guarded) moves blocks of a pool mapped from a file its owner may
 * shrink: each thread names the guard it copies under (_guard.c) before it touches the pool, and
 * the call reports -3 if the file shrunk.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_fused.h"
#include "_guard.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#define STREAM_STORES 1
#else
#define STREAM_STORES 0
#endif
#ifndef STREAM_MIN_BYTES /* (the sanitizer test builds it smaller, so its small batches stream too) */
#define STREAM_MIN_BYTES (INT64_C(4) << 20) /* a batch this large passes the cache: stream its stores */
#endif

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the checksum hashes its pieces' hashes as little-endian words: build on a little-endian host"
#endif

typedef struct {
    uint8_t *dst;
    const uint8_t *src;
    int64_t row_bytes;
    const int64_t *dst_rows, *src_rows; /* rows_per_block per block, block after block */
    int64_t rows_per_block;
    const uint8_t *hashed;        /* the array whose spans are hashed (span_bytes each) */
    const int64_t *hashed_spans;  /* one per block */
    int64_t span_bytes;
    uint64_t *sums;               /* one per block */
    int64_t blocks, step_blocks;
    hash_fn hash;
    int64_t piece_bytes;          /* the checksum's pieces */
    atomic_int *failed;           /* set by a step that found no memory for its pieces' hashes */
    kvx_guard_t *guard;           /* the pool's range, when its file may shrink (else NULL) */
    int stream;                   /* store past the cache, hash what was read (see the top) */
} job_t;

/* The ticket: generation (24 bits) | steps (20 bits) | next step (20 bits). A thread
 * claims a step with one compare-and-swap on it, so a helper that wakes late, after
 * its batch ended, claims nothing and never reads a later batch's half-written job. */
#define GEN_SHIFT 40
#define STEPS_SHIFT 20
#define FIELD ((UINT64_C(1) << 20) - 1)
#define GEN_MASK ((UINT64_C(1) << 24) - 1)
#define MAX_HELPERS 63
#define SPIN_NS 200000 /* a helper spins this long for the next batch before it sleeps */
static job_t job;
static _Atomic uint64_t ticket;
static atomic_long steps_done;
static atomic_int lanes_wanted; /* helpers with id < this take part in the current batch */
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER; /* one batch at a time */
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cv = PTHREAD_COND_INITIALIZER;
static int helpers;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* The checksum of the `n` bytes at `span`: the hash of its pieces' hashes (`pieces` holds them). */
static uint64_t pieced(const job_t *j, const uint8_t *span, int64_t n, uint64_t *pieces) {
    int64_t count = 0;
    for (int64_t at = 0; at < n; at += j->piece_bytes)
        pieces[count++] = j->hash(span + at, (size_t)(n - at < j->piece_bytes ? n - at : j->piece_bytes));
    if (count == 0)
        pieces[count++] = j->hash(span, 0);
    return j->hash(pieces, (size_t)count * sizeof(uint64_t));
}

/* One block of more than a piece: its rows copied a piece at a time, and each whole piece of the
 * block's hashed span (its rows, in order, on the tier side; or, for one row, the row itself:
 * contiguous either way) hashed right after, while in cache. */
static void copy_hash_pieces(const job_t *j, int64_t b, uint64_t *pieces) {
    const int64_t k = j->rows_per_block, n = j->row_bytes, piece = j->piece_bytes;
    const uint8_t *hashed = j->hashed + j->hashed_spans[b] * j->span_bytes;
    int64_t fed = 0, count = 0; /* bytes of the hashed span hashed so far, in `count` pieces */
    for (int64_t o = 0; o < k; o++) {
        uint8_t *to = j->dst + j->dst_rows[b * k + o] * n;
        const uint8_t *from = j->src + j->src_rows[b * k + o] * n;
        for (int64_t at = 0; at < n; at += piece) {
            const int64_t len = n - at < piece ? n - at : piece, copied = o * n + at + len;
            memcpy(to + at, from + at, (size_t)len);
            for (; copied - fed >= piece || (copied == k * n && fed < copied); count++) {
                const int64_t m = copied - fed < piece ? copied - fed : piece;
                pieces[count] = j->hash(hashed + fed, (size_t)m);
                fed += m;
            }
        }
    }
    j->sums[b] = j->hash(pieces, (size_t)count * sizeof(uint64_t));
}

/* memcpy with non-temporal stores for all but the unaligned head and tail (x86-64; the caller fences). */
static void stream_copy(uint8_t *to, const uint8_t *from, size_t n) {
#if STREAM_STORES
    size_t head = (16 - ((uintptr_t)to & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(to, from, head);
    to += head, from += head, n -= head;
    const size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(from + i));
        const __m128i b = _mm_loadu_si128((const __m128i *)(from + i + 16));
        const __m128i c = _mm_loadu_si128((const __m128i *)(from + i + 32));
        const __m128i d = _mm_loadu_si128((const __m128i *)(from + i + 48));
        _mm_stream_si128((__m128i *)(to + i), a);
        _mm_stream_si128((__m128i *)(to + i + 16), b);
        _mm_stream_si128((__m128i *)(to + i + 32), c);
        _mm_stream_si128((__m128i *)(to + i + 48), d);
    }
    memcpy(to + body, from + body, n - body);
#else
    memcpy(to, from, n);
#endif
}

/* copy_hash_pieces for a streamed batch: each row is stored past the cache a unit at a time (up to the
 * next piece boundary of the span) and each piece hashed from where it was just read: the tier's span on
 * a restore, the source rows on an offload. A piece that spans two rows is gathered first (from cache). */
static void stream_hash_pieces(const job_t *j, int64_t b, uint64_t *pieces, uint8_t *gather) {
    const int64_t k = j->rows_per_block, n = j->row_bytes, piece = j->piece_bytes, total = k * n;
    const uint8_t *hashed = j->hashed + j->hashed_spans[b] * j->span_bytes;
    const int from_source = j->hashed == j->dst; /* an offload: the destination is not in cache */
    int64_t count = 0, fill = 0;                 /* pieces hashed; bytes of the piece being gathered */
    for (int64_t o = 0; o < k; o++) {
        uint8_t *to = j->dst + j->dst_rows[b * k + o] * n;
        const uint8_t *from = j->src + j->src_rows[b * k + o] * n;
        const uint8_t *read = from_source ? from : hashed + o * n; /* this row's bytes, in cache once copied */
        for (int64_t at = 0; at < n;) {
            const int64_t pos = o * n + at, edge = (pos / piece + 1) * piece;
            const int64_t len = n - at < edge - pos ? n - at : edge - pos;
            stream_copy(to + at, from + at, (size_t)len);
            if (fill == 0 && (len == piece || pos + len == total)) {
                pieces[count++] = j->hash(read + at, (size_t)len);
            } else {
                memcpy(gather + fill, read + at, (size_t)len);
                fill += len;
                if (fill == piece || pos + len == total) {
                    pieces[count++] = j->hash(gather, (size_t)fill);
                    fill = 0;
                }
            }
            at += len;
        }
    }
    j->sums[b] = j->hash(pieces, (size_t)count * sizeof(uint64_t));
}

static void do_step_unguarded(const job_t *j, int64_t step);

static void do_step(const job_t *j, int64_t step) {
    if (j->guard == NULL) {
        do_step_unguarded(j, step);
        return;
    }
    kvx_guarding = j->guard;
    atomic_signal_fence(memory_order_seq_cst); /* named before the first access, cleared after the last */
    do_step_unguarded(j, step);
    atomic_signal_fence(memory_order_seq_cst);
    kvx_guarding = NULL;
}

static void do_step_unguarded(const job_t *j, int64_t step) {
    int64_t b0 = step * j->step_blocks, b1 = b0 + j->step_blocks;
    if (b1 > j->blocks)
        b1 = j->blocks;
    const int64_t k = j->rows_per_block, n = j->row_bytes;
    if (j->hashed == NULL) { /* copies alone */
        for (int64_t r = b0 * k; r < b1 * k; r++)
            memcpy(j->dst + j->dst_rows[r] * n, j->src + j->src_rows[r] * n, (size_t)n);
        return;
    }
    uint64_t *pieces = malloc((size_t)(j->span_bytes / j->piece_bytes + 1) * sizeof(uint64_t));
    if (pieces == NULL) {
        atomic_store(j->failed, 1);
        return;
    }
    if (j->stream) {
        uint8_t *gather = malloc((size_t)j->piece_bytes);
        if (gather == NULL) {
            atomic_store(j->failed, 1);
            free(pieces);
            return;
        }
        for (int64_t b = b0; b < b1; b++)
            stream_hash_pieces(j, b, pieces, gather);
        free(gather);
#if STREAM_STORES
        _mm_sfence(); /* the streamed stores are visible before the step is counted done */
#endif
    } else if (k > 0 && j->span_bytes > j->piece_bytes) {
        for (int64_t b = b0; b < b1; b++)
            copy_hash_pieces(j, b, pieces);
    } else {
        for (int64_t r = b0 * k; r < b1 * k; r++)
            memcpy(j->dst + j->dst_rows[r] * n, j->src + j->src_rows[r] * n, (size_t)n);
        for (int64_t b = b0; b < b1; b++)
            j->sums[b] = pieced(j, j->hashed + j->hashed_spans[b] * j->span_bytes, j->span_bytes, pieces);
    }
    free(pieces);
}

static void run_steps(uint64_t gen) {
    for (;;) {
        uint64_t t = atomic_load_explicit(&ticket, memory_order_acquire);
        if ((t >> GEN_SHIFT) != gen || (t & FIELD) >= ((t >> STEPS_SHIFT) & FIELD))
            return;
        if (!atomic_compare_exchange_weak_explicit(&ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        do_step(&job, (int64_t)(t & FIELD));
        atomic_fetch_add_explicit(&steps_done, 1, memory_order_release);
    }
}

static void *helper(void *arg) {
    const int id = (int)(intptr_t)arg;
    pthread_setname_np(pthread_self(), "kvxfer-copy"); /* as `top -H` and /proc show it */
    uint64_t seen = atomic_load(&ticket) >> GEN_SHIFT;
    for (;;) {
        uint64_t gen;
        int64_t until = now_ns() + SPIN_NS;
        for (int i = 0; (gen = atomic_load_explicit(&ticket, memory_order_acquire) >> GEN_SHIFT) == seen; i++) {
            cpu_relax();
            if ((i & 63) == 63 && now_ns() > until)
                break;
        }
        if (gen == seen) { /* idle: sleep until the next batch */
            pthread_mutex_lock(&wake_mu);
            while ((gen = atomic_load(&ticket) >> GEN_SHIFT) == seen)
                pthread_cond_wait(&wake_cv, &wake_mu);
            pthread_mutex_unlock(&wake_mu);
        }
        seen = gen;
        if (id < atomic_load(&lanes_wanted))
            run_steps(gen);
    }
    return NULL;
}

static void reset_after_fork(void) { /* the child has no helper threads, and fresh locks */
    helpers = 0;
    pthread_mutex_init(&call_mu, NULL);
    pthread_mutex_init(&wake_mu, NULL);
    pthread_cond_init(&wake_cv, NULL);
}

static pthread_once_t once = PTHREAD_ONCE_INIT;
static void register_fork_handler(void) { pthread_atfork(NULL, NULL, reset_after_fork); }

int kvx_copy_hash(uint8_t *dst, const uint8_t *src, int64_t row_bytes, const int64_t *dst_rows,
                  const int64_t *src_rows, int64_t rows_per_block, const uint8_t *hashed,
                  const int64_t *hashed_spans, int64_t span_bytes, uint64_t *sums, int64_t blocks,
                  int64_t step_blocks, hash_fn hash, int64_t piece_bytes, int threads) {
    return kvx_copy_hash_guarded(dst, src, row_bytes, dst_rows, src_rows, rows_per_block, hashed, hashed_spans,
                                 span_bytes, sums, blocks, step_blocks, hash, piece_bytes, threads, NULL);
}

static int64_t stream_min = -1; /* set once: KVXFER_STREAM_STORES=0 turns streaming off (to measure it) */
static pthread_once_t stream_once = PTHREAD_ONCE_INIT;
static void read_stream_setting(void) {
    const char *setting = getenv("KVXFER_STREAM_STORES");
    stream_min = STREAM_STORES && !(setting != NULL && strcmp(setting, "0") == 0) ? STREAM_MIN_BYTES : INT64_MAX;
}

static atomic_long streamed; /* batches streamed so far (tests see the path taken) */
int64_t kvx_streamed_batches(void) { return atomic_load(&streamed); }

int64_t kvx_stream_min_bytes(void) {
    pthread_once(&stream_once, read_stream_setting);
    return stream_min;
}

static int run_batch(const job_t *mine, uint64_t steps, int threads);

int kvx_copy_hash_guarded(uint8_t *dst, const uint8_t *src, int64_t row_bytes, const int64_t *dst_rows,
                          const int64_t *src_rows, int64_t rows_per_block, const uint8_t *hashed,
                          const int64_t *hashed_spans, int64_t span_bytes, uint64_t *sums, int64_t blocks,
                          int64_t step_blocks, hash_fn hash, int64_t piece_bytes, int threads,
                          kvx_guard_t *guard) {
    if (blocks <= 0)
        return 0;
    if (kvx_guard_broken(guard))
        return -3;
    if (step_blocks < 1 || (blocks + step_blocks - 1) / step_blocks > (int64_t)FIELD || piece_bytes < 1)
        return -1;
    const uint64_t steps = (uint64_t)((blocks + step_blocks - 1) / step_blocks);
    atomic_int failed = 0;
    /* Streamed: a large batch whose hashed span is one side's rows, in order, rows of a piece or more (of
     * smaller rows every piece would be gathered: a second copy, from cache, that costs what streaming saves). */
    const int stream = STREAM_STORES && rows_per_block > 0 && hashed != NULL && span_bytes > piece_bytes &&
                       (hashed == dst || hashed == src) && span_bytes == rows_per_block * row_bytes &&
                       (rows_per_block == 1 || row_bytes >= piece_bytes) &&
                       blocks * span_bytes >= kvx_stream_min_bytes();
    if (stream)
        atomic_fetch_add(&streamed, 1);
    const job_t mine = {dst, src, row_bytes, dst_rows, src_rows, rows_per_block, hashed, hashed_spans,
                        span_bytes, sums, blocks, step_blocks, hash, piece_bytes, &failed, guard, stream};
    const int code = run_batch(&mine, steps, threads);
    return kvx_guard_broken(guard) ? -3 : code;
}

static int run_batch(const job_t *mine, uint64_t steps, int threads) {
    atomic_int *failed = mine->failed;
    if (threads <= 1 || steps == 1) { /* nothing to share: no helper is woken, no lock taken */
        for (uint64_t s = 0; s < steps; s++)
            do_step(mine, (int64_t)s);
        return atomic_load(failed) ? -2 : 0;
    }
    pthread_once(&once, register_fork_handler);
    pthread_mutex_lock(&call_mu);
    job = *mine;
    atomic_store(&steps_done, 0);
    pthread_mutex_lock(&wake_mu);
    if (helpers < threads - 1 && helpers < MAX_HELPERS) {
        /* Helpers block every signal but SIGBUS (they inherit this mask): signals go to the process's
         * own threads, never interrupt a copy. A fault's SIGBUS goes to the thread that faulted, and
         * the kernel kills the process if that thread blocks it: a guarded copy needs it. */
        sigset_t all, previous;
        sigfillset(&all);
        sigdelset(&all, SIGBUS);
        pthread_sigmask(SIG_SETMASK, &all, &previous);
        while (helpers < threads - 1 && helpers < MAX_HELPERS) {
            pthread_t tid;
            if (pthread_create(&tid, NULL, helper, (void *)(intptr_t)helpers) != 0)
                break; /* fewer helpers: the caller takes the steps they would have */
            pthread_detach(tid);
            helpers++;
        }
        pthread_sigmask(SIG_SETMASK, &previous, NULL);
    }
    atomic_store(&lanes_wanted, threads - 1);
    const uint64_t gen = ((atomic_load(&ticket) >> GEN_SHIFT) + 1) & GEN_MASK;
    atomic_store_explicit(&ticket, (gen << GEN_SHIFT) | (steps << STEPS_SHIFT), memory_order_release);
    pthread_cond_broadcast(&wake_cv);
    pthread_mutex_unlock(&wake_mu);
    run_steps(gen);
    /* Every claimed step has finished before the call returns: no copy outlives it. A helper
     * descheduled mid-step (fewer CPUs than threads) gets the CPU back through sched_yield. */
    const int64_t until = now_ns() + SPIN_NS;
    for (int i = 0; (uint64_t)atomic_load_explicit(&steps_done, memory_order_acquire) < steps; i++) {
        cpu_relax();
        if ((i & 63) == 63 && now_ns() > until)
            sched_yield();
    }
    pthread_mutex_unlock(&call_mu);
    return atomic_load(failed) ? -2 : 0;
}
