#!/usr/bin/env bash
# Evaluate every checkpoint of a training run on a suite and print a per-benchmark table.
#
#   bash launch/eval.sh RUN_DIR [--recipe RECIPE] [hydra overrides ...] [[--] extra `python -m eval run` flags ...]
#   bash launch/eval.sh runs/f1_only_s44/checkpoints eval.suite=test eval.gpus=[0,1,2,3] retriever.urls=http://127.0.0.1:8000
#   GPUS=0,1,2,3 SUITE=test RETRIEVER_URL=http://127.0.0.1:8000 bash launch/eval.sh runs/f1_only_s44/checkpoints
#
# RUN_DIR is the run's checkpoint folder (trainer.default_local_dir, holding global_step_N/). The
# settings are the recipe's eval: and retriever: blocks (recipes/base.yaml), read from the run's
# saved recipe.yaml (else recipes/eval_sample.yaml, or --recipe) with the overrides, as training reads them.
# Without retriever.urls the retriever retriever: describes is started on 127.0.0.1:retriever.port
# and stopped (by PID) at the end; every retriever must answer one real POST /retrieve first. With
# eval.gpus, one `python -m eval run` per GPU on one results folder. Environment variables (SUITE,
# PLAN, LIMIT, OUT, BACKEND, GPUS, JUDGE_URL, JUDGE_MODEL, SAMPLES, TEMPERATURE, SAMPLE_SEED,
# TIMEOUT_S, RETRIEVER_URL, RETRIEVER_PORT, RETRIEVER_BACKEND, CORPUS, INDEX, ENCODER, RETRIEVER_GPU,
# RETRIEVER_AUTH_TOKEN_FILE) are aliases, one override each, and PYTHON picks the interpreter:
# bash launch/eval.sh --help (launch/evaluate.py).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
need_verl
launch_py eval "$@"
