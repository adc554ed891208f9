"""Attention over the paged KV cache: the layer models call, the backend interface behind it, the backends
(pure-PyTorch reference, Triton kernels) and the registry that picks one. Kernels sit below."""
