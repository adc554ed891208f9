"""Single-file GGUF checkpoints: metadata as a transformers config, tensors dequantized to torch."""
