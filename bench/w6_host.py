"""W6's host side: what 256 constrained streams cost the host per decode step, on this machine's CPU. The
grammar masks of 256 requests (W6's JSON schema, the real Qwen3 vocabulary) filled by xgrammar's threads,
and each sampled token fed back to its matcher, along a random walk of allowed tokens (a random-weight
model's outputs). The device step these must hide behind is in W6's figures. Prints one JSON line."""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np
from shapes import find_qwen3_tokenizer
from transformers import AutoTokenizer
from w6_structured import SCHEMA

from asyncllm import SamplingParams
from asyncllm.sample.grammar import GrammarBackend

ROWS, STEPS, VOCAB = 256, 40, 151_936


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(find_qwen3_tokenizer()))
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    backend = GrammarBackend(tokenizer, VOCAB, stops)
    t0 = time.perf_counter()
    backend.prepare_async()
    spec = SamplingParams(json_schema=SCHEMA).structured
    assert spec is not None
    compiled = backend.compile(spec)  # waits for the vocabulary's tables, then compiles
    tables_and_compile_s = time.perf_counter() - t0
    import xgrammar as xgr

    matchers = [xgr.GrammarMatcher(compiled) for _ in range(ROWS)]
    host = np.zeros((ROWS, backend.bitmask_words), dtype=np.int32)
    batch = xgr.BatchGrammarMatcher()
    rng = random.Random(0)
    fill_s = accept_s = 0.0
    steps = 0
    for _ in range(STEPS):
        live = [i for i in range(ROWS) if not matchers[i].is_terminated()]
        if not live:
            break
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask([matchers[i] for i in live], host, live)
        fill_s += time.perf_counter() - t0
        tokens = []
        for i in live:
            allowed = np.flatnonzero(np.unpackbits(host[i].view(np.uint8), bitorder="little")[:VOCAB])
            tokens.append(int(allowed[rng.randrange(len(allowed))]))
        t0 = time.perf_counter()
        for i, token in zip(live, tokens):
            matchers[i].accept_token(token)
        accept_s += time.perf_counter() - t0
        steps += 1
    print(
        json.dumps(
            {
                "workload": "W6 host",
                "cpus": os.cpu_count(),
                "rows": ROWS,
                "steps": steps,
                "fill_ms_per_step": round(1000 * fill_s / steps, 3),
                "accept_ms_per_step": round(1000 * accept_s / steps, 3),
                "tables_and_first_compile_s": round(tables_and_compile_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
