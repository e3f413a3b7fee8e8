"""kvxfer for SGLang 0.5.23's HiCache: ``--hicache-storage-backend dynamic`` with
``"module_path": "kvxfer.integrations.sglang", "class_name": "KvxferStore"`` (docs/sglang.md).

The backend is imported on first use, so that the SGLang-free parts (naming, pages) load without SGLang.
"""

__all__ = ["KvxferStore"]


def __getattr__(name: str):
    if name == "KvxferStore":
        from kvxfer.integrations.sglang.backend import KvxferStore

        return KvxferStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
