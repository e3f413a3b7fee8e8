"""A real vLLM engine (vLLM's CPU build) generating tokens through kvxfer: the tiny models its tests and
benchmarks write, the engine process they drive, and ``kvxfer bench engine``."""
