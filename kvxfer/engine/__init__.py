"""The engine-side toolkit: block tables and the attention-side kernels."""
