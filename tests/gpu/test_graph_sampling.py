"""ASYNCLLM_CUDA_GRAPH_SAMPLING on the GPU: decode graphs that run the LM head, and the plain draw with the
latest-token record in a draw graph per decode bucket, give the tokens of the same graphs with the LM head and
sampler run eagerly (ASYNCLLM_CUDA_GRAPH_SAMPLING=0), bit for bit: seeded temperature sampling and greedy,
batches crossing several buckets, filtered, logprobs and constrained rows beside plain ones (their steps sample
eagerly from the graph's logits; the next all-plain step goes back to the draw graph), cascade and LoRA graph
variants. Also: a plain decode step replays two graphs (the forward pass with its LM head, the draw), not one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from asyncllm import LLM, SamplingParams
from tests.fixtures.lora_adapters import write_adapter
from tests.worker.test_cascade_attention import shared_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

COMMON = dict(device="cuda", block_size=4, max_num_seqs=40, num_kv_blocks=1024)


def _prompts(vocab: int, n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


def _engine(path: Path, graph_sampling: bool, **engine_args: object) -> LLM:
    """An engine with the LM head and plain draw in the decode graphs (ASYNCLLM_CUDA_GRAPH_SAMPLING) or not:
    the variable is read when the engine is built. Matchers in the step thread: a grammar process started
    mid-test would take later requests without jumps."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ASYNCLLM_CUDA_GRAPH_SAMPLING", "1" if graph_sampling else "0")
        env.setenv("ASYNCLLM_GRAMMAR_PROCESS", "off")
        return LLM(str(path), **{**COMMON, **engine_args})


def _generate(
    path: Path,
    requests: list[tuple[list[list[int]], list[SamplingParams]]],
    graph_sampling: bool = True,
    **engine_args: object,
) -> list:
    """Each batch of requests in turn, from one engine: token ids (and logprobs' keys, where asked)."""
    llm = _engine(path, graph_sampling, **engine_args)
    try:
        out = []
        for prompts, params in requests:
            for o in llm.generate(prompts, params, use_tqdm=False):
                out.append((o.token_ids, [sorted(d) for d in o.logprobs] if o.logprobs else None))
        return out
    finally:
        llm.shutdown()


def _plain(n: int, seed: int, longer: int = 0) -> list[SamplingParams]:
    """Seeded temperature rows and greedy rows, of different lengths (the batch shrinks through buckets)."""
    return [
        SamplingParams(
            temperature=0.0 if i % 4 == 0 else 0.6 + i / 50,
            seed=seed + i,
            max_tokens=3 + i % 7 + longer,
            ignore_eos=True,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_draw_in_graphs_equals_eager_sampling(tiny_model: Path, dtype: str) -> None:
    vocab = 300  # tiny_model's prompts stay well inside its vocabulary
    batches = [(_prompts(vocab, n, seed=n), _plain(n, seed=100 * n)) for n in (1, 3, 8, 21, 37)]
    on = _generate(tiny_model, batches, dtype=dtype)
    off = _generate(tiny_model, batches, graph_sampling=False, dtype=dtype)
    assert on == off


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_plain_and_eager_rows_in_consecutive_steps(tiny_model: Path, dtype: str) -> None:
    """Filtered, penalised, logprobs, min_tokens and constrained rows stop early (max_tokens) beside plain rows
    that go on: steps alternate between the eager sampler over the graph's logits and the draw graph, and a
    filtered or constrained step still works after plain ones (the second batch)."""
    vocab = 300
    special = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.9, repetition_penalty=1.3, seed=3, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.5, logprobs=2, seed=4, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.7, min_tokens=4, seed=5, max_tokens=7),
        SamplingParams(regex=r"[a-z]{2,6}", temperature=0.8, seed=6, max_tokens=6),
    ]
    first = (_prompts(vocab, 14, seed=1), _plain(8, seed=7, longer=3) + special)
    plain_then_special = (_prompts(vocab, 6, seed=2), [*_plain(4, seed=9, longer=6), special[0], special[-1]])
    batches = [first, (_prompts(vocab, 5, seed=4), _plain(5, seed=11)), plain_then_special]
    on = _generate(tiny_model, batches, dtype=dtype)
    off = _generate(tiny_model, batches, graph_sampling=False, dtype=dtype)
    assert on == off


@pytest.mark.usefixtures("exact_fp32")
def test_greedy_graphs_equal_enforce_eager(tiny_model: Path) -> None:
    """float32: the graphed draw at temperature 0 (the kernel's first-of-the-best argmax) gives enforce_eager's
    greedy tokens (torch.argmax over eagerly computed logits)."""
    prompts = _prompts(300, 19, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=4 + i % 6, ignore_eos=True) for i in range(19)]
    on = _generate(tiny_model, [(prompts, params)], dtype="float32")
    eager = _generate(tiny_model, [(prompts, params)], dtype="float32", enforce_eager=True)
    assert on == eager


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cascade_variant(tiny_model: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests sharing a cached prefix decode through the cascade graphs, whose draw is the same draw graph."""
    monkeypatch.setenv("ASYNCLLM_CASCADE_ATTENTION", "auto")
    prompts = shared_prompts(300, 12)
    warm = (prompts[:1], _plain(1, seed=1))  # fills the prefix cache
    rest = (prompts[1:], _plain(11, seed=2))
    on = _generate(tiny_model, [warm, rest], dtype=dtype)
    assert on == _generate(tiny_model, [warm, rest], graph_sampling=False, dtype=dtype)


def test_lora_variant(tiny_model: Path, tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "a", tiny_model, 0, r=4)
    prompts = _prompts(300, 9, seed=6)
    params = _plain(9, seed=3)
    loras = ["a" if i % 2 else None for i in range(9)]

    def run(graph_sampling: bool = True) -> list[list[int]]:
        llm = _engine(tiny_model, graph_sampling, dtype="bfloat16", enable_lora=True, max_lora_rank=8)
        try:
            llm.add_lora("a", adapter)
            first = llm.generate(prompts, params, use_tqdm=False, lora=loras)
            plain = llm.generate(prompts[:3], params[:3], use_tqdm=False)  # no adapter row: the plain graphs
            return [o.token_ids for o in first + plain]
        finally:
            llm.shutdown()

    assert run() == run(graph_sampling=False)


def _graph_launches(path: Path, graph_sampling: bool = True) -> int:
    llm = _engine(path, graph_sampling, dtype="bfloat16")
    try:
        params = SamplingParams(temperature=0.7, seed=1, max_tokens=17, ignore_eos=True)
        llm.generate([[5, 6, 7]], params, use_tqdm=False)  # warm
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
        return sum(e.count for e in prof.key_averages() if e.key.startswith("cudaGraphLaunch"))
    finally:
        llm.shutdown()


def test_a_plain_decode_step_replays_the_draw_graph(tiny_model: Path) -> None:
    """17 tokens: a prefill step, then 16 decode steps, each one forward graph, and with the draw in graphs
    one draw graph more."""
    on, off = _graph_launches(tiny_model), _graph_launches(tiny_model, graph_sampling=False)
    assert off >= 16
    assert 16 <= on - off <= off
