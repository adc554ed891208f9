"""W10 (issue 44): the KV tiers below the GPU. Multi-turn conversations (64 x 8 turns by default, histories
growing from ~2K to ~8K tokens: each turn adds U[500, 800] user tokens and 64 output tokens) whose working set is
`--pool-ratio` (4) times the device pool (`num_kv_blocks`), all conversations' turn t sent together: the time to
first token of the returning turns (t >= 1) with the host tier on and off, p50 and p90. Beside it: the host tier's
copy bandwidth (device -> host and host -> device, GB/s, the engine's own `HostKVPool` over a cache of the shape's
layout), W1-like throughput where nothing ever hits (distinct random prompts that fit the pool; tier on / off),
and the disk tier after a restart: an engine computes one `--disk-history`-token history (cold, its TTFT timed)
and stops; a new engine on the same directory answers the returning turn (history plus 64 tokens) from disk.

Random weights of the real shape (Qwen3-8B; `load_format="dummy"`), greedy. Each engine runs in a process of its
own (the device's memory whole for it); `--tiny` runs everything in this process on CPU in seconds (qwen3-tiny,
a handful of short conversations; tests/bench). Prints one JSON line.

Usage: python3 bench/kv_tiers.py [--parts w10,w1,bandwidth,disk] [--conversations 64] [--turns 8]
       [--host-gib G] [--kinds on] [--engine-arg NAME=VALUE]   |   python3 bench/kv_tiers.py --tiny
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine_args import add_engine_arg_option, engine_kwargs, free_device_memory
from shapes import SHAPES
from triton_compiles import triton_compiles

from asyncllm import LLM, SamplingParams

PARTS = ("w10", "w1", "bandwidth", "disk")
KINDS = ("off", "on", "bandwidth", "disk_cold", "disk_warm")
VOCAB = 10_000  # prompt ids drawn below it


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="qwen3-tiny on CPU, small sizes, in this process")
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--history", type=int, nargs=2, default=(1500, 2500), help="first turn's history, U[a, b]")
    ap.add_argument("--user-tokens", type=int, nargs=2, default=(500, 800), help="each turn's new tokens, U[a, b]")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--pool-ratio", type=float, default=4.0, help="the working set over the device pool")
    ap.add_argument("--host-gib", type=float, default=None, help="the host tier (default: 1.25x the working set)")
    ap.add_argument("--w1-requests", type=int, default=64)
    ap.add_argument("--disk-history", type=int, default=8192)
    ap.add_argument("--disk-dir", default=None, help="the disk tier's directory (default: a new temporary one)")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--kinds", default=None, help="the runs, of " + ",".join(KINDS) + " (default: what --parts needs)")
    ap.add_argument("--trace", action="store_true", help="disk_warm: where the restore's time goes (kv_trace.py)")
    ap.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval in each run (the GIL's hand-off)"
    )
    ap.add_argument("--child", choices=KINDS, default=None, help=argparse.SUPPRESS)
    add_engine_arg_option(ap)
    return ap


def settle(args: argparse.Namespace) -> argparse.Namespace:
    """`--tiny`: the CPU smoke sizes."""
    if args.tiny:
        args.shape, args.device = "qwen3-tiny", "cpu"
        args.conversations, args.turns, args.history, args.user_tokens = 4, 3, (40, 60), (10, 20)
        args.output_tokens, args.w1_requests, args.disk_history, args.max_model_len = 4, 4, 96, 512
    return args


# ---------------------------------------------------------------------- the workload
def conversations(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The first histories and, per turn, each conversation's new tokens (seed 0)."""
    rng = random.Random(0)
    first = [[rng.randrange(VOCAB) for _ in range(rng.randint(*args.history))] for _ in range(args.conversations)]
    turns = [
        [[rng.randrange(VOCAB) for _ in range(rng.randint(*args.user_tokens))] for _ in range(args.conversations)]
        for _ in range(args.turns)
    ]
    return first, turns


def kv_bytes_per_token(shape: str) -> int:
    cfg = SHAPES[shape]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2  # bfloat16


def sizes(args: argparse.Namespace) -> tuple[int, float]:
    """The device pool (blocks of 16) and the host tier (GiB) for the conversations' working set."""
    first, turns = conversations(args)
    tokens = sum(len(h) for h in first) + sum(len(u) + args.output_tokens for turn in turns for u in turn)
    longest = max(len(h) for h in first) + sum(max(map(len, turn)) + args.output_tokens for turn in turns)
    blocks = max(int(tokens / 16 / args.pool_ratio), 2 * -(-longest // 16))
    gib = args.host_gib if args.host_gib is not None else 1.25 * tokens * kv_bytes_per_token(args.shape) / 2**30
    return blocks, max(gib, 0.01)


def engine(args: argparse.Namespace, **overrides: Any) -> LLM:
    model = Path(tempfile.mkdtemp()) / args.shape
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SHAPES[args.shape]))
    kwargs: dict[str, Any] = dict(device=args.device, load_format="dummy", max_model_len=args.max_model_len)
    if args.tiny:
        kwargs["dtype"] = "float32"
    llm = LLM(str(model), **kwargs | engine_kwargs(args.engine_arg) | overrides)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    return llm


def run_w10(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    first, turns = conversations(args)
    histories = [list(h) for h in first]
    greedy = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    returning: list[float] = []
    t0 = time.perf_counter()
    for t, news in enumerate(turns):
        prompts = [h + u for h, u in zip(histories, news, strict=True)]
        for i, out in enumerate(llm.generate(prompts, greedy, use_tqdm=False)):
            histories[i] = prompts[i] + list(out.token_ids)
            if t > 0 and out.metrics is not None and out.metrics.time_to_first_token is not None:
                returning.append(out.metrics.time_to_first_token)
    stats = llm.stats()
    return {
        "ttft_p50_s": statistics.median(returning),
        "ttft_p90_s": statistics.quantiles(returning, n=10)[-1] if len(returning) > 1 else returning[0],
        "seconds": time.perf_counter() - t0,
        "host_hit_tokens": stats["prefix_cache_host_hit_tokens"],
        "hit_tokens": stats["prefix_cache_hit_tokens"],
        "queried_tokens": stats["prefix_cache_queried_tokens"],
        "preemptions": stats["num_preemptions"],
    }


def run_w1(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    """Distinct random prompts (no prefix hits), U[100, 1024] tokens, outputs U[64, 256]: tokens/s."""
    rng = random.Random(1)
    short = args.tiny
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(20, 40) if short else rng.randint(100, 1024))]
               for _ in range(args.w1_requests)]  # fmt: skip
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=4 if short else rng.randint(64, 256))
              for _ in prompts]  # fmt: skip
    hits0 = llm.stats()["prefix_cache_hit_tokens"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_s": tokens / seconds, "tokens": tokens, "hit_tokens": llm.stats()["prefix_cache_hit_tokens"] - hits0}


def bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    """GB/s of the host tier's copies (`HostKVPool`, as the engine runs them) over 1 GiB of the shape's blocks
    (64 MiB on CPU), the median of five."""
    import torch

    from asyncllm.worker.kv_host import HostKVPool

    cfg, device = SHAPES[args.shape], torch.device(args.device)
    shape = (16, cfg["num_key_value_heads"], cfg["head_dim"])
    per_block = 16 * kv_bytes_per_token(args.shape)
    n = (64 << 20 if args.tiny else 1 << 30) // per_block
    cache = [
        (torch.randn((n, *shape), device=device).bfloat16(), torch.randn((n, *shape), device=device).bfloat16())
        for _ in range(cfg["num_hidden_layers"])
    ]
    pool = HostKVPool(cache, n, device)
    pairs = list(zip(range(n), range(n), strict=True))
    out: dict[str, Any] = {"blocks": n, "block_bytes": pool.block_bytes}
    for name, copy in (("device_to_host", pool.to_host), ("host_to_device", pool.to_device)):
        seconds = []
        for _ in range(6):
            pool.begin()
            t0 = time.perf_counter()
            copy(pairs)
            pool.synchronize()
            seconds.append(time.perf_counter() - t0)
        out[f"{name}_gb_s"] = n * pool.block_bytes / statistics.median(seconds[1:]) / 1e9
    pool.close()
    return out


def disk(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """`disk_cold`: one history computed from scratch (its TTFT), the engine then stopped (its blocks kept on
    disk); `disk_warm`: a new engine answers the returning turn from disk (its TTFT). Beside the warm TTFT, where
    it goes: the steps it took, the Triton kernels it compiled, the same turn's TTFT once its history is on the
    device (the compute alone) and the history's files read alone (`read_files`)."""
    rng = random.Random(2)
    history = [rng.randrange(VOCAB) for _ in range(args.disk_history)]
    turn = history + [rng.randrange(VOCAB) for _ in range(64)]
    files_before = set(Path(args.disk_dir).rglob("*.kvb"))
    tracing = args.trace and kind == "disk_warm"
    if tracing:
        import kv_trace

        kv_trace.install()
    llm = engine(args, kv_offloading_size=4.0 if not args.tiny else 0.01, kv_cache_dir=args.disk_dir)
    greedy = SamplingParams(temperature=0, max_tokens=1)
    try:
        prompt = history if kind == "disk_cold" else turn
        steps0 = llm.stats()["num_steps"]
        t0 = time.perf_counter()
        with triton_compiles() as compiles:
            out = llm.generate([prompt], greedy, use_tqdm=False)[0]
        trace = kv_trace.timeline(t0) if tracing else None
        if tracing:
            kv_trace.uninstall()
        assert out.metrics is not None
        stats = llm.stats()
        result: dict[str, Any] = {
            "ttft_s": out.metrics.time_to_first_token,
            "disk_hit_tokens": stats["prefix_cache_disk_hit_tokens"],
            "steps": stats["num_steps"] - steps0,
            "triton_compiles": dict(compiles),
        }
        if trace is not None:
            result["trace"] = trace
        if kind == "disk_warm":
            again = llm.generate([history + turn[-64:][::-1]], greedy, use_tqdm=False)[0]
            assert again.metrics is not None
            result["device_hit_ttft_s"] = again.metrics.time_to_first_token
            result["read_files"] = read_files(sorted(files_before), args.device)
    finally:
        llm.shutdown()
    return result


def read_files(paths: list[Path], device: str) -> dict[str, Any]:
    """The disk tier's reads alone: these files (page cache or disk) into pinned memory, each checked with
    xxh3 as the loader does, on as many threads as it uses (`kv_disk._LOAD_THREADS`), best of three."""
    import torch
    import xxhash

    from asyncllm.worker import kv_disk

    if not paths:
        return {"files": 0}
    size = paths[0].stat().st_size
    pinned = torch.cuda.is_available() and device == "cuda"
    buffer = torch.empty((len(paths), size), dtype=torch.uint8, pin_memory=pinned).numpy()

    def read(i: int) -> int:
        with open(paths[i], "rb") as f:
            n = f.readinto(memoryview(buffer[i]))
        return xxhash.xxh3_64_intdigest(buffer[i, :n].data) & 1

    seconds = []
    with ThreadPoolExecutor(kv_disk._LOAD_THREADS) as pool:
        for _ in range(3):
            t0 = time.perf_counter()
            list(pool.map(read, range(len(paths))))
            seconds.append(time.perf_counter() - t0)
    best = min(seconds)
    return {"files": len(paths), "bytes": len(paths) * size, "seconds": best, "gb_s": len(paths) * size / best / 1e9}


def measure(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """One variant's figures (in this process)."""
    if kind == "bandwidth":
        return bandwidth(args)
    if kind.startswith("disk"):
        return disk(args, kind)
    blocks, gib = sizes(args)
    parts = args.parts.split(",")
    llm = engine(args, num_kv_blocks=blocks, kv_offloading_size=gib if kind == "on" else 0)
    try:
        out: dict[str, Any] = {"num_kv_blocks": blocks, "host_gib": gib if kind == "on" else 0}
        if "w10" in parts:
            out["w10"] = run_w10(llm, args)
        if "w1" in parts:
            out["w1"] = run_w1(llm, args)
        return out
    finally:
        llm.shutdown()
        del llm
        free_device_memory()


def child(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """`measure(kind)` in a process of its own (the device's memory whole for it)."""
    argv = [sys.executable, __file__, *sys.argv[1:], "--child", kind, "--disk-dir", args.disk_dir]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the {kind} run failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def summary(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": "W10", "shape": args.shape, "device": args.device, "runs": runs}
    on, off = runs.get("on", {}), runs.get("off", {})
    if "w10" in on and "w10" in off:
        out["w10_ttft_p50_on_over_off"] = on["w10"]["ttft_p50_s"] / off["w10"]["ttft_p50_s"]
    if "w1" in on and "w1" in off:
        out["w1_tok_s_on_over_off"] = on["w1"]["tok_s"] / off["w1"]["tok_s"]
    if "bandwidth" in runs:
        out["restore_gb_s"] = runs["bandwidth"]["host_to_device_gb_s"]
    if "disk_cold" in runs and "disk_warm" in runs:
        out["disk_ttft_over_cold"] = runs["disk_warm"]["ttft_s"] / runs["disk_cold"]["ttft_s"]
    return out


def main() -> None:
    args = settle(parser().parse_args())
    if args.disk_dir is None:
        args.disk_dir = tempfile.mkdtemp(prefix="asyncllm-kv-tiers-")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.child is not None:
        print(json.dumps(measure(args, args.child)))
        return
    parts = args.parts.split(",")
    kinds = [k for k in ("off", "on") if {"w10", "w1"} & set(parts)]
    kinds += ["bandwidth"] * ("bandwidth" in parts) + ["disk_cold", "disk_warm"] * ("disk" in parts)
    if args.kinds is not None:  # e.g. "on" alone, to compare a setting's run against an earlier "off"
        kinds = [k for k in kinds if k in args.kinds.split(",")]
    runs = {kind: measure(args, kind) if args.tiny else child(args, kind) for kind in kinds}
    for kind, run in runs.items():
        for row in run.pop("trace", []):
            print(f"trace {kind} {row}")
    print(json.dumps(summary(args, runs)))


if __name__ == "__main__":
    main()
