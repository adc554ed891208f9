"""`LLM` as a user meets it: bad inputs raise `InvalidRequestError` naming the problem, nothing already
accepted is lost, the engine keeps serving; unknown engine arguments raise `TypeError`."""

from __future__ import annotations

import re
import time

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


def test_progress_bar_prefill_rate_is_over_the_prefill_steps(llm: LLM, capsys) -> None:
    """Regression: the prefill rate was prompt tokens over the whole run, so the decode steps after the
    prompts drove it towards 0 ("prefill 1 tok/s"). Over the steps that carried the prompts, it is far above
    prompt tokens over the whole run when 39 decode-only steps follow one prefill step."""
    prompts = [[5 + i] * 24 for i in range(4)]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=True)
    wall = time.perf_counter() - start
    shown = re.findall(r"prefill ([\d,]+) tok/s", capsys.readouterr().err)
    assert shown, "no prefill rate shown"
    assert int(shown[-1].replace(",", "")) > 3 * 96 / wall, (shown[-1], 96 / wall)


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


def test_logprobs_reach_the_output(llm: LLM, tiny_checkpoints) -> None:
    import torch

    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    out = llm.generate([[5, 6, 7], [8, 9]], [params, SamplingParams(temperature=0, max_tokens=2)], use_tqdm=False)
    assert out[1].logprobs is None
    lps = out[0].logprobs
    assert lps is not None and len(lps) == len(out[0].token_ids) == 4
    for token, lp in zip(out[0].token_ids, lps):
        assert token in lp and 1 <= len(lp) <= 4
        assert lp[token] == max(lp.values()), "greedy picks the most likely token"
        assert all(v <= 0.0 for v in lp.values())
    # every logprob is transformers' log_softmax at that position (teacher-forced along our greedy path)
    from tests.models.helpers import load_reference, reference_logits

    hf = load_reference(tiny_checkpoints["qwen3"])
    seq = torch.tensor([5, 6, 7, *out[0].token_ids])
    ref = torch.log_softmax(reference_logits(hf, seq)[2:-1].float(), dim=-1)  # positions predicting each output
    for row, lp in zip(ref, lps):
        for token, value in lp.items():
            assert abs(value - row[token].item()) < 1e-5


def test_min_tokens_keeps_eos_out_of_the_output(tmp_path) -> None:
    """Regression: the runner built sampling states without the model's EOS ids, so EOS was sampled inside
    the output before min_tokens and generation ran on past it.

    The checkpoint makes EOS the greedy choice at every step: every LM-head row is the same random vector, so
    all logits tie and greedy takes the lowest id, which the checkpoint names as its EOS."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from tests.fixtures.tiny_models import build_checkpoint

    path = build_checkpoint(tmp_path / "eos_first", "qwen3", tie_word_embeddings=False)
    weights = load_file(path / "model.safetensors")
    row = torch.randn(weights["lm_head.weight"].shape[1])
    weights["lm_head.weight"] = row.expand_as(weights["lm_head.weight"]).contiguous()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    llm = LLM(str(path), device="cpu", num_kv_blocks=64)
    eos = 0
    assert llm.runtime.eos_token_ids == {eos}
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert free.token_ids == [eos] and free.finish_reason == "stop"
    held = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, min_tokens=4), use_tqdm=False)[0]
    assert eos not in held.token_ids[:4]
    assert held.token_ids[4:] == [eos] and held.finish_reason == "stop"


def test_prompts_in_one_batch_share_their_prefix(tiny_checkpoints) -> None:
    """Regression: with registration deferred to after the step, prompts admitted together recomputed their
    common prefix; they must hit it within the same step, and still give the uncached outputs."""
    shared = list(range(10, 46))
    prompts = [[*shared, 50 + i, 60 + i, 70 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cached = LLM(str(tiny_checkpoints["qwen3"]), device="cpu", block_size=4, num_kv_blocks=128)
    outs = cached.generate(prompts, params, use_tqdm=False)
    assert cached.stats()["prefix_cache_hit_rate"] > 0.5
    plain = LLM(
        str(tiny_checkpoints["qwen3"]), device="cpu", block_size=4, num_kv_blocks=128, enable_prefix_caching=False
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]


def test_priorities_order_a_batch_that_does_not_fit_at_once(tiny_checkpoints) -> None:
    """`LLM.generate(..., priority=[...])` (vLLM's offline form): with one sequence at a time, the prompts
    run lowest priority value first (arrival order among equals); results stay in prompt order."""
    llm = LLM(str(tiny_checkpoints["qwen3"]), device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=1)
    try:
        prompts = [[5, 6, 7 + i] for i in range(5)]
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False, priority=[3, 1, 2, 1, 0])
        assert [o.prompt_token_ids for o in outs] == prompts
        ttft = [o.metrics.time_to_first_token for o in outs if o.metrics is not None]
        assert sorted(range(5), key=lambda i: ttft[i]) == [4, 1, 3, 2, 0]
        with pytest.raises(InvalidRequestError, match="2 priorities"):
            llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])
        with pytest.raises(InvalidRequestError, match=r"priority=1\.5 is invalid"):
            llm.generate(prompts[:1], params, use_tqdm=False, priority=[1.5])  # type: ignore[list-item]
    finally:
        llm.shutdown()
