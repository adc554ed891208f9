"""Count the Triton kernels compiled (or loaded from Triton's disk cache) while a block runs: after the
engine's warm-up, a serving step should compile nothing; one that does stalls every stream for a whole compile
(bench/RESULTS.md, runs 3 and 6) or a cache load. Uses triton.knobs' post-compile hook (Triton >= 3.4)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def triton_compiles() -> Iterator[Counter[str]]:
    """Yields a Counter of kernel name -> compilations, filled while the block runs (empty if no Triton)."""
    seen: Counter[str] = Counter()
    try:
        import triton.knobs as knobs
    except ImportError:
        yield seen
        return
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args: Any, **kwargs: Any) -> bool:
        fn = kwargs.get("fn")  # a JitFunctionInfo (module, name, jit_function)
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[")[0]
        seen[name] += 1
        if previous is not None:
            previous(*args, **kwargs)
        return False

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_post_compile_hook = previous
