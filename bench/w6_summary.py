"""One line per `w6_structured.py --host-timing` output file: the W1-style ratio, and for each run (schema,
plain) the decode and prompt steps' count and ms per step with the matchers' share (accept, fill), the
figures that say where a constrained step's time goes. Usage: python3 w6_summary.py FILE..."""

from __future__ import annotations

import json
import sys


def summary(path: str) -> str:
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.startswith("{")]
    final = next(line for line in lines if line.get("workload") == "W6")
    parts = [f"{path}: ratio {final['w1_ratio']} (b1 {final['b1_ratio']})"]
    for timing in (line for line in lines if line.get("workload") == "W6 host timing"):
        kinds = timing["by_kind"]
        for kind in ("decode", "prompt"):
            k = kinds.get(kind)
            if not k:
                continue
            extra = ""
            if "grammar_accept" in k:
                extra = f" accept {k['grammar_accept']['wall']} fill {k['grammar_fill']['wall']}"
            parts.append(f"{timing['run']} {kind} {k['steps']} x {k['step']['wall']} ms{extra}")
    return "; ".join(parts)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(summary(path))
