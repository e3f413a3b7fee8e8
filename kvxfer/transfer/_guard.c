/* The guard of kvxfer's guarded copies (kvx_copy_hash_guarded in _fused.c): a pool mapped from a file
 * its owner may shrink. Each copying thread names the guard it copies under in a thread-local before it
 * touches the pool; a SIGBUS on the guarded range (the file shrunk) marks the guard broken, then maps
 * anonymous memory over the whole range, so the faulting copy re-runs on zeros and ends, and the call
 * reports -3. The mark comes first: a thread that reads the zeros has already seen it when its call ends.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "_fused.h"
#include "_guard.h"

__thread kvx_guard_t *kvx_guarding __attribute__((tls_model("initial-exec")));
static struct sigaction chained; /* SIGBUS's handler before ours */

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    kvx_guard_t *g = kvx_guarding;
    const uint8_t *at = (const uint8_t *)info->si_addr;
    if (g != NULL && info->si_code > 0 && at >= g->base && at < g->base + g->len) {
        __atomic_store_n(&g->broken, 1, __ATOMIC_SEQ_CST); /* before any thread can read the zeros */
        if (mmap(g->base, (size_t)g->len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED | MAP_ANONYMOUS, -1, 0)
            != MAP_FAILED)
            return; /* the faulting access runs again, on anonymous memory */
    }
    if (chained.sa_flags & SA_SIGINFO) {
        chained.sa_sigaction(sig, info, context);
    } else if (chained.sa_handler == SIG_DFL || chained.sa_handler == SIG_IGN) {
        signal(sig, SIG_DFL); /* the access faults again and the process ends as it would have */
    } else {
        chained.sa_handler(sig);
    }
}

static int install_result = -1;
static pthread_once_t install_once = PTHREAD_ONCE_INIT;
static void install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    install_result = sigaction(SIGBUS, &sa, &chained);
}

int kvx_guard_install(void) {
    pthread_once(&install_once, install);
    return install_result;
}
