"""kvxfer for vLLM 0.33: ``--kv-transfer-config '{"kv_connector": "KvxferConnector",
"kv_connector_module_path": "kvxfer.integrations.vllm", ...}'`` (docs/vllm.md).

The connector is imported on first use, so that the vLLM-free parts (naming) load without vLLM.
"""

__all__ = ["KvxferConnector"]


def __getattr__(name: str):
    if name == "KvxferConnector":
        from kvxfer.integrations.vllm.connector import KvxferConnector

        return KvxferConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
