"""Two real NIXL agents (UCX over TCP) in this process: a read made from here is progressed by the reader's
own polling, not by waking its progress thread (which shares the GIL and the cores with the read)."""

import time

import pytest
import torch

from kvxfer.peering.agent import Agent, XferResult
from kvxfer.peering.settings import PeeringSettings

BLOCK = 64 << 10


@pytest.fixture
def agents():
    made = [Agent(PeeringSettings(name, ucx_tls="tcp", ucx_net_devices="lo")) for name in ("holder", "reader")]
    yield made
    for agent in made:
        agent.close()


def test_a_read_lands_bit_exact_without_holding_the_readers_worker(agents, monkeypatch):
    holder, reader = agents
    holder.add_peer("reader", reader.connection_info())
    reader.add_peer("holder", holder.connection_info())
    src = torch.randint(0, 256, (4, BLOCK), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    dst = torch.zeros_like(src)
    metadata = holder.expose([src[i].data_ptr() for i in range(4)], BLOCK)
    holder.hold()  # as a lease does: over TCP, UCX's emulated reads need the holder's progress
    reader.learn("holder", metadata)
    registration = reader.register(dst.data_ptr(), dst.numel())
    held = []
    monkeypatch.setattr(reader, "hold", lambda: held.append(1))
    try:
        pairs = [(dst[i].data_ptr(), src[3 - i].data_ptr()) for i in range(4)]
        assert reader.read("holder", pairs, BLOCK, time.monotonic() + 30) is XferResult.DONE
    finally:
        reader.deregister(registration)
        holder.unhold()
        holder.withdraw([src[i].data_ptr() for i in range(4)], BLOCK)
    assert torch.equal(dst, src.flip(0)) and held == [] and reader._busy == 0
