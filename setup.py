"""The one thing pyproject.toml cannot say: kvxfer's C copy loop (kvxfer/transfer/_fused.c).

A shared library loaded through ctypes (it includes no Python header). Optional:
without a C compiler the install goes on and the CPU copy engine uses numpy
(kvxfer/transfer/native.py says so in the log).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvxfer.transfer._fused", ["kvxfer/transfer/_fused.c"],
                             depends=["kvxfer/transfer/_fused.h"],
                             extra_compile_args=["-O2", "-pthread", "-fvisibility=hidden"],
                             extra_link_args=["-pthread"], optional=True)])
