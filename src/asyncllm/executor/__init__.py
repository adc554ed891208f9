"""ModelExecutor implementations: one worker in the calling thread (`uniproc`), or tensor-parallel ranks in
worker processes fed through a shared-memory ring (`multiproc`). Both build their workers with
`asyncllm.worker.setup.build_worker` from one `ResolvedModel`."""
