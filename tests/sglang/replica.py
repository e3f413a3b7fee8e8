"""Another SGLang replica, in a process of its own: ``python -m tests.sglang.replica SOCKET LAYOUT ALLOCATOR KEY...``
builds its own host pool and backend, asks how many of the keys the daemon holds, loads them into its
own pages and prints, as JSON, the hit count and each loaded page's SHA-256 (by SGLang's accessor)."""

import hashlib
import json
import sys

from tests.sglang.conftest import backend, extra_config, host_pool, page_bytes


def main(socket: str, layout: str, allocator: str, *keys: str) -> None:
    pool = host_pool(layout, allocator)
    store = backend(pool, extra_config(socket, allocator))
    hits = store.batch_exists(list(keys))
    pages = pool.alloc(len(keys) * pool.page_size)
    loaded = store.batch_get_v1(list(keys), pages)
    digests = [hashlib.sha256(page_bytes(pool, int(p))).hexdigest() for p in pages[::pool.page_size] // pool.page_size]
    store.close()
    print(json.dumps({"hits": hits, "loaded": loaded, "digests": digests}))


if __name__ == "__main__":
    main(*sys.argv[1:])
