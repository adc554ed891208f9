"""Tests of asyncllm.distributed (CPU; real processes where the behaviour is about processes)."""
