"""An inference engine on the simulated GPU, in a process of its own (as in production).

It maps the daemon's pool by its IPC handle (or allocates its own KV memory to register),
and "runs a forward pass": on its own stream, a delay (or a hang until released), a
write of new KV into a block, then an interprocess event recorded behind the write,
whose handle it hands to the daemon side. ``SimEngine`` drives it from a test.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import threading
import time
from ctypes import c_int, c_size_t, c_uint64, c_void_p

from kvxfer.memory.cuda_driver import IpcEventHandle
from tests.conftest import PYTHON, python_env
from tests.cudasim.library import CudaSim
from tests.cudasim.rules import EVENT_DISABLE_TIMING, EVENT_INTERPROCESS


class IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def _ok(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"{what} failed: {code}")


class _EngineProcess:
    """The child's side: one context, one stream, the pool (mapped or allocated), its events."""

    def __init__(self, region: str, device: int) -> None:
        self.sim = CudaSim(region)
        ctx = c_void_p()
        _ok(self.sim.cuDevicePrimaryCtxRetain(ctypes.pointer(ctx), device), "ctx")
        _ok(self.sim.cuCtxSetCurrent(ctx), "set ctx")
        self.stream = c_void_p()
        _ok(self.sim.cuStreamCreate(ctypes.pointer(self.stream), 1), "stream")
        self.base = 0
        self.gate = threading.Event()
        self.events: list[c_void_p] = []

    def open(self, handle: str) -> dict:
        raw, ptr = IpcMemHandle(), c_void_p()
        ctypes.memmove(ctypes.addressof(raw), bytes.fromhex(handle), 64)
        _ok(self.sim.cuIpcOpenMemHandle_v2(ctypes.pointer(ptr), raw, 1), "open pool")
        self.base = ptr.value
        return {}

    def alloc(self, nbytes: int) -> dict:
        ptr, raw = c_uint64(), IpcMemHandle()
        _ok(self.sim.cuMemAlloc_v2(ctypes.pointer(ptr), c_size_t(nbytes)), "alloc")
        self.base = ptr.value
        _ok(self.sim.cuIpcGetMemHandle(ctypes.pointer(raw), c_uint64(self.base)), "export")
        return {"handle": bytes(raw).hex()}

    def write(self, offset: int, nbytes: int, value: int, delay_s: float = 0.0, hang: bool = False,
              flags: int = EVENT_INTERPROCESS | EVENT_DISABLE_TIMING) -> dict:
        if hang:
            self.gate.clear()
            self.sim.launch(self.stream.value, self.gate.wait)  # an NCCL peer that never arrives
        if delay_s:
            self.sim.launch(self.stream.value, lambda: time.sleep(delay_s))
        _ok(self.sim.cuMemsetD8Async(c_uint64(self.base + offset), value, c_size_t(nbytes), self.stream), "write")
        event, raw = c_void_p(), IpcEventHandle()
        _ok(self.sim.cuEventCreate(ctypes.pointer(event), c_int(flags)), "event")
        _ok(self.sim.cuEventRecord(event, self.stream), "record")
        self.events.append(event)
        code = self.sim.cuIpcGetEventHandle(ctypes.pointer(raw), event)
        return {"event": bytes(raw).hex() if code == 0 else "", "code": code}

    def free(self) -> dict:
        _ok(self.sim.cuMemFree_v2(c_uint64(self.base)), "free")
        return {}

    def release(self) -> dict:
        self.gate.set()
        return {}

    def destroy(self, index: int = -1) -> dict:
        _ok(self.sim.cuEventDestroy_v2(self.events.pop(index)), "destroy")
        return {}

    def sync(self) -> dict:
        _ok(self.sim.cuStreamSynchronize(self.stream), "sync")
        return {}


def main() -> None:
    region, device = sys.argv[1], int(sys.argv[2])
    engine = _EngineProcess(region, device)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            reply = getattr(engine, op)(**command)
        except RuntimeError as exc:
            reply = {"error": str(exc)}
        print(json.dumps(reply), flush=True)


class SimEngine:
    """The test's side: start the engine process and send it commands."""

    def __init__(self, region: str, device: int = 0) -> None:
        self.proc = subprocess.Popen([PYTHON, "-m", "tests.cudasim.engine", region, str(device)], env=python_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self.proc.stdout.readline())["ready"]

    def __call__(self, op: str, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        assert "error" not in reply, reply
        return reply

    def forward(self, offset: int, nbytes: int, value: int, **kw) -> bytes:
        """A forward pass writing ``value`` over [offset, offset + nbytes) of the pool; its event's handle."""
        return bytes.fromhex(self("write", offset=offset, nbytes=nbytes, value=value, **kw)["event"])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


if __name__ == "__main__":
    main()
