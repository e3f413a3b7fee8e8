/* The interface of kvxfer's fused copy-and-hash loop (_fused.c): what ctypes calls
 * (kvxfer/transfer/native.py mirrors it) and what the sanitizer test links against. */
#ifndef KVXFER_FUSED_H
#define KVXFER_FUSED_H

#include <stddef.h>
#include <stdint.h>

typedef uint64_t (*hash_fn)(const void *, size_t);

/* XXH3's streaming API (state, reset with seed 0, update, digest), for blocks larger than a
 * piece: such a block is copied a piece at a time and each piece hashed right after, from L1/L2. */
typedef struct {
    void *(*create)(void);
    int (*release)(void *);
    int (*reset)(void *);
    int (*update)(void *, const void *, size_t);
    uint64_t (*digest)(const void *);
} stream_fns;

/* Copy `blocks` blocks of `rows_per_block` rows (dst row dst_rows[r] <- src row src_rows[r])
 * in steps of `step_blocks` blocks on up to `threads` threads, and store in sums[b] the hash
 * of block b's span of `hashed` (hashed + hashed_spans[b] * span_bytes: its rows, in order,
 * on the tier side). `stream` may be NULL (every block hashed whole after its step). With
 * `rows_per_block` 0 nothing is copied (dst, src and the row arrays unused): spans are only hashed.
 * Returns 0, or -1 if the batch has too many steps. */
__attribute__((visibility("default")))
int kvx_copy_hash(uint8_t *dst, const uint8_t *src, int64_t row_bytes, const int64_t *dst_rows,
                  const int64_t *src_rows, int64_t rows_per_block, const uint8_t *hashed,
                  const int64_t *hashed_spans, int64_t span_bytes, uint64_t *sums, int64_t blocks,
                  int64_t step_blocks, hash_fn hash, const stream_fns *stream, int threads);

#endif
