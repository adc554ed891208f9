"""W7 (issue 22): n samples per prompt as one request against n separate requests. 32 W1 prompts (ids < 10000,
lengths U[100, 1024]) x n=8: `SamplingParams(n=8, seed=s)` per prompt against 256 requests seeded s + i, which
makes the same tokens (ignore_eos, each prompt's output length drawn once for its 8 samples, U[100, 1024] as W1,
or --max-tokens). Random weights of the real shape. Target: >= 1.5x the separate requests' tokens/s.

Run with the prefix cache on (the default engine: separate requests admitted together find the first one's
blocks, registered when planned) and off (only `n` shares the prompt): one engine each, in a process of its own
(the device's memory whole for each), every run on prompts of its own (a first token per run) so no run reads
another's cache. Prints one JSON line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import subprocess
import sys
import time

from w1_throughput import RunResult, add_w1_arguments, w1_engine

from asyncllm import LLM, SamplingParams
from asyncllm.core.engine_core import EngineCore


def w7_requests(num_prompts: int, n: int, max_tokens: int | None) -> tuple[list[list[int]], list[SamplingParams]]:
    """The prompts and one `SamplingParams(n=n)` each (seed 1000 * i, temperature 0.6, ignore_eos)."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_prompts)]
    lengths = [max_tokens or rng.randint(100, 1024) for _ in range(num_prompts)]
    params = [
        SamplingParams(n=n, seed=1000 * i, temperature=0.6, ignore_eos=True, max_tokens=m)
        for i, m in enumerate(lengths)
    ]
    return prompts, params


def separate(prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[list[int]], list[SamplingParams]]:
    """Each request's samples as requests of their own: sample i of seed s is a request seeded s + i."""
    out_prompts, out_params = [], []
    for prompt, p in zip(prompts, params):
        assert p.seed is not None
        for i in range(p.n):
            out_prompts.append(prompt)
            out_params.append(dataclasses.replace(p, n=1, seed=p.seed + i))
    return out_prompts, out_params


def fresh(prompts: list[list[int]], run: int) -> list[list[int]]:
    """The prompts with a first token of this run's own: no prefix is shared with another run."""
    return [[10001 + run, *p[1:]] for p in prompts]


@dataclasses.dataclass(frozen=True)
class Run:
    result: RunResult
    prefill_tokens: int  # prompt tokens the steps computed (what sharing saves)


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> Run:
    """One timed `generate`: wall seconds, output tokens of every sample, engine steps, prompt tokens
    computed (summed from each step's counts, as `LLM`'s progress bar does)."""
    counted = [0]
    step = EngineCore.step

    def counting_step(core: EngineCore, *args: object, **kwargs: object) -> object:
        out = step(core, *args, **kwargs)  # type: ignore[arg-type]
        counted[0] += core.last_step.num_prefill_tokens
        return out

    steps0 = llm.stats()["num_steps"]
    EngineCore.step = counting_step  # type: ignore[assignment,method-assign]
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        EngineCore.step = step  # type: ignore[method-assign]
    tokens = sum(len(sample.token_ids) for out in outs for sample in out.outputs)
    return Run(RunResult(seconds, tokens, int(llm.stats()["num_steps"] - steps0)), counted[0])


def best_of_rounds(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], rounds: int) -> tuple[Run, Run]:
    """(n samples per request, separate requests): the same tokens, in alternating order over `rounds`
    (n first, then separate first, ...), each run on prompts of its own; the fastest run of each."""
    runs: dict[str, list[Run]] = {"n": [], "separate": []}
    order = ["n", "separate"]
    for r in range(rounds):
        for kind in order if r % 2 == 0 else order[::-1]:
            fresh_prompts = fresh(prompts, len(runs["n"]) + len(runs["separate"]))
            if kind == "n":
                runs[kind].append(timed(llm, fresh_prompts, params))
            else:
                runs[kind].append(timed(llm, *separate(fresh_prompts, params)))
    samples = min(runs["n"], key=lambda run: run.result.seconds)
    alone = min(runs["separate"], key=lambda run: run.result.seconds)
    assert samples.result.output_tokens == alone.result.output_tokens, "both kinds of run make the same tokens"
    return samples, alone


def measure(args: argparse.Namespace, caching: bool) -> dict[str, object]:
    """Both runs on one engine with the prefix cache on or off."""
    prompts, params = w7_requests(args.num_seqs, args.n, args.max_tokens)
    llm = w1_engine(args, enable_prefix_caching=caching)
    try:
        samples, alone = best_of_rounds(llm, prompts, params, args.rounds)
        stats = llm.stats()
    finally:
        llm.shutdown()
    a, b = samples.result, alone.result
    n_tps, alone_tps = a.output_tokens / a.seconds, b.output_tokens / b.seconds
    tag = "" if caching else "_no_prefix_cache"
    return {
        f"n_tok_s{tag}": round(n_tps, 1),
        f"separate_tok_s{tag}": round(alone_tps, 1),
        f"ratio{tag}": round(n_tps / alone_tps, 3),
        f"prefill_tokens_n_separate{tag}": [samples.prefill_tokens, alone.prefill_tokens],
        f"steps_n_separate{tag}": [a.steps, b.steps],
        f"preemptions{tag}": stats["num_preemptions"],
        "output_tokens": a.output_tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_w1_arguments(ap)
    ap.set_defaults(num_seqs=32)  # prompts; each with --n samples
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=None, help="every output's length (default: U[100, 1024])")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each kind, alternating which goes first")
    ap.add_argument("--child", choices=["on", "off"], default=None, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.child is not None:
        print(json.dumps(measure(args, caching=args.child == "on")))
        return
    result: dict[str, object] = {"workload": "W7", "shape": args.shape, "prompts": args.num_seqs, "n": args.n}
    for caching in ("on", "off"):
        done = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--child", caching], capture_output=True, text=True, check=False
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise SystemExit(f"the prefix-cache-{caching} run failed:\n{done.stderr[-4000:]}")
        result |= json.loads(lines[-1])
    result["target_ratio"] = 1.5
    print(json.dumps(result))


if __name__ == "__main__":
    main()
