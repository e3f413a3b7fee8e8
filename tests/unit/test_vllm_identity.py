"""A vLLM model's identity: the weights by content, the architecture, the precision."""

import os

from kvxfer.integrations.identity import SAMPLE_BYTES, model_identity, weights_identity

CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "_name_or_path": "/models/a",
          "transformers_version": "4.57.0"}


def _model(directory, weights: bytes, name: str = "model.safetensors"):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(weights)
    (directory / "README.md").write_text(str(directory))  # not weights: ignored
    return str(directory)


def test_the_same_weights_anywhere_are_one_model_and_other_weights_another(tmp_path):
    weights = os.urandom(3 * SAMPLE_BYTES + 12345)
    a, b = _model(tmp_path / "a", weights), _model(tmp_path / "copy" / "b", weights)
    tuned = bytearray(weights)
    tuned[-1] ^= 1  # a fine-tune differs everywhere; here, even one byte in a sample is enough
    c = _model(tmp_path / "c", bytes(tuned))
    assert weights_identity(a, None) == weights_identity(b, None) != weights_identity(c, None)
    d = _model(tmp_path / "d", weights, name="model-00001-of-00001.safetensors")  # another file name
    assert weights_identity(d, None) != weights_identity(a, None)


def test_a_hugging_face_cache_blob_is_named_by_its_sha256(tmp_path):
    blob = tmp_path / "blobs" / ("ab" * 32)
    blob.parent.mkdir()
    blob.write_bytes(b"weights")
    for snapshot in ("s1", "s2"):
        (tmp_path / snapshot).mkdir()
        (tmp_path / snapshot / "model.safetensors").symlink_to(blob)
    assert weights_identity(str(tmp_path / "s1"), None) == weights_identity(str(tmp_path / "s2"), None)
    blob.write_bytes(b"other bytes, same name: the cache's name is trusted")
    assert weights_identity(str(tmp_path / "s1"), None) == weights_identity(str(tmp_path / "s2"), None)


def test_hub_models_by_revision_and_the_rest_of_the_identity(tmp_path):
    assert weights_identity("Qwen/Qwen2.5-0.5B", "abc123") != weights_identity("Qwen/Qwen2.5-0.5B", None)
    base = model_identity("Qwen/Qwen2.5-0.5B", None, CONFIG, "torch.bfloat16", None)
    moved = {**CONFIG, "_name_or_path": "/elsewhere", "transformers_version": "5.0.0"}
    assert model_identity("Qwen/Qwen2.5-0.5B", None, moved, "torch.bfloat16", None) == base
    assert model_identity("Qwen/Qwen2.5-0.5B", None, {**CONFIG, "num_hidden_layers": 3}, "torch.bfloat16",
                          None) != base
    assert model_identity("Qwen/Qwen2.5-0.5B", None, CONFIG, "torch.float16", None) != base
    assert model_identity("Qwen/Qwen2.5-0.5B", None, CONFIG, "torch.bfloat16", "fp8") != base
    named = model_identity(str(tmp_path), None, CONFIG, "torch.bfloat16", None, model_id="qwen@sha:1f")
    assert named == model_identity("/other/path", None, CONFIG, "torch.bfloat16", None, model_id="qwen@sha:1f")
    assert named != model_identity("/other/path", None, CONFIG, "torch.bfloat16", None, model_id="qwen@sha:2a")
