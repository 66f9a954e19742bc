#!/usr/bin/env bash
# Evaluate every checkpoint of a training run on a suite and print a per-benchmark table.
#
#   bash launch/eval.sh RUN_DIR [extra `python -m eval run` flags ...]
#   GPUS=0,1,2,3 SUITE=test RETRIEVER_URL=http://127.0.0.1:8000 bash launch/eval.sh runs/f1_only_s44/checkpoints
#
# RUN_DIR is the run's checkpoint folder (trainer.default_local_dir, holding global_step_N/),
# e.g. runs/demo_cpu/checkpoints for the CPU demo. Without RETRIEVER_URL a retriever over CORPUS
# is started on 127.0.0.1:RETRIEVER_PORT (BM25, or dense with INDEX and ENCODER: its faiss index on
# the GPU(s) where it fits on a GPU node) and stopped (by PID) when the script exits;
# every retriever must answer one real POST /retrieve before anything is evaluated.
# With GPUS, one `python -m eval run` per listed GPU (CUDA_VISIBLE_DEVICES=<id>) works on the same
# results folder: each takes the checkpoints no other holds (per-checkpoint locks), and the table
# is printed once all are done; their logs are OUT/<run dir name>.gpu<id>.log.
#
# Environment (defaults in brackets):
#   SUITE          suite folder/file or built-in name: fixtures | test | val          [fixtures]
#   PLAN           auto | full | sequential (screen every checkpoint, confirm the few
#                  that may be best; docs/evaluation.md)                              [auto: sequential on a GPU]
#   LIMIT          rows per benchmark (seeded subsample); empty = all; full plan only [4 for fixtures, else all]
#   OUT            results root; the run goes to OUT/<run>                           [results/eval_<suite>]
#   BACKEND        auto | hf | vllm                                                   [auto]
#   GPUS           comma-separated GPU ids, one evaluation process each; empty = one  []
#   RETRIEVER_URL  running retrieval server(s), comma-separated; empty = start one    []
#   RETRIEVER_PORT port of the retriever this script starts                           [8010]
#   CORPUS         corpus of that retriever                                          [search_env/retrieval/data/wiki18_sample_1000.jsonl]
#   INDEX, ENCODER with both: that retriever is dense (this faiss index over CORPUS + this E5
#                  encoder folder) instead of BM25                                    []
#   RETRIEVER_GPU  its --gpu: on = the index on the GPU(s) where it fits in free memory (else CPU,
#                  logged), auto = index on CPU (training's placement), off = all CPU [on when torch sees a GPU, else auto]
#   TIMEOUT_S      hard wall-clock limit of the evaluation in seconds; 0 = none        [0]
#   PYTHON         interpreter [the active venv / conda env / python on PATH; the repo's .venv
#                  only when those cannot import verl] (the first line printed names it)
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
need_verl
RUN_DIR="$1"; shift
if [[ ! -d "$RUN_DIR" ]]; then
  echo "error: RUN_DIR $RUN_DIR is not a folder (expected the run's checkpoints, with global_step_N/)" >&2
  exit 2
fi

SUITE="${SUITE:-fixtures}"
PLAN="${PLAN:-auto}"
if [[ -z "${LIMIT+x}" ]]; then
  if [[ "$SUITE" == "fixtures" && "$PLAN" != "sequential" ]]; then LIMIT=4; else LIMIT=""; fi
fi
OUT="${OUT:-$ROOT/results/eval_$(basename "${SUITE%.*}")}"
BACKEND="${BACKEND:-auto}"
GPUS="${GPUS:-}"
RETRIEVER_URL="${RETRIEVER_URL:-}"
RETRIEVER_PORT="${RETRIEVER_PORT:-8010}"
CORPUS="${CORPUS:-$ROOT/search_env/retrieval/data/wiki18_sample_1000.jsonl}"
INDEX="${INDEX:-}"
ENCODER="${ENCODER:-}"
TIMEOUT_S="${TIMEOUT_S:-0}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"

RETRIEVER_PID=""
WORKER_PIDS=()
LOG_DIR="$(mktemp -d)"
cleanup() {
  local pid
  for pid in "${WORKER_PIDS[@]}"; do stop_pid "$pid" 10; done
  if [[ -n "$RETRIEVER_PID" ]]; then stop_pid "$RETRIEVER_PID" 10; fi
  rm -rf "$LOG_DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [[ -z "$RETRIEVER_URL" ]]; then
  if [[ ! -f "$CORPUS" ]]; then
    echo "error: CORPUS $CORPUS not found; set CORPUS or RETRIEVER_URL" >&2
    exit 2
  fi
  if wait_health "http://127.0.0.1:$RETRIEVER_PORT" 1; then
    echo "error: port $RETRIEVER_PORT already serves a retriever; set RETRIEVER_URL=http://127.0.0.1:$RETRIEVER_PORT to use it, or RETRIEVER_PORT to another port" >&2
    exit 2
  fi
  SERVE=(--backend bm25)
  STARTUP_S=60
  if [[ -n "$INDEX$ENCODER" ]]; then
    if [[ ! -f "$INDEX" || ! -f "$ENCODER/config.json" ]]; then
      echo "error: a dense retriever needs INDEX (a faiss index file, got '$INDEX') and ENCODER (a model folder with config.json, got '$ENCODER')" >&2
      exit 2
    fi
    if [[ -z "${RETRIEVER_GPU:-}" ]]; then  # evaluation's placement: the index on the GPU(s) of a GPU node
      RETRIEVER_GPU=auto
      if "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then RETRIEVER_GPU=on; fi
    fi
    SERVE=(--backend dense --index "$INDEX" --encoder "$ENCODER" --gpu "$RETRIEVER_GPU")
    STARTUP_S=1800  # reading (and copying to the GPU) the 16 GB wiki-18 index takes minutes
  fi
  echo "starting retriever ${SERVE[*]} on 127.0.0.1:$RETRIEVER_PORT over $CORPUS"
  "$PYTHON" -m search_env serve "${SERVE[@]}" --corpus "$CORPUS" --host 127.0.0.1 --port "$RETRIEVER_PORT" \
    >"$LOG_DIR/retriever.log" 2>&1 &
  RETRIEVER_PID=$!
  RETRIEVER_URL="http://127.0.0.1:$RETRIEVER_PORT"
  if ! wait_health "$RETRIEVER_URL" "$STARTUP_S" "$RETRIEVER_PID"; then
    echo "error: the retriever did not become healthy within $STARTUP_S s; its log:" >&2
    cat "$LOG_DIR/retriever.log" >&2
    exit 1
  fi
fi

IFS=',' read -r -a URLS <<<"$RETRIEVER_URL"
for url in "${URLS[@]}"; do
  if ! PROBE="$(probe_retrieve "$url" 0)"; then
    echo "error: retriever $url failed its test search: $PROBE" >&2
    exit 1
  fi
done
CMD=("$PYTHON" -m eval run --run-dir "$RUN_DIR" --suite "$SUITE" --out "$OUT" --backend "$BACKEND"
     --plan "$PLAN" --retriever-url "${URLS[@]}")
if [[ -n "$LIMIT" ]]; then CMD+=(--limit "$LIMIT"); fi
CMD+=("$@")
if [[ "$TIMEOUT_S" != "0" ]]; then CMD=(timeout "$TIMEOUT_S" "${CMD[@]}"); fi

cd "$ROOT"
if [[ -z "$GPUS" ]]; then
  echo "+ ${CMD[*]}"
  "${CMD[@]}"
  exit $?
fi

# One process per GPU on one results folder; the first one's output (the whole table) is printed.
IFS=',' read -r -a GPU_LIST <<<"$GPUS"
mkdir -p "$OUT"
LOGS=()
for gpu in "${GPU_LIST[@]}"; do
  LOGS+=("$OUT/$(basename "$(cd "$RUN_DIR" && pwd)").gpu$gpu.log")
  echo "+ CUDA_VISIBLE_DEVICES=$gpu ${CMD[*]}   > ${LOGS[-1]}"
  CUDA_VISIBLE_DEVICES="$gpu" "${CMD[@]}" >"${LOGS[-1]}" 2>&1 &
  WORKER_PIDS+=($!)
done
RC=0
for i in "${!WORKER_PIDS[@]}"; do
  if ! wait "${WORKER_PIDS[$i]}"; then
    RC=1
    echo "error: the evaluation on GPU ${GPU_LIST[$i]} failed; last lines of ${LOGS[$i]}:" >&2
    tail -n 20 "${LOGS[$i]}" >&2
  fi
done
WORKER_PIDS=()
if ((RC == 0)); then sed -n '/^| step/,$p' "${LOGS[0]}"; fi
exit "$RC"
