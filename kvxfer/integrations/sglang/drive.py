"""Moved to ``kvxfer.bench.sglang_engine`` (issue 48: the harness that drives SGLang's HiCache in one process is
no part of the backend). This name re-exports it for one more release, for tests written against it; import
the new one."""

from kvxfer.bench.sglang_engine import Controller, Model, attach, extra_config, host_pool, storage_config

__all__ = ["Controller", "Model", "attach", "extra_config", "host_pool", "storage_config"]
