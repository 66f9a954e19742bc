#!/usr/bin/env bash
# The one script a lent GPU runs: every GPU-only path once, <= 10 minutes in all, each stage under
# its own timeout, and a Markdown report of what passed.
#
#   bash launch/gpu_smoke.sh                 # report: runs/gpu_smoke/report.md (SMOKE_DIR overrides)
#
# Chooses the interpreter (launch/_common.sh) and runs `python -m launch.doctor.gpu_smoke run`: the
# stages, their timeouts, the budget (BUDGET_S) and the report are there (launch/doctor/gpu_smoke.py,
# docs/gpu.md). Without a CUDA device it exits 2 at once; else 0 when every stage passed, 1 otherwise.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"
exec "$PYTHON" -m launch.doctor.gpu_smoke run
