"""Engines of one model with different tensor-parallel sizes and layouts share prefixes (issue 34), under
vLLM's real scheduler: each rank offloads its heads into one canonical block, and a rank of any other
split restores its own heads from it."""

import pytest
import torch

from kvxfer import Client
from kvxfer.bench.vllm_engine import Model
from tests.vllm.test_backend import MODES, PROMPT, TAIL, computed, external_hits, run_alone

OTHER = list(range(300, 364))  # 4 more blocks of 16


def group_stats(daemon, engine):
    names = engine.worker.spec.names
    with Client(daemon.target) as client:
        return next(s for s in client.stats() if s.pool_id == names.pool_id(0))


def shares(daemon, writer, reader, prompt):
    """``writer`` computes ``prompt``; ``reader`` then loads all of it, bit-exact, and continues it right."""
    run_alone(writer, f"w{id(prompt)}", prompt)
    expected = writer.expected_block_bytes(prompt, 4)
    assert torch.equal(writer.block_bytes(writer.block_tables[f"w{id(prompt)}"][:4]), expected)
    reports = run_alone(reader, f"r{id(prompt)}", prompt + TAIL)
    assert external_hits(reports, f"r{id(prompt)}") == 64 and computed(reports, f"r{id(prompt)}") == len(TAIL)
    assert not any(r.load_errors for r in reports)
    table = reader.block_tables[f"r{id(prompt)}"][:4]
    assert torch.equal(reader.block_bytes(table), expected)
    for rank in reader.ranks:  # each rank holds exactly its heads
        assert torch.equal(reader.block_bytes(table, reader.ranks.index(rank)), expected[:, :, rank.heads])
    assert reader.outputs[f"r{id(prompt)}"] == [reader.expected_token(prompt + TAIL)]


@pytest.mark.parametrize("mode", ["v1", "v2-async"])
def test_a_tp2_engine_and_a_tp1_engine_of_another_layout_share_prefixes_both_ways(daemon, make_engine, mode):
    tp2 = make_engine(daemon.config["socket"], model=Model(num_kv_heads=2), tensor_parallel=2, **MODES[mode])
    tp1 = make_engine(daemon.config["socket"], model=Model(num_kv_heads=2), layout="LBHNC", **MODES[mode])
    names2, names1 = tp2.worker.spec.names, tp1.worker.spec.names
    assert names2.cache_group(1) == names1.cache_group(0) and names2.namespace(None) == names1.namespace(None)
    shares(daemon, tp2, tp1, PROMPT)
    shares(daemon, tp1, tp2, OTHER)
    stats = group_stats(daemon, tp1)
    assert stats.tiers[0].ready_blocks == 8  # one canonical block a key, not one a rank
    assert stats.tiers[0].slot_bytes == 2 * tp2.block_bytes([1], 0).numel()


def test_replicated_heads_tp4_over_two_kv_heads_restore_into_tp1(daemon, make_engine):
    tp4 = make_engine(daemon.config["socket"], model=Model(num_kv_heads=2), tensor_parallel=4)
    tp1 = make_engine(daemon.config["socket"], model=Model(num_kv_heads=2))
    assert [r.heads for r in tp4.ranks] == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]
    shares(daemon, tp4, tp1, PROMPT)
    shares(daemon, tp1, tp4, OTHER)


def test_an_mla_latent_is_stored_once_for_every_rank_and_restores_into_any_split(daemon, make_engine):
    model = Model(num_kv_heads=1, head_size=72, latent=True)
    tp2 = make_engine(daemon.config["socket"], model=model, tensor_parallel=2)
    tp1 = make_engine(daemon.config["socket"], model=model)
    shares(daemon, tp2, tp1, PROMPT)
    shares(daemon, tp1, tp2, OTHER)
    stats = group_stats(daemon, tp1)
    assert stats.tiers[0].ready_blocks == 8 and stats.tiers[0].slot_bytes == 2 * 16 * 72 * 2  # once, no V


def test_another_model_of_the_same_geometry_never_matches(daemon, make_engine):
    writer = make_engine(daemon.config["socket"], model=Model(num_kv_heads=2), tensor_parallel=2)
    reader = make_engine(daemon.config["socket"], model=Model(num_kv_heads=2, weights_seed=1))
    run_alone(writer, "A", PROMPT)
    reports = run_alone(reader, "B", PROMPT + TAIL)
    assert external_hits(reports, "B") == 0
    assert reader.worker.spec.names.cache_group(0) != writer.worker.spec.names.cache_group(0)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_per_token_head", "int8_per_token_head"])
def test_per_token_head_scales_travel_with_their_heads_across_tp_sizes(daemon, make_engine, kv_cache_dtype):
    """vLLM's per-token-head quantised cache: each head's token cell is its K codes and fp32 scale, then
    V's. A TP=2 engine's blocks restore into a TP=1 engine bit-exact, scales included."""
    model = Model(num_kv_heads=2, kv_cache_dtype=kv_cache_dtype)
    tp2 = make_engine(daemon.config["socket"], model=model, tensor_parallel=2)
    tp1 = make_engine(daemon.config["socket"], model=model)
    names = tp1.worker.spec.names
    assert names.spec.kv_parts == 1 and names.spec.head_size == 2 * 16 + 8 and names.spec.dtype == torch.uint8
    assert names.kv_format == f"{kv_cache_dtype}:k16v16:inline_f32"
    shares(daemon, tp2, tp1, PROMPT)
    shares(daemon, tp1, tp2, OTHER)


def test_an_fp8_cache_with_per_tensor_scales_shares_and_never_matches_other_formats(daemon, make_engine):
    fp8 = make_engine(daemon.config["socket"], model=Model(num_kv_heads=2, kv_cache_dtype="fp8"), tensor_parallel=2)
    fp8_tp1 = make_engine(daemon.config["socket"], model=Model(num_kv_heads=2, kv_cache_dtype="fp8"))
    assert fp8.worker.spec.names.kv_format == "fp8:per_tensor"
    shares(daemon, fp8, fp8_tp1, PROMPT)
    for other in ("auto", "fp8_per_token_head"):  # the same prompt, another element format: never a hit
        engine = make_engine(daemon.config["socket"], model=Model(num_kv_heads=2, kv_cache_dtype=other))
        reports = run_alone(engine, f"x-{other}", PROMPT + TAIL)
        assert external_hits(reports, f"x-{other}") == 0
        assert engine.worker.spec.names.cache_group(0) != fp8_tp1.worker.spec.names.cache_group(0)


def test_k_and_v_of_different_head_sizes_are_one_cell_split_by_heads(daemon, make_engine):
    model = Model(num_kv_heads=2, head_size=16, head_size_v=8)
    tp2 = make_engine(daemon.config["socket"], model=model, tensor_parallel=2)
    tp1 = make_engine(daemon.config["socket"], model=model, layout="LBHNC")
    names = tp1.worker.spec.names
    assert (names.spec.kv_parts, names.spec.head_size, names.kv_format) == (1, 24, "k16v8")
    shares(daemon, tp2, tp1, PROMPT)


@pytest.mark.parametrize("field", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallel_ranks_hold_other_tokens_and_keep_a_group_a_rank(daemon, make_engine, field):
    from kvxfer.integrations.vllm.connector import engine_names

    engine = make_engine(daemon.config["socket"], model=Model(num_kv_heads=2), tensor_parallel=2)
    assert engine.worker.spec.names.canonical
    setattr(engine.config.parallel_config, field, 2)
    names = engine_names(engine.config, engine.kv_cache_config)
    assert not names.canonical and names.sharding(0) is None
    assert names.cache_group(0) != names.cache_group(1)
