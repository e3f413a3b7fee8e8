"""What only a GPU can show; run by ``kvxfer devcheck`` (skipped, with the reason, elsewhere)."""

import json
import subprocess

import torch

from kvxfer.core.records import Outcome
from kvxfer.engine.block_table import BlockTable, batch_metadata
from kvxfer.engine.kernels import Kernel, compute_slot_mapping, write_kv
from kvxfer.geometry.layout import PRESETS, KVSpec
from kvxfer.memory.pool import Pool
from kvxfer.serving.batch import TransferBatch, TransferKind
from kvxfer.serving.pool_manager import PoolManager
from tests.conftest import PYTHON, python_env

SPEC = KVSpec(4, 64, 16, 2, 64, torch.bfloat16)


def test_a_cuda_pool_round_trips_bit_exact_through_the_pinned_tier():
    for layout in ("BLHNC", "LBHNC"):
        with Pool.create("gpu", SPEC, PRESETS[layout], device="cuda:0") as pool:
            pool.storage.view(torch.int64).random_()
            before = pool.storage.clone()
            manager = PoolManager(pool, 32)
            keys = [b"g%d" % i for i in range(20)]
            assert manager.offload("g", list(zip(range(1, 21), keys))).outcomes == [Outcome.DONE] * 20
            assert manager.restore("g", list(zip(keys, range(40, 60)))).outcomes == [Outcome.DONE] * 20
            for b in range(20):
                src = before.view(-1)
                runs = pool.layout.block_runs(1 + b)
                dst_runs = pool.layout.block_runs(40 + b)
                for r, d in zip(runs, dst_runs):
                    assert torch.equal(pool.storage[d.offset:d.end], src[r.offset:r.end])


ENGINE = """
import json, sys, torch
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory.pool import Pool, PoolDescriptor, PoolHandle
from kvxfer.core.records import Medium
d = json.loads(sys.argv[1])
handle = PoolHandle(Medium.CUDA, ipc_handle=bytes.fromhex(d["handle"]), device_uuid=d["uuid"])
pool = Pool.attach(PoolDescriptor("ev", KVSpec.from_dict(d["spec"]), Layout.parse(d["layout"]), handle))
span = pool.layout.block_bytes
stream, event = torch.cuda.Stream(), torch.cuda.Event(interprocess=True)
with torch.cuda.stream(stream):
    torch.cuda._sleep(200_000_000)  # the engine's forward pass is still running
    pool.storage[3 * span:4 * span].fill_(0x5A)
    event.record(stream)
print(bytes(event.ipc_handle()).hex(), flush=True)
sys.stdin.read()  # the event and the mapping live until the daemon side is done
"""


def test_offload_waits_for_the_engines_writes():
    """The engine (another process: CUDA IPC events open only there) records an event after its
    KV writes and hands it over; the offload copies once it has completed (polled, never waited
    on by a stream)."""
    with Pool.create("ev", SPEC, PRESETS["BLHNC"], device="cuda:0") as pool:
        manager = PoolManager(pool, 8)
        d = pool.descriptor
        described = json.dumps({"spec": d.spec.to_dict(), "layout": d.layout.spelled,
                                "handle": d.handle.ipc_handle.hex(), "uuid": d.handle.device_uuid})
        engine = subprocess.Popen([PYTHON, "-c", ENGINE, described], env=python_env(), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = engine.stdout.readline().strip()
            assert line, engine.stderr.read()[-2000:]
            batch = TransferBatch.build(TransferKind.OFFLOAD, "ev", [3], [b"late"], SPEC.num_blocks,
                                        ready_event=bytes.fromhex(line))
            result = manager.run(batch)
            assert result.outcomes == [Outcome.DONE], result
            slot = manager.group.index.locate("ev", b"late")
            assert bool((manager.host.buffer[slot] == 0x5A).all())  # the copy ran after the engine's write
        finally:
            engine.stdin.close()
            engine.wait(timeout=60)


def test_triton_kernels_equal_their_torch_twins_on_the_gpu():
    table = BlockTable(4, 8, device=torch.device("cuda"))
    table.append_row(0, [3, 5, 7])
    table.append_row(1, [9])
    qsl, positions, n = batch_metadata([(0, 40), (10, 1)])
    device_table = table.commit(2, 3)
    qsl, positions = qsl.cuda(), positions.cuda()
    triton = compute_slot_mapping(qsl, positions, device_table, 16, n, n + 4, kernel=Kernel.TRITON)
    twin = compute_slot_mapping(qsl, positions, device_table, 16, n, n + 4, kernel=Kernel.TORCH)
    assert torch.equal(triton, twin)
    pool_a = torch.zeros(SPEC.nbytes, dtype=torch.uint8, device="cuda")
    pool_b = pool_a.clone()
    from kvxfer.geometry.layout import PoolLayout

    pl = PoolLayout(SPEC, PRESETS["BLHNC"])
    key = torch.randn((n, 2, 64), device="cuda").to(torch.bfloat16)
    value = torch.randn((n, 2, 64), device="cuda").to(torch.bfloat16)
    for storage, kernel in ((pool_a, Kernel.TRITON), (pool_b, Kernel.TORCH)):
        k_cache, v_cache = pl.views(storage)[1]
        write_kv(key, value, k_cache, v_cache, triton, kernel=kernel)
    assert torch.equal(pool_a, pool_b)
