"""One unit style for sizes in settings (issue 50: ``_mib`` and ``_gib`` were mixed): every size key ends
``_mib``; the keys renamed on the way are read still, as their new key, with a warning naming it."""

import pytest
import yaml

from kvxfer.core.errors import ConfigError
from kvxfer.tiers.sections import RENAMED, renamed
from service import chart_schema
from service import config as service_config
from service import program as cli

UNIT_WORDS = ("gib", "kib", "bytes", "_mb", "_gb", "_kb")


def test_every_size_key_the_daemon_reads_is_in_mib():
    renamed = {old for _, old in RENAMED}
    keys = [(section, key) for section, fields in chart_schema.daemon_keys().items() for key in (fields or [section])]
    assert not [f"{s}.{k}" for s, k in keys if k not in renamed and any(w in k for w in UNIT_WORDS)]
    assert {new for new, _ in RENAMED.values()} <= {k for _, k in keys}


def _load(tmp_path, raw: dict):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"), **raw}))
    config = service_config.load(str(path), env={})
    return config, list(config.notes)


def test_renamed_keys_are_read_as_their_new_keys_with_a_warning(tmp_path):
    disk = {"path": str(tmp_path / "d")}
    old, warnings = _load(tmp_path, {"disk": {**disk, "capacity_gib": 2}, "events": {"replay_bytes": 3 << 20 | 1}})
    new, none = _load(tmp_path, {"disk": {**disk, "capacity_mib": 2048}, "events": {"publish_replay_mib": 4}})
    assert old.tiers["disk"] == new.tiers["disk"] and old.tiers["disk"].capacity_bytes == 2 << 30
    assert old.events.replay_bytes == 3 << 20 | 1 and new.events.replay_bytes == 4 << 20
    assert none == [] and sorted(warnings) == sorted(
        f"{s}.{o} is renamed {s}.{n} (every size is in MiB): read as {n}; rename it" for (s, o), (n, _) in RENAMED.items()
        if s != "object")
    # (the object tier asks its bucket at load: its section is read the same way, checked here without one)
    assert renamed("object", {"url": "s3://b/p", "max_gib": 0.5}) == {"url": "s3://b/p", "max_mib": 512}


@pytest.mark.parametrize("section, raw, message", [
    ("disk", {"capacity_gib": 1, "capacity_mib": 1024}, "disk.capacity_gib: renamed capacity_mib; give only"),
    ("disk", {"capacity_gib": "1G"}, "disk.capacity_gib (renamed capacity_mib, in MiB): must be a number"),
    ("events", {"replay_bytes": True}, "events.replay_bytes (renamed publish_replay_mib, in MiB)"),
])
def test_a_renamed_key_is_still_validated(tmp_path, section, raw, message):
    if section == "disk":
        raw = {"path": str(tmp_path / "d"), **raw}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _load(tmp_path, {section: raw})


def test_serve_check_prints_the_renamed_keys(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"), "metrics_listen": "",
                                    "pools": [{"id": "p", "device": "cpu", "spec": {"num_blocks": 8}}],
                                    "disk": {"path": str(tmp_path / "d"), "capacity_gib": 1}}))
    assert cli.main(["serve", "--check", "--config", str(path)]) == 0
    assert "warning: disk.capacity_gib is renamed disk.capacity_mib" in capsys.readouterr().out
