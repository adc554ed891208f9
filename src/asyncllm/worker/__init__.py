"""The worker (torch): one device's step pipeline and its set-up. `build_worker` loads the model, sizes and
allocates the KV cache, warms up and captures CUDA graphs; `ModelRunner` runs each step (bucket, pad, plan,
stage, flush, feed, run, logits, sample, record) with `Buckets`, `InputBuffers`, `StepStaging` and
`CudaGraphRunner`. Knows nothing of requests beyond the plain data of `asyncllm.step`."""
