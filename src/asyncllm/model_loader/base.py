"""What every checkpoint format opens into: config, tokenizer, EOS ids and a weight iterator.

Weights come out under Hugging Face parameter names in the requested dtype, so model code loads every
format the same way. Knows no file format itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WeightIterator = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class Checkpoint:
    path: Path
    hf_config: Any  # transformers.PretrainedConfig
    tokenizer: Any | None  # transformers fast tokenizer (chat template included), None if absent
    eos_token_ids: frozenset[int]
    iter_weights: WeightIterator  # yields (hf_name, tensor) pairs
