"""W6 (issue 21): what a JSON schema on every request costs. The W1 requests (256, prompts U[100, 1024],
outputs up to U[100, 1024], temperature 0.6) and W5 (batch 1, 128 in / 512 out), each run unconstrained and
with a JSON schema, on the same engine (random weights of the real shape, the real Qwen3 tokenizer). Also the
first request's latency with a grammar the engine has not compiled yet against the same request warm.

Constrained outputs end when their JSON closes; the unconstrained run is then given each request's
constrained length (ignore_eos), so both runs make the same tokens. Targets: W1-style >= 0.9x and batch 1 >= 0.95x
of unconstrained tokens/s. The constrained requests' matchers are where the engine's default puts them (on
CUDA the grammar process, started by the first constrained request: the runs wait until it is up; it never
jumps forward; `--engine-arg grammar_process=off` (ASYNCLLM_GRAMMAR_PROCESS) keeps them in the step thread) with
jump-forward on (the default; `--engine-arg jump_forward=0` (ASYNCLLM_JUMP_FORWARD) draws every token); unless
second engine then gives the W1-style ratio with jump-forward the other way (the twin), in the same call, and
both runs' engine steps per output token. Prints one JSON line; `--host-timing` first prints the step thread's
time per step by phase (bench/host_timing.py, structured output's phases included) for the constrained run and
for the unconstrained one. `--fill-split N` (an experiment, bench-only): the step thread's many-row mask fill split
over N threads of ours, each filling a share with a one-thread xgrammar call, instead of one xgrammar call with
its own threads (`Filler`); `--fill-threads N`: that call on N threads (the default: at most 8)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import threading
import time
from contextlib import nullcontext

from engine_args import engine_kwargs, tuning_env
from host_timing import host_timing
from w1_throughput import RunResult, add_w1_arguments, run_w1, w1_engine, w1_requests

from asyncllm import LLM, RequestOutput, SamplingParams, envs

SCHEMA = {  # a typical extraction schema: nested object, enum, bounded integer, bounded strings, arrays
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
        "name": {"type": "string", "maxLength": 48},
        "kind": {"enum": ["person", "place", "thing"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
        "scores": {"type": "array", "items": {"type": "object", "properties": {"v": {"type": "number"}}}},
    },
    "required": ["id", "name", "kind", "tags", "scores"],
}


class GrammarProcessReady(logging.Handler):
    """Notes the engine's "grammar process ready" log record (the only outside sign of it)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._ready = threading.Event()
        source = logging.getLogger("asyncllm.structured_output.grammar_process")
        source.setLevel(logging.INFO)
        source.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("grammar process ready"):
            self._ready.set()

    def wait(self, timeout: float) -> float:
        """Seconds waited for it (up to `timeout`)."""
        t0 = time.perf_counter()
        self._ready.wait(timeout)
        return round(time.perf_counter() - t0, 2)


class SplitFill:
    """Stands in for `Filler` (`--fill-split`): `threads` shares, the first on the calling thread, the others on
    threads kept for the run (each xgrammar call releases the GIL)."""

    def __init__(self, threads: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from xgrammar import BatchGrammarMatcher

        self._fills = [BatchGrammarMatcher(max_threads=1) for _ in range(threads)]
        self._pool = ThreadPoolExecutor(max(1, threads - 1))

    def __call__(self, matchers: list, bitmask: object, indices: list[int]) -> None:
        n = len(matchers)
        parts = max(1, min(len(self._fills), n // 16))
        at = [n * k // parts for k in range(parts + 1)]
        futures = [
            self._pool.submit(self._fills[k].batch_fill_next_token_bitmask, matchers[at[k] : at[k + 1]], bitmask,
                              indices[at[k] : at[k + 1]])
            for k in range(1, parts)
        ]  # fmt: skip
        self._fills[0].batch_fill_next_token_bitmask(matchers[: at[1]], bitmask, indices[: at[1]])
        for future in futures:
            future.result()


def constrained(params: list[SamplingParams], schema: dict[str, object]) -> list[SamplingParams]:
    return [dataclasses.replace(p, ignore_eos=False, json_schema=schema) for p in params]


def batch1_ms_per_token(llm: LLM, params: SamplingParams, rounds: int = 3) -> float:
    """Decode time per token at batch 1: (512-token run - 1-token run) / 511, median of `rounds`."""
    prompt = [[(7 * i) % 10000 for i in range(128)]]
    per_token = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = llm.generate(prompt, dataclasses.replace(params, max_tokens=512), use_tqdm=False)[0]
        full = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate(prompt, dataclasses.replace(params, max_tokens=1), use_tqdm=False)
        one = time.perf_counter() - t0
        per_token.append(1000 * (full - one) / max(len(out.token_ids) - 1, 1))
    return sorted(per_token)[len(per_token) // 2]


def first_request_ms(llm: LLM, schema: dict[str, object]) -> tuple[float, float]:
    """A one-token request with a schema never compiled before, then the same request again (cached)."""
    params = SamplingParams(max_tokens=1, json_schema=schema)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)
        times.append(1000 * (time.perf_counter() - t0))
    return times[0], times[1]


def w1_style(llm: LLM, args: argparse.Namespace) -> tuple[list[RequestOutput], float, list[int], RunResult, int]:
    """The W1 requests with the schema, then unconstrained with each one's constrained length: (constrained
    outputs, their seconds, their lengths, the unconstrained run, the constrained run's engine steps)."""
    prompts, params = w1_requests(args.num_seqs)
    # Each run its own prompts (first token changed: W1 draws ids up to 10,000), so neither finds the other's
    # in the prefix cache: both compute every prompt. (Until run 68 the unconstrained run reused the
    # constrained run's prompts and found them all cached: a third of the constrained run's time is prefill.)
    warm, plain_prompts = _fresh(prompts[:4], 1), _fresh(prompts, 2)
    llm.generate(warm, constrained(params[:4], SCHEMA), use_tqdm=False)  # this schema compiled, kernels warm
    # The constrained run first; the unconstrained run then makes exactly as many tokens per request (its
    # lengths, ignore_eos), so the two differ only in the constraint.
    steps = llm.stats()["num_steps"]
    timed = getattr(args, "host_timing", False)
    with host_timing(grammar=True) if timed else nullcontext() as timing:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, constrained(params, SCHEMA), use_tqdm=False)
        schema_s = time.perf_counter() - t0
    if timing is not None:
        print(json.dumps({"workload": "W6 host timing", "run": "schema", **timing.summary()}), flush=True)
    steps = int(llm.stats()["num_steps"] - steps)
    lengths = [len(o.token_ids) for o in outs]
    same = [dataclasses.replace(p, max_tokens=n) for p, n in zip(params, lengths)]
    with host_timing() if timed else nullcontext() as timing:
        plain = run_w1(llm, plain_prompts, same)
    if timing is not None:
        print(json.dumps({"workload": "W6 host timing", "run": "plain", **timing.summary()}), flush=True)
    return outs, schema_s, lengths, plain, steps


def _fresh(prompts: list[list[int]], k: int) -> list[list[int]]:
    """`prompts` with a first token no W1 prompt has (W1 draws ids in [0, 10000]), distinct for each k."""
    return [[10_000 + k, *p[1:]] for p in prompts]


def jump_twin(args: argparse.Namespace, jump_forward: bool) -> tuple[float, float]:
    """The W1-style ratio and the constrained run's steps per output token with `jump_forward`, on a fresh
    engine (otherwise as the first)."""
    given = engine_kwargs(args.engine_arg)  # first: it sets the tuning variables it names
    with tuning_env(jump_forward=jump_forward):
        llm = w1_engine(args, **given)
    try:
        _, schema_s, lengths, plain, steps = w1_style(llm, args)
    finally:
        llm.shutdown()
    return (sum(lengths) / schema_s) / (plain.output_tokens / plain.seconds), steps / sum(lengths)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_w1_arguments(ap)
    ap.add_argument("--no-twin", action="store_true", help="skip the in-thread twin's W1-style ratio")
    ap.add_argument("--host-timing", action="store_true", help="the step thread's time per step by phase, both runs")
    ap.add_argument("--fill-split", type=int, default=0, help="the step thread's fill over N threads of ours")
    ap.add_argument("--fill-threads", type=int, default=0, help="the step thread's fill on N of xgrammar's threads")
    args = ap.parse_args()
    from asyncllm.structured_output import request_grammar
    from asyncllm.structured_output.matcher_set import Filler

    if args.fill_split:
        request_grammar.Filler = lambda: SplitFill(args.fill_split)  # type: ignore[assignment,misc]
    elif args.fill_threads:
        request_grammar.Filler = lambda: Filler(args.fill_threads)  # type: ignore[assignment,misc]
    given = engine_kwargs(args.engine_arg)
    jump = envs.JUMP_FORWARD.get()
    process_ready = GrammarProcessReady()  # before the engine: it logs the moment its grammar process is up
    llm = w1_engine(args, **given)
    cold_ms, warm_ms = first_request_ms(llm, {**SCHEMA, "title": f"cold-{time.time_ns()}"})
    # On CUDA the default (ASYNCLLM_GRAMMAR_PROCESS=auto) starts the grammar process in the background at that
    # first constrained request: the runs below begin once it is up, as a server's steady state would.
    lazy = envs.GRAMMAR_PROCESS.get() is envs.GrammarProcessChoice.AUTO
    waited_s = process_ready.wait(60.0) if args.device == "cuda" and lazy else None
    outs, schema_s, lengths, plain, steps = w1_style(llm, args)
    # On the device's own kernels: every output that ended on its own (its JSON closed) must parse.
    closed = [o for o in outs if o.finish_reason == "stop"]
    parsed = sum(isinstance(json.loads(o.text), dict) for o in closed)
    greedy1 = SamplingParams(temperature=0.6, ignore_eos=True)
    # A schema never seen, once the engine has served for a while: the compile alone (the vocabulary's
    # tables are built at start-up on CUDA).
    late_cold_ms, _ = first_request_ms(llm, {**SCHEMA, "title": f"late-{time.time_ns()}"})
    b1_plain = batch1_ms_per_token(llm, greedy1)
    b1_schema = batch1_ms_per_token(llm, dataclasses.replace(greedy1, ignore_eos=False, json_schema=SCHEMA))
    plain_tps, schema_tps = plain.output_tokens / plain.seconds, sum(lengths) / schema_s
    llm.shutdown()
    twin = None if args.no_twin else jump_twin(args, not jump)
    print(
        json.dumps(
            {
                "workload": "W6",
                "shape": args.shape,
                "w1_plain_tok_s": round(plain_tps, 1),
                "w1_schema_tok_s": round(schema_tps, 1),
                "grammar_process": envs.GRAMMAR_PROCESS.get().value,
                "waited_for_grammar_process_s": waited_s,
                "fill_split": args.fill_split,
                "fill_threads": args.fill_threads,
                "jump_forward": jump,
                "w1_ratio": round(schema_tps / plain_tps, 3),
                "w1_target_ratio": 0.9,
                "w1_output_tokens": sum(lengths),
                "w1_steps_per_output_token": round(steps / sum(lengths), 3),
                "twin_jump_forward": not jump,
                "w1_ratio_twin": None if twin is None else round(twin[0], 3),
                "w1_steps_per_output_token_twin": None if twin is None else round(twin[1], 3),
                "b1_plain_ms_per_token": round(b1_plain, 3),
                "b1_schema_ms_per_token": round(b1_schema, 3),
                "b1_ratio": round(b1_plain / b1_schema, 3),  # tokens/s constrained over unconstrained
                "b1_target_ratio": 0.95,
                "closed_outputs": len(closed),
                "closed_outputs_parsed": parsed,
                "first_request_cold_grammar_ms": round(cold_ms, 1),
                "first_request_warm_grammar_ms": round(warm_ms, 1),
                "new_schema_later_ms": round(late_cold_ms, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
