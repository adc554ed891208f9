"""The slice of a quantized layer's tensor one tensor-parallel rank loads, from the slice of its weight.

Every tensor of the layout is [out, ...]: a column-parallel layer's rows are the same rows of each. A
row-parallel layer's input columns [start, stop) are, in `qweight`, words [start / P, stop / P) (P codes a
word; e4m3: one), and in `scales` / `qzeros` groups [start / G, stop / G): the cut must fall on a group's
edge, else the rank's groups would straddle two scales. One scale per row (no groups) is whole on every rank.
Knows no family: the weight's slice comes from `models.tensor_parallel.weight_shard`, passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from asyncllm.errors import InvalidConfigError
from asyncllm.kernels.quant_matmul_ref import codes_per_word
from asyncllm.layers.parallel import WeightShard
from asyncllm.quantization.scheme import QuantScheme

Select = Callable[[str], WeightShard | None]


def quantized_shards(select: Select, quantized: Mapping[str, QuantScheme]) -> Select:
    """`select` (name -> this rank's slice, for the unquantized model) extended to the quantized layers'
    tensors (`quantized`: their checkpoint module names, each with its layer's scheme)."""

    def select_quantized(name: str) -> WeightShard | None:
        module, _, param = name.rpartition(".")
        if module not in quantized or param == "bias":
            return select(name)
        scheme = quantized[module]
        weight = select(f"{module}.weight")
        if weight is None or weight.dim == 0:
            return weight  # replicated, or this rank's output rows
        assert weight.dim == 1 and weight.size == weight.stop - weight.start, weight
        if param == "qweight":
            per = 1 if scheme.fp8 else codes_per_word(scheme.bits)
        elif scheme.group_size is None:
            return None  # one scale per output channel: every rank's columns share it
        else:
            per = scheme.group_size
        if weight.start % per or weight.stop % per:
            raise InvalidConfigError(
                f"tensor_parallel_size splits {module}'s inputs at {weight.start}..{weight.stop}, not on the edges "
                f"of its {per}-input {'words' if param == 'qweight' else 'groups'} ({scheme.describe()}): choose a "
                "tensor_parallel_size that divides its input groups"
            )
        start, stop = weight.start // per, weight.stop // per
        return WeightShard(1, start, stop, stop - start)

    return select_quantized
