"""The synthetic traces ``kvxfer bench trace`` writes: the Mooncake format ``bench policy`` replays, in time
order, with content-addressed prefix chains, and each kind's shape (a conversation's turns extend each other,
agents share their system prompts, a scan's documents are read once)."""

import json

import pytest

from kvxfer.bench.traces import KINDS, make
from kvxfer.cli import commands as cli


def _requests(kind: str, n: int = 600, seed: int = 3) -> list[dict]:
    return [json.loads(line) for line in make(kind, n, seed)]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_trace_is_in_time_order_and_its_ids_name_whole_prefixes(kind):
    requests = _requests(kind)
    assert len(requests) == 600 and [r["timestamp"] for r in requests] == sorted(r["timestamp"] for r in requests)
    parent_of: dict[int, int] = {}
    for r in requests:
        ids = r["hash_ids"]
        assert r["input_length"] == 512 * len(ids) and r["output_length"] > 0
        for parent, block in zip([-1] + ids, ids):
            assert parent_of.setdefault(block, parent) == parent  # one id, one prefix
    assert _requests(kind) == requests and _requests(kind, seed=4) != requests  # a seed names a trace


def test_a_chats_turns_extend_its_earlier_turns_and_a_scans_documents_are_read_once():
    chat = _requests("chat")
    extended = sum(any(r["hash_ids"][:len(p["hash_ids"]) - 1] == p["hash_ids"][:-1] and len(p["hash_ids"]) > 1
                       for p in chat[max(0, i - 200):i]) for i, r in enumerate(chat))
    assert extended > len(chat) // 2  # most turns continue a conversation (all but the partial last block)
    scan = _requests("scan", 2000)
    firsts = [r["hash_ids"][0] for r in scan]
    documents = [r for r in scan if len(r["hash_ids"]) > 40]
    assert 0.1 * len(scan) < len(documents) < 0.3 * len(scan)
    assert all(firsts.count(d["hash_ids"][0]) == 1 for d in documents)
    agents = {r["hash_ids"][0] for r in _requests("agent")}
    assert len(agents) <= 4  # every session starts with one of the agents' system prompts


def test_bench_trace_then_bench_policy(tmp_path, capsys):
    out = tmp_path / "chat.jsonl"
    assert cli.main(["bench", "trace", "chat", str(out), "--requests", "300"]) == 0
    assert len(out.read_text().splitlines()) == 300
    assert cli.main(["bench", "policy", str(out), "--shares", "0.1,1", "--json", str(tmp_path / "p.json")]) == 0
    curve = json.loads((tmp_path / "p.json").read_text())["curve"]
    assert curve[-1]["lru"] == curve[-1]["belady"] > 0.3  # a tier holding everything: every reuse hits
    assert curve[0]["lru"] <= curve[0]["belady"]
