"""A simulator of the CUDA driver API that keeps CUDA's rules: the test suite's one fake, for the GPU."""
