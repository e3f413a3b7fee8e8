"""The Mooncake Store tier through real daemons and a real ``mooncake_master``: blocks one daemon demotes are
restored bit-exact by another; a value forged, moved from another prefix, truncated or grown under a block's
name is DATA_LOSS and removed, never served; deletes stick; a bad section is refused in one line."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from kvxfer import Client
from kvxfer.core.records import Outcome, TierKind
from tests.conftest import ROOT
from tests.e2e.mooncake_node import KEYS, SECRET, events, master, needs_mooncake, node, tiers, until  # noqa: F401
from tests.e2e.test_remote import offload, restore

pytestmark = [pytest.mark.e2e, needs_mooncake]


def _store(master):
    """A plain client of the cluster, as any other party's: it lends no memory."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", master.metadata, 0, 16 << 20, "tcp", "", master.master) == 0
    return store


def _name(prefix: str, key: bytes) -> str:
    return f"{prefix}rank0/default/{key.hex()}"


def test_a_node_restores_bit_exact_what_another_demoted_and_deletes_stick(master, tmp_path):
    a, b = node(master, tmp_path, "share:"), node(master, tmp_path, "share:")
    try:
        shadow = offload(a, KEYS)
        until(lambda: events(a).get("stored", 0) >= 16, "a demoted 16")
        assert tiers(b, KEYS[:16]) == [TierKind.MOONCAKE] * 16
        outcomes, blocks = restore(b, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8 and all(d.equal(shadow[k]) for k, d in zip(KEYS[:8], blocks))
        with Client(a.target) as client:
            assert client.delete(KEYS[8:10]) == 2  # in the cluster: gone for every node
        assert tiers(b, KEYS[8:11]) == [None, None, TierKind.MOONCAKE]
        assert events(b)["promoted"] == 8 and not events(b)["degraded"]
    finally:
        a.cleanup()
        b.cleanup()


def test_forged_moved_truncated_and_grown_values_are_never_served(master, tmp_path):
    """Another prefix's daemon shares the secret; a party without it writes under the blocks' names."""
    theirs, ours = node(master, tmp_path, "staging:"), node(master, tmp_path, "prod:")
    store = _store(master)
    try:
        offload(theirs, KEYS[:40])  # KEYS[:8] go down under staging:
        until(lambda: events(theirs).get("stored", 0) >= 8, "theirs demoted")
        moved = store.get(_name("staging:", KEYS[0]))
        assert len(moved) > 16384
        forged = {KEYS[0]: moved,  # the same bytes and MAC, under another prefix: the MAC covers the name
                  KEYS[1]: bytes(len(moved)),  # zeros of the right length, no MAC of ours
                  KEYS[2]: moved[:-100],  # truncated
                  KEYS[3]: moved + bytes(1 << 20)}  # larger than any value of ours
        for key, value in forged.items():
            assert store.put(_name("prod:", key), value) == 0
        assert tiers(ours, list(forged)) == [TierKind.MOONCAKE] * 4  # there, as far as a lookup can tell
        for _ in range(2):  # never served, also when asked again
            outcomes, _ = restore(ours, list(forged))
            assert set(outcomes) <= {Outcome.DATA_LOSS, Outcome.NOT_FOUND}
        assert events(ours)["corrupt"] == 4
        assert [store.is_exist(_name("prod:", key)) for key in forged] == [0] * 4  # removed
        assert store.is_exist(_name("staging:", KEYS[0])) == 1  # the original is theirs, untouched
    finally:
        store.close()
        theirs.cleanup()
        ours.cleanup()


@pytest.mark.parametrize("section, message", [
    ({"master": "nohost"}, "mooncake.master: HOST:PORT"),
    ({"master": "127.0.0.1:1", "metadata": "ftp://x"}, "mooncake.metadata"),
    ({"master": "127.0.0.1:1", "metadata": "P2PHANDSHAKE", "protocol": "udp"}, "mooncake.protocol"),
    ({"master": "127.0.0.1:1", "metadata": "P2PHANDSHAKE", "segment_mib": -1}, "mooncake.segment_mib"),
    ({"master": "127.0.0.1:1", "metadata": "P2PHANDSHAKE", "key_prefix": "a b"}, "mooncake.key_prefix"),
    ({"master": "127.0.0.1:1", "metadata": "P2PHANDSHAKE", "secret_file": "/nonexistent"}, "secret_file"),
    ({"master": "127.0.0.1:1", "metadata": "P2PHANDSHAKE", "bogus": 1}, "unknown keys"),
    ({"master": "127.0.0.1:1", "metadata": "P2PHANDSHAKE", "mac": "md5"}, "mooncake.mac: one of hmac-sha256, blake3"),
])
def test_a_bad_section_is_refused_by_serve_check_in_one_line(tmp_path, section, message):
    config = tmp_path / "kvxfer.yaml"
    config.write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"), "mooncake": section}))
    check = subprocess.run([sys.executable, "-m", "service.program", "serve", "--check", "--config", str(config)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    said = (check.stderr + check.stdout).strip().splitlines()
    assert check.returncode != 0 and message in said[-1] and "Traceback" not in check.stderr, said


@pytest.mark.parametrize("mac", ["blake3", "hmac-sha256"])
def test_zero_copy_puts_send_the_staged_value_itself(master, tmp_path, mac):
    """The value the tier puts is the staging buffer (header, block, MAC in place): read back whole by a plain
    client, it is the header, 32 bytes of MAC and the block's bytes (blake3), or the header, the block's bytes and
    32 bytes of MAC (hmac-sha256)."""
    daemon = node(master, tmp_path, "zc:", mac=mac)
    store = _store(master)
    try:
        shadow = offload(daemon, KEYS[:40])
        until(lambda: events(daemon).get("stored", 0) >= 8, "demoted")
        value = np.frombuffer(store.get(_name("zc:", KEYS[0])), dtype=np.uint8)
        block = shadow[KEYS[0]].numpy()
        assert np.array_equal(value[-len(block):] if mac == "blake3" else value[-32 - len(block):-32], block)
    finally:
        store.close()
        daemon.cleanup()


def test_bench_mooncake_reports_wall_and_cpu_beside_the_bare_client(capsys):
    from kvxfer.cli import commands as cli

    assert cli.main(["bench", "mooncake", "--blocks", "32", "--block-kib", "16", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "CPU / bare" in out and "tier: fetch" in out


def test_bench_mooncake_restore_reports_a_daemons_restore_beside_the_bare_batch_call(capsys, tmp_path):
    from kvxfer.cli import commands as cli

    figures = tmp_path / "restore.json"
    assert cli.main(["bench", "mooncake-restore", "--blocks", "16", "--block-kib", "32", "--reps", "1",
                     "--json", str(figures)]) == 0
    out = capsys.readouterr().out
    assert "Restore / bare: wall" in out and "batch_get_into (bare)" in out
    (run,) = json.loads(figures.read_text())
    assert {"wall_ratio", "cpu_ratio", "mac"} <= set(run) and run["mac"] == "blake3"


def test_a_node_sealing_with_blake3_and_one_with_hmac_read_each_others_blocks(master, tmp_path):
    """``mac: blake3`` changes what a daemon writes, never what it reads: in a rollout both seals are served."""
    a, b = node(master, tmp_path, "seal:", mac="blake3"), node(master, tmp_path, "seal:", mac="hmac-sha256")
    try:
        shadow_a = offload(a, KEYS)
        until(lambda: events(a).get("stored", 0) >= 16, "a demoted 16")
        outcomes, blocks = restore(b, KEYS[:8])
        assert outcomes == [Outcome.DONE] * 8 and all(d.equal(shadow_a[k]) for k, d in zip(KEYS[:8], blocks))
        keys_b = [b"hm%02d" % i for i in range(48)]
        shadow_b = offload(b, keys_b)
        until(lambda: events(b).get("stored", 0) >= 16, "b demoted 16")
        outcomes, blocks = restore(a, keys_b[:8])
        assert outcomes == [Outcome.DONE] * 8 and all(d.equal(shadow_b[k]) for k, d in zip(keys_b[:8], blocks))
        assert events(a).get("corrupt", 0) == events(b).get("corrupt", 0) == 0
    finally:
        a.cleanup()
        b.cleanup()


def test_values_sealed_the_other_way_are_read_again_whole_in_batches_past_the_bounce_buffer(master, tmp_path):
    """A tier reads values in the parts its own seal lays out; 40 values sealed the other way (more than the
    bounce buffer's 32) are each read again whole, checked and copied into their slots."""
    from kvxfer.geometry.block_checksum import block_checksum
    from kvxfer.tiers.mooncake.settings import parse
    from kvxfer.tiers.mooncake.store import MooncakeTier

    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    section = master.section(segment_mib=64, secret_file=str(secret), timeout_ms=10_000)
    slot, keys = 16384, [b"w%02d" % i for i in range(40)]
    blocks = torch.randint(0, 256, (40, slot), dtype=torch.uint8)
    host = torch.zeros((48, slot), dtype=torch.uint8)
    writer = MooncakeTier(parse({**section, "mac": "blake3"}), "g", b"f" * 32, slot)
    reader = MooncakeTier(parse({**section, "mac": "hmac-sha256", "segment_mib": 0}), "g", b"f" * 32, slot,
                          host_memory=(host.data_ptr(), host.numel()))
    try:
        writer.stage("ns", [(k, block_checksum(b.numpy()), b) for k, b in zip(keys, blocks)])
        assert writer.flush(60) and writer.stats().events.get("stored") == 40
        verdicts = reader.read_into("ns", keys, list(host[:40]))
        assert [v[0] for v in verdicts] == [Outcome.DONE] * 40 and torch.equal(host[:40], blocks)
    finally:
        writer.close(5)
        reader.close(5)
