"""The ``peering`` section: every value checked, each mistake one precise message."""

import subprocess

import pytest

from kvxfer.core.errors import ConfigError
from service import config as cfg


@pytest.fixture
def files(tmp_path):
    ca, key, token = tmp_path / "ca.pem", tmp_path / "key.pem", tmp_path / "token"
    # (the listener's certificate and key are checked to belong together: a real pair)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(ca),
                    "-days", "1", "-subj", "/CN=a"], check=True, capture_output=True)
    token.write_text("t0ken\n")
    return {"tls_cert": str(ca), "tls_key": str(key), "token_file": str(token), "ca": str(ca), "token": str(token)}


def _load(tmp_path, files, peering, client_ca=True):
    if client_ca and isinstance(peering, dict):  # (every valid section names its client CA)
        peering = {"tls_client_ca": files["ca"], **peering}
    return cfg.load(overrides={"socket": str(tmp_path / "k.sock"), "listen": "127.0.0.1:7000",
                               "tls_cert": files["tls_cert"], "tls_key": files["tls_key"],
                               "token_file": files["token_file"], "peering": peering})


def _peer(files, **over):
    return {"name": "b", "address": "10.0.0.2:7000", "tls_ca": files["ca"], "token_file": files["token"], **over}


def test_a_valid_section(tmp_path, files):
    c = _load(tmp_path, files, {"name": "a", "peers": [_peer(files)], "ucx_tls": "tcp", "lease_ms": 2000})
    p = c.peering
    assert p.name == "a" and p.ucx_tls == "tcp" and p.lease_ms == 2000
    assert p.peers[0].name == "b" and p.peers[0].token == "t0ken" and "t0ken" not in repr(p)
    assert (p.tls_client_ca, p.tls_cert, p.tls_key) == (files["ca"], files["tls_cert"], files["tls_key"])  # listener's
    assert (p.host_share, p.max_leases_per_peer) == (0.25, 32)


def test_mutual_tls_and_the_peers_share_are_checked(tmp_path, files):
    with pytest.raises(ConfigError, match="peering.tls_client_ca: the CA file"):
        _load(tmp_path, files, {"name": "a", "peers": [_peer(files)]}, client_ca=False)
    with pytest.raises(ConfigError, match="peering.tls_client_ca: .* is not a readable file"):
        _load(tmp_path, files, {"name": "a", "tls_client_ca": str(tmp_path / "absent.pem")})
    with pytest.raises(ConfigError, match="both or neither"):
        _load(tmp_path, files, {"name": "a", "tls_cert": files["ca"]})
    for share in (0, 0.95, True, "half"):
        with pytest.raises(ConfigError, match="peering.host_share"):
            _load(tmp_path, files, {"name": "a", "host_share": share})
    with pytest.raises(ConfigError, match="peering.max_leases_per_peer"):
        _load(tmp_path, files, {"name": "a", "max_leases_per_peer": 0})
    own = _load(tmp_path, files, {"name": "a", "tls_cert": files["token"], "tls_key": files["token"], "host_share": 0.5})
    assert own.peering.tls_cert == files["token"] and own.peering.host_share == 0.5


BAD = {
    "not a mapping": ("yes", "peering: must be a mapping"),
    "unknown key": ({"name": "a", "peer": []}, "unknown keys ['peer']"),
    "bad name": ({"name": "a b"}, "peering.name"),
    "bad number": ({"name": "a", "lease_ms": 0}, "peering.lease_ms: an integer in [1, 600000]"),
    "bool number": ({"name": "a", "max_leases": True}, "peering.max_leases"),
    "bad ucx list": ({"name": "a", "ucx_tls": "tcp; rm -rf"}, "peering.ucx_tls"),
    "peers not a list": ({"name": "a", "peers": {"b": 1}}, "peering.peers: a list"),
    "peer missing keys": ({"name": "a", "peers": [{"name": "b"}]}, "peering.peers[0]: a mapping of"),
    "peer bad address": ({"name": "a", "peers": ["ADDR"]}, "peering.peers[0].address: HOST:PORT"),
    "duplicate names": ({"name": "a", "peers": ["P", "P"]}, "names must be distinct"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_values_are_refused_with_the_setting_named(tmp_path, files, case):
    raw, message = BAD[case]
    if isinstance(raw, dict) and "peers" in raw and isinstance(raw["peers"], list):
        raw = {**raw, "peers": [_peer(files) if p == "P" else _peer(files, address="nowhere") if p == "ADDR" else p
                                for p in raw["peers"]]}
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, files, raw)
    assert message in str(err.value)


def test_one_peer_list_serves_a_whole_fleet_each_daemon_skipping_itself(tmp_path, files):
    """Issue 50: the chart's StatefulSet gives every replica one config listing them all."""
    fleet = [_peer(files, name=f"kv-{i}", address=f"kv-{i}.kv-peers.ns.svc:7070") for i in range(3)]
    for i in range(3):
        loaded = _load(tmp_path, files, {"name": f"kv-{i}", "peers": fleet})
        assert [p.name for p in loaded.peering.peers] == [f"kv-{j}" for j in range(3) if j != i]


def test_a_peer_address_token_and_ca_are_checked(tmp_path, files):
    for over, message in (({"address": "host"}, ".address: HOST:PORT"), ({"address": "h:70000"}, ".address"),
                          ({"tls_ca": "/nonexistent"}, ".tls_ca: '/nonexistent' is not a readable file"),
                          ({"server_name": "bad name"}, ".server_name")):
        with pytest.raises(ConfigError) as err:
            _load(tmp_path, files, {"name": "a", "peers": [_peer(files, **over)]})
        assert message in str(err.value)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="token_file: must hold"):
        _load(tmp_path, files, {"name": "a", "peers": [_peer(files, token_file=str(tmp_path / "empty"))]})


def test_peering_needs_the_tls_listener(tmp_path, files):
    with pytest.raises(ConfigError, match="peering: needs listen"):
        cfg.load(overrides={"socket": str(tmp_path / "k.sock"), "peering": {"name": "a", "tls_client_ca": files["ca"]}})
