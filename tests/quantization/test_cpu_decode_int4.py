"""The CPU decode path (models/cpu_decode.py) over packed int4 layers in the whole engine: a tiny GGUF's greedy
decode steps take it, with its small ops in C (ASYNCLLM_CPU_NATIVE=auto, kernels/cpu_decode_ops.c) and in torch
(off), and every step's top log-probabilities stay within the bfloat16 bound of the modules' path
(ASYNCLLM_CPU_DECODE=off), the bound tests/quantization/test_cpu_int4.py holds the int4 path to."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from asyncllm import LLM, SamplingParams, envs
from asyncllm.kernels import cpu_decode_native
from asyncllm.quantization import cpu_int4
from tests.fixtures.tiny_gguf import build_hf_model, write_gguf

pytestmark = pytest.mark.skipif(not cpu_int4.supported(), reason="no native bfloat16 on this CPU")
# One CPU thread, as on a 2-core machine by default: the Q8_0 head's C path is taken on one thread only.
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=96, max_num_batched_tokens=64, num_threads=1)


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every weight Q8_0, the embedding tied to the head: the head reads the embedding's codes (Q8Head)."""
    root = tmp_path_factory.mktemp("cpu_decode_q8")
    model = build_hf_model("llama", vocab_size=128, intermediate_size=128, tie_word_embeddings=True)
    return write_gguf(root / "llama-Q8_0.gguf", "llama", model, quant=Q.Q8_0)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cpu_decode")
    model = build_hf_model("llama", vocab_size=128, intermediate_size=128, tie_word_embeddings=True)
    return write_gguf(root / "llama-Q4_1.gguf", "llama", model, quant=Q.Q4_1)


PROMPTS = [[(i * 37 + 11) % 120 + 3 for i in range(9)], [(i * 53 + 5) % 120 + 3 for i in range(9)]]
Decoded = tuple[list[list[int]], list[list[dict]], int]


def _decode_logprobs(
    path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, native: str = "off", prompts: int = 1
) -> Decoded:
    """Each prompt's greedy tokens and top log-probabilities, and how many steps the decode path took (with
    `native` on, how many its C ops computed). Prompts of one length decode together: two make steps of two rows."""
    monkeypatch.setenv("ASYNCLLM_CPU_INT4", "auto")
    monkeypatch.setenv("ASYNCLLM_CPU_DECODE", mode)
    monkeypatch.setenv("ASYNCLLM_CPU_NATIVE", native)
    llm = LLM(str(path), **ENGINE)
    try:
        model = llm._engine.core.executor.worker.runner.model  # type: ignore[attr-defined]
        fast, taken = model.cpu_decode, []
        if fast is not None and fast.native is not None:  # counts the steps the C ops computed
            c_ops = fast.native
            fast.native = lambda *args: (lambda out: taken.append(out is not None) or out)(c_ops(*args))
        elif fast is not None:
            model.cpu_decode = lambda *args: taken.append(True) or fast(*args)  # counts the steps it takes
        params = SamplingParams(temperature=0, max_tokens=12, logprobs=8, ignore_eos=True)
        outs = llm.generate(PROMPTS[:prompts], params, use_tqdm=False)
        return [o.token_ids for o in outs], [o.logprobs for o in outs], sum(taken)
    finally:
        llm.shutdown()


def _within_bf16_bound(fast: Decoded, ref: Decoded) -> None:
    for tokens, ref_tokens, got_steps, want_steps in zip(fast[0], ref[0], fast[1], ref[1]):
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        for got, want in zip(got_steps[: same + 1], want_steps[: same + 1]):  # while both follow the same tokens
            scale = max(abs(v) for v in want.values())
            tol = 2 * (0.03 * scale + 0.05)
            shared = set(got) & set(want)
            assert shared and max(abs(got[t] - want[t]) for t in shared) <= tol


def _builds_in_c() -> bool:
    return cpu_decode_native.load(envs.cache_home() / "cpu-kernels") is not None


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C ops built into this test's cache directory, not the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize("native", ["auto", "off"])
def test_engine_decode_within_bf16_bound_of_the_modules(
    gguf_file: Path, native: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="asyncllm"):
        fast = _decode_logprobs(gguf_file, monkeypatch, "auto", native)
    assert ("small ops in C" in caplog.text) == (native == "auto" and _builds_in_c())
    ref = _decode_logprobs(gguf_file, monkeypatch, "off")
    assert fast[2] >= 11 and ref[2] == 0  # every decode step after the prompt's (and the warm-up's)
    _within_bf16_bound(fast, ref)


def test_small_ops_in_c_on_steps_of_two_rows(gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sequences a step (their own blocks and slots, one length): the C ops against torch's."""
    if not _builds_in_c():
        pytest.skip("no C compiler builds kernels/cpu_decode_ops.c here")
    fast = _decode_logprobs(gguf_file, monkeypatch, "auto", "auto", prompts=2)
    ref = _decode_logprobs(gguf_file, monkeypatch, "auto", "off", prompts=2)
    assert fast[2] >= 11 and ref[2] >= 11
    _within_bf16_bound(fast, ref)


def test_q8_head_within_bf16_bound(
    q8_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A tied Q8_0 head read from the embedding's codes in C (one CPU thread), against the packed int4 head."""
    if not _builds_in_c():
        pytest.skip("no C compiler builds kernels/cpu_decode_ops.c here")
    with caplog.at_level(logging.INFO, logger="asyncllm"):
        fast = _decode_logprobs(q8_file, monkeypatch, "auto", "auto")
    assert "the LM head reads the embedding's 8-bit codes" in caplog.text
    ref = _decode_logprobs(q8_file, monkeypatch, "auto", "off")
    assert fast[2] >= 11 and ref[2] >= 11
    _within_bf16_bound(fast, ref)
