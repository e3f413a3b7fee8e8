"""Memory: pools (shared memory files, sealed memfds, CUDA allocations) and their mapping."""
