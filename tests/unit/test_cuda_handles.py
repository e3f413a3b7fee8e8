"""What describes GPU memory without touching it: torch's sharing handle, the wire form, the views,
the driver's absence, and the device check's report."""

import json
import subprocess

import pytest
import torch

from kvxfer.core.errors import FailedPrecondition
from kvxfer.devcheck.plot import plot
from kvxfer.geometry.layout import PRESETS, PoolLayout
from kvxfer.memory.cuda_driver import load_library
from kvxfer.memory.cuda_mem import ipc_handle_from_torch
from tests.conftest import PYTHON, ROOT, python_env
from tests.unit.test_cuda_engine import SPEC


def test_torchs_shared_storage_handle_yields_the_cuda_ipc_handle():
    """torch 2.x prefixes a version and a type byte (seen on an H200: 66 bytes from torch 2.11)."""
    handle = bytes(range(64))
    assert ipc_handle_from_torch(handle) == handle  # older torch: the bare handle
    for version in (1, 2, 3):
        assert ipc_handle_from_torch(bytes([version]) + b"c" + handle) == handle
    with pytest.raises(FailedPrecondition, match="expandable_segments:False"):
        ipc_handle_from_torch(b"\x02e" + bytes(100))
    with pytest.raises(FailedPrecondition, match="does not know"):
        ipc_handle_from_torch(b"\x02x" + handle)


def test_no_driver_no_device_is_a_clear_error():
    with pytest.raises(FailedPrecondition, match="no CUDA driver"):
        load_library("libcuda-not-here.so.1")


def test_devcheck_without_a_gpu_says_so_and_exits_3(tmp_path):
    proc = subprocess.run([PYTHON, "-m", "kvxfer.devcheck", "--out", str(tmp_path)], env=python_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    first, last = proc.stdout.strip().splitlines()  # what it loaded from where, then why it stops
    assert first.startswith("[devcheck] loaded: grpc ") and "no GPU" in last


def test_a_cuda_handle_and_its_gpu_uuid_survive_the_wire():
    from kvxfer.core.records import Medium
    from kvxfer.memory.pool import PoolDescriptor, PoolHandle
    from kvxfer.wire import messages as wire

    handle = PoolHandle(Medium.CUDA, ipc_handle=bytes(range(64)), device=3, offset=4096,
                        device_uuid="GPU-6f1d2c3b-0000-1111-2222-333344445555")
    desc = PoolDescriptor("gpu0", SPEC, PRESETS["BLHNC"], handle, epoch=77, owned=False)
    back = wire.descriptor_from_pb(wire.pb.PoolInfo.FromString(wire.pool_info(desc).SerializeToString()))
    assert back == desc and back.handle.device_uuid.startswith("GPU-")


@pytest.mark.parametrize("layout", sorted(PRESETS))
def test_gpu_views_have_the_cpu_views_strides_and_offsets(layout):
    """The views an engine builds over a CUDA pool (checked on the meta device: same code path,
    no memory) have exactly the shapes, strides and offsets of the CPU pool's views."""
    pl = PoolLayout(SPEC, PRESETS[layout])
    cpu = pl.views(torch.zeros(pl.nbytes, dtype=torch.uint8))
    meta = pl.views(torch.empty(pl.nbytes, dtype=torch.uint8, device="meta"))
    for (kc, vc), (km, vm) in zip(cpu, meta):
        for c, m in ((kc, km), (vc, vm)):
            assert (c.shape, c.stride(), c.storage_offset(), c.dtype) == (m.shape, m.stride(), m.storage_offset(),
                                                                        m.dtype)


def test_devcheck_plots_a_recorded_run(tmp_path):
    report = json.loads((ROOT / "docs" / "benchmarks" / "devcheck" / "2026-11-30-3-device-checksums.json").read_text())
    assert plot(report, str(tmp_path / "bandwidth.png"))
    assert (tmp_path / "bandwidth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plot({"stages": []}, str(tmp_path / "none.png"))  # the bandwidth stage did not run


def test_an_offloads_event_travels_as_its_64_byte_ipc_handle():
    from kvxfer.client import event_handle
    from kvxfer.core.errors import InvalidArgument

    handle = bytes(range(64))
    assert event_handle(None) == b"" and event_handle(handle) == handle and event_handle(bytearray(handle)) == handle

    class Recorded:  # what torch.cuda.Event(interprocess=True) answers
        def ipc_handle(self):
            return handle

    class NotShareable:  # torch's answer for an event created without interprocess=True
        def ipc_handle(self):
            raise RuntimeError("CUDA error: invalid resource handle")

    assert event_handle(Recorded()) == handle
    with pytest.raises(InvalidArgument, match="interprocess=True"):
        event_handle(NotShareable())
    with pytest.raises(InvalidArgument, match="64 bytes"):
        event_handle(b"short")
