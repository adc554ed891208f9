"""Quantized weights: which scheme a checkpoint (or the `quantization` engine argument) asks for (`scheme.py`),
its on-disk tensors converted to one layout at load (`convert.py`, `packing.py`), the layers that run it
(`linear.py`, swapped into a built model from outside: `apply.py`) and their shards under tensor parallelism
(`sharding.py`). The layout and its kernels live in `kernels/quant_matmul*.py` and `kernels/fp8_scaled_mm.py`.
"""
