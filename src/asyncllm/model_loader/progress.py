"""Progress of a long weight load on the `asyncllm` logger (INFO): a line every few seconds once the load has
taken that long (dequantizing a GGUF file, reading many shards), nothing for a fast one. Knows nothing of
formats: it counts the (name, tensor) pairs an iterator yields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TypeVar

logger = logging.getLogger("asyncllm.model_loader")

T = TypeVar("T")

EVERY_S = 5.0  # seconds between two progress lines


def with_progress(weights: Iterator[T], total: int | None, every_s: float = EVERY_S) -> Iterator[T]:
    """`weights` unchanged; after each item, a progress line when `every_s` have passed since the last one
    (or the start). `total`: the item count, None when unknown."""
    start = last = time.monotonic()
    for done, item in enumerate(weights, 1):
        yield item
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            of = f" of {total} ({100 * done // total} %)" if total else ""
            logger.info("loading weights: %d tensors%s after %.0f s", done, of, now - start)
