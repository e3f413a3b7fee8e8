"""What an engine's KV bytes depend on besides the cache geometry: the model's weights, its
architecture and the precision it runs in.

Replicas that load the same weights from different paths share blocks; a weight update
makes a new identity, after which no block of the old weights is served. Weights are
named by content, cheaply: a file in the Hugging Face cache is a link to a blob named by
its SHA-256; any other weight file by its size and a few MiB sampled across it (a fine-
tune differs everywhere). A model named on the hub is named by its revision. An
explicit ``model_id`` replaces the weights' identity (not the rest).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

#: Files whose bytes are weights.
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf"})
#: A file outside the Hugging Face cache: this many samples of this many bytes, spread over it.
SAMPLES, SAMPLE_BYTES = 4, 1 << 20
#: Config keys that name where or with what the config was read, not what the model computes.
_NOT_MODEL = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash"})
_SHA256 = re.compile(r"[0-9a-f]{64}")


def weights_identity(model: str, revision: str | None) -> str:
    """The weights of a local directory by content, or a hub model by name and revision."""
    path = Path(model)
    if not path.is_dir():
        return f"hub:{model}@{revision or 'main'}"
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        digest.update(file.name.encode() + b"\0" + _file_identity(file))
    return f"weights:{digest.hexdigest()[:32]}"


def _file_identity(file: Path) -> bytes:
    target = file.resolve()
    if _SHA256.fullmatch(target.name):  # a Hugging Face cache blob: named by its content's SHA-256
        return target.name.encode()
    size = target.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with target.open("rb") as f:
        for i in range(SAMPLES):
            f.seek(max(0, size - SAMPLE_BYTES) * i // (SAMPLES - 1))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.digest()


def config_identity(config: dict[str, Any]) -> str:
    """The model's architecture: its config, less the keys that only say where it was read."""
    kept = {k: v for k, v in config.items() if k not in _NOT_MODEL}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_identity(model: str, revision: str | None, hf_config: dict[str, Any], dtype: object,
                   quantization: str | None, model_id: str = "") -> str:
    """Everything of the model the KV bytes depend on (the geometry is bound elsewhere)."""
    weights = f"id:{model_id}" if model_id else weights_identity(model, revision)
    return f"{weights}|config:{config_identity(hf_config)}|{dtype}|{quantization or 'none'}"


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def safe_group_prefix(prefix: str, default: str) -> str:
    """A user's cache-group prefix made safe for a group name (``default`` when empty)."""
    return _UNSAFE.sub("-", prefix)[:24] or default
