"""The runner layer (torch): model execution, input preparation, KV cache, sampling."""
