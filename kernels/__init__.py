"""asyncllm's Triton kernels (installed as `asyncllm.kernels`).

Each kernel ships with a pure-PyTorch `*_ref` twin, a launcher that checks its inputs, a test and a
micro-benchmark. Importing this package never imports triton; each kernel module does, when used.
"""
