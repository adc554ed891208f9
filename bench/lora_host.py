"""LoRA's host work per step (issue 27), on whatever machine runs it: what the step thread adds to a step for
8 rank-16 adapters mixed over 256 sequences, beside the runner's own input preparation for the same step.

- `stage`: `LoRAManager.stage` (rows per slot, planned and staged with the step's inputs) for a decode step
  whose batch is the last step's (most W1 decode steps), one whose batch lost a request since (a request
  finished), and a W1-like prompt step (8 prompts of 1,024 tokens beside 248 decodes); `prepare`:
  `InputBuffers.prepare` for the same step (the runner's host work without LoRA), for scale.
- `launch`: each LoRA site's launcher called eagerly (what a step too large for the CUDA graphs pays per
  site, 4 sites x 28 layers of Qwen3-0.6B's shapes at 8,192 rows). On CUDA the launch itself is in it; on a
  machine without one the Triton launch is left out (nothing to launch on) and only the launcher's own Python
  is timed.

Prints one JSON line per figure (microseconds, median of 5 repeats). Usage: python3 bench/lora_host.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES
from w1_lora import write_adapter

from asyncllm.attention.torch_ref import TorchAttentionBackend
from asyncllm.kernels.lora_plan import plan_lora_blocks
from asyncllm.layers.fusion import use_fused_kernels
from asyncllm.layers.linear import Linear
from asyncllm.layers.lora import LoRABatch, LoRALinear
from asyncllm.models.config import ModelArchConfig
from asyncllm.models.registry import resolve_model_class
from asyncllm.step import LoRAAdapter, ScheduledSeq, SchedulerOutput
from asyncllm.worker.input_batch import InputBuffers
from asyncllm.worker.lora import LoRAManager

SEQS, ADAPTERS, RANK, PROMPT = 256, 8, 16, 1024
SITES_06B = {"qkv": (1024, (2048, 1024, 1024)), "o": (2048, (1024,)), "gate_up": (1024, (3072, 3072))}
SITES_06B["down"] = (3072, (1024,))


def median_us(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """The median over `repeats` of the mean wall time of `calls` calls, in microseconds. On CUDA the device
    is waited for before each repeat (outside the timing): a few hundred launches then never fill the launch
    queue, so the host's time is what is timed, not the device's."""
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(times), 1)


def tiny_model_with_adapters(device: torch.device) -> tuple[LoRAManager, ModelArchConfig]:
    """A two-layer Qwen3 (random weights) with the kernels' LoRA form and 8 adapters loaded: the staging does
    not depend on the layers' sizes."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(**{k: v for k, v in SHAPES["qwen3-tiny"].items() if k != "architectures"})
    cfg.architectures = ["Qwen3ForCausalLM"]
    arch = ModelArchConfig.from_hf(cfg, 4096)
    with torch.device(device):
        model = resolve_model_class(cfg)(arch, TorchAttentionBackend()).eval()
    manager = LoRAManager(model, arch, ADAPTERS, RANK)
    use_fused_kernels(model)  # what the Triton backend does: the block tables, not a row-slot list
    root = Path(tempfile.mkdtemp())
    for i in range(ADAPTERS):
        manager.add(LoRAAdapter(i + 1, f"l{i}", str(write_adapter("qwen3-tiny", root / f"l{i}", RANK, seed=i))))
    return manager, arch


def step(request_ids: list[str], prompt_rows: int = 0) -> SchedulerOutput:
    """A step of `request_ids`: the first `prompt_rows // PROMPT` take a 1,024-token prompt chunk, the rest
    decode one token at position 700."""
    prompts = prompt_rows // PROMPT
    seqs = []
    for i, rid in enumerate(request_ids):
        n, start = (PROMPT, 0) if i < prompts else (1, 700)
        blocks = list(range(i * 80, i * 80 + -(-(start + n) // 16)))
        seqs.append(ScheduledSeq(rid, [5] * n, start, blocks, sample=True))
    return SchedulerOutput(seqs=seqs)


def staging(device: torch.device, calls: int = 200) -> list[dict[str, object]]:
    """The `stage` figures, each the median of `calls` steps (a tenth of them for the prompt step)."""
    manager, _ = tiny_model_with_adapters(device)
    max_tokens = 8192 + SEQS
    buffers = InputBuffers(max_tokens, SEQS, 80, 16, device)
    manager.bind(buffers.staging, max_tokens)
    ids = [f"r{i}" for i in range(SEQS)]
    for i, rid in enumerate(ids):
        manager.add_request(rid, 1 + i % ADAPTERS)
    steady, lost_one = step(ids), step(ids[1:])
    prompt = step(ids, prompt_rows=8 * PROMPT)
    return [
        _stage_row("decode, same batch", manager, buffers, [steady], calls),
        _stage_row("decode, batch changed", manager, buffers, [steady, lost_one], calls),
        _stage_row("prompt step, 8 x 1024 + 248 decodes", manager, buffers, [prompt, steady], max(1, calls // 10)),
    ]


def _stage_row(
    name: str, manager: LoRAManager, buffers: InputBuffers, steps: list[SchedulerOutput], calls: int
) -> dict[str, object]:
    """Each of `steps` in turn, prepared (inputs, then LoRA's rows) and flushed, as the runner does, until the
    first has run `calls` times after a warm-up turn: the inputs' time and LoRA's, apart."""
    prepare: list[float] = []
    lora: list[float] = []
    with torch.inference_mode():
        for i in range(len(steps) * (calls + 1)):
            scheduled = steps[i % len(steps)]
            t0 = time.perf_counter()
            x = buffers.prepare(scheduled, flush=False)
            t1 = time.perf_counter()
            manager.stage(scheduled, x.num_tokens, x.meta.query_lens_cpu)
            t2 = time.perf_counter()
            buffers.flush()
            if i >= len(steps) and scheduled is steps[0]:  # the step named; warm-up and the others left out
                prepare.append(t1 - t0)
                lora.append(t2 - t1)
    return {"figure": "stage", "step": name, "seqs": SEQS, "adapters": ADAPTERS,
            "prepare_us": _us(prepare), "lora_stage_us": _us(lora)}  # fmt: skip


def _us(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e6, 1)


def launches(device: torch.device, rows: int, calls: int = 200) -> list[dict[str, object]]:
    """Each site's `LoRALinear.add_adapters` at `rows` rows (the eager path), with block tables of 8 slots; on
    a machine without CUDA the kernels are stood in for while it runs (see the module)."""
    from asyncllm.kernels import lora as kernels

    names = ("_lora_fused_kernel", "_lora_shrink_kernel", "_lora_expand_kernel")
    saved = {name: getattr(kernels, name) for name in names}
    if device.type != "cuda":
        for name in names:
            setattr(kernels, name, _NoLaunch())
    try:
        out = [_launch_row(device, rows, site, k, shards, calls) for site, (k, shards) in SITES_06B.items()]
    finally:
        for name, kernel in saved.items():
            setattr(kernels, name, kernel)
    total = sum(float(str(r["us_per_call"])) for r in out)
    out.append({"figure": "launch", "site": "4 sites x 28 layers", "rows": rows, "us_per_step": round(28 * total)})
    return out


def _launch_row(
    device: torch.device, rows: int, site: str, k: int, shards: tuple[int, ...], calls: int
) -> dict[str, object]:
    batch = LoRABatch()
    tokens, blocks = plan_lora_blocks([i % ADAPTERS for i in range(SEQS)], [rows // SEQS] * SEQS, ADAPTERS, rows)
    batch.block_tokens = torch.as_tensor(tokens, dtype=torch.int32, device=device)
    batch.block_slot = torch.as_tensor(blocks, dtype=torch.int32, device=device)
    batch.active = True
    n, dtype = sum(shards), torch.bfloat16
    with torch.device(device):
        a = torch.zeros(ADAPTERS, len(shards) * RANK, k, dtype=dtype)
        b = torch.zeros(ADAPTERS, n, RANK, dtype=dtype)
        x, y = torch.zeros(rows, k, dtype=dtype), torch.zeros(rows, n, dtype=dtype)
        layer = LoRALinear(Linear(k, n, bias=False).to(dtype), a, b, shards, batch)
    layer.enable_fused_kernels()
    us = median_us(lambda: layer.add_adapters(x, y), calls)
    return {"figure": "launch", "site": site, "rows": rows, "us_per_call": us, "device": device.type}


class _NoLaunch:
    """Stands in for a Triton kernel where there is no device: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192, help="rows of the eager launches")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per figure")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for row in staging(device, args.calls) + launches(device, args.rows, args.calls):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
