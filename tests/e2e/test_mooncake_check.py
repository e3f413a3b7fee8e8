"""``kvxfer serve --check`` with a Mooncake Store section says, in one line naming the setting, what a start
would find: a master or metadata server that does not answer, an RDMA transport on a node without the device,
memory past the machine's with the segments and transfer buffers counted. A start with no RDMA device refuses in
the same line; one with the master down serves (the tier degraded: ``test_mooncake_faults.py``)."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvxfer.bench.mooncake_master import MooncakeMaster, _free_port
from kvxfer.tiers.mooncake.reachable import unreachable
from kvxfer.tiers.mooncake.settings import MooncakeSettings, missing_devices
from tests.conftest import ROOT
from tests.e2e.conftest import SMALL_POOL
from tests.e2e.mooncake_node import master, needs_mooncake  # noqa: F401

pytestmark = [pytest.mark.e2e, needs_mooncake]


def _check(tmp_path, section: dict) -> subprocess.CompletedProcess:
    config = tmp_path / "check.yaml"
    config.write_text(yaml.safe_dump({"pools": [SMALL_POOL], "mooncake": section}))
    return subprocess.run([sys.executable, "-m", "service.program", "serve", "--check", "--config", str(config)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def _one_line(run: subprocess.CompletedProcess, *words: str) -> None:
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), run.stderr


def test_a_live_cluster_passes_and_the_memory_line_counts_segments_and_buffers(master, tmp_path):
    run = _check(tmp_path, master.section(segment_mib=64, buffer_mib=32))
    assert run.returncode == 0, run.stderr
    memory = next(line for line in run.stdout.splitlines() if line.startswith("memory:"))
    # the daemon's own cache group and the engine rank expected to register: each 64 + 32 MiB
    assert "lower-tier clients 192 MiB" in memory


def test_a_master_that_does_not_answer_is_named(master, tmp_path):
    _one_line(_check(tmp_path, {**master.section(), "master": f"127.0.0.1:{_free_port()}"}),
              "mooncake.master", "does not answer", "degraded")


def test_a_metadata_server_that_does_not_answer_is_named(master, tmp_path):
    _one_line(_check(tmp_path, {**master.section(), "metadata": f"http://127.0.0.1:{_free_port()}/metadata"}),
              "mooncake.metadata", "does not answer")


@pytest.mark.skipif(Path("/sys/class/infiniband").is_dir(), reason="this node has RDMA devices")
def test_rdma_on_a_node_without_a_device_is_refused_by_check_and_start(master, tmp_path):
    _one_line(_check(tmp_path, master.section(protocol="rdma")), "mooncake.protocol", "no RDMA device")
    config = tmp_path / "start.yaml"
    config.write_text(yaml.safe_dump({"pools": [SMALL_POOL], "mooncake": master.section(protocol="rdma"),
                                      "socket": str(tmp_path / "d.sock"), "metrics_listen": ""}))
    start = subprocess.run([sys.executable, "-m", "service.program", "serve", "--config", str(config)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert start.returncode != 0 and "mooncake.protocol" in start.stderr and "Traceback" not in start.stderr


def test_a_segment_past_the_machines_memory_is_refused(master, tmp_path):
    _one_line(_check(tmp_path, master.section(segment_mib=400_000)), "memory", "lower-tier clients 781.4 GiB",
              "mooncake.segment_mib")


def test_devices_named_must_be_on_the_node(tmp_path):
    root = tmp_path / "infiniband"
    settings = MooncakeSettings("127.0.0.1:1", "P2PHANDSHAKE", protocol="rdma", device="mlx5_1")
    assert "no RDMA device" in missing_devices(settings, root)
    (root / "mlx5_0").mkdir(parents=True)
    assert missing_devices(settings, root) == "mooncake.device: mlx5_1 not on this node (it has mlx5_0)"
    assert missing_devices(MooncakeSettings("127.0.0.1:1", "P2PHANDSHAKE", protocol="rdma"), root) is None
    assert unreachable(MooncakeSettings(f"127.0.0.1:{_free_port()}", "P2PHANDSHAKE")).startswith("mooncake.master")
