"""W6's host side: what 256 constrained streams cost the host per decode step, on this machine's CPU. The
grammar masks of 256 requests (W6's JSON schema, the real Qwen3 vocabulary) filled by xgrammar's threads (1,
2, 4, 8, the engine's default count and every core: `fill_ms_by_threads`; or as many threads of ours, each
filling a share with one of xgrammar's: `fill_ms_by_our_threads`), and each sampled token fed back
to its matcher in one batch call, along a random walk of allowed tokens (a random-weight
model's outputs), and how much of such outputs jump-forward takes without draws (`jump_potential`); then
the same work as steps against a simulated device (`w6_steps.py`, every token drawn): ms per step with
no grammar, with the matchers in the step thread, and in the grammar process, and the ratios to the plain
step (the W1-style ratio the host allows; issue 21's target 0.9); and how many cores n busy processes
really get (`cores_given_to_n_processes`: a CPU quota shows here, not in the affinity mask). Prints one JSON
line.

`--forward-ms` (the device's step, default 2.5), `--host-ms` (the core's own host work a step, default 2.0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import numpy as np
from shapes import find_qwen3_tokenizer
from transformers import AutoTokenizer
from w6_steps import run_steps
from w6_structured import SCHEMA

from asyncllm import SamplingParams
from asyncllm.structured_output.backend import GrammarBackend

ROWS, STEPS, VOCAB = 256, 40, 151_936


def xgrammar_alone(backend: GrammarBackend, threads: int, split: bool = False) -> dict[str, float]:
    """xgrammar's own batch fill on `threads` threads (`split`: our threads instead, each filling a share of the
    rows with a one-thread batch call, as the grammar process does) and its batch accept along a random walk
    (the same walk whatever `threads`: the rng's seed is fixed), ms per step."""
    from concurrent.futures import ThreadPoolExecutor

    spec = SamplingParams(json_schema=SCHEMA).structured
    assert spec is not None
    compiled = backend.compile(spec)
    import xgrammar as xgr

    matchers = [xgr.GrammarMatcher(compiled) for _ in range(ROWS)]
    host = np.zeros((ROWS, backend.bitmask_words), dtype=np.int32)
    batch = xgr.BatchGrammarMatcher(max_threads=1 if split else threads)
    shares = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(threads - 1)] if split else []
    pool = ThreadPoolExecutor(max(1, threads - 1))
    rng = random.Random(0)
    fill_s = accept_s = 0.0
    steps = 0
    for _ in range(STEPS):
        live = [i for i in range(ROWS) if not matchers[i].is_terminated()]
        if not live:
            break
        t0 = time.perf_counter()
        parts = [live[len(live) * k // threads : len(live) * (k + 1) // threads] for k in range(threads)]
        futures = [
            pool.submit(share.batch_fill_next_token_bitmask, [matchers[i] for i in part], host, part)
            for share, part in zip(shares, parts[1:])
        ]
        first = parts[0] if split else live
        batch.batch_fill_next_token_bitmask([matchers[i] for i in first], host, first)
        for future in futures:
            future.result()
        fill_s += time.perf_counter() - t0
        tokens = []
        for i in live:
            allowed = np.flatnonzero(np.unpackbits(host[i].view(np.uint8), bitorder="little")[:VOCAB])
            tokens.append(int(allowed[rng.randrange(len(allowed))]))
        t0 = time.perf_counter()
        xgr.BatchGrammarMatcher.batch_accept_token([matchers[i] for i in live], tokens)
        accept_s += time.perf_counter() - t0
        steps += 1
    pool.shutdown()
    return {
        "steps": steps,
        "fill_ms_per_step": round(1000 * fill_s / steps, 3),
        "accept_ms_per_step": round(1000 * accept_s / steps, 3),
    }


def _spin(seconds: float) -> int:
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def cpu_scaling(counts: list[int], seconds: float = 0.4) -> dict[int, float]:
    """How much CPU the host really gives n busy processes at once, in cores (n processes' loop counts over
    one process's): below n where a quota or other tenants share the cores (`sched_getaffinity` counts
    cores this process may run on, not how much of them it gets)."""
    from concurrent.futures import ProcessPoolExecutor

    one = _spin(seconds)
    out = {}
    for n in counts:
        with ProcessPoolExecutor(n) as pool:
            out[n] = round(sum(pool.map(_spin, [seconds] * n)) / one, 2)
    return out


def jump_potential(backend: GrammarBackend, rows: int = ROWS) -> dict[str, float]:
    """Jump-forward's reach on W6's schema: `rows` random walks (a random-weight model's outputs), each
    forced run (the matcher's jump-forward string, tokenised by the tokenizer, the prefix the matcher takes)
    taken without a draw. The forced share of output tokens, and the steps an average 63-token output takes:
    serially (a run is computed in the step after its token) and overlapped (that step's draw is already
    under way: it draws the run's first token)."""
    spec = SamplingParams(json_schema=SCHEMA).structured
    assert spec is not None
    compiled = backend.compile(spec)
    import xgrammar as xgr

    stops = set(backend.stop_token_ids)
    row = np.zeros((1, backend.bitmask_words), dtype=np.int32)
    rng = random.Random(0)
    tokens = draws = runs = 0
    for _ in range(rows):
        matcher, n = xgr.GrammarMatcher(compiled), 0
        while n < 256 and not matcher.is_terminated():
            text = matcher.find_jump_forward_string() if n else ""
            if text:
                ids = backend.tokenizer.encode(text, add_special_tokens=False)
                taken = 0
                while taken < len(ids) and matcher.accept_token(ids[taken]):
                    taken += 1
                n += taken
                runs += taken > 0
            matcher.fill_next_token_bitmask(row, 0)
            allowed = np.flatnonzero(np.unpackbits(row[0].view(np.uint8), bitorder="little")[:VOCAB])
            token = int(allowed[rng.randrange(len(allowed))])
            matcher.accept_token(token)
            n, draws = n + 1, draws + 1
            if token in stops:
                break
        tokens += n
    return {
        "jump_forced_share": round(1 - draws / tokens, 3),
        "jump_mean_output_tokens": round(tokens / rows, 1),
        "jump_steps_per_63_serial": round(63 * draws / tokens, 1),
        "jump_steps_per_63_overlapped": round(63 * (draws + runs) / tokens, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--forward-ms", type=float, default=2.5)
    ap.add_argument("--host-ms", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(find_qwen3_tokenizer()))
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    backend = GrammarBackend(tokenizer, VOCAB, stops)
    t0 = time.perf_counter()
    backend.prepare_async().result()
    spec = SamplingParams(json_schema=SCHEMA).structured
    assert spec is not None
    backend.compile(spec)
    tables_and_compile_s = time.perf_counter() - t0
    cpus = len(os.sched_getaffinity(0))
    counts = sorted({1, 2, 4, 8, max(1, min(16, cpus - 2)), cpus})
    sweep = {n: xgrammar_alone(backend, n) for n in counts}
    figures = {
        "fill_ms_by_threads": {n: sweep[n]["fill_ms_per_step"] for n in counts},
        "fill_ms_by_our_threads": {n: xgrammar_alone(backend, n, split=True)["fill_ms_per_step"] for n in counts},
        "accept_ms_per_step": sweep[1]["accept_ms_per_step"],
        "cores_given_to_n_processes": cpu_scaling(counts),
        **jump_potential(backend),
    }
    steps = run_steps(backend, SCHEMA, rows=ROWS, steps=args.steps, forward_ms=args.forward_ms, host_ms=args.host_ms)
    print(
        json.dumps(
            {
                "workload": "W6 host",
                "cpus": cpus,
                "rows": ROWS,
                **figures,
                "tables_and_first_compile_s": round(tables_and_compile_s, 3),
                "forward_ms": args.forward_ms,
                "host_ms": args.host_ms,
                **{f"step_{key}": value for key, value in steps.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
