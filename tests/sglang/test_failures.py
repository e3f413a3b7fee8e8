"""What SGLang sees when the daemon fails: misses within a deadline, never an exception, never a torn page."""

import hashlib
import queue
import signal
import threading
import time

import pytest
import torch

from kvxfer import Client
from kvxfer.bench import launch
from tests.sglang.conftest import DAEMON, RETRY_S, backend, extra_config, fill, host_pool, page_bytes
from tests.tiermem import flip_byte

KEYS = [hashlib.sha256(f"chain{i}".encode()).hexdigest() for i in range(16)]
DEADLINE_S, TIMEOUT_S = 1.0, 0.5


def test_a_daemon_killed_mid_prefetch_turns_into_misses_within_the_deadline(stores):
    daemon = launch.spawn(DAEMON)
    try:
        pool = host_pool("page_first")
        store = stores(pool, extra_config(daemon.config["socket"], deadline_s=DEADLINE_S, timeout_s=TIMEOUT_S))
        pages = pool.alloc(len(KEYS) * pool.page_size)
        fill(pool, 7)
        assert store.batch_set_v1(KEYS, pages) == [True] * len(KEYS)
        answers: queue.Queue = queue.Queue()
        stop = threading.Event()

        def prefetch() -> None:  # SGLang's prefetch thread: exists, then get, again and again
            while not stop.is_set():
                started = time.monotonic()
                try:
                    hits = store.batch_exists(KEYS)
                    loaded = store.batch_get_v1(KEYS, pages)
                except BaseException as exc:  # noqa: BLE001 - the test asserts there is none
                    answers.put(("raised", exc, 0.0))
                    return
                answers.put((hits, loaded, time.monotonic() - started))

        thread = threading.Thread(target=prefetch)
        thread.start()
        time.sleep(0.3)
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        time.sleep(1.0)
        stop.set()
        thread.join(timeout=10)
        assert not thread.is_alive()
        seen = list(answers.queue)
        assert all(a[0] != "raised" for a in seen), seen[-1]
        assert all(a[2] < DEADLINE_S + TIMEOUT_S + 1.0 for a in seen)  # no call outlived its deadline
        assert seen[0][1] == [True] * len(KEYS) and seen[-1][0] == 0 and seen[-1][1] == [False] * len(KEYS)
        assert all(len(loaded) == len(KEYS) and all(isinstance(ok, bool) for ok in loaded) for _, loaded, _ in seen)
    finally:
        daemon.cleanup()


def test_a_restarted_daemon_is_registered_with_again_and_stores_anew(stores):
    daemon = launch.spawn(DAEMON)
    socket = daemon.config["socket"]
    pool = host_pool("layer_first")
    store = stores(pool, extra_config(socket, deadline_s=DEADLINE_S, timeout_s=TIMEOUT_S))
    pages = pool.alloc(4 * pool.page_size)
    fill(pool, 8)
    assert store.batch_set_v1(KEYS[:4], pages) == [True] * 4
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    assert store.batch_set_v1(KEYS[4:8], pages) == [False] * 4  # down: misses, at once
    restarted = launch.spawn({**DAEMON, "socket": socket})
    try:
        time.sleep(RETRY_S * 2)
        assert store.batch_exists(KEYS[:4]) == 0  # the host tier died with the daemon
        assert store.batch_set_v1(KEYS[:4], pages) == [True] * 4  # the link registered the pools again
        before = [page_bytes(pool, p) for p in range(4)]
        pool.kv_buffer.zero_()
        assert store.batch_get_v1(KEYS[:4], pages) == [True] * 4
        assert [page_bytes(pool, p) for p in range(4)] == before
    finally:
        restarted.cleanup()
        daemon.cleanup()


def test_a_corrupted_tier_byte_is_a_miss_and_the_page_is_dropped(daemon, stores):
    pool = host_pool("page_first_direct")  # a page's K half is one run: the needle to find in the tier
    store = stores(pool, extra_config(daemon.config["socket"]))
    pages = pool.alloc(4 * pool.page_size)
    fill(pool, 9)
    assert store.batch_set_v1(KEYS[:4], pages) == [True] * 4
    before = [page_bytes(pool, p) for p in range(4)]
    k_half = pool.kv_buffer[0, 2].contiguous().view(-1).view(torch.uint8).numpy().tobytes()  # page 2's K part
    assert flip_byte(daemon.proc.pid, k_half) == 1
    pool.kv_buffer.zero_()
    assert store.batch_get_v1(KEYS[:4], pages) == [True, True, False, True]  # per-page DATA_LOSS is a miss
    assert [page_bytes(pool, p) for p in (0, 1, 3)] == [before[p] for p in (0, 1, 3)]
    assert store.batch_exists(KEYS[:4]) == 2  # the corrupt entry was dropped
    with Client(daemon.target) as client:
        stats = client.stats(store.mover.names.pool_id("host"))[0]
        assert stats.outcomes.get("data_loss") == 1


def test_a_misspelt_setting_stops_sglang_at_attach_naming_it(daemon):
    pool = host_pool("page_first")
    with pytest.raises(ValueError, match=r"extra-config\.dedline_s.*did you mean 'deadline_s'"):
        backend(pool, {**extra_config(daemon.config["socket"]), "dedline_s": 2})
    with pytest.raises(ValueError, match=r"extra-config\.deadline_s: a number of seconds"):
        backend(pool, {**extra_config(daemon.config["socket"]), "deadline_s": -1})


def test_sglangs_prefetch_and_backup_threads_share_one_backend(daemon, stores):
    """The controller's threads call at once: stores and loads of different pages never mix."""
    pool = host_pool("page_first", "default")  # every page through the one staging area
    store = stores(pool, extra_config(daemon.config["socket"], staging_pages=4))
    fill(pool, 10)
    halves = pool.alloc(8 * pool.page_size), pool.alloc(8 * pool.page_size)
    ref = {p: page_bytes(pool, p) for p in range(16)}
    errors = []

    def backup(keys, pages) -> None:
        for _ in range(5):
            if store.batch_set_v1(keys, pages) != [True] * len(keys):
                errors.append("store")

    threads = [threading.Thread(target=backup, args=(KEYS[:8], halves[0])),
               threading.Thread(target=backup, args=(KEYS[8:], halves[1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    pool.kv_buffer.zero_()
    loaders = [threading.Thread(target=lambda k=k, h=h: errors.extend(
        [] if store.batch_get_v1(k, h) == [True] * 8 else ["load"])) for k, h in ((KEYS[:8], halves[0]),
                                                                             (KEYS[8:], halves[1]))]
    for t in loaders:
        t.start()
    for t in loaders:
        t.join()
    assert not errors
    assert {p: page_bytes(pool, p) for p in range(16)} == ref
