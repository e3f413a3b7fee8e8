"""``kvxfer bench policy``: a trace through the real index. Its LRU is the textbook LRU of a prefix cache
(each request reuses its longest cached prefix, then stores every block), its Belady never does worse
than LRU and equals it when everything fits, and the command writes its table, JSON and plot."""

import json
import random
import subprocess
import sys
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.bench import policy, policy_hints


def textbook_lru(requests, capacity):
    cache, hits = OrderedDict(), 0
    for blocks in requests:
        prefix = next((k for k, b in enumerate(blocks) if b not in cache), len(blocks))
        hits += prefix
        for b in blocks[:prefix]:  # loaded: used, in request order
            cache.move_to_end(b)
        held = {b for b in blocks if b in cache}
        for b in blocks:  # stored again: used, and never evicted for this request's new blocks
            if b in held:
                cache.move_to_end(b)
        for b in blocks:
            if b not in cache:
                if len(cache) >= capacity:
                    victim = next((v for v in cache if v not in held), None)
                    if victim is None:
                        break  # every slot holds this request's blocks: the rest are not stored
                    del cache[victim]
                cache[b] = True
                held.add(b)  # (being written: not evictable by its own request)
    return hits


prefix_requests = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=40).map(
    lambda shapes: [[100 * root + k for k in range(length)] for root, length in shapes])


@settings(max_examples=60, deadline=None)
@given(prefix_requests, st.integers(1, 12))
def test_lru_through_the_index_is_the_textbook_lru_and_belady_is_never_worse(requests, capacity):
    trace = policy.of_requests(requests)
    lru_hits, _ = policy.replay(trace, capacity, "lru")
    assert lru_hits == textbook_lru(requests, capacity)
    belady_hits, _ = policy.replay(trace, capacity, "belady")
    assert belady_hits >= lru_hits
    everything = len({b for r in requests for b in r})
    if capacity >= everything:
        assert belady_hits == lru_hits


def test_belady_keeps_what_comes_back_first():
    # Two prefixes of two blocks alternate with one-off blocks, in a cache of two: LRU loses both every time;
    # Belady keeps one (either way two hits: a cache of two holds one prefix) and stores no one-off block.
    requests = [[1, 2], [50], [3, 4], [51], [1, 2], [52], [3, 4]]
    trace = policy.of_requests(requests)
    assert policy.replay(trace, 2, "lru")[0] == 0
    assert policy.replay(trace, 2, "belady")[0] == 2


def test_the_command_prints_the_curve_and_writes_json_and_a_plot(tmp_path):
    rng = random.Random(5)
    lines = []
    for _ in range(200):
        root = rng.randrange(20)
        lines.append(json.dumps({"timestamp": 0, "hash_ids": [root * 100 + k for k in range(rng.randrange(1, 8))]}))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli.commands", "bench", "policy", str(trace),
                          "--shares", "0.1,0.5,1",
                          "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "LRU hit ratio" in out.stdout and "Belady hit ratio" in out.stdout
    curve = json.loads((tmp_path / "r.json").read_text())["curve"]
    assert [c["share"] for c in curve] == [0.1, 0.5, 1.0]
    assert all(c["belady"] >= c["lru"] for c in curve) and curve[-1]["belady"] == curve[-1]["lru"]
    assert (tmp_path / "r.png").stat().st_size > 1000
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"hash_ids": [1, 1]}) + "\n")
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli.commands", "bench", "policy", str(bad)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "distinct integers" in out.stderr


@settings(max_examples=60, deadline=None)
@given(prefix_requests, st.integers(1, 12))
def test_the_hinted_index_without_hints_is_exactly_lru(requests, capacity):
    trace = policy.of_requests(requests)
    none = policy_hints.released(requests, "none")
    assert policy.replay(trace, capacity, "hinted", none)[0] == policy.replay(trace, capacity, "lru")[0]


def test_turns_are_found_from_the_trace():
    # A conversation [1, 2] -> [1, 2, 3] (repeats all but the last block... of a one-block head: it must
    # repeat at least one) -> [1, 2, 3, 4, 5]; a one-off [9]; [7, 8] continued by a request that changed
    # only its last block ([7, 6]): all but at most the last block repeated.
    requests = [[1, 2], [9], [1, 2, 3], [7, 8], [1, 2, 3, 4, 5], [7, 6]]
    assert policy_hints.last_turns(requests) == [False, True, False, False, True, True]
    assert policy_hints.released(requests, "session-end") == [False, True, False, False, True, True]
    wrong = policy_hints.released(requests * 50, "session-end", wrong=0.5, seed=1)
    assert sum(wrong) > sum(policy_hints.released(requests * 50, "session-end"))


def conversations(seed: int, n: int) -> list[list[int]]:
    """Interleaved conversations of 1-6 turns, each turn two more blocks than the last, and their ends."""
    rng, live, out, next_id = random.Random(seed), [], [], 0
    while len(out) < n:
        if not live or rng.random() < 0.3:
            live.append([[next_id, next_id + 1], rng.randint(1, 6)])
            next_id += 2
        chat = rng.choice(live)
        out.append(list(chat[0]))
        chat[0] += [next_id, next_id + 1]
        next_id += 2
        chat[1] -= 1
        if chat[1] == 0:
            live.remove(chat)
    return out


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(0, 10_000), st.integers(4, 60))
def test_session_end_hints_are_never_below_lru_on_conversations(seed, capacity):
    requests = conversations(seed, 120)
    trace = policy.of_requests(requests)
    released = policy_hints.released(requests, "session-end")
    assert policy.replay(trace, capacity, "hinted", released)[0] >= policy.replay(trace, capacity, "lru")[0]


def test_the_command_replays_hints_beside_lru_and_belady(tmp_path):
    trace = tmp_path / "chats.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0, "hash_ids": r}) + "\n" for r in conversations(3, 300)))
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli.commands", "bench", "policy", str(trace),
                          "--shares", "0.05,0.2",
                          "--hints", "session-end", "--wrong", "0.2", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "session-end hit ratio" in out.stdout and "20% wrong: hit ratio" in out.stdout
    curve = json.loads((tmp_path / "r.json").read_text())["curve"]
    assert all(c["belady"] >= c["hinted"] >= c["lru"] for c in curve)
    assert any(c["hinted"] > c["lru"] for c in curve)
