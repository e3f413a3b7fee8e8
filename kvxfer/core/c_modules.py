"""kvxfer's optional C modules of per-key bookkeeping, and the switch that turns them off.

``FAST`` (``kvxfer/core/_fastpath.c``: validation passes) is loaded here; the index loads its own
(``kvxfer/index/_tables.c``: a tier index's key table, in ``kvxfer.index.keytable``;
``kvxfer/index/_use_order.c``: its LRU order, in ``kvxfer.index.eviction``). Each is the built
module, or None where it is not built (no C compiler at install time) or ``KVXFER_NATIVE=0``
turns kvxfer's C code off: every caller then runs its Python twin, with the same results and
messages (the tests run both).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

#: Set to 0 to turn kvxfer's C code off: these passes and the CPU copy loop (benchmarks, debugging).
ENV_DISABLE = "KVXFER_NATIVE"


def load(name: str) -> ModuleType | None:
    """The C module ``name`` (dotted), or None where it is not built or C code is turned off."""
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


FAST = load("kvxfer.core._fastpath")
