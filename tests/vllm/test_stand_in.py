"""The stand-in engine (``kvxfer.bench.vllm_engine``) is faithful to vLLM's EngineCore where timing depends on
it (issue 51): EngineCore marks its start-up heap static (``freeze_gc_heap``) and unfreezes it at shutdown.
Without that, ``kvxfer bench vllm``'s first load took 0.4 s, a collection of the oldest generation over the
whole start-up heap, which vLLM never pays (20x the median; with it, no repetition of 50 over 2x)."""

import gc

from vllm.utils.gc_utils import freeze_gc_heap

from kvxfer.bench.vllm_engine import Engine
from tests.vllm.conftest import kv_transfer


def test_the_start_up_heap_is_frozen_as_engine_core_freezes_it(daemon):
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    engine = Engine(kv_transfer({"socket": daemon.config["socket"]}), num_blocks=16)
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # vLLM's, torch's and the engine's objects: out of every collection's way
        freeze_gc_heap()  # (what EngineCore does: nothing was left to freeze)
        assert gc.get_freeze_count() - frozen < frozen // 10
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0  # as EngineCore's shutdown: collectable again
