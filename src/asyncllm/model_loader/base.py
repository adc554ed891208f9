"""What every checkpoint format opens into: config, tokenizer, EOS ids and a weight iterator.

Weights come out under Hugging Face parameter names in the requested dtype, so model code loads every
format the same way. Knows no file format itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncllm.layers.parallel import WeightShard
from asyncllm.quantization.scheme import QuantScheme

WeightIterator = Callable[[], Iterator[tuple[str, torch.Tensor]]]
# Which slice of each tensor to read (tensor parallelism): name -> WeightShard, or None for the whole tensor.
ShardSelector = Callable[[str], WeightShard | None]
ShardIterator = Callable[[ShardSelector], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class Checkpoint:
    path: Path
    hf_config: Any  # transformers.PretrainedConfig; None in a directory a worker rank reopened (`reopen_checkpoint`)
    tokenizer: Any | None  # transformers fast tokenizer (chat template included), None if absent or deferred
    eos_token_ids: frozenset[int]
    iter_weights: WeightIterator  # yields (hf_name, tensor) pairs
    # Yields each tensor's selected slice, reading only that from disk; None where the format cannot (the
    # loader then slices whole tensors).
    iter_weight_shards: ShardIterator | None = None
    num_tensors: int | None = None  # how many pairs `iter_weights` yields (load progress), None if unknown
    # GGUF: `iter_weights` with the given checkpoint modules' weights kept quantized, each in its layer scheme's
    # layout (model_loader/gguf/repack.py); None for formats whose quantized tensors come through `iter_weights`.
    iter_quantized_weights: Callable[[Mapping[str, QuantScheme]], Iterator[tuple[str, torch.Tensor]]] | None = None
    # The tokenizer, not loaded yet (`tokenizer` is None): a worker rank's reopened checkpoint, whose only reader
    # of it is a constraint's grammar; or one loading on a thread of its own while the engine loads the weights
    # (`open_checkpoint(background_tokenizer=True)`). None where `tokenizer` is loaded, or absent.
    load_tokenizer: Callable[[], Any] | None = None

    def loaded_tokenizer(self) -> Any | None:
        """The tokenizer, loaded now if it was deferred (or waited for, if loading in the background); None if
        the checkpoint has none. A failure to load it is raised here."""
        if self.tokenizer is None and self.load_tokenizer is not None:
            self.tokenizer, self.load_tokenizer = self.load_tokenizer(), None
        return self.tokenizer
