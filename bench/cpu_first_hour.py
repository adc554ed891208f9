"""The CPU path a newcomer meets first (issue 23, item 7), on the built-in SmolLM2-135M GGUF: engine build
seconds by phase from a fresh interpreter, resident memory after the build and after a 64-token answer,
batch-1 decode tok/s idle and beside a busy process, and the seeded draw's share of a decode step; then
transformers loading the same GGUF file and decoding the same way. Each measurement runs in its own process.
Prints one JSON line. Usage: python bench/cpu_first_hour.py [--threads N] [--skip-transformers]
(needs the default model: `asyncllm fetch-model`)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "<|im_start|>user\nTell me a story about a dragon.<|im_end|>\n<|im_start|>assistant\n"
NEW_TOKENS = 64


def rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def busy_neighbour() -> subprocess.Popen[bytes]:
    """Another process keeping one core busy (a build, a browser tab, another helper's tests)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def engine_part(threads: int | None, reference_draw: bool, repeats: int) -> dict[str, object]:
    start = time.perf_counter()
    from asyncllm import LLM, SamplingParams
    from asyncllm.default_model import default_model_path

    if reference_draw:  # the draw before issue 23, gumbel_argmax_ref (this imports torch before the build)
        from asyncllm.kernels.sampling_ref import gumbel_argmax_ref
        from asyncllm.sample import sampler

        sampler.load_draw = lambda device: gumbel_argmax_ref  # type: ignore[assignment]
    args = {} if threads is None else {"num_threads": threads}
    llm = LLM(str(default_model_path()), device="cpu", **args)
    out: dict[str, object] = {
        "build_s": round(time.perf_counter() - start, 2),
        "phases_s": {k: round(v, 2) for k, v in llm.runtime.startup_seconds},
        "num_threads": getattr(llm.runtime, "num_threads", None),  # absent before issue 23
        "kv_cache_tokens": llm.runtime.kv_capacity_tokens,
        "rss_after_build_mib": rss_mib(),
    }
    ids = llm.tokenizer(PROMPT).input_ids

    def decode_rate(params: SamplingParams) -> float:
        metrics = llm.generate([ids], params, use_tqdm=False)[0].metrics
        assert metrics is not None and metrics.time_to_first_token is not None
        return (NEW_TOKENS - 1) / (metrics.e2e_latency - metrics.time_to_first_token)

    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    decode_rate(greedy)
    out["rss_after_64_tokens_mib"] = rss_mib()
    out["decode_tok_s"] = round(statistics.median(decode_rate(greedy) for _ in range(repeats)), 2)

    # The seeded draw's share of a decode step: time inside Sampler.__call__ over the run's wall time.
    from asyncllm.sample import sampler as sampler_module

    spent = [0.0]
    original = sampler_module.Sampler.__call__

    def timed(self, *a, **kw):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return original(self, *a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    sampler_module.Sampler.__call__ = timed  # type: ignore[method-assign]
    seeded = SamplingParams(temperature=0.7, seed=1, max_tokens=NEW_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    rate = decode_rate(seeded)
    wall = time.perf_counter() - t0
    sampler_module.Sampler.__call__ = original  # type: ignore[method-assign]
    out["seeded_decode_tok_s"] = round(rate, 2)
    out["sampler_share"] = round(spent[0] / wall, 3)

    hog = busy_neighbour()
    try:
        time.sleep(0.5)
        busy = statistics.median(decode_rate(greedy) for _ in range(repeats))
        out["decode_tok_s_beside_busy_process"] = round(busy, 2)
    finally:
        hog.kill()
        hog.wait()
    llm.shutdown()
    return out


def transformers_part(threads: int) -> dict[str, object]:
    """transformers' own GGUF loading (dequantized to float32) and greedy generate, on `threads` threads."""
    start = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from asyncllm.default_model import default_model_path

    # from_pretrained(gguf_file=...) wants accelerate; this is its loading without it (as tests/model_loader).
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    model.load_state_dict(tensors["tensors"], strict=False)
    model.tie_weights()
    model.eval()
    del tensors
    out: dict[str, object] = {"build_s": round(time.perf_counter() - start, 2), "rss_after_build_mib": rss_mib()}
    ids = torch.tensor([tok(PROMPT).input_ids])

    def generate_s(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0

    generate_s(NEW_TOKENS)
    out["rss_after_64_tokens_mib"] = rss_mib()

    def decode_rate() -> float:  # the prefill and first token cancel out
        return (NEW_TOKENS - 1) / (generate_s(NEW_TOKENS) - generate_s(1))

    out["decode_tok_s"] = round(statistics.median(decode_rate() for _ in range(3)), 2)
    hog = busy_neighbour()
    try:
        time.sleep(0.5)
        out["decode_tok_s_beside_busy_process"] = round(statistics.median(decode_rate() for _ in range(3)), 2)
    finally:
        hog.kill()
        hog.wait()
    return out


def in_subprocess(*part_args: str) -> dict[str, object]:
    cmd = [sys.executable, __file__, "--part", *part_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=os.environ.copy())
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="num_threads for the engine (default: its own)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--part", nargs="+", help=argparse.SUPPRESS)  # internal: one measurement, in its process
    args = ap.parse_args()
    if args.part:
        kind, *rest = args.part
        if kind == "engine":
            threads = None if rest[0] == "default" else int(rest[0])
            result = engine_part(threads, reference_draw=rest[1] == "reference", repeats=int(rest[2]))
        else:
            result = transformers_part(int(rest[0]))
        print(json.dumps(result))
        return
    import torch

    from asyncllm.worker.threads import available_cores, default_num_threads

    default_threads = default_num_threads(torch.device("cpu")) or 1
    chosen = "default" if args.threads is None else str(args.threads)
    report: dict[str, object] = {
        "workload": "cpu_first_hour",
        "cores": available_cores(),
        "load_average": os.getloadavg()[0],
        "torch": torch.__version__,
        "engine": in_subprocess("engine", chosen, "new", "3"),
        # torch's own thread default (every core; one repeat: it can be very slow) and the draw before issue 23
        "engine_all_cores": in_subprocess("engine", str(available_cores()), "new", "1"),
        "engine_reference_draw": in_subprocess("engine", chosen, "reference", "3"),
    }
    if not args.skip_transformers:
        threads = args.threads or default_threads
        report["transformers"] = {"num_threads": threads, **in_subprocess("transformers", str(threads))}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
