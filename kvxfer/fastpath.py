"""The optional C passes of per-key bookkeeping (``kvxfer/_fastpath.c``).

``FAST`` is the built module, or None where it is not built (no C compiler at
install time) or ``KVXFER_NATIVE=0`` turns kvxfer's C code off: every caller then
runs its Python pass alone, with the same results and messages (the tests run both).
"""

from __future__ import annotations

import os
from types import ModuleType

#: Set to 0 to turn kvxfer's C code off: these passes and the CPU copy loop (benchmarks, debugging).
ENV_DISABLE = "KVXFER_NATIVE"


def _load() -> ModuleType | None:
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return None
    try:
        from kvxfer import _fastpath
    except ImportError:
        return None
    return _fastpath


FAST = _load()
