"""ModelExecutor implementations: the in-process executor now, tensor-parallel workers later."""
