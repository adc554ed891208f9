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


def test_logprobs_reach_the_output(llm: LLM) -> None:
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
    # the first token's logprob is log_softmax of the prompt's last logits
    runner = llm._engine.core.executor
    model = runner.model
    from asyncllm.core.scheduler_output import ScheduledSeq, SchedulerOutput
    from asyncllm.runner.kv_cache import allocate_kv_cache

    scratch = allocate_kv_cache(runner.kv_spec, 2, runner.device)  # never touch the engine's own cache
    x = runner.inputs.prepare(SchedulerOutput(seqs=[ScheduledSeq("probe", [5, 6, 7], 0, [1], True)]))
    runner.backend.prepare(x.meta)
    with torch.inference_mode():
        logits = model.compute_logits(model(x.input_ids, x.positions, scratch, x.meta)[-1:]).float()
    ref = torch.log_softmax(logits[0], dim=-1)
    first = out[0].token_ids[0]
    assert abs(lps[0][first] - ref[first].item()) < 1e-5


def test_min_tokens_keeps_eos_out_of_the_output(tiny_checkpoints) -> None:
    """Regression: the runner built sampling states without the model's EOS ids, so EOS was sampled inside
    the output before min_tokens and generation ran on past it."""
    llm = LLM(str(tiny_checkpoints["qwen3"]), device="cpu", num_kv_blocks=64)
    eos = next(iter(llm.runtime.eos_token_ids))
    model = llm._engine.core.executor.model
    real = model.compute_logits

    def eos_first(hidden):  # make EOS the model's favourite at every step
        logits = real(hidden).clone()
        logits[:, eos] += 100.0
        return logits

    model.compute_logits = eos_first
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert free.token_ids == [eos] and free.finish_reason == "stop"
    held = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, min_tokens=4), use_tqdm=False)[0]
    assert eos not in held.token_ids[:4]
    assert held.token_ids[4:] == [eos] and held.finish_reason == "stop"


def test_interrupted_step_leaves_no_stale_prefix(tiny_checkpoints, monkeypatch) -> None:
    """Regression: a step interrupted before its forward pass (Ctrl-C) left prefix hashes pointing at blocks
    whose KV was never written; the same prompt then hit the cache and came out wrong, silently."""
    llm = LLM(str(tiny_checkpoints["qwen3"]), device="cpu", block_size=4, num_kv_blocks=64)
    prompt = list(range(5, 41))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runner = llm._engine.core.executor
    real = runner.execute_model

    def interrupted(scheduled):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "execute_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([prompt], params, use_tqdm=False)
    monkeypatch.setattr(runner, "execute_model", real)
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    fresh = LLM(str(tiny_checkpoints["qwen3"]), device="cpu", block_size=4, num_kv_blocks=64)
    assert again.token_ids == fresh.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


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
