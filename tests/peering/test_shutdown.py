"""A peering daemon's stop on a node with rdma-core (CI installs libibverbs1 and its providers): it exits 0
after its write-down, and starts warm. With UCX's EFA module loaded, the system's libefa brought a second
libibverbs and libnl beside the wheel's bundled ones, and every process that had made a NIXL agent died of
SIGSEGV in libnl's destructors at exit (return code -11; 139 from a shell)."""

import signal
import subprocess

import pytest

from kvxfer.bench.peering_local import peering_configs
from kvxfer.core.records import Outcome, TierKind
from tests.conftest import PYTHON, ROOT, python_env
from tests.e2e.conftest import SMALL_POOL, start_daemon
from tests.peering.cluster import block, client, fill, keys

pytestmark = pytest.mark.e2e


def test_a_process_that_made_an_agent_exits_cleanly():
    program = ("from kvxfer.peering.agent import Agent\n"
               "from kvxfer.peering.settings import PeeringSettings\n"
               "agent = Agent(PeeringSettings('alone', ucx_net_devices='lo'))\n"
               "agent.close()\n")
    done = subprocess.run([PYTHON, "-c", program], env=python_env(), cwd=ROOT, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_a_peering_daemon_stopped_exits_0_with_its_write_down_done_and_starts_warm(tls, tmp_path):
    configs = peering_configs(["a", "b"], tls, "tcp", {"a": SMALL_POOL, "b": SMALL_POOL})
    configs["a"]["disk"] = {"path": str(tmp_path / "disk"), "capacity_mib": 4}
    daemons = {name: start_daemon(config) for name, config in configs.items()}
    try:
        ks = keys("stop", 6)
        with client(daemons["a"]) as a, client(daemons["b"]) as b:
            written = fill(a, list(range(1, 7)), seed=5)
            assert all(o is Outcome.DONE for o in a.offload(list(zip(range(1, 7), ks))).outcomes)
            assert b.restore(list(zip(ks[:3], [10, 11, 12]))).outcomes == [Outcome.DONE] * 3  # over NIXL
            assert all(block(b, 10 + i).equal(written[1 + i]) for i in range(3))
        for name, daemon in daemons.items():
            assert daemon.stop(signal.SIGTERM) == 0, daemon.log_text()[-3000:]
        assert '"host tier written to disk"' in daemons["a"].log_text()
        daemons["a"].cleanup()
        daemons["a"] = start_daemon(configs["a"])
        with client(daemons["a"]) as a:
            assert a.lookup(ks).tiers == [TierKind.DISK] * 6
            assert a.restore(list(zip(ks, range(20, 26)))).outcomes == [Outcome.DONE] * 6
            assert all(block(a, 20 + i).equal(written[1 + i]) for i in range(6))
        assert daemons["a"].stop(signal.SIGTERM) == 0
    finally:
        for daemon in daemons.values():
            daemon.cleanup()
