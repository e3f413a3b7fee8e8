/* The interface of kvxfer's fused copy-and-hash loop (_fused.c): what ctypes calls
 * (kvxfer/transfer/native.py mirrors it) and what the sanitizer test links against. */
#ifndef KVXFER_FUSED_H
#define KVXFER_FUSED_H

#include <stddef.h>
#include <stdint.h>

typedef uint64_t (*hash_fn)(const void *, size_t);

/* Copy `blocks` blocks of `rows_per_block` rows (dst row dst_rows[r] <- src row src_rows[r])
 * in steps of `step_blocks` blocks on up to `threads` threads, and store in sums[b] the checksum
 * of block b's span of `hashed` (hashed + hashed_spans[b] * span_bytes: its rows, in order,
 * on the tier side): `hash` of the little-endian `hash`es of its pieces of `piece_bytes`. With
 * `rows_per_block` 0 nothing is copied (dst, src and the row arrays unused): spans are only hashed.
 * Returns 0, -1 if the batch has too many steps (or no pieces), -2 if memory for the pieces'
 * hashes ran out (some sums are then unset). */
__attribute__((visibility("default")))
int kvx_copy_hash(uint8_t *dst, const uint8_t *src, int64_t row_bytes, const int64_t *dst_rows,
                  const int64_t *src_rows, int64_t rows_per_block, const uint8_t *hashed,
                  const int64_t *hashed_spans, int64_t span_bytes, uint64_t *sums, int64_t blocks,
                  int64_t step_blocks, hash_fn hash, int64_t piece_bytes, int threads);

/* The smallest batch (blocks x span bytes) whose stores go past the cache; INT64_MAX where none do
 * (not x86-64, or KVXFER_STREAM_STORES=0 in the environment at the first call). */
__attribute__((visibility("default")))
int64_t kvx_stream_min_bytes(void);

/* How many batches this process has streamed (for tests: which path a batch took). */
__attribute__((visibility("default")))
int64_t kvx_streamed_batches(void);

/* A pool this process maps from a file its owner may shrink (a memfd without seals): [base, base + len),
 * page-aligned, the whole mapping. A copy that faults on it (SIGBUS: the file was shrunk) sets `broken`,
 * maps anonymous memory over the range (libwayland's wl_shm does the same for a client's buffer) and
 * carries on; the call then returns -3, as does every later call on it. */
typedef struct {
    uint8_t *base;
    int64_t len;
    int broken; /* read and written atomically */
} kvx_guard_t;

/* Install the SIGBUS handler that guarded copies need (once; a fault anywhere else goes to the handler
 * installed before it, or to the default action). 0, or -1 if sigaction failed. */
__attribute__((visibility("default")))
int kvx_guard_install(void);

/* kvx_copy_hash whose reads and writes of `guard`'s range are guarded (`guard` NULL: unguarded). */
__attribute__((visibility("default")))
int kvx_copy_hash_guarded(uint8_t *dst, const uint8_t *src, int64_t row_bytes, const int64_t *dst_rows,
                          const int64_t *src_rows, int64_t rows_per_block, const uint8_t *hashed,
                          const int64_t *hashed_spans, int64_t span_bytes, uint64_t *sums, int64_t blocks,
                          int64_t step_blocks, hash_fn hash, int64_t piece_bytes, int threads,
                          kvx_guard_t *guard);

#endif
