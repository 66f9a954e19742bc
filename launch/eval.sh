#!/usr/bin/env bash
# Evaluate every checkpoint of a training run on a suite and print a per-benchmark table.
#
#   bash launch/eval.sh RUN_DIR [extra `python -m eval run` flags ...]
#   GPUS=0,1,2,3 SUITE=test RETRIEVER_URL=http://127.0.0.1:8000 bash launch/eval.sh runs/f1_only_s44/checkpoints
#
# RUN_DIR is the run's checkpoint folder (trainer.default_local_dir, holding global_step_N/).
# Without RETRIEVER_URL a retriever over CORPUS is started on 127.0.0.1:RETRIEVER_PORT (BM25, or
# dense with INDEX and ENCODER) and stopped (by PID) at the end; every retriever must answer one
# real POST /retrieve first. With GPUS, one `python -m eval run` per GPU on one results folder.
# Environment (SUITE, PLAN, LIMIT, OUT, BACKEND, GPUS, JUDGE_URL, JUDGE_MODEL, SAMPLES, TEMPERATURE,
# SAMPLE_SEED, RETRIEVER_URL, RETRIEVER_PORT, CORPUS, INDEX, ENCODER, RETRIEVER_GPU,
# RETRIEVER_AUTH_TOKEN_FILE, TIMEOUT_S, PYTHON): bash launch/eval.sh --help
# (launch/evaluate.py). RETRIEVER_AUTH_TOKEN_FILE (a bearer-token file, mode 600) is passed as
# --auth-token-file to the retriever started here and sent by every probe and search.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
need_verl
launch_py eval "$@"
