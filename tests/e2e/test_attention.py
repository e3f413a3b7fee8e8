"""The attention-side view around a restore into other slots, against a real daemon."""

import pytest

from tests.e2e.conftest import run_worker

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("pool_id", ["rank0", "lbhnc"])
@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_restored_blocks_read_back_right_and_decoding_continues(daemon, pool_id, use_triton):
    result = run_worker("attention_roundtrip", daemon.target, pool_id, f"attn-{pool_id}-{use_triton}", use_triton)
    assert result["restored"], result
    assert result["decode"], result
