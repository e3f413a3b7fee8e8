"""What a vLLM engine's blocks are called at the daemon (no vLLM needed: plain values)."""

import dataclasses

import pytest
import torch

from kvxfer.core.errors import InvalidArgument
from kvxfer.core.validate import NAMESPACE_RE, POOL_ID_RE
from kvxfer.geometry.layout import KVSpec, Layout
from kvxfer.integrations.vllm.naming import VLLM_LAYOUTS, EngineNames, kvxfer_layout

NAMES = EngineNames(engine_id="3f2b-engine", model="Qwen/Qwen2.5-0.5B",
                    spec=KVSpec(24, 1000, 16, 2, 64, torch.bfloat16), layout=kvxfer_layout("BLHNC"), world_size=1)


def test_every_name_is_one_the_daemon_accepts():
    names = dataclasses.replace(NAMES, engine_id="x" * 200, group_prefix="team/a b!" * 10)
    for pool_id in [names.pool_id(0), names.cache_group(0)]:
        assert POOL_ID_RE.fullmatch(pool_id), pool_id
    for salt in [None, "", "tenant-1", "ü" * 500]:
        assert NAMESPACE_RE.fullmatch(names.namespace(salt))


@pytest.mark.parametrize("change", [
    {"model": "meta-llama/Llama-3.1-8B"}, {"world_size": 2}, {"layout": kvxfer_layout("LBHNC")},
    {"spec": KVSpec(24, 1000, 32, 2, 64, torch.bfloat16)}, {"spec": KVSpec(24, 1000, 16, 2, 64, torch.float16)},
    {"spec": KVSpec(23, 1000, 16, 2, 64, torch.bfloat16)}])
def test_another_model_geometry_or_layout_never_shares_a_namespace(change):
    other = dataclasses.replace(NAMES, **change)
    assert other.namespace("t") != NAMES.namespace("t") and other.cache_group(0) != NAMES.cache_group(0)


def test_the_cache_size_and_the_engine_instance_do_not_change_what_blocks_mean():
    restarted = dataclasses.replace(NAMES, engine_id="another-start", spec=KVSpec(24, 5000, 16, 2, 64,
                                                                                   torch.bfloat16))
    assert restarted.namespace("t") == NAMES.namespace("t")  # a restarted engine finds its blocks
    assert restarted.cache_group(0) == NAMES.cache_group(0)  # ... in the host tier it used before
    assert restarted.pool_id(0) != NAMES.pool_id(0)  # while its pool is new


def test_tenants_and_ranks_are_kept_apart():
    assert len({NAMES.namespace(s) for s in [None, "a", "b", "A"]}) == 4
    two = dataclasses.replace(NAMES, world_size=2)
    assert two.pool_ids() == [two.pool_id(0), two.pool_id(1)] and two.cache_group(0) != two.cache_group(1)


def test_vllm_layouts_are_kvxfer_layouts_and_others_are_refused():
    assert kvxfer_layout("BLHNC") == Layout.parse("BLHNC")  # vLLM's C is kvxfer's KV,D
    for name, axes in VLLM_LAYOUTS.items():
        assert kvxfer_layout(name).spelled.replace(",", "") == axes.replace(",", "")
    with pytest.raises(InvalidArgument, match="NHD"):
        kvxfer_layout("NHD")
