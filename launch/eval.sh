#!/usr/bin/env bash
# Evaluate every checkpoint of a training run on a suite and print a per-benchmark table.
#
#   bash launch/eval.sh RUN_DIR [extra `python -m eval run` flags ...]
#
# RUN_DIR is the run's checkpoint folder (trainer.default_local_dir, holding global_step_N/),
# e.g. runs/f1_format_s42/checkpoints for the CPU demo. Without RETRIEVER_URL a BM25 retriever
# over CORPUS is started on 127.0.0.1:RETRIEVER_PORT and stopped (by PID) when the script exits.
#
# Environment (defaults in brackets):
#   SUITE          suite folder/file or built-in name: fixtures | test | val          [fixtures]
#   LIMIT          rows per benchmark (seeded subsample); empty = all                 [4 for fixtures, else all]
#   OUT            results root; the run goes to OUT/<run>                           [results/eval_<suite>]
#   BACKEND        auto | hf | vllm                                                   [auto]
#   RETRIEVER_URL  running retrieval server(s), comma-separated; empty = start BM25   []
#   RETRIEVER_PORT port of the BM25 retriever this script starts                      [8010]
#   CORPUS         corpus of that retriever                                          [search_env/demo/wiki18_sample_1000.jsonl]
#   TIMEOUT_S      hard wall-clock limit of the evaluation in seconds; 0 = none        [0]
#   PYTHON         interpreter                                                        [.venv/bin/python if present]
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exit 2
fi
RUN_DIR="$1"; shift
if [[ ! -d "$RUN_DIR" ]]; then
  echo "error: RUN_DIR $RUN_DIR is not a folder (expected the run's checkpoints, with global_step_N/)" >&2
  exit 2
fi

PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON="python3"; fi
fi
SUITE="${SUITE:-fixtures}"
if [[ -z "${LIMIT+x}" ]]; then
  if [[ "$SUITE" == "fixtures" ]]; then LIMIT=4; else LIMIT=""; fi
fi
OUT="${OUT:-$REPO/results/eval_$(basename "${SUITE%.*}")}"
BACKEND="${BACKEND:-auto}"
RETRIEVER_URL="${RETRIEVER_URL:-}"
RETRIEVER_PORT="${RETRIEVER_PORT:-8010}"
CORPUS="${CORPUS:-$REPO/search_env/demo/wiki18_sample_1000.jsonl}"
TIMEOUT_S="${TIMEOUT_S:-0}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"

RETRIEVER_PID=""
LOG_DIR="$(mktemp -d)"
cleanup() {
  if [[ -n "$RETRIEVER_PID" ]] && kill -0 "$RETRIEVER_PID" 2>/dev/null; then
    kill "$RETRIEVER_PID" 2>/dev/null || true
    wait "$RETRIEVER_PID" 2>/dev/null || true
  fi
  rm -rf "$LOG_DIR"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

health() {  # health URL -> 0 when GET URL/health answers 200
  "$PYTHON" - "$1" <<'PY' 2>/dev/null
import sys, httpx
sys.exit(0 if httpx.get(sys.argv[1].rstrip("/") + "/health", timeout=2.0).status_code == 200 else 1)
PY
}

if [[ -z "$RETRIEVER_URL" ]]; then
  if [[ ! -f "$CORPUS" ]]; then
    echo "error: CORPUS $CORPUS not found; set CORPUS or RETRIEVER_URL" >&2
    exit 2
  fi
  if health "http://127.0.0.1:$RETRIEVER_PORT"; then
    echo "error: port $RETRIEVER_PORT already serves a retriever; set RETRIEVER_URL=http://127.0.0.1:$RETRIEVER_PORT to use it, or RETRIEVER_PORT to another port" >&2
    exit 2
  fi
  echo "starting BM25 retriever on 127.0.0.1:$RETRIEVER_PORT over $CORPUS"
  "$PYTHON" -m search_env serve --backend bm25 --corpus "$CORPUS" --host 127.0.0.1 --port "$RETRIEVER_PORT" \
    >"$LOG_DIR/retriever.log" 2>&1 &
  RETRIEVER_PID=$!
  RETRIEVER_URL="http://127.0.0.1:$RETRIEVER_PORT"
  for _ in $(seq 1 120); do
    if health "$RETRIEVER_URL"; then break; fi
    if ! kill -0 "$RETRIEVER_PID" 2>/dev/null; then
      echo "error: the retriever exited; its log:" >&2; cat "$LOG_DIR/retriever.log" >&2; exit 1
    fi
    sleep 0.5
  done
  if ! health "$RETRIEVER_URL"; then
    echo "error: the retriever is not healthy after 60 s; its log:" >&2; cat "$LOG_DIR/retriever.log" >&2; exit 1
  fi
fi

IFS=',' read -r -a URLS <<<"$RETRIEVER_URL"
CMD=("$PYTHON" -m eval run --run-dir "$RUN_DIR" --suite "$SUITE" --out "$OUT" --backend "$BACKEND"
     --retriever-url "${URLS[@]}")
if [[ -n "$LIMIT" ]]; then CMD+=(--limit "$LIMIT"); fi
CMD+=("$@")
if [[ "$TIMEOUT_S" != "0" ]]; then CMD=(timeout "$TIMEOUT_S" "${CMD[@]}"); fi

cd "$REPO"
echo "+ ${CMD[*]}"
"${CMD[@]}"
