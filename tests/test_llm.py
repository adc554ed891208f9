"""`LLM` as a user meets it: bad inputs raise `InvalidRequestError` naming the problem, nothing already
accepted is lost, the engine keeps serving; unknown engine arguments raise `TypeError`."""

from __future__ import annotations

import pytest

from asyncllm import LLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:
    return LLM(str(tiny_checkpoints["qwen3"]), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=128)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", None, "prompt is empty"),
        ([], None, "empty"),
        ([1, 2, 10_000], None, "outside the vocabulary"),
        ([1, -1], None, "outside the vocabulary"),
        ([1, "x"], None, "integers"),
        ([1] * 120, SamplingParams(min_tokens=20), "max_model_len"),
        ([1] * 300, None, "KV cache"),
        ("hi", {"temperature": 0}, "SamplingParams"),
        (3.5, None, "prompt must be"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(llm: LLM, prompt, params, message: str) -> None:
    good = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([[5, 6, 7], prompt], [good, params] if params is not None else good, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_waiting"] == stats["num_running"] == 0, "a rejected batch must queue nothing"
    out = llm.generate([[5, 6, 7]], good, use_tqdm=False)
    assert len(out[0].token_ids) == 3


def test_bad_sampling_value_names_the_field() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_unknown_engine_argument_is_a_type_error(tiny_checkpoints) -> None:
    with pytest.raises(TypeError, match="max_num_seq'"):
        LLM(str(tiny_checkpoints["qwen3"]), max_num_seq=4)


def test_params_list_must_match_prompts(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="2 prompts but 3"):
        llm.generate([[1], [2]], [SamplingParams()] * 3, use_tqdm=False)


def test_progress_bar_reports_token_rates(llm: LLM, capsys) -> None:
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=True)
    err = capsys.readouterr().err
    assert "2/2" in err and "prefill" in err and "decode" in err and "tok/s" in err


def test_seeded_sampling_is_reproducible_across_batches(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=5)
    mixed = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [others, params, others], use_tqdm=False)[1].token_ids
    assert alone == mixed


def test_min_tokens_and_stop_token_ids(llm: LLM) -> None:
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    first = greedy[0].token_ids[0]
    stopped = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[first]), use_tqdm=False
    )
    assert stopped[0].token_ids == [first] and stopped[0].finish_reason == "stop"
    held = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, min_tokens=3, stop_token_ids=[first]), use_tqdm=False
    )[0]
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_chat_template_gives_ids_the_engine_accepts(llm: LLM) -> None:
    ids = llm.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert ids == llm.tokenizer("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n").input_ids
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert out[0].prompt_token_ids == ids
