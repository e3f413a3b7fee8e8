"""The optional C passes of per-key bookkeeping (``kvxfer/_fastpath.c``).

``FAST`` is the built module, or None where it is not built (no C compiler at
install time) or ``KVXFER_NATIVE=0`` turns kvxfer's C code off: every caller then
runs its Python pass alone, with the same results and messages (the tests run both).
"""

from __future__ import annotations

import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("KVXFER_NATIVE", "1") == "0":
        return None
    try:
        from kvxfer import _fastpath
    except ImportError:
        return None
    return _fastpath


FAST = _load()
