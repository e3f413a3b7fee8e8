"""Client programs the end-to-end tests run as separate processes.

``python -m tests.e2e.workers FUNCTION '[args...]'`` prints the function's JSON result
as its last line. Each one is a real client: it maps the daemon's pool itself.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from kvxfer.client import Client
from kvxfer.core.errors import KvxferError


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


def offload_forever(target: str, pool_id: str, namespace: str, batch: int, seconds: float, progress: str) -> dict:
    """Offload rounds of freshly written blocks until the daemon goes away; count what was acknowledged.

    Key ``r{round}-{j}`` holds K = (round * 1000 + j) % 2048 and V = layer in every element.
    The last acknowledged round is written to the file ``progress``.
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
                Path(progress + ".tmp").write_text(str(round_))
                os.replace(progress + ".tmp", progress)
            except KvxferError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                break
            round_ += 1
    return {"acknowledged": done, "rounds": round_, "errors": errors}


def verify_present(target: str, pool_id: str, namespace: str, batch: int, seconds: float, progress: str) -> dict:
    """Restore every key a lookup reports present, from rounds just behind the writer, and check its bytes."""
    checked, bad, round_ = 0, [], 0
    deadline = time.monotonic() + seconds
    with Client(target, namespace, pool_id=pool_id, timeout=30) as client:
        views = client.kv_views()
        print(json.dumps({"started": True}), flush=True)
        try:
            while time.monotonic() < deadline:
                try:
                    latest = int(Path(progress).read_text())
                except (FileNotFoundError, ValueError):
                    time.sleep(0.002)
                    continue
                round_ = max(round_, latest - 2)  # older rounds are likely evicted already
                keys = [f"r{round_}-{j}".encode() for j in range(batch)]
                tiers = client.lookup(keys).tiers
                present = [j for j, t in enumerate(tiers) if t is not None]
                if not present:
                    round_ += 1
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


def submit_and_hang(target: str, pool_id: str, jobs: int, batch: int, lease_s: float) -> dict:
    """Queue many asynchronous jobs, say so, then wait to be killed without ever collecting them."""
    with Client(target, "orphan", pool_id=pool_id, timeout=30) as client:
        client.map_pool()
        ids = []
        for i in range(jobs):
            pairs = [(1 + j, f"o{i}-{j}".encode()) for j in range(batch)]
            ids.append(client.submit_offload(pairs, lease_s=lease_s))
            if i % 2:
                ids.append(client.submit_restore([(f"o{i - 1}-{j}".encode(), 1 + batch + j) for j in range(batch)],
                                                 lease_s=lease_s))
        print(json.dumps({"submitted": ids}), flush=True)
        time.sleep(600)
    return {}


def engine_pool(shm_dir: str, pool_id: str, spec: dict, layout: str) -> tuple:
    """What an engine does: allocate its own KV memory as a file under /dev/shm and map it."""
    from kvxfer.core.records import Medium
    from kvxfer.geometry.layout import KVSpec, Layout, PoolLayout
    from kvxfer.memory.pool import Pool, PoolDescriptor, PoolHandle

    kv_spec = KVSpec.from_dict(spec)
    kv_layout = Layout.parse(layout)
    path = Path(shm_dir) / f"engine-{pool_id}-{os.getpid()}"
    offset = 4096  # the KV cache starts inside a larger allocation
    with open(path, "wb") as f:
        f.truncate(offset + PoolLayout(kv_spec, kv_layout).nbytes)
    handle = PoolHandle(Medium.SHM, str(path), offset=offset)
    return Pool.attach(PoolDescriptor(pool_id, kv_spec, kv_layout, handle, owned=False)), path


def registered_offload(target: str, shm_dir: str, pool_id: str, group: str, spec: dict, layout: str, seed: int,
                       slots: list[int]) -> dict:
    """An engine registers its own pool, writes KV, offloads it, unregisters and exits."""
    pool, path = engine_pool(shm_dir, pool_id, spec, layout)
    with Client(target, "registered") as client:
        desc = client.register_pool(pool_id, pool.descriptor.spec, pool.descriptor.layout, pool.descriptor.handle,
                                    host_capacity_mib=16, cache_group=group)
        _fill(pool.views(), slots, seed)
        keys = [f"reg-{seed}-{i}".encode() for i in range(len(slots))]
        result = client.offload(list(zip(slots, keys)), pool_id=pool_id)
        info = {"epoch": desc.epoch, "done": [o.value for o in result.outcomes], "keys": [k.hex() for k in keys]}
        client.unregister_pool(pool_id)
    pool.close()
    path.unlink()
    return info


def registered_restore(target: str, shm_dir: str, pool_id: str, group: str, spec: dict, layout: str, seed: int,
                       keys_hex: list[str], slots: list[int]) -> dict:
    """Another engine process registers a new pool in the same cache group and restores the blocks."""
    from kvxfer.geometry.layout import KVSpec, Layout, PoolLayout

    pool, path = engine_pool(shm_dir, pool_id, spec, layout)
    with Client(target, "registered") as client:
        client.register_pool(pool_id, pool.descriptor.spec, pool.descriptor.layout, pool.descriptor.handle,
                             cache_group=group)
        keys = [bytes.fromhex(k) for k in keys_hex]
        hits = client.lookup(keys, pool_ids=[pool_id]).hits
        outcomes = client.restore(list(zip(keys, slots)), pool_id=pool_id).outcomes
        scratch = PoolLayout(KVSpec.from_dict(spec), Layout.parse(layout))
        expected = _fill(scratch.views(torch.zeros(scratch.nbytes, dtype=torch.uint8)), slots, seed)
        same = _same(pool.views(), slots, expected)
        client.unregister_pool(pool_id)
    pool.close()
    path.unlink()
    return {"hits": hits, "outcomes": [o.value for o in outcomes], "same": same}


def offload_until_error(target: str, pool_id: str, timeout: float) -> dict:
    """Offload in a loop; when the daemon dies, report how long the failing call took."""
    with Client(target, "doomed", pool_id=pool_id, timeout=timeout) as client:
        client.map_pool()
        print(json.dumps({"started": True}), flush=True)
        i = 0
        while True:
            start = time.monotonic()
            try:
                client.offload([(1 + i % 60, f"d{i}".encode())])
            except KvxferError as exc:
                dropped = client.offload([(1, b"x")], best_effort=True)  # best effort: no raise
                return {"error": type(exc).__name__, "failing_call_s": time.monotonic() - start,
                        "best_effort": dropped}
            i += 1


def attention_roundtrip(target: str, pool_id: str, namespace: str, use_triton: bool) -> dict:
    """The engine's attention-side path around an offload and a restore into other slots."""
    from kvxfer.engine.block_table import BlockTable, batch_metadata, gather_kv
    from kvxfer.engine.kernels import Kernel, compute_slot_mapping, write_kv

    kernel = Kernel.TRITON if use_triton else Kernel.TORCH
    with Client(target, namespace, pool_id=pool_id) as client:
        views = client.kv_views()
        spec = client.pool_info().spec
        n, layers = spec.block_size, spec.num_layers
        free = list(range(1, spec.num_blocks))[::-1]  # the engine's allocator
        table = BlockTable(4, 8)
        lengths = [2 * n + n // 2, 2 * n]  # request 0 ends in a half-filled block
        for r, length in enumerate(lengths):
            table.append_row(r, [free.pop() for _ in range(-(-length // n))])
        g = torch.Generator().manual_seed(11)

        def step(requests):
            qsl, positions, num_tokens = batch_metadata(requests)
            slots = compute_slot_mapping(qsl, positions, table.commit(len(requests), len(requests) + 1), n,
                                         num_tokens, max_num_tokens=num_tokens + 5, kernel=kernel)
            new = [(torch.randn((num_tokens, spec.num_kv_heads, spec.head_size), generator=g).to(spec.dtype),
                    torch.randn((num_tokens, spec.num_kv_heads, spec.head_size), generator=g).to(spec.dtype))
                   for _ in range(layers)]
            for (k_cache, v_cache), (key, value) in zip(views, new):
                write_kv(key, value, k_cache, v_cache, slots, kernel=kernel)
            return new

        prefill = step([(0, lengths[0]), (0, lengths[1])])
        original = [[gather_kv(k, v, table.row(r), lengths[r]) for (k, v) in views] for r in range(2)]
        # Offload the full blocks of both requests, then the engine reuses their slots.
        full = [(r, b) for r in range(2) for b in range(lengths[r] // n)]
        keys = {(r, b): client.block_keys(list(range(1000 * r, 1000 * r + lengths[r])), n)[b] for r, b in full}
        client.offload([(table.row(r)[b], keys[r, b]) for r, b in full])
        for r, b in full:
            for k, v in views:
                k[table.row(r)[b]].normal_()
                v[table.row(r)[b]].normal_()
        # Restore into other slots and rewrite the block table.
        new_slots = {rb: free.pop() for rb in full}
        client.restore([(keys[rb], new_slots[rb]) for rb in full])
        for r, b in full:
            table.set_blocks(r, b, [new_slots[r, b]])
        restored_ok = all(
            all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(gather_kv(k, v, table.row(r), lengths[r]), original[r][layer]))
            for r in range(2) for layer, (k, v) in enumerate(views))
        # Decode one token each: request 0 continues its half-filled block, request 1 needs a new block.
        table.append_row(1, [free.pop()])
        decode = step([(lengths[0], 1), (lengths[1], 1)])
        decode_ok = True
        for r in range(2):
            for layer, (k, v) in enumerate(views):
                k_read, v_read = gather_kv(k, v, table.row(r), lengths[r] + 1)
                decode_ok &= torch.equal(k_read[:-1].view(torch.uint8), original[r][layer][0].view(torch.uint8))
                decode_ok &= torch.equal(k_read[-1], decode[layer][0][r]) and torch.equal(v_read[-1],
                                                                                         decode[layer][1][r])
        assert prefill
        return {"restored": restored_ok, "decode": bool(decode_ok), "rows": [table.row(0), table.row(1)]}


if __name__ == "__main__":
    result = globals()[sys.argv[1]](*json.loads(sys.argv[2]))
    print(json.dumps(result), flush=True)
