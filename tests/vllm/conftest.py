"""vLLM 0.33's real scheduler and connector against a real daemon subprocess (``make test-vllm``)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny model is a local config.json; nothing is downloaded

from vllm.config import KVTransferConfig  # noqa: E402

from kvxfer.bench.vllm_engine import Engine  # noqa: E402
from kvxfer.bench import launch  # noqa: E402
from tests.e2e.conftest import SMALL_POOL  # noqa: E402

RETRY_S = 0.2  # the backend's retry_s in these tests
DAEMON = {"grace_period_s": 5, "log_level": "debug", "pools": [SMALL_POOL], "registered_host_capacity_mib": 8}


def kv_transfer(extra: dict) -> KVTransferConfig:
    """The --kv-transfer-config a user passes (docs/vllm.md) with ``extra`` as its extra config."""
    return KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.integrations.vllm",
                            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)


@pytest.fixture
def daemon():
    d = launch.spawn(DAEMON)
    yield d
    d.cleanup()


@pytest.fixture
def disk_daemon(tmp_path):
    """A daemon with a host tier of 1 MiB (256 blocks of the tiny model's 4 KiB), a disk tier below it, /metrics."""
    from tests.e2e.redis_server import free_port

    port = free_port()
    d = launch.spawn({**DAEMON, "registered_host_capacity_mib": 1, "metrics_listen": f"127.0.0.1:{port}",
                      "disk": {"path": str(tmp_path / "disk"), "capacity_mib": 8}})
    d.metrics_port = port
    yield d
    d.cleanup()


@pytest.fixture
def make_engine():
    engines = []

    def make(socket: str, num_blocks: int = 64, settings: dict | None = None, **kwargs) -> Engine:
        engine = Engine(kv_transfer({"socket": socket, "retry_s": RETRY_S, **(settings or {})}), num_blocks=num_blocks,
                        **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
