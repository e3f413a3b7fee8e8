"""kvxfer's optional C modules of per-key bookkeeping.

``FAST`` (``kvxfer/_fastpath.c``: validation passes), ``TABLES`` (``kvxfer/_tables.c``: a tier
index's key table) and ``USE_ORDER`` (``kvxfer/_use_order.c``: its LRU order) are the built
modules, or None where they are not built (no C compiler at install time) or ``KVXFER_NATIVE=0``
turns kvxfer's C code off: every caller then runs its Python twin, with the same results and
messages (the tests run both).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

#: Set to 0 to turn kvxfer's C code off: these passes and the CPU copy loop (benchmarks, debugging).
ENV_DISABLE = "KVXFER_NATIVE"


def _load(name: str) -> ModuleType | None:
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return None
    try:
        return importlib.import_module(f"kvxfer.{name}")
    except ImportError:
        return None


FAST = _load("_fastpath")
TABLES = _load("_tables")
USE_ORDER = _load("_use_order")
