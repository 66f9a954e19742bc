#!/usr/bin/env bash
# Check, without a GPU and without installing anything, that `pip install -e ".[gpu]"` resolves.
#
#   bash launch/check_gpu_install.sh            # ~1 min with a warm pip cache, ~1-3 min cold
#
# Chooses the interpreter (PYTHON [python3 on PATH]: the resolution is for its Python version and
# platform) and runs `python -m launch.doctor.install_verdict` (standard library only): a pip dry run
# in a throwaway venv, then the verdict. Exit status: 0 clean resolution with exactly one faiss,
# faiss-gpu, on its own CUDA runtime wheels, and no CPU-set package; 1 it does not resolve cleanly;
# 3 the package index was unreachable (twice) -- a network failure, not a verdict. TIMEOUT_S [600],
# RETRY_DELAY_S [10]; details: launch/doctor/install_verdict.py, docs/gpu.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || { echo "error: PYTHON=$PYTHON not found" >&2; exit 1; }
exec "$PYTHON" -m launch.doctor.install_verdict
