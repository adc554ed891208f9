"""Speculative decoding's host drafters on CPU (issue 41): SmolLM2-135M (`asyncllm fetch-model`), greedy,
batch 1, on copy-heavy prompts (correct or rewrite a given passage), tokens per second without speculation and
with each method (`ngram`, `suffix`), the runs alternating; each method's acceptance rate (accepted drafts /
drafts) and the tokens a verifying step gave, per round: from the second round on, `suffix` also finds the
earlier rounds' outputs (an agent sending the same request again). Checks the outputs are the same tokens.

    .venv/bin/python bench/spec_ngram.py [--model PATH] [--k 4] [--max-tokens 256] [--rounds 2]
        [--methods ngram suffix]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from asyncllm import LLM, SamplingParams

PASSAGES = [
    "The city council met on tuesday evening to discuss the new budget for the comming year. Several members "
    "expressed concern about the rising cost of road maintenance, which has grown by nearly twenty percent "
    "since the last review. The mayor argued that the roads are the backbone of the local economy and that "
    "delaying repairs would only make them more expensive later. Others pointed out that the library, the "
    "parks and the public swimming pool have all seen their funding cut twice in three years, and that "
    "residents have started to notice. After a long debate the council agreed to set up a small working group "
    "that will look at both questions and report back before the end of next month. The group will include "
    "two council members, a representative of the local business association and three residents chosen at "
    "random from the electoral roll. The meeting ended shortly after ten oclock, and the next session is "
    "planned for the first week of march, when the final version of the budget will be put to a vote.",
    "def parse_config(path):\n    with open(path) as f:\n        lines = f.readlines()\n    config = {}\n"
    "    for line in lines:\n        line = line.strip()\n        if not line or line.startswith('#'):\n"
    "            continue\n        key, value = line.split('=', 1)\n        config[key.strip()] = value.strip()\n"
    "    return config\n\n\ndef merge_configs(base, override):\n    result = dict(base)\n"
    "    for key, value in override.items():\n        if key in result and isinstance(result[key], dict):\n"
    "            result[key] = merge_configs(result[key], value)\n        else:\n            result[key] = value\n"
    "    return result\n\n\ndef load_all(paths):\n    config = {}\n    for path in paths:\n"
    "        config = merge_configs(config, parse_config(path))\n    return config\n",
    "Our team has spent the last six months building a new system for tracking orders across all of our "
    "warehouses. Before this project, each warehouse kept its own spreadsheet, and it could take several days "
    "to find out where a customers order actually was. The new system collects every scan from every "
    "warehouse in one place, so that anyone in the company can see the status of an order within seconds. "
    "During the first month we found a number of problems: some scanners sent duplicate events, some "
    "warehouses used different codes for the same product, and the reports were too slow when many people "
    "opened them at once. We fixed the duplicates by giving every scan a unique number, agreed on one list of "
    "product codes, and moved the reports to a separate database that is updated every few minutes. Since "
    "then the number of support tickets about lost orders has fallen by more than half.",
]
INSTRUCTIONS = [
    "Correct the spelling and punctuation of this passage. Reply with the whole corrected passage only.",
    "Rename the function parse_config to read_config everywhere in this code. Reply with the whole code only.",
    "Rewrite this passage in the past perfect tense where it fits. Reply with the whole passage only.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: `asyncllm fetch-model`'s SmolLM2-135M")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--methods", nargs="+", choices=["ngram", "suffix"], default=["ngram", "suffix"])
    args = parser.parse_args()
    model = (
        args.model
        or subprocess.run(
            [str(Path(sys.executable).parent / "asyncllm"), "fetch-model"], capture_output=True, text=True, check=True
        ).stdout.split()[-1]
    )
    specs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
        "suffix": {"method": "suffix", "num_speculative_tokens": args.k},
    }
    engines = {"off": LLM(model)} | {m: LLM(model, speculative_config=specs[m]) for m in args.methods}
    chat = engines["off"]
    prompts = [
        chat.apply_chat_template([{"role": "user", "content": f"{i}\n\n{p}"}]) for i, p in zip(INSTRUCTIONS, PASSAGES)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    rounds: dict[str, list[str]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            before = llm.stats()
            tokens = 0
            t0 = time.perf_counter()
            outs = []
            for prompt in prompts:  # batch 1
                out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
                outs.append(out)
                tokens += len(out)
            rates[name].append(tokens / (time.perf_counter() - t0))
            outputs[name] = outs
            after = llm.stats()
            num_steps = int(after["num_steps"] - before["num_steps"])
            drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            rounds[name].append(
                f"{rates[name][-1]:.1f} tok/s, {num_steps} steps, {tokens / max(num_steps, 1):.2f} tokens a step"
                + (f", accepted {accepted}/{drafts} = {accepted / max(drafts, 1):.2f}" if name != "off" else "")
            )
    off = statistics.median(rates["off"])
    print(f"model {model}, greedy, batch 1, {len(prompts)} prompts x {args.max_tokens} tokens, k={args.k}")
    for name in engines:
        rate = statistics.median(rates[name])
        same = outputs[name] == outputs["off"]
        print(f"{name:>6}: {rate:7.1f} tok/s median, {rate / off:.2f}x of off (target >= 1.5x); same tokens: {same}")
        for i, line in enumerate(rounds[name]):
            print(f"        round {i + 1}: {line}")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
