"""The GEMV's launch plans (kernels/quant_matmul_gemv.py): a `GemvConfig` (the tile and how many programs a
launch aims for), the configs tuned per layer shape, and the `GemvPlan` one launch runs (the K tile's groups,
the split of K over programs). Host arithmetic only; knows nothing of layers or models.

Weight kinds, as the kernel's BITS sees them: 4 and 8 are integer codes packed in int32 words; 0 is one value
per element: e4m3 (`E4M3`, with scales) or plain floats without scales (`FLOAT16`: bfloat16 or float16;
`FLOAT32`: float32, the interpreter's tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = 0
FLOAT16 = 16
FLOAT32 = 32
_ELEMENT_BYTES = {E4M3: 1, FLOAT16: 2, FLOAT32: 4}
_KIND_NAMES = {4: "int4", 8: "int8", E4M3: "fp8", FLOAT16: "16bit", FLOAT32: "fp32"}
MIN_BLOCK_N = 16  # the smallest tile a config may take: counters sized for it fit every config
ROW_GROUP = 1 << 30  # the kernel's GROUP for one group (or none) per row: one compiled variant whatever K


@dataclass(frozen=True)
class GemvConfig:
    """How a GEMV launch is cut. The defaults are the first tuning (bench/RESULTS.md, run 56); the shapes
    bench/kernels/sweep_gemv.py measured better with another config are in `TUNED_CONFIGS`."""

    block_n: int = 32  # output rows per program: 32 rows x 128 bytes = four 16-byte vectors per thread of 2 warps
    num_warps: int = 2  # 4 rows a thread: each field's activations, loaded once, serve 4 rows
    row_bytes: int = 128  # bytes of each weight row a program loads per K tile
    programs_per_sm: int = 8  # split K until (token rows x output tiles x splits) reaches this many per SM
    max_split: int = 16
    # Integer codes: multiplied in as 1 + code / 2**bits, their offsets taken off once a word (three
    # instructions a code, not four; a few float32 roundings less exact). Other kinds ignore it.
    fold_offsets: bool = False

    def __post_init__(self) -> None:
        def power_of_two(name: str, value: int, lo: int, hi: int) -> None:
            if not (isinstance(value, int) and lo <= value <= hi and value & (value - 1) == 0):
                raise ValueError(f"GemvConfig.{name}={value!r}: expected a power of two from {lo} to {hi}")

        power_of_two("block_n", self.block_n, MIN_BLOCK_N, 256)
        power_of_two("num_warps", self.num_warps, 1, 8)
        power_of_two("row_bytes", self.row_bytes, 64, 512)
        for name in ("programs_per_sm", "max_split"):
            value = getattr(self, name)
            if not (isinstance(value, int) and 1 <= value <= 64):
                raise ValueError(f"GemvConfig.{name}={value!r}: expected an integer from 1 to 64")
        if not isinstance(self.fold_offsets, bool):
            raise ValueError(f"GemvConfig.fold_offsets={self.fold_offsets!r}: expected True or False")


DEFAULT_CONFIG = GemvConfig()
INTERPRETER_CONFIG = GemvConfig(block_n=128)  # on CPU: Triton's interpreter pays per program and per op

# (kind name, N, K) -> the config bench/kernels/sweep_gemv.py measured fastest on the H200 for that layer
# shape, where it beat DEFAULT_CONFIG clearly; every other shape runs DEFAULT_CONFIG. Each config here must
# compile for Hopper (tests/kernels/hopper_compile.py compiles every candidate the sweep may pick).
# Run 58 (bench/RESULTS.md; shapes whose best config beat the default by more than 3 %, microseconds at one
# row, default -> tuned). _c(block_n, num_warps, row_bytes, programs_per_sm, max_split).
_c = GemvConfig
TUNED_CONFIGS: dict[tuple[str, int, int], GemvConfig] = {
    ("int4", 4096, 1024): _c(64, 4, 256, 16, 32),  # qwen3-0.6b qkv: 5.4 -> 5.18 us
    ("fp8", 4096, 1024): _c(64, 4, 256, 8, 32),  # qwen3-0.6b qkv: 5.58 -> 4.81 us
    ("16bit", 4096, 1024): _c(128, 8, 256, 16, 32),  # qwen3-0.6b qkv: 7.45 -> 6.41 us
    ("int4", 1024, 2048): _c(32, 4, 128, 4, 32),  # qwen3-0.6b o: 5.42 -> 4.78 us
    ("fp8", 1024, 2048): _c(32, 4, 256, 4, 32),  # qwen3-0.6b o: 5.39 -> 4.55 us
    ("16bit", 1024, 2048): _c(128, 8, 256, 4, 32),  # qwen3-0.6b o: 5.73 -> 4.99 us
    ("int4", 6144, 1024): _c(64, 4, 128, 16, 32),  # qwen3-0.6b gate_up: 6.32 -> 5.84 us
    ("16bit", 6144, 1024): _c(128, 4, 128, 4, 32),  # qwen3-0.6b gate_up: 8.59 -> 7.14 us
    ("int4", 1024, 3072): _c(32, 4, 128, 32, 32),  # qwen3-0.6b down: 6.01 -> 5.29 us
    ("fp8", 1024, 3072): _c(32, 4, 256, 8, 32),  # qwen3-0.6b down: 5.51 -> 5.14 us
    ("16bit", 1024, 3072): _c(32, 4, 128, 4, 32),  # qwen3-0.6b down: 8.53 -> 6.65 us
    ("int4", 6144, 4096): _c(64, 2, 128, 8, 32),  # qwen3-8b qkv: 14.23 -> 13.27 us
    ("fp8", 6144, 4096): _c(64, 4, 128, 4, 32),  # qwen3-8b qkv: 16.56 -> 15.16 us
    ("16bit", 6144, 4096): _c(128, 4, 128, 4, 32),  # qwen3-8b qkv: 22.42 -> 16.61 us
    ("fp8", 4096, 4096): _c(32, 4, 256, 4, 32),  # qwen3-8b o: 10.44 -> 10.08 us
    ("16bit", 4096, 4096): _c(128, 4, 128, 4, 32),  # qwen3-8b o: 16.82 -> 12.43 us
    ("int4", 24576, 4096): _c(64, 2, 128, 4, 32),  # qwen3-8b gate_up: 41.56 -> 35.41 us
    ("fp8", 24576, 4096): _c(32, 4, 128, 4, 32),  # qwen3-8b gate_up: 51.75 -> 36.72 us
    ("16bit", 24576, 4096): _c(64, 4, 256, 16, 32),  # qwen3-8b gate_up: 61.66 -> 54.8 us
    ("fp8", 4096, 12288): _c(64, 4, 256, 4, 32),  # qwen3-8b down: 34.87 -> 24.48 us
    ("16bit", 4096, 12288): _c(128, 4, 128, 4, 32),  # qwen3-8b down: 40.16 -> 28.58 us
}


# What bench/kernels/sweep_gemv.py times for each layer shape (tests/kernels/hopper_compile.py compiles every
# tile for each kind it sweeps): (block_n, num_warps, row_bytes) tiles, each at these programs per SM.
CANDIDATE_TILES = [
    (32, 2, 128),  # the default
    (32, 4, 128),
    (64, 2, 128),  # more rows per thread: each activation load serves 8 rows
    (64, 4, 128),
    (128, 4, 128),
    (32, 4, 256),  # 256-byte rows: twice the bytes in flight per program
    (64, 4, 256),
    (64, 8, 256),
    (128, 8, 256),
]
CANDIDATE_PROGRAMS_PER_SM = (4, 8, 16, 32)
CANDIDATE_MAX_SPLIT = 32


def candidate_configs(kind: int) -> list[GemvConfig]:
    """Every config the sweep times for weights of `kind`: each candidate tile at each target of programs per
    SM, for integer codes with their offsets folded or not."""
    folds = (False, True) if kind in (4, 8) else (False,)
    return [
        GemvConfig(
            block_n=bn, num_warps=w, row_bytes=rb, programs_per_sm=p, max_split=CANDIDATE_MAX_SPLIT, fold_offsets=fold
        )
        for bn, w, rb in CANDIDATE_TILES
        for p in CANDIDATE_PROGRAMS_PER_SM
        for fold in folds
    ]


def kind_name(kind: int) -> str:
    """The weight kind's name in `TUNED_CONFIGS` ("int4", "int8", "fp8", "16bit", "fp32")."""
    return _KIND_NAMES[kind]


def float_kind(dtype: torch.dtype) -> int:
    """The kind of a plain float weight of `dtype` (FLOAT16 or FLOAT32)."""
    if dtype in (torch.bfloat16, torch.float16):
        return FLOAT16
    if dtype == torch.float32:
        return FLOAT32
    raise TypeError(f"weight has dtype {dtype}; expected float32, float16 or bfloat16")


def config_for(kind: int, n: int, k: int) -> GemvConfig:
    """The config a layer of N outputs and K inputs with weights of `kind` runs on CUDA."""
    return TUNED_CONFIGS.get((kind_name(kind), n, k), DEFAULT_CONFIG)


@dataclass(frozen=True)
class GemvPlan:
    """One launch's shape: a K tile is `groups` groups (or parts of one group) of `group_words` words (values
    for the one-value kinds), K split over `split` programs of `tiles_per_split` tiles each."""

    groups: int  # G
    group_words: int  # GW
    split: int
    tiles_per_split: int
    config: GemvConfig


def codes_per_unit(kind: int) -> int:
    """Weights per loaded unit: 8 or 4 codes per int32 word, one per element for the one-value kinds."""
    return 32 // kind if kind in (4, 8) else 1


def tile_shape(k: int, group_size: int, kind: int, row_bytes: int) -> tuple[int, int] | None:
    """(G, GW) of the `row_bytes` K tile, or None where the groups neither cover whole tiles nor divide them
    into whole words (those layers take quant_matmul's GEMM)."""
    codes = codes_per_unit(kind)
    units = row_bytes // 4 if kind in (4, 8) else row_bytes // _ELEMENT_BYTES[kind]  # per row per tile
    block_k = units * codes
    if group_size >= k or group_size % block_k == 0:
        return 1, units
    if block_k % group_size == 0 and group_size % codes == 0:
        return block_k // group_size, group_size // codes
    return None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gemv_plan(
    m: int,
    n: int,
    k: int,
    kind: int,
    group_size: int,
    num_sms: int,
    split_k: int | None = None,
    config: GemvConfig = DEFAULT_CONFIG,
) -> GemvPlan | None:
    """The launch for M = m token rows, or None where the groups do not fit the kernel's tiles. Splits K so
    the grid reaches `config.programs_per_sm` programs per SM (at most `config.max_split` ways), each split
    whole tiles; `split_k` forces the split."""
    shape = tile_shape(k, group_size, kind, config.row_bytes)
    if shape is None:
        return None
    g, gw = shape
    tiles_k = _cdiv(k, g * gw * codes_per_unit(kind))
    if split_k is None:
        split_k = min(config.max_split, _cdiv(config.programs_per_sm * num_sms, m * _cdiv(n, config.block_n)))
    per = _cdiv(tiles_k, max(1, min(split_k, tiles_k)))
    return GemvPlan(g, gw, _cdiv(tiles_k, per), per, config)


def gemv_locks(n: int, max_tokens: int, device: torch.device) -> torch.Tensor:
    """The zeroed counters a GEMV launch needs for an N-output layer at up to `max_tokens` rows, whatever its
    config; a layer keeps one set (the kernel leaves them zero), so its calls launch nothing but the kernel."""
    return torch.zeros(max_tokens * _cdiv(n, MIN_BLOCK_N), dtype=torch.int32, device=device)
