"""Attention over the paged KV cache, behind one small backend interface."""
