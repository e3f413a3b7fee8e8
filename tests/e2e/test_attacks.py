"""Attacks by clients of other Unix users, each against a real daemon (docs/design.md, threat model).

The attacker may connect to the socket (it is in the socket group) but cannot open
the daemon's or other users' files. Run as root: the tests create the users.
"""

import json
import os
import shutil
import time

import pytest

from kvxfer.client import Client
from tests.e2e.conftest import SMALL_POOL, run_as, start_as

pytestmark = pytest.mark.e2e


@pytest.fixture
def shared_daemon(make_daemon, unix_users):
    """A daemon whose sockets the socket group may use, with a secret file and a directory per user."""
    group, attacker, victim = unix_users
    daemon = make_daemon({"socket_mode": "0660", "socket_group": group, "registered_host_capacity_mib": 1,
                          "pools": [SMALL_POOL]})
    os.chmod(daemon.dir, 0o711)
    os.chmod(daemon.shm_dir, 0o711)
    secret = daemon.shm_dir / "secret"
    secret.write_bytes(b"\x5a" * 8 * 512)
    os.chmod(secret, 0o600)
    readable = daemon.shm_dir / "readable"
    readable.write_bytes(b"\x5b" * 8 * 512)
    os.chmod(readable, 0o644)
    dirs = {}
    for user in (attacker, victim):
        d = dirs[user] = daemon.shm_dir / user
        d.mkdir()
        shutil.chown(d, user, group)
    yield daemon, attacker, victim, dirs, secret, readable


def test_registration_serves_only_memory_the_client_opened_itself(shared_daemon):
    daemon, attacker, _, dirs, secret, readable = shared_daemon
    got = run_as(attacker, "confused_deputy", daemon.target, str(secret), str(readable), str(dirs[attacker]))
    assert got == {
        "path_without_token": "PERMISSION_DENIED",  # the daemon never opens a path it is given
        "made_up_token": "PERMISSION_DENIED",
        "open_secret": "OSError:13",  # the attacker's own credentials decide what it can hand over
        "read_only_descriptor": "PERMISSION_DENIED",  # read-only is not enough to be served read-write
        "directory_descriptor": "INVALID_ARGUMENT",
        "served_pool_descriptor": "PERMISSION_DENIED",  # no alias of memory the daemon already serves
        "own_file_named_as_secret": "INVALID_ARGUMENT",  # the published path must name the file handed over
        "own_file": "OK",
        "replayed_token": "PERMISSION_DENIED",  # tokens are single use
    }, got
    assert secret.read_bytes() == b"\x5a" * 8 * 512
    with Client(daemon.target) as client:
        assert client.health() == "SERVING"


def test_link_swapping_never_maps_a_foreign_file(shared_daemon):
    daemon, attacker, _, dirs, secret, _ = shared_daemon
    start = time.monotonic()
    got = run_as(attacker, "link_race", daemon.target, str(secret), str(dirs[attacker]), 10_000, timeout=600)
    assert got["registered"] + got["refused"] + got["open_failed"] == 10_000
    assert got["registered"] > 0 and got["open_failed"] > 0, got  # the race really ran both ways
    assert got["checked"] > 0 and got["secret_bytes_seen"] == 0, got
    assert secret.read_bytes() == b"\x5a" * 8 * 512
    print(f"link race: {got} in {time.monotonic() - start:.1f} s")


def test_another_uid_on_the_local_lane_reaches_no_registered_pool_and_cannot_take_the_victims_lane(shared_daemon):
    daemon, attacker, victim, dirs, _, _ = shared_daemon
    holder = start_as(victim, "register_and_hold", daemon.target, str(dirs[victim]), "vpool", "victims")
    assert json.loads(holder.stdout.readline())["registered"] == "vpool"
    squatter = start_as(attacker, "lane_squat", daemon.target, "vpool", 60.0)
    try:
        line = squatter.stdout.readline()
        assert line, squatter.communicate(timeout=60)[1]
        got = json.loads(line)
        assert got == {"holding": 32, "connections": 32, "then": "RESOURCE_EXHAUSTED",  # half of 64 for one uid
                       "offload_victims_pool": "PERMISSION_DENIED", "restore_into_victims_pool": "PERMISSION_DENIED"}
        with Client(daemon.target, namespace="bystander", pool_id="rank0") as client:  # root: another uid, its own half
            assert client.lookup([b"k"]).hits == 0
            assert client._lane._idle  # answered over the lane
    finally:
        squatter.kill()
        squatter.communicate(timeout=60)
        holder.communicate("", timeout=60)
    assert "Traceback" not in daemon.log_text()


def test_groups_admit_their_creator_and_only_the_registrant_unregisters(shared_daemon):
    daemon, attacker, victim, dirs, _, _ = shared_daemon
    holder = start_as(victim, "register_and_hold", daemon.target, str(dirs[victim]), "vpool", "victims")
    assert json.loads(holder.stdout.readline())["registered"] == "vpool"
    try:
        got = run_as(attacker, "join_and_unregister", daemon.target, str(dirs[attacker]), "vpool", "victims")
    finally:
        out, err = holder.communicate("", timeout=60)
    assert got == {"join_victims_group": "PERMISSION_DENIED", "join_daemon_group": "PERMISSION_DENIED",
                   "victims_path_shown": False, "offload_victims_pool": "PERMISSION_DENIED",
                   "restore_into_victims_pool": "PERMISSION_DENIED", "delete_in_victims_group": "PERMISSION_DENIED",
                   "unregister_without_token": "PERMISSION_DENIED", "unregister_wrong_token": "PERMISSION_DENIED",
                   "own_group": "OK"}, got
    assert holder.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"still_served_before_unregister": True, "unregistered": True}
