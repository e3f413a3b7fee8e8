"""Other caches through a real engine: an fp8 KV cache (per-tensor scales, one byte an element), restored
bit-exact.

No MLA model: vLLM 0.32's CPU platform turns prefix caching (and chunked prefill) off for MLA models on CPUs
without AMX, as this one is, so no block of theirs is ever looked up or stored by any connector; its CPU MLA
decode kernel takes only DeepSeek's own sizes (a 576-wide latent, blocks of 16)."""

from __future__ import annotations

from kvxfer.bench.engine.process import EngineProcess, EngineSpec
from tests.engine.conftest import CONTROL, MODEL, PROMPT, RESTORED, RETRY_S, evict, restored_blocks


def test_an_fp8_cache_restored_bit_exact(model_dir, make_daemon, tmp_path):
    def engine(socket: str | None, name: str) -> EngineProcess:
        kvxfer = None if socket is None else {"socket": socket, "retry_s": RETRY_S}
        spec = EngineSpec(model_dir, kvxfer=kvxfer, kv_cache_dtype="fp8",
                          kv_bytes_per_token=MODEL.kv_bytes_per_token() // 2)
        return EngineProcess(spec, tmp_path / f"{name}.log")

    plain = engine(None, "plain")
    try:
        computed, cached, control = plain.generate(PROMPT), plain.generate(PROMPT), plain.generate(CONTROL)
    finally:
        plain.close()
    assert not control.same_as(computed), "the model's output does not depend on its prefix"
    assert cached.cached == RESTORED  # (the tokens after a cached prefix are computed in another split)
    daemon = make_daemon()
    offloaded = engine(daemon.socket, "kvxfer")
    try:
        assert offloaded.generate(PROMPT).same_as(computed)
        evict(offloaded)
        before = restored_blocks(daemon)
        again = offloaded.generate(PROMPT)
        assert again.cached == RESTORED and restored_blocks(daemon) - before == RESTORED // 32
        assert again.same_as(cached)
        assert offloaded.generate(CONTROL).same_as(control)
    finally:
        offloaded.close()
