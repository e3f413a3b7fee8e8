"""Moved to ``kvxfer.bench.vllm_engine`` (issue 48: the harness that drives vLLM in one process is no part of
the backend). This name re-exports it for one more release, for tests written against it; import the new one."""

from kvxfer.bench.vllm_engine import Engine, Model, Rank, StepReport, prefix_hashes

__all__ = ["Engine", "Model", "Rank", "StepReport", "prefix_hashes"]
