"""Admission rules alone (``kvxfer.index.admission``): a new block is stored on its N-th offer, an offload
stores at most its first M new blocks, blocks held already always pass, and the offers table stays bounded."""

import pytest
import torch
import yaml

from kvxfer.core.errors import ConfigError
from kvxfer.core.records import Outcome, TierKind
from kvxfer.geometry.layout import PRESETS, KVSpec, PoolLayout
from kvxfer.index.admission import Admission, AdmissionSettings
from kvxfer.serving.group import CacheGroup
from service import config as service_config


def test_a_new_block_is_stored_on_its_nth_offer_and_counts_are_per_namespace():
    a = Admission(AdmissionSettings(store_threshold=3))
    keys = [b"a", b"b"]
    assert a.admit("n", keys, [False, False]) == [False, False]
    assert a.admit("other", keys, [False, False]) == [False, False]  # another namespace's offers are its own
    assert a.admit("n", keys, [True, False]) == [True, False]  # held: always (nothing stored); b: 2nd offer
    assert a.admit("n", keys, [False, False]) == [False, True]  # a: 2nd offer (held ones are not counted)
    assert (a.declined_threshold, a.declined_cap) == (6, 0)


def test_an_offload_stores_its_first_new_blocks_up_to_the_cap():
    a = Admission(AdmissionSettings(max_blocks_per_request=2))
    assert a.admit("n", [b"a", b"b", b"c", b"d"], [False, True, False, False]) == [True, True, True, False]
    assert a.declined_cap == 1 and a.tracked == 0  # (no threshold: no offers counted)


def test_the_offers_table_forgets_the_least_recently_offered_first():
    a = Admission(AdmissionSettings(store_threshold=2, tracked_keys=100))
    for i in range(1000):
        a.admit("n", [b"%d" % i], [False])
        assert a.tracked <= 100
    assert a.admit("n", [b"999"], [False]) == [True]  # remembered
    assert a.admit("n", [b"0"], [False]) == [False]  # forgotten: a first offer again


def test_a_group_answers_not_admitted_for_declined_blocks_and_counts_them():
    layout = PoolLayout(KVSpec(2, 16, 4, 2, 8, torch.float16), PRESETS["BLHNC"])
    group = CacheGroup("g", layout, 8, admission=AdmissionSettings(store_threshold=2, max_blocks_per_request=1))
    keys = [b"a", b"b", b"c"]
    first = group.prepare_store("n", keys, admit=True)
    assert first.outcomes == [Outcome.NOT_ADMITTED] * 3 and not first.slots
    second = group.prepare_store("n", keys, admit=True)
    assert second.outcomes == [Outcome.DONE, Outcome.NOT_ADMITTED, Outcome.NOT_ADMITTED]
    assert list(second.positions) == [0] and len(second.slots) == 1
    group.publish(second.slots, [7])
    third = group.prepare_store("n", keys, admit=True)  # a held; b its first (cap 1); c over the cap
    assert third.outcomes == [Outcome.ALREADY_PRESENT, Outcome.DONE, Outcome.NOT_ADMITTED]
    assert list(third.positions) == [1]
    group.publish(third.slots, [8])
    assert group.prepare_store("n", [b"d"]).outcomes == [Outcome.DONE]  # (admit=False: a peer's, a rank's)
    host = next(t for t in group.tier_stats() if t.tier is TierKind.HOST)
    assert host.events["declined_store_threshold"] == 3 and host.events["declined_request_cap"] == 3
    group.close()


@pytest.mark.parametrize("raw, message", [
    ({"store_threshold": -1}, "admission.store_threshold: must be an integer in"),
    ({"max_blocks_per_request": True}, "admission.max_blocks_per_request: must be an integer"),
    ({"tracked_keys": 0}, "admission.tracked_keys: must be an integer in"),
    ({"store_treshold": 2}, "admission: must be a mapping of"),
    ([1], "admission: must be a mapping of"),
])
def test_bad_admission_settings_are_refused_at_load(tmp_path, raw, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"socket": str(tmp_path / "k.sock"), "admission": raw}))
    with pytest.raises(ConfigError, match=message):
        service_config.load(str(path), env={})
