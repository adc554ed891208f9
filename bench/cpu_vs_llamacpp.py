"""asyncllm beside llama.cpp on a CPU, the same GGUF file (issue 40): greedy decode tok/s over 128 new tokens at
1 and 2 threads, prompt tok/s for a 512-token prompt, and each engine's peak resident memory in each.

The two parts run in processes of their own, so each peak RSS is that part's alone: the main job (load, then
chat replies of 128 tokens: what `scripts/chat.sh` does) and the prompt test (load, then distinct 512-token
prompts; asyncllm keeps each one's KV in its prefix cache, llama.cpp keeps none). The engines alternate
within every round, so load from other work on the machine falls on both alike; the load average is printed
beside each row. llama.cpp runs through llama-cpp-python in the interpreter given by --llama-python (a venv
where `import llama_cpp` works; it needs nothing of asyncllm). Limits: decode and prompt >= 0.8x llama.cpp's
(1x the aim), RSS <= llama.cpp's + 300 MB.

    python bench/cpu_vs_llamacpp.py --llama-python /work/llama-venv/bin/python [--rounds 2] [--threads 1 2]
        [--before-src DIR]  # also asyncllm from DIR/src (an older commit's tree), alternating with this one
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

NEW_TOKENS = 128
PROMPT_TOKENS = 512
CHAT = "<|im_start|>user\nTell me a story about a dragon.<|im_end|>\n<|im_start|>assistant\n"
TARGET, AIM, RSS_MARGIN_MB = 0.8, 1.0, 300
KEYS = {  # figure -> its row's name
    "decode_tok_s": "decode tok/s",
    "decode_peak_rss_mb": "peak RSS MB, the main job (load + chat replies)",
    "prompt_tok_s": "prompt tok/s",
    "prompt_peak_rss_mb": "peak RSS MB, load + 512-token prompts (ours cached)",
}
TWIN = "asyncllm-float32"  # --twin: asyncllm with ASYNCLLM_CPU_INT4=off
BEFORE = "asyncllm-before"  # --before-src: asyncllm imported from another tree (e.g. `git archive <commit> src`)


def long_prompt(vocab: int, salt: int) -> list[int]:
    """A 512-token prompt of ordinary ids, the same for both engines; each call's `salt` makes its first token
    differ, so no prefix cache serves a repeat (the values do not change the work)."""
    return [100 + (i * 7919 + salt * 104729) % (vocab - 200) for i in range(PROMPT_TOKENS)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def llama_part(model: str, threads: int, repeats: int, what: str) -> dict[str, float]:
    import llama_cpp.llama as binding
    from llama_cpp import Llama

    # Without llama.cpp's extra buffer types (the AMX and repacked weights): built with GGML_NATIVE on this
    # Sapphire Rapids VM its AMX path dies with SIGSEGV at the first batch (bench/RESULTS.md, issue 40).
    defaults = binding.llama_cpp.llama_model_default_params

    def model_params():  # type: ignore[no-untyped-def]
        params = defaults()
        params.use_extra_bufts = False
        return params

    binding.llama_cpp.llama_model_default_params = model_params
    llm = Llama(model, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    chat = llm.tokenize(CHAT.encode(), add_bos=False, special=True)

    def decode() -> float:
        llm.reset()
        stamps = []
        for _ in llm.generate(chat, temp=0.0, top_k=1, reset=True):  # never stops at EOS by itself
            stamps.append(time.perf_counter())
            if len(stamps) == NEW_TOKENS:
                break
        return (NEW_TOKENS - 1) / (stamps[-1] - stamps[0])

    salts = iter(range(1000))

    def prompt() -> float:
        llm.reset()
        ids = long_prompt(llm.n_vocab(), next(salts))
        start = time.perf_counter()
        llm.eval(ids)
        return PROMPT_TOKENS / (time.perf_counter() - start)

    return _measure(what, decode, prompt, repeats)


def asyncllm_part(model: str, threads: int, repeats: int, what: str) -> dict[str, float]:
    from asyncllm import LLM, SamplingParams

    llm = LLM(model, device="cpu", num_threads=threads)
    chat = llm.tokenizer(CHAT).input_ids
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def decode() -> float:
        m = llm.generate([chat], greedy, use_tqdm=False)[0].metrics
        assert m is not None and m.time_to_first_token is not None
        return (NEW_TOKENS - 1) / (m.e2e_latency - m.time_to_first_token)

    salts = iter(range(1000))

    def prompt() -> float:
        m = llm.generate([long_prompt(llm.runtime.vocab_size, next(salts))], first, use_tqdm=False)[0].metrics
        assert m is not None and m.time_to_first_token is not None
        return PROMPT_TOKENS / m.time_to_first_token  # the prompt's forward pass and its one token

    out = _measure(what, decode, prompt, repeats)
    llm.shutdown()
    return out


def _measure(what: str, decode: Callable[[], float], prompt: Callable[[], float], repeats: int) -> dict[str, float]:
    """One part's figures: after a warm-up run, the median of `repeats`, and the process's peak RSS."""
    run = decode if what == "decode" else prompt
    run()  # warm-up
    value = statistics.median(run() for _ in range(repeats))
    return {f"{what}_tok_s": value, f"{what}_peak_rss_mb": peak_rss_mb()}


def run_part(
    python: str, engine: str, model: str, threads: int, repeats: int, what: str, before_src: str | None = None
) -> dict[str, float | str]:
    kind = "llama" if engine == "llama" else "asyncllm"
    cmd = [python, __file__, "--part", kind, model, str(threads), str(repeats), what]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if engine == TWIN:
        env["ASYNCLLM_CPU_INT4"] = "off"  # the dequantized float32 path: main's before issue 40
    if engine == BEFORE and before_src is not None:  # ahead of the installed (editable) tree on sys.path
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(before_src, "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"error": tail[0]}
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", required=False, help="an interpreter where `import llama_cpp` works")
    ap.add_argument("--model", default=None, help="the GGUF file (default: asyncllm's default model)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2, help="rounds of alternating runs; medians are reported")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per process (median)")
    ap.add_argument("--twin", action="store_true", help="also run asyncllm with ASYNCLLM_CPU_INT4=off (before)")
    ap.add_argument("--before-src", default=None, help="also run asyncllm from DIR/src (another commit's tree)")
    ap.add_argument("--part", nargs=5, help=argparse.SUPPRESS)  # internal: engine, model, threads, repeats, what
    args = ap.parse_args()
    if args.part:
        engine, model, threads, repeats, what = args.part
        part = llama_part if engine == "llama" else asyncllm_part
        print(json.dumps(part(model, int(threads), int(repeats), what)))
        return
    if args.model is None:
        from asyncllm.default_model import default_model_path

        args.model = str(default_model_path())
    engines = {"asyncllm": sys.executable}
    if args.twin:
        engines[TWIN] = sys.executable
    if args.before_src:
        engines[BEFORE] = sys.executable
    if args.llama_python:
        engines = {"llama": args.llama_python, **engines}
    runs: dict[tuple[str, int], list[dict[str, float | str]]] = {}
    for r in range(args.rounds):
        for threads in args.threads:
            for engine, python in engines.items():
                load = os.getloadavg()[0]
                result: dict[str, float | str] = {"load": load}
                for what in ("decode", "prompt"):
                    result.update(run_part(python, engine, args.model, threads, args.repeats, what, args.before_src))
                runs.setdefault((engine, threads), []).append(result)
                print(f"# round {r} {engine} threads={threads}: {json.dumps(result)}", file=sys.stderr)
    report(runs, args.threads, list(engines))


def _median(rows: list[dict[str, float | str]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if key in r]
    return statistics.median(values) if values else None


def report(runs: dict[tuple[str, int], list[dict[str, float | str]]], threads: list[int], engines: list[str]) -> None:
    for name in [e for e in engines if e != "llama"]:
        print(f"## {name} against llama.cpp")
        _table(runs, threads, name)
    print(json.dumps({"workload": "cpu_vs_llamacpp", "engines": engines, **{
        f"{key}@{t}": {e: _median(runs.get((e, t), []), key) for e in engines}
        for t in threads for key in KEYS}}))  # fmt: skip


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _table(runs: dict[tuple[str, int], list[dict[str, float | str]]], threads: list[int], name: str) -> None:
    print("| threads | figure | llama.cpp | asyncllm | ratio | limit | load avg (each run) |")
    print("|---|---|---|---|---|---|---|")
    for t in threads:
        ours = runs.get((name, t), [])
        theirs = runs.get(("llama", t), [])
        loads = "/".join(f"{float(r['load']):.1f}" for r in theirs + ours)
        for key, unit in KEYS.items():
            a, b = _median(theirs, key), _median(ours, key)
            if key.endswith("peak_rss_mb"):
                ok = None if a is None or b is None else b <= a + RSS_MARGIN_MB
                ratio, limit = ("" if a is None or b is None else f"+{b - a:.0f} MB"), f"<= +{RSS_MARGIN_MB} MB"
            else:
                ok = None if a is None or b is None else b >= TARGET * a
                ratio, limit = (
                    ("" if a is None or b is None or a == 0 else f"{b / a:.2f}x ({b / a / TARGET:.0%} of 0.8x)"),
                    f">= {TARGET}x (aim {AIM}x)",
                )
            mark = "" if ok is None else (" ok" if ok else " MISSED")
            print(f"| {t} | {unit} | {_fmt(a)} | {_fmt(b)} | {ratio}{mark} | {limit} | {loads} |")


if __name__ == "__main__":
    main()
