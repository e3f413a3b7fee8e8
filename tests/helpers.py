"""Small helpers shared by tests: reading and writing whole blocks through their runs, stopping a process."""

import os
import signal
import subprocess
import time

import torch

from kvxfer.geometry.layout import PoolLayout


def read_block(storage: torch.Tensor, layout: PoolLayout, block: int) -> torch.Tensor:
    """A block's bytes in canonical order (its runs, ascending)."""
    return torch.cat([storage[r.offset:r.end] for r in layout.block_runs(block)]).clone()


def write_block(storage: torch.Tensor, layout: PoolLayout, block: int, data: torch.Tensor) -> None:
    pos = 0
    for r in layout.block_runs(block):
        storage[r.offset:r.end] = data[pos:pos + r.length]
        pos += r.length


def made_and_closed(factory):
    """A fixture's body: yields a maker of ``factory(...)`` objects, each closed after the test."""
    made = []

    def make(*args, **kwargs):
        thing = factory(*args, **kwargs)
        made.append(thing)
        return thing

    yield make
    for thing in made:
        thing.close()


def stop_process(proc: subprocess.Popen, within_s: float = 30.0) -> None:
    """SIGSTOP ``proc`` and return once every thread of it is stopped: the signal is delivered when the
    kernel next runs each thread, and a call sent before that may still be answered."""
    proc.send_signal(signal.SIGSTOP)
    give_up = time.monotonic() + within_s  # (a hang guard)
    tasks = f"/proc/{proc.pid}/task"
    while time.monotonic() < give_up:
        states = []
        for task in os.listdir(tasks):
            try:
                with open(f"{tasks}/{task}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        if states and all(state in "Tt" for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {proc.pid} not stopped within {within_s} s")


def until(check, what: str, seconds: float = 30) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``seconds`` (room for a busy machine)."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def lookup_tiers(daemon, keys: list[bytes]) -> list:
    """Where a daemon's pool ``rank0`` holds each key (None: nowhere)."""
    from kvxfer import Client

    with Client(daemon.target) as client:
        return client.lookup(keys, pool_ids=["rank0"]).tiers


def tier_events(daemon, kind) -> dict:
    """One lower tier's event counts in the daemon's pool ``rank0``, and whether it is degraded."""
    from kvxfer import Client

    with Client(daemon.target) as client:
        (tier,) = [t for t in client.stats("rank0")[0].tiers if t.tier is kind]
        return {**tier.events, "degraded": tier.degraded}
