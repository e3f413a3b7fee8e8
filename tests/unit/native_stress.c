/* Stress test of kvxfer/transfer/_fused.c under ThreadSanitizer and AddressSanitizer
 * (built and run by tests/unit/test_native_copy.py): four threads call the loop at once,
 * each with random batches (1-97 blocks of 3 rows, steps of 1-7 blocks, 1-4 threads,
 * checksums of pieces of 7 or 16 bytes or of one piece a block; streamed where the test builds the
 * loop to stream such small batches), and check every byte and
 * checksum; a forked child calls it too (its parent's helper threads do not exist
 * there). Prints "ok" and exits 0, or names what went wrong. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "_fused.h"

enum { ROWS_PER_BLOCK = 3, ROW = 40, BLOCK = ROWS_PER_BLOCK * ROW, NUM_BLOCKS = 97, BATCHES = 300, CALLERS = 4 };

static uint64_t fnv1a(const void *data, size_t n) { /* any hash will do: the loop only calls it */
    const uint8_t *b = data;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* The checksum the loop computes from a hash: the hash of the pieces' hashes (pieces of `piece`
 * bytes, the last one shorter), as little-endian words. */
static uint64_t pieced(const uint8_t *data, int64_t n, int64_t piece) {
    uint64_t sums[BLOCK + 1];
    int64_t count = 0;
    for (int64_t at = 0; at < n; at += piece)
        sums[count++] = fnv1a(data + at, (size_t)(n - at < piece ? n - at : piece));
    return fnv1a(sums, (size_t)count * sizeof(uint64_t));
}

static void *caller(void *arg) {
    unsigned seed = (unsigned)(uintptr_t)arg;
    static __thread uint8_t src[NUM_BLOCKS * BLOCK], dst[NUM_BLOCKS * BLOCK];
    static __thread int64_t src_rows[NUM_BLOCKS * ROWS_PER_BLOCK], dst_rows[NUM_BLOCKS * ROWS_PER_BLOCK];
    static __thread int64_t spans[NUM_BLOCKS], perm[NUM_BLOCKS];
    static __thread uint64_t sums[NUM_BLOCKS];
    for (int batch = 0; batch < BATCHES; batch++) {
        for (int i = 0; i < NUM_BLOCKS * BLOCK; i++)
            src[i] = (uint8_t)rand_r(&seed);
        memset(dst, 0, sizeof dst);
        const int n = 1 + rand_r(&seed) % NUM_BLOCKS, step = 1 + rand_r(&seed) % 7, threads = 1 + rand_r(&seed) % 4;
        for (int i = 0; i < NUM_BLOCKS; i++)
            perm[i] = i;
        for (int i = NUM_BLOCKS - 1; i > 0; i--) { /* scattered source blocks */
            int j = rand_r(&seed) % (i + 1);
            int64_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        for (int b = 0; b < n; b++) {
            spans[b] = b;
            for (int k = 0; k < ROWS_PER_BLOCK; k++) {
                src_rows[b * ROWS_PER_BLOCK + k] = perm[b] * ROWS_PER_BLOCK + k;
                dst_rows[b * ROWS_PER_BLOCK + k] = b * ROWS_PER_BLOCK + k;
            }
        }
        /* pieces of 16 B or 7 B (copied and hashed piece by piece, across rows), or one piece a block */
        const int64_t pieces[] = {16, 7, BLOCK, 4 * BLOCK}, piece = pieces[rand_r(&seed) % 4];
        if (kvx_copy_hash(dst, src, ROW, dst_rows, src_rows, ROWS_PER_BLOCK, dst, spans, BLOCK, sums, n, step,
                          fnv1a, piece, threads) != 0) {
            printf("batch refused\n");
            exit(1);
        }
        for (int b = 0; b < n; b++)
            if (memcmp(dst + b * BLOCK, src + perm[b] * BLOCK, BLOCK) != 0 || sums[b] != pieced(dst + b * BLOCK, BLOCK, piece)) {
                printf("block %d of batch %d wrong\n", b, batch);
                exit(1);
            }
        /* Copy only (no hashed array: nothing hashed, no sum written), into a cleared destination. */
        memset(dst, 0, (size_t)n * BLOCK);
        if (kvx_copy_hash(dst, src, ROW, dst_rows, src_rows, ROWS_PER_BLOCK, NULL, NULL, 0, NULL, n, step,
                          fnv1a, piece, threads) != 0) {
            printf("copy-only batch refused\n");
            exit(1);
        }
        for (int b = 0; b < n; b++)
            if (memcmp(dst + b * BLOCK, src + perm[b] * BLOCK, BLOCK) != 0) {
                printf("copy-only block %d of batch %d wrong\n", b, batch);
                exit(1);
            }
        /* Hash only (zero rows per block: nothing copied), the source's scattered blocks. */
        if (kvx_copy_hash(NULL, NULL, 0, NULL, NULL, 0, src, perm, BLOCK, sums, n, step, fnv1a, piece, threads) != 0) {
            printf("hash-only batch refused\n");
            exit(1);
        }
        for (int b = 0; b < n; b++)
            if (sums[b] != pieced(src + perm[b] * BLOCK, BLOCK, piece)) {
                printf("hash-only block %d of batch %d wrong\n", b, batch);
                exit(1);
            }
    }
    return NULL;
}

int main(void) {
    for (int round = 0; round < 3; round++) {
        pthread_t threads[CALLERS];
        for (int i = 0; i < CALLERS; i++)
            pthread_create(&threads[i], NULL, caller, (void *)(uintptr_t)(1 + i + 10 * round));
        for (int i = 0; i < CALLERS; i++)
            pthread_join(threads[i], NULL);
        if (round == 1) {
            pid_t pid = fork();
            if (pid == 0) {
                caller((void *)77);
                _exit(0);
            }
            int status;
            waitpid(pid, &status, 0);
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
                printf("forked child failed\n");
                return 1;
            }
        }
    }
#if defined(__x86_64__) && defined(STREAM_MIN_BYTES)
    if (kvx_streamed_batches() == 0) { /* built to stream small batches: some must have been */
        printf("no batch was streamed\n");
        return 1;
    }
#endif
    printf("ok\n");
    return 0;
}
