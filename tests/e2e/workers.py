"""Client programs the end-to-end tests run as separate processes.

``python -m tests.e2e.workers FUNCTION '[args...]'`` prints the function's JSON result
as its last line. Each one is a real client: it maps the daemon's pool itself.
"""

import json
import sys
import time

import torch

from kvxfer.client import Client
from kvxfer.errors import KvxferError


def _fill(views, slots: list[int], seed: int) -> list[list[torch.Tensor]]:
    """Write distinct random K and V into every layer of ``slots``; return what was written."""
    g = torch.Generator().manual_seed(seed)
    written = []
    for k, v in views:
        per_layer = []
        for view in (k, v):
            data = torch.randn((len(slots), *view.shape[1:]), generator=g).to(view.dtype)
            view[slots] = data
            per_layer.append(data)
        written.append(per_layer)
    return written


def _same(views, slots: list[int], written) -> bool:
    for (k, v), (wk, wv) in zip(views, written):
        for view, want in ((k, wk), (v, wv)):
            if not torch.equal(view[slots].contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)):
                return False
    return True


def roundtrip(target: str, pool_id: str, namespace: str, seed: int, src: list[int], dst: list[int]) -> dict:
    """Write a sequence through the views, offload, overwrite, restore into other slots, compare."""
    with Client(target, namespace, pool_id=pool_id) as client:
        views = client.kv_views()
        block_size = client.pool_info().spec.block_size
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 150000, (len(src) * block_size + block_size // 2,), generator=g).tolist()
        keys = client.block_keys(tokens, block_size)
        assert len(keys) == len(src)
        block_table = list(src)  # logical block i -> physical slot
        written = _fill(views, block_table, seed)
        result = client.offload(list(zip(block_table, keys)))
        _fill(views, block_table, seed + 1)  # the engine reuses the slots
        assert not _same(views, block_table, written)
        assert client.lookup(keys).hits == len(keys)
        restored = client.restore(list(zip(keys, dst)))
        block_table = list(dst)  # the remapped table
        return {"same": _same(views, block_table, written), "offload_bytes": result.bytes,
                "restore_bytes": restored.bytes, "keys": [k.hex() for k in keys]}


def namespace_probe(target: str, pool_id: str, namespace: str, keys_hex: list[str]) -> dict:
    """What another namespace sees of some keys."""
    with Client(target, namespace, pool_id=pool_id) as client:
        keys = [bytes.fromhex(k) for k in keys_hex]
        return {"hits": client.lookup(keys).hits,
                "restore": [o.value for o in client.restore([(keys[0], 1)], partial=True).outcomes]}


WRITER_SLOTS = 47  # offload_forever writes slots 1..47; verify_present restores into 48 and up


def offload_forever(target: str, pool_id: str, namespace: str, batch: int, seconds: float) -> dict:
    """Offload rounds of freshly written blocks until the daemon goes away; count what was acknowledged.

    Key ``r{round}-{j}`` holds K = (round * 1000 + j) % 2048 and V = layer in every element.
    """
    done, errors = 0, []
    deadline = time.monotonic() + seconds
    with Client(target, namespace, pool_id=pool_id, timeout=30) as client:
        views = client.kv_views()
        print(json.dumps({"started": True}), flush=True)
        round_ = 0
        while time.monotonic() < deadline:
            slots = [1 + (round_ * batch + j) % WRITER_SLOTS for j in range(batch)]
            for layer, (k, v) in enumerate(views):
                for j, slot in enumerate(slots):
                    k[slot].fill_(float((round_ * 1000 + j) % 2048))
                    v[slot].fill_(float(layer))
            keys = [f"r{round_}-{j}".encode() for j in range(batch)]
            try:
                client.offload(list(zip(slots, keys)), partial=True)
                done += batch
            except KvxferError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                break
            round_ += 1
    return {"acknowledged": done, "rounds": round_, "errors": errors}


def verify_present(target: str, pool_id: str, namespace: str, batch: int, seconds: float) -> dict:
    """Round by round: restore every key a lookup reports present and check its bytes."""
    checked, bad, round_ = 0, [], 0
    deadline = time.monotonic() + seconds
    with Client(target, namespace, pool_id=pool_id, timeout=30) as client:
        views = client.kv_views()
        print(json.dumps({"started": True}), flush=True)
        try:
            while time.monotonic() < deadline:
                keys = [f"r{round_}-{j}".encode() for j in range(batch)]
                tiers = client.lookup(keys).tiers
                present = [j for j, t in enumerate(tiers) if t is not None]
                if not present:
                    if client.lookup([f"r{round_ + 1}-0".encode()]).hits:
                        round_ += 1  # this round was evicted already; move on
                    else:
                        time.sleep(0.002)  # not written yet
                    continue
                dst = [WRITER_SLOTS + 1 + i for i in range(len(present))]
                outcomes = client.restore([(keys[j], d) for j, d in zip(present, dst)], partial=True).outcomes
                for j, d, outcome in zip(present, dst, outcomes):
                    if outcome.value != "done":
                        continue  # evicted between lookup and restore: allowed
                    checked += 1
                    want_k = float((round_ * 1000 + j) % 2048)
                    if not all(bool((k[d] == want_k).all()) and bool((v[d] == float(layer)).all())
                               for layer, (k, v) in enumerate(views)):
                        bad.append(keys[j].decode())
                round_ += 1
        except KvxferError:
            pass  # the daemon went away
    return {"checked": checked, "rounds": round_, "bad": bad}


def concurrent_offloads(target: str, pool_id: str, threads: int, batch: int) -> dict:
    """Fire many large requests at once; count each status code."""
    from concurrent.futures import ThreadPoolExecutor

    codes: dict[str, int] = {}
    with Client(target, "flood", pool_id=pool_id, timeout=60) as client:
        client.map_pool()

        def one(i: int) -> str:
            pairs = [(1 + (i * batch + j) % 60, f"f{i}-{j}".encode()) for j in range(batch)]
            pairs = list(dict((s, (s, k)) for s, k in pairs).values())
            try:
                client.offload(pairs, partial=True)
                return "OK"
            except KvxferError as exc:
                return exc.code

        with ThreadPoolExecutor(threads) as pool:
            for code in pool.map(one, range(threads * 4)):
                codes[code] = codes.get(code, 0) + 1
    return codes


if __name__ == "__main__":
    result = globals()[sys.argv[1]](*json.loads(sys.argv[2]))
    print(json.dumps(result), flush=True)
