"""Checkpoints in, models with weights out: Hugging Face directories (safetensors), GGUF files, dummy weights."""
