"""The one thing pyproject.toml cannot say: kvxfer's C code.

- kvxfer/transfer/_fused.c and _guard.c, the CPU copy loop and the SIGBUS guard of its copies
  from files that may shrink: a shared library loaded through ctypes (it includes no Python header).
- kvxfer/core/_fastpath.c, per-key validation passes; kvxfer/index/_tables.c and kvxfer/index/_use_order.c, a
  tier index's key table and use order: CPython extension modules.

Both optional: without a C compiler the install goes on, the CPU copy engine uses
numpy (kvxfer/transfer/native.py says so in the log) and bookkeeping runs its
Python twins alone (kvxfer/core/c_modules.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvxfer.transfer._fused", ["kvxfer/transfer/_fused.c", "kvxfer/transfer/_guard.c"],
                             depends=["kvxfer/transfer/_fused.h", "kvxfer/transfer/_guard.h"],
                             extra_compile_args=["-O2", "-pthread", "-fvisibility=hidden"],
                             extra_link_args=["-pthread"], optional=True),
                   *(Extension(name, [name.replace(".", "/") + ".c"], extra_compile_args=["-O2"], optional=True)
                     for name in ("kvxfer.core._fastpath", "kvxfer.index._tables", "kvxfer.index._use_order"))])
