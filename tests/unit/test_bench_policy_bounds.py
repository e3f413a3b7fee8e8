"""``kvxfer bench policy-bounds``: each bound runs through the real index and ranks what it is told: when
everything fits they all equal LRU; the history oracle keeps blocks read before over new ones, the queue
keeps what waiting requests read; the hazard table counts each read's gap to the next by reads so far."""

import json
import random
import subprocess
import sys

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.bench import policy
from kvxfer.bench import policy_bounds as pb

prefix_requests = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=30).map(
    lambda shapes: [[100 * root + k for k in range(length)] for root, length in shapes])


@settings(max_examples=30, deadline=None)
@given(prefix_requests)
def test_when_everything_fits_every_bound_is_lru(requests):
    trace = policy.of_requests(requests)
    lru = policy.replay(trace, trace.distinct, "lru")[0]
    for name, score in pb.bounds(trace, horizon=3).items():
        assert pb.replay(trace, trace.distinct, score) == lru, name


def test_the_history_oracle_keeps_blocks_read_before_over_new_ones():
    # [1, 2] read twice, then two one-off blocks in a cache of two: LRU has lost both by the third read;
    # the oracle knows [1, 2] comes back (their history says they are read again) and evicts the new 50.
    trace = policy.of_requests([[1, 2], [1, 2], [50], [51], [1, 2]])
    assert policy.replay(trace, 2, "lru")[0] == 2
    assert pb.replay(trace, 2, pb.history_oracle(len(trace.requests))) == 3  # 2, then the prefix [1]
    # On a first read it knows nothing: the same as LRU where no block is read before it is needed.
    once = policy.of_requests([[1, 2], [50], [60], [1, 2]])
    assert pb.replay(once, 2, pb.history_oracle(4)) == policy.replay(once, 2, "lru")[0] == 0


def test_a_queue_keeps_what_waiting_requests_read():
    trace = policy.of_requests([[1, 2], [50], [60], [1, 2]])
    assert policy.replay(trace, 2, "lru")[0] == 0
    assert pb.replay(trace, 2, pb.queue(0, 4)) == 0  # a queue of none: least recently used first
    assert pb.replay(trace, 2, pb.queue(8, 4)) == 1  # 50 takes the deeper 2, 60 takes 50: [1] is a hit


def test_the_hazard_table_counts_gaps_by_reads_so_far():
    trace = policy.of_requests([[1], [1], [2], [1]])
    hazard = pb.Hazard.fit(trace, horizon=1)
    assert list(hazard.gaps[1]) == [1, policy.NEVER]  # block 1's first read (next: 1 later), block 2's
    assert list(hazard.gaps[2]) == [2] and list(hazard.gaps[3]) == [policy.NEVER]
    ranked = pb.Ranked(4, hazard.score)
    ranked.now = 5
    for slot, (last, count) in enumerate([(5, 1), (4, 1), (5, 2), (3, 2)]):
        ranked.set(slot, last, count, 0, 0)
    # chance of a read within 1 request: count 1 age 0: 1 of 2; count 1 age 1: none of the 1 still alive;
    # count 2 age 0: none (its gap is 2); count 2 age 2: none alive
    assert list(-ranked.score(ranked, np.arange(4))) == [0.5, 0.0, 0.0, 0.0]


def test_the_command_prints_the_bounds_and_writes_json_and_a_plot(tmp_path):
    rng = random.Random(7)
    lines = [json.dumps({"hash_ids": [r * 100 + k for k in range(rng.randrange(1, 8))]})
             for r in (rng.randrange(20) for _ in range(150))]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli.commands", "bench", "policy-bounds", str(trace), "--shares",
                          "0.2,1", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "history-oracle" in out.stdout and "queue-128" in out.stdout
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [r["share"] for r in results] == [0.2, 1.0]
    assert all(r["hit_ratio"]["belady"] >= r["hit_ratio"]["lru"] for r in results)
    assert all(v == results[1]["hit_ratio"]["lru"] for v in results[1]["hit_ratio"].values())
    assert (tmp_path / "r.png").stat().st_size > 1000
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli.commands", "bench", "policy-bounds", str(trace),
                          "--horizon", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "--horizon" in out.stderr
