#!/usr/bin/env bash
# Serve an LLM judge from a local model folder with vLLM's OpenAI-compatible server, in the
# foreground (Ctrl-C / SIGTERM stops it): vLLM's CPU build on a CPU machine, vLLM on a GPU.
#
#   bash launch/serve_judge.sh MODEL_DIR [extra vllm serve flags ...]
#   PORT=8001 JUDGE_MODEL=qwen2.5-7b bash launch/serve_judge.sh data/models/Qwen2.5-7B-Instruct
#   JUDGE_URL=http://127.0.0.1:8001/v1 JUDGE_MODEL=qwen2.5-7b bash launch/eval.sh RUN_DIR
#
# Environment (HOST [127.0.0.1], PORT [8001], JUDGE_MODEL [MODEL_DIR's name], MAX_MODEL_LEN [4096],
# GPU_MEMORY_UTILIZATION [0.85], PYTHON): bash launch/serve_judge.sh --help (launch/serve_judge.py).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m launch.serve_judge "$@"
