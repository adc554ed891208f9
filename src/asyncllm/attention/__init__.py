"""Attention over the paged KV cache, behind one small backend interface (the layer models call; kernels sit below)."""
