"""Lease releases leave on one long-lived thread per peer (``kvxfer.peering.releaser``): a restore never
waits for one, none is lost while the queue has room, and the queue is bounded."""

import threading
import time

import pytest

from kvxfer.peering.releaser import Releaser


def test_releases_are_sent_in_order_on_one_thread_and_close_sends_what_is_queued():
    sent, threads, gate = [], set(), threading.Event()

    def send_now(request, failed):
        gate.wait(30)
        sent.append(request)
        threads.add(threading.current_thread().name)

    releaser = Releaser("kvxfer-release-a", send_now)
    for i in range(50):
        releaser.send(i, lambda cause: pytest.fail(f"release {cause}"))  # returns at once: the send waits
    gate.set()
    releaser.close(timeout=30)
    assert sent == list(range(50)) and threads == {"kvxfer-release-a"}


def test_a_full_queue_reports_the_release_failed_at_once_and_keeps_the_others():
    gate, failures = threading.Event(), []
    releaser = Releaser("r", lambda request, failed: gate.wait(30), max_queued=3)
    for i in range(6):  # one taken by the thread (or not yet): at most 3 wait, the rest are refused
        releaser.send(i, failures.append)
    assert 2 <= len(failures) <= 3 and set(failures) == {"backoff"}
    gate.set()
    releaser.close(timeout=30)
    assert releaser.pending() == 0


def test_a_send_that_raises_is_counted_failed_and_the_thread_goes_on():
    sent, failures = [], []

    def send_now(request, failed):
        if request == 1:
            raise RuntimeError("a bug in one send")
        sent.append(request)

    releaser = Releaser("r", send_now)
    for i in range(3):
        releaser.send(i, failures.append)
    releaser.close(timeout=30)
    assert sent == [0, 2] and failures == ["release"]


def test_after_close_a_release_is_refused_not_queued_for_ever():
    failures = []
    releaser = Releaser("r", lambda request, failed: None)
    releaser.close()
    releaser.send(0, failures.append)
    assert failures == ["backoff"] and releaser.pending() == 0


def test_close_waits_at_most_its_timeout_for_a_send_that_hangs():
    """A peer that stalls cannot hold a shutdown: ``close`` gives up after its timeout (the lease ends at its
    deadline at the peer)."""
    gate = threading.Event()
    releaser = Releaser("r", lambda request, failed: gate.wait(60))
    releaser.send(0, lambda cause: None)
    start = time.monotonic()
    releaser.close(timeout=0.2)
    assert time.monotonic() - start < 30  # (a hang guard: the send blocks for 60 s)
    gate.set()
