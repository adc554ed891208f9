"""Where start-up's `import` and `open` phases go (issue 45): a fresh interpreter imports torch, then opens a
checkpoint of a real shape (config, tokenizer) as `build_engine` does, under `python -X importtime`; prints the
seconds of each step and the modules with the most import time of their own (and cumulative), as one JSON line.

Usage (device machine, from bench/): python3 open_imports.py [--shape qwen3-0.6b] [--top 25]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = """
import time, json, sys
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from asyncllm.model_loader.checkpoint import open_checkpoint
t2 = time.perf_counter()
checkpoint = open_checkpoint(sys.argv[1], torch.float32)
t3 = time.perf_counter()
print(json.dumps({"import_torch_s": t1 - t0, "import_loader_s": t2 - t1, "open_s": t3 - t2,
                  "sklearn_imported": "sklearn" in sys.modules,
                  "modeling_utils_imported": "transformers.modeling_utils" in sys.modules,
                  "dtensor_imported": "torch.distributed.tensor" in sys.modules}))
"""
_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    from shapes import write_shape_dir

    model = write_shape_dir(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", _CHILD, str(model)], capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [(int(own), int(cum), len(pad) // 2, name) for own, cum, pad, name in _LINE.findall(done.stderr)]
    top_own = sorted(rows, reverse=True)[: args.top]
    top_cum = sorted(rows, key=lambda r: -r[1])[: args.top]
    result["top_own_s"] = [(name, round(own / 1e6, 3)) for own, _, _, name in top_own]
    result["top_cumulative_s"] = [(name, round(cum / 1e6, 3)) for _, cum, _, name in top_cum]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
