"""The worker (torch): device set-up, KV cache, input buffers, the one-step model runner; later CUDA graphs."""
