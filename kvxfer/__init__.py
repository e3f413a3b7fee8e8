"""kvxfer: KV-cache offload and transfer for LLM inference engines."""

__version__ = "0.1.0"
