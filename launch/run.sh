#!/usr/bin/env bash
# Train one recipe end to end: preflight, resume, demo assets, retriever, verl GRPO, clean-up.
#
#   bash launch/run.sh RECIPE.yaml [hydra overrides...]
#   bash launch/run.sh recipes/demo_cpu.yaml                                  # CPU demo, ~7 min
#   bash launch/run.sh recipes/demo_cpu.yaml trainer.total_training_steps=3   # resumes, trains step 3
#
# Environment: RLVR_RUN_DIR (run directory, default runs/<recipe name>), PYTHON (interpreter, else
# the active virtualenv / conda env / python on PATH, the repo's .venv only when those lack verl),
# RAY_ADDRESS (join a running Ray cluster), XDG_RUNTIME_DIR (the demo assets' lock).
# Killed as a whole: run the same command again; it resumes from the last complete checkpoint.
# What each step does and what the run directory holds: docs/training.md; the code: launch/train.py.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
need_verl
launch_py run "$@"
