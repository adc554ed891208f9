"""Sampling (torch): per-request state, penalties, filters and the sampler that turns logits into tokens."""
