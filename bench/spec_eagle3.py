"""EAGLE-3's costs on the Qwen3-8B shape (issue 41's third GPU row): what drafting with a head and verifying its
drafts cost a batch-1 step, and the speedup those costs give at the acceptance lengths the published heads
report (about 3 tokens a step for Qwen3-8B), since a random head's drafts are never right.

Three engines on the same random target weights (load_format="dummy"), greedy, one request at a time:
- plain: no speculation (overlapped scheduling, the W5 path): ms per step, one token each;
- verify: the host oracle of spec_oracle.py (every draft right, k a step): a step verifying 1 + k tokens
  without any draft model, so its ms per step is verification's cost alone;
- eagle3: a random EAGLE-3 head saved as the published ones are (tests/fixtures/eagle3_heads.py: 32,000-id
  draft vocabulary, aux layers low / middle / high), its k drafts a step verified (none accepted: each step
  gives one token). The adaptive cap is pinned at k (a bench's reach into the engine, not an API) so every
  step drafts and verifies k tokens, as it would while the head's drafts are being accepted.

draft cost = eagle3 step - verify step. Projected ms per token at an acceptance length L (tokens a step,
accepted drafts + 1) = eagle3 step / L; speedup = plain step * L / eagle3 step.

    python3 bench/spec_eagle3.py [--shape qwen3-8b] [--k 3] [--tokens 128]     (CUDA)
    python3 bench/spec_eagle3.py --shape qwen3-tiny --device cpu --tokens 8 --rounds 1   (a CPU smoke run)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

from engine_args import add_engine_arg_option, engine_kwargs
from shapes import write_shape_dir
from spec_oracle import PROMPT, Replay, decode_timing

from asyncllm import LLM, SamplingParams
from asyncllm.core.spec import speculation
from asyncllm.core.spec.adaptive import AdaptiveDrafter

ROOT = str(Path(__file__).resolve().parents[1])  # the repository root: tests.fixtures
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from tests.fixtures.eagle3_heads import build_eagle3_head  # noqa: E402


def run_engine(model_dir: Path, common: dict[str, Any], tokens: int, rounds: int) -> dict[str, Any]:
    llm = LLM(str(model_dir), **common)
    try:
        llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        return decode_timing(llm, tokens, rounds)
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens a run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=32000, help="the head's draft vocabulary")
    ap.add_argument("--lengths", type=float, nargs="+", default=[2.0, 3.0, 3.5], help="acceptance lengths")
    add_engine_arg_option(ap)
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp())
    model_dir = write_shape_dir(args.shape, root / args.shape)
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    aux = [min(2, layers - 1), layers // 2, max(layers - 3, 0)]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    head = build_eagle3_head(
        root / "eagle3-head",
        model_dir,
        draft_vocab_size=min(args.draft_vocab, vocab),
        eagle_config={"eagle_aux_hidden_state_layer_ids": aux},
        torch_dtype="bfloat16",
    )
    common: dict[str, Any] = dict(device=args.device, load_format="dummy", max_model_len=4096, num_kv_blocks=512)
    common |= engine_kwargs(args.engine_arg)
    plain = run_engine(model_dir, common, args.tokens, args.rounds)
    oracle = Replay(plain["token_ids"], len(PROMPT), args.k)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k}  # its drafter is the oracle instead
    with mock.patch.object(speculation, "make_drafter", lambda config: oracle):
        verify = run_engine(model_dir, common | {"speculative_config": ngram}, args.tokens, args.rounds)
    eagle = {"method": "eagle3", "model": str(head), "num_speculative_tokens": args.k}
    with mock.patch.object(AdaptiveDrafter, "cap", lambda self, request_id: self.num_tokens):
        drafted = run_engine(model_dir, common | {"speculative_config": eagle}, args.tokens, args.rounds)
    plain_step, verify_step, eagle_step = plain["ms_per_step"], verify["ms_per_step"], drafted["ms_per_step"]
    row: dict[str, Any] = {
        "bench": "spec_eagle3",
        "shape": args.shape,
        "device": args.device,
        "k": args.k,
        "plain_ms_per_step": plain_step,
        "verify_ms_per_step": verify_step,
        "eagle3_ms_per_step": eagle_step,
        "draft_ms_per_step": round(eagle_step - verify_step, 4),
        "verify_step_ratio": round(verify_step / plain_step, 3),
        "eagle3_step_ratio": round(eagle_step / plain_step, 3),
        "oracle_tokens_per_step": round((len(verify["token_ids"]) - 1) / max(verify["steps"], 1), 2),
        "eagle3_tokens_per_step": round((len(drafted["token_ids"]) - 1) / max(drafted["steps"], 1), 2),
        "same_tokens": verify["token_ids"] == plain["token_ids"] == drafted["token_ids"],
    }
    for length in args.lengths:
        row[f"speedup_at_{length:g}"] = round(plain_step * length / eagle_step, 3)
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
