"""The vocabulary every other package speaks: errors, records, request validation, the embedded
default pool, slot bookkeeping, the circuit breaker, plain-text tables and the optional C passes.

Imports no torch and no gRPC (``tests/unit/test_layers.py`` checks it), so that the client, the
command-line tools and the daemon share it at no cost.
"""
