"""The chart points the sidecar at an existing Mooncake Store cluster: the rendered config's ``mooncake``
section (which the daemon takes), the HMAC secret mounted from a Secret, the memory lent counted in the
sidecar's limit, and a missing master refused at render."""

import pytest
import yaml

from tests.e2e.test_helm import pod_of, render, rendered_config

MOONCAKE = {"enabled": True, "master": "mooncake-master.kv:50051",
            "metadata": "http://mooncake-master.kv:8080/metadata", "segmentMiB": 1024, "secretName": "mooncake-hmac"}


def _sidecar(objects: list[dict]) -> dict:
    return next(c for c in pod_of(objects)["initContainers"] if c["name"] == "kvxfer")


def test_the_sidecar_joins_the_cluster_with_its_secret_and_the_memory_it_lends(tmp_path):
    plain = render({})
    objects = render({"kvxfer": {"mooncake": MOONCAKE}})
    section = rendered_config(objects)["mooncake"]
    assert section == {"master": "mooncake-master.kv:50051", "metadata": "http://mooncake-master.kv:8080/metadata",
                       "protocol": "tcp", "segment_mib": 1024, "buffer_mib": 64,
                       "secret_file": "/etc/kvxfer/mooncake/secret"}
    sidecar = _sidecar(objects)
    assert {"name": "kvxfer-mooncake", "mountPath": "/etc/kvxfer/mooncake", "readOnly": True} in sidecar["volumeMounts"]
    (volume,) = [v for v in pod_of(objects)["volumes"] if v["name"] == "kvxfer-mooncake"]
    assert volume["secret"] == {"secretName": "mooncake-hmac", "items": [{"key": "secret", "path": "secret"}]}
    lent = int(sidecar["resources"]["limits"]["memory"].removesuffix("Mi"))
    before = int(_sidecar(plain)["resources"]["limits"]["memory"].removesuffix("Mi"))
    assert lent - before >= 1024 + 64  # (each cache group's client: at least one)
    from service import config as service_config  # the daemon takes what the chart renders

    config = rendered_config(objects)
    (tmp_path / "secret").write_text("a-cluster-wide-secret-of-32-bytes")
    config["mooncake"]["secret_file"] = str(tmp_path / "secret")
    path = tmp_path / "kvxfer.yaml"
    path.write_text(yaml.safe_dump({**config, "socket": str(tmp_path / "k.sock"), "socket_group": ""}))
    assert service_config.load(str(path)).tiers["mooncake"].segment_bytes == 1024 << 20


def test_a_cluster_without_a_master_is_refused_at_render():
    with pytest.raises(Exception, match="mooncake.master"):
        render({"kvxfer": {"mooncake": {"enabled": True}}})
