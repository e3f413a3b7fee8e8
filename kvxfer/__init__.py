"""kvxfer: KV-cache offload and transfer for LLM inference engines.

``from kvxfer import Client`` gives the engine-side client (imported on first use,
so that ``import kvxfer.core.records`` stays light). The layers are described in
docs/design.md.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Client":
        from kvxfer.client import Client

        return Client
    raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")


__all__ = ["Client", "__version__"]
