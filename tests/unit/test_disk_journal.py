"""The disk tier's base and journal (kvxfer/tiers/disk_journal.py) against a model: what a crash at
any point leaves is replayed to exactly what was acknowledged; anything torn, foreign or mixed is
refused (the caller scans)."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvxfer.tiers.disk.journal as disk_journal
from kvxfer.tiers.disk.files import BASE, JOURNAL
from kvxfer.tiers.disk.journal import Journal, recover

FINGERPRINT = b"format-1"
CAPACITY = 12


@pytest.fixture
def directory(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def as_model(entries) -> list[tuple[int, str, bytes, int, int]]:
    return [(e.slot, e.namespace, e.key, e.checksum, e.key_format) for e in entries]


def begin(journal: Journal, model: dict) -> None:
    journal.begin(lambda: [[(ns, key, slot, checksum, code) for slot, (ns, key, checksum, code) in model.items()]],
                  len(model))


ops = st.lists(st.one_of(
    st.tuples(st.just("store"), st.lists(st.tuples(st.integers(0, CAPACITY - 1), st.sampled_from(["a", "b"]),
                                                   st.binary(min_size=1, max_size=4), st.integers(0, 2**64 - 1),
                                                   st.integers(0, 1)),  # (the key's format: kept across restarts)
                                         max_size=4, unique_by=lambda t: t[0])),
    st.tuples(st.just("remove"), st.lists(st.integers(0, CAPACITY - 1), max_size=4, unique=True)),
    st.tuples(st.just("rebase"), st.none()),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(steps=ops)
def test_a_crash_after_any_sequence_recovers_exactly_what_was_journaled(tmp_path_factory, steps):
    path = tmp_path_factory.mktemp("j")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        journal = Journal(fd, FINGERPRINT)
        model: dict[int, tuple[str, bytes, int, int]] = {}  # slot -> entry, least recently stored first
        begin(journal, model)
        for op, arg in steps:
            if op == "store":
                for slot, ns, key, checksum, code in arg:
                    journal.stored(ns, [(slot, key, checksum, code)])
                    for other in [s for s, e in model.items() if e[:2] == (ns, key)]:
                        del model[other]  # (the index never holds a key twice; the journal copes anyway)
                    model.pop(slot, None)
                    model[slot] = (ns, key, checksum, code)
            elif op == "remove":
                journal.removed(arg)
                for slot in arg:
                    model.pop(slot, None)
            else:
                begin(journal, model)
        journal.close()  # a crash: nothing more is written
        got = recover(fd, FINGERPRINT, CAPACITY)
        assert got is not None and as_model(got) == [(s, *e) for s, e in model.items()]
        assert not {BASE, JOURNAL} & set(os.listdir(path))  # consumed
    finally:
        os.close(fd)


def test_a_torn_last_record_is_dropped_and_the_rest_kept(directory):
    journal = Journal(directory, FINGERPRINT)
    begin(journal, {0: ("a", b"k0", 5, 0)})
    journal.stored("a", [(1, b"k1", 6, 0)])
    journal.stored("a", [(2, b"k2", 7, 0)])
    journal.close()
    size = os.stat(JOURNAL, dir_fd=directory).st_size
    os.truncate(os.open(JOURNAL, os.O_WRONLY, dir_fd=directory), size - 3)  # a crash mid-append
    assert as_model(recover(directory, FINGERPRINT, CAPACITY)) == [(0, "a", b"k0", 5, 0), (1, "a", b"k1", 6, 0)]


@pytest.mark.parametrize("damage", ["mode", "generation", "fingerprint", "no-base", "capacity"])
def test_a_journal_not_ours_or_not_of_its_base_is_refused_and_consumed(directory, damage):
    journal = Journal(directory, FINGERPRINT)
    begin(journal, {3: ("a", b"k3", 1, 0)})
    journal.stored("a", [(11, b"k11", 2, 0)])
    journal.close()
    if damage == "mode":
        os.chmod(JOURNAL, 0o644, dir_fd=directory)
    elif damage == "generation":  # a base of another life beside this journal
        other = Journal(directory, FINGERPRINT)
        os.rename(JOURNAL, "saved", src_dir_fd=directory, dst_dir_fd=directory)
        begin(other, {})
        other.close()
        os.rename("saved", JOURNAL, src_dir_fd=directory, dst_dir_fd=directory)
    elif damage == "no-base":
        os.unlink(BASE, dir_fd=directory)
    fingerprint = b"format-2" if damage == "fingerprint" else FINGERPRINT
    capacity = 4 if damage == "capacity" else CAPACITY  # slot 11 is out of a smaller tier
    got = recover(directory, fingerprint, capacity)
    if damage == "capacity":
        assert got is None or all(e.slot < 4 for e in got)
    else:
        assert got is None
    assert not {BASE, JOURNAL} & set(os.listdir(directory))


def test_removals_while_a_new_base_is_written_open_its_journal(directory):
    journal = Journal(directory, FINGERPRINT)
    model = {0: ("a", b"k0", 1, 0), 1: ("a", b"k1", 2, 0)}
    begin(journal, model)

    def entries():  # a Delete on another thread while the writer thread writes the base
        yield [("a", b"k0", 0, 1, 0)]
        journal.removed([0, 1])
        yield [("a", b"k1", 1, 2, 0)]

    journal.begin(entries, 2)
    journal.close()
    assert recover(directory, FINGERPRINT, CAPACITY) == []


def test_a_failed_append_stops_the_journal_and_removes_it(directory, monkeypatch):
    journal = Journal(directory, FINGERPRINT)
    begin(journal, {})

    def full(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_journal, "write_all", full)
    journal.removed([1])  # not on disk: a later crash must not trust what is there
    assert not {BASE, JOURNAL} & set(os.listdir(directory))
    journal.stored("a", [(2, b"k", 3, 0)])  # ignored from now on
    assert recover(directory, FINGERPRINT, CAPACITY) is None


def test_the_base_is_due_when_the_journal_outgrows_it(directory, monkeypatch):
    monkeypatch.setattr(disk_journal, "MIN_RECORDS", 4)
    journal = Journal(directory, FINGERPRINT)
    begin(journal, {s: ("a", b"k%d" % s, s, 0) for s in range(6)})
    journal.removed([0, 1, 2])
    assert not journal.due
    journal.removed([3, 4])
    assert journal.due
    begin(journal, {5: ("a", b"k5", 5, 0)})
    assert not journal.due
    journal.end()
    assert not {BASE, JOURNAL} & set(os.listdir(directory))
