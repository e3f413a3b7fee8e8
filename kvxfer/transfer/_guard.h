/* What _fused.c needs of the guard (_guard.c): the thread-local naming the guard a thread copies under,
 * and whether a guard is broken. Internal: not part of the interface ctypes calls (_fused.h). */
#ifndef KVXFER_GUARD_H
#define KVXFER_GUARD_H

#include "_fused.h"

/* The guard the calling thread copies under now (NULL: none). initial-exec: reading it in the signal
 * handler never allocates (a dynamic TLS block may be allocated on first touch). */
extern __thread kvx_guard_t *kvx_guarding __attribute__((tls_model("initial-exec")));

static inline int kvx_guard_broken(const kvx_guard_t *guard) {
    return guard != NULL && __atomic_load_n(&guard->broken, __ATOMIC_SEQ_CST);
}

#endif
