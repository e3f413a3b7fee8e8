"""What users run on a GPU, on the CUDA simulator: a real daemon process serving CUDA pools, an
engine in another process writing KV on its own stream, the client mapping the pool by IPC."""

import json
import signal
import subprocess
import threading
import time

import pytest

from kvxfer.bench import launch
from kvxfer.client import Client
from kvxfer.core.records import Medium, Outcome
from tests.conftest import PYTHON, python_env
from tests.cudasim.engine import SimEngine

pytestmark = pytest.mark.e2e
SPEC = {"num_layers": 2, "num_blocks": 32, "block_size": 4, "num_kv_heads": 2, "head_size": 16, "dtype": "float16"}
BLOCK = 1024


@pytest.fixture
def gpu_daemon(cuda_sim):
    """A daemon whose two pools live on the simulated GPUs 0 and 1 (the test maps the same region)."""
    pools = [{"id": f"gpu{d}", "device": f"cuda:{d}", "layout": "BLHNC", "spec": SPEC, "host_capacity_mib": 1}
             for d in (0, 1)]
    daemon = launch.spawn({"grace_period_s": 2, "log_level": "debug", "pools": pools, "gpu_copy_deadline_s": 1.0},
                          command=[PYTHON, "-m", "tests.cudasim.daemon", cuda_sim.region.path])
    engine = SimEngine(cuda_sim.region.path)
    yield daemon, engine
    engine.close()
    daemon.cleanup()


def test_an_engine_offloads_and_restores_through_a_daemon_on_the_gpu(gpu_daemon):
    daemon, engine = gpu_daemon
    with Client(daemon.target, pool_id="gpu0") as client:
        pool = client.map_pool()  # by CUDA IPC handle and GPU UUID, in this process
        assert pool.descriptor.handle.medium is Medium.CUDA
        engine("open", handle=pool.descriptor.handle.ipc_handle.hex())
        event = engine.forward(1 * BLOCK, 4 * BLOCK, 0x5A, delay_s=0.3)  # a forward pass, still running
        assert client.offload([(b, b"k%d" % b) for b in range(1, 5)], cuda_event=event).outcomes == \
            [Outcome.DONE] * 4
        engine.forward(5 * BLOCK, BLOCK, 0x6B, delay_s=0.3)  # no event: the copy does not wait
        client.offload([(5, b"stale")])
        client.restore([(b"k%d" % b, 10 + b) for b in range(1, 5)] + [(b"stale", 20)])
        storage = pool.storage
        assert bool((storage[11 * BLOCK:15 * BLOCK] == 0x5A).all())
        assert bool((storage[20 * BLOCK:21 * BLOCK] == 0).all())  # what was there before the pass


def test_a_hung_engine_stream_fails_its_job_at_the_deadline_and_the_daemon_answers_meanwhile(gpu_daemon):
    daemon, engine = gpu_daemon
    with Client(daemon.target, pool_id="gpu0") as client:
        engine("open", handle=client.pool_info().handle.ipc_handle.hex())
        event = engine.forward(2 * BLOCK, BLOCK, 0x11, hang=True)  # an NCCL peer that never arrives
        outcome: list = []
        waiting = threading.Thread(target=lambda: outcome.append(
            client.offload([(2, b"h")], cuda_event=event, partial=True, timeout=20).outcomes))
        waiting.start()
        time.sleep(0.2)
        # (behind the hung stream health would wait its 20 s: the offload still waits when health answers)
        assert client.health() == "SERVING" and waiting.is_alive()
        assert client.offload([(3, b"other")], pool_id="gpu1").outcomes == [Outcome.DONE]
        waiting.join(timeout=60)
        assert outcome == [[Outcome.DEADLINE_EXCEEDED]]  # failed at the job's deadline, not hung
        assert client.offload([(4, b"after")]).outcomes == [Outcome.DONE]  # the pool serves on
        engine("release")


REGISTER = """
import sys
from kvxfer.client import Client
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.memory import cuda_driver, cuda_mem
from kvxfer.memory.pool import PoolHandle
from kvxfer.core.records import Medium
from tests.cudasim.library import CudaSim
sim = CudaSim(sys.argv[1])
cuda_driver.load_library = lambda name=cuda_driver.LIBRARY: sim
spec = KVSpec.from_dict(__import__("json").loads(sys.argv[3]))
memory, handle = cuda_mem.allocate(spec.nbytes, 0)  # the engine's own KV cache
client = Client(sys.argv[2])
client.register_pool("engine0", spec, Layout.parse("BLHNC"),
                     PoolHandle(Medium.CUDA, ipc_handle=handle, device_uuid=cuda_mem.device_uuid(0)))
print("registered", flush=True)
sys.stdin.read()
"""


def test_a_registered_gpu_pool_is_unregistered_when_its_engine_dies(gpu_daemon, cuda_sim):
    daemon, _ = gpu_daemon
    proc = subprocess.Popen([PYTHON, "-c", REGISTER, cuda_sim.region.path, daemon.target, json.dumps(SPEC)],
                            env=python_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "registered"
        with Client(daemon.target) as client:
            assert "engine0" in [p.pool_id for p in client.pools()]
            mapped = [a for a in cuda_sim.region.allocs if a.live and a.mapped and a.owner == proc.pid]
            assert len(mapped) == 1  # the daemon holds the engine's memory open
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            deadline = time.monotonic() + 10
            while "engine0" in [p.pool_id for p in client.pools()] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "engine0" not in [p.pool_id for p in client.pools()]
            while mapped[0].mapped and time.monotonic() < deadline + 20:  # (closed just after: jobs end first)
                time.sleep(0.05)
            assert mapped[0].mapped == 0  # the daemon's IPC mapping is closed
        assert "registered a pool exited" in daemon.log_text()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_gpu_that_breaks_stops_the_daemon_with_exit_69(gpu_daemon, cuda_sim):
    daemon, _ = gpu_daemon
    cuda_sim.region.header.fault_pid = daemon.proc.pid
    cuda_sim.region.header.fault = 700  # the daemon's next GPU operation: CUDA_ERROR_ILLEGAL_ADDRESS
    with Client(daemon.target, pool_id="gpu0") as client:
        result = client.offload([(1, b"x")], partial=True)
        assert result.outcomes == [Outcome.FAILED]
        assert daemon.proc.wait(timeout=30) == 69
    log = daemon.log_text()
    assert "GPU lost" in log and '"exit_code": 69' in log


def test_the_device_checks_daemon_stage_runs_on_the_simulator(cuda_sim):
    """``kvxfer devcheck``'s stage for what users run (the daemon over gRPC with a CUDA pool, this
    process as the engine) runs here against a daemon on the simulated GPU, small."""
    from kvxfer.devcheck.daemon_stage import daemon_over_grpc

    result = daemon_over_grpc({"daemon_command": [PYTHON, "-m", "tests.cudasim.daemon", cuda_sim.region.path],
                               "daemon_blocks": 16, "daemon_host_mib": 1, "latency_calls": 20,
                               "daemon_spec": {"num_layers": 2, "block_size": 4, "num_kv_heads": 2, "head_size": 16}})
    assert result["bit_identical"] and result["random_event_handle"] == "failed"
    assert result["metrics_bytes"] == {k: float(v) for k, v in result["client_told_bytes"].items()}
    assert result["client_told_bytes"]["offload"] > 16 * 512 and result["pool_on"] == "cpu"  # (the simulator's)


def test_the_device_checks_driver_runs_the_stages_the_simulator_can(cuda_sim, tmp_path, monkeypatch):
    """The stage driver and the stages as the device check lists them, on the simulator: a stage
    that crashes in its own plumbing or report code shows here, not on a lent GPU."""
    from kvxfer.devcheck import stages
    from kvxfer.devcheck.report import run_stages
    from kvxfer.transfer import staging

    monkeypatch.setattr(staging, "STAGING_BUFFER_BYTES", 8 * 1024)
    chosen = [s for s in stages.STAGES if s[0] in ("daemon_over_grpc", "staging_on_the_gpu")]
    small = {"num_layers": 2, "block_size": 4, "num_kv_heads": 2, "head_size": 16}
    status = run_stages(str(tmp_path), chosen, prepared={"copy_loop": "test"}, settings={
        "daemon_command": [PYTHON, "-m", "tests.cudasim.daemon", cuda_sim.region.path], "daemon_blocks": 16,
        "daemon_host_mib": 1, "latency_calls": 10, "daemon_spec": small, "staging_blocks": 6,
        "staging_spec": {**small, "num_layers": 4}})
    report = json.loads((tmp_path / "devcheck.json").read_text())
    assert status == 0, report
    assert [s["stage"] for s in report["stages"]] == ["daemon_over_grpc", "staging_on_the_gpu"]
    assert all(s["result"]["bit_identical"] for s in report["stages"])
