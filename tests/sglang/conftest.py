"""SGLang 0.5.23's own HiCache classes (host KV pools, the storage-backend factory) against real
daemon subprocesses (``make test-sglang``). SGLang's controller needs a GPU's device pool and
process groups; its calls (batch_exists, batch_get_v1, batch_set_v1 from its prefetch and backup
threads) are made here as it makes them."""

from __future__ import annotations

import pytest
import torch

from kvxfer.bench import sglang_engine
from kvxfer.bench import launch
from tests.helpers import made_and_closed

RETRY_S = 0.2
DAEMON = {"grace_period_s": 5, "log_level": "debug", "registered_host_capacity_mib": 16, "max_pools": 16,
          "pools": [{"id": "rank0", "device": "cpu", "host_capacity_mib": 1,
                     "spec": {"num_layers": 2, "num_blocks": 8, "block_size": 4, "num_kv_heads": 1, "head_size": 8,
                              "dtype": "float16"}}]}


def host_pool(layout: str, allocator: str = "shm", mla: bool = False):
    return sglang_engine.host_pool(layout, allocator, mla)


def extra_config(socket: str, allocator: str = "shm", **settings) -> dict:
    return sglang_engine.extra_config(socket, allocator, retry_s=RETRY_S, **settings)


def backend(pool, extra: dict, **kwargs):
    return sglang_engine.attach("dynamic", pool, extra, **kwargs)


def fill(pool, seed: int) -> None:
    """Random bytes in every page (NaN patterns included: bytes, not values, are compared)."""
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))


def page_bytes(pool, index: int) -> bytes:
    """One host page's bytes, by SGLang's own accessor (flat, in its layout's order)."""
    return pool.get_data_page(index * pool.page_size, flat=True).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def daemon():
    d = launch.spawn(DAEMON)
    yield d
    d.cleanup()


@pytest.fixture
def stores():
    yield from made_and_closed(backend)
