#!/usr/bin/env bash
# Start the retrieval server in the foreground (Ctrl-C / SIGTERM stops it).
#
#   bash launch/serve_retriever.sh                      # BM25 over the bundled 1,000-passage demo corpus
#   BACKEND=dense CORPUS=data/wiki-18.jsonl INDEX=data/e5_IVF4096_SQ8.index ENCODER=models/e5-base-v2 \
#     bash launch/serve_retriever.sh                    # the paper's E5 + IVF4096,SQ8 retriever
#
# Environment (defaults in brackets): BACKEND [bm25], CORPUS [bundled demo], INDEX, ENCODER (dense only),
# BM25_INDEX (optional saved bm25s dir), HOST [127.0.0.1], PORT [8000], NPROBE [64], TOPK [5],
# GPU [auto|on|off: auto = the encoder on CUDA when visible, the faiss index on CPU (training); on = the
# index on the GPU(s) where it fits (evaluation), docs/retrieval.md], MAX_BATCH [256], MAX_WAIT_MS [2],
# PYTHON [the active virtualenv / conda env / python on PATH; the repo's .venv only when those lack verl].
# Extra arguments are passed to `python -m search_env.retrieval serve`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"
BACKEND="${BACKEND:-bm25}"
args=(serve --backend "$BACKEND" --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" --topk "${TOPK:-5}"
      --max-batch "${MAX_BATCH:-256}" --max-wait-ms "${MAX_WAIT_MS:-2}" --gpu "${GPU:-auto}")

need_file() {  # need_file VAR PATH: fail with a clear message when PATH is missing
  if [ -z "$2" ] || [ ! -e "$2" ]; then
    echo "serve_retriever.sh: $1='${2}' does not exist (see docs/retrieval.md; launch/prepare.sh fetches it)" >&2
    exit 2
  fi
}

if [ -n "${CORPUS:-}" ]; then need_file CORPUS "$CORPUS"; args+=(--corpus "$CORPUS"); fi
case "$BACKEND" in
  bm25)
    if [ -n "${BM25_INDEX:-}" ]; then args+=(--bm25-index "$BM25_INDEX"); fi ;;
  dense)
    need_file CORPUS "${CORPUS:-}"
    need_file INDEX "${INDEX:-}"
    need_file ENCODER "${ENCODER:-}"
    args+=(--index "$INDEX" --encoder "$ENCODER" --nprobe "${NPROBE:-64}") ;;
  *) echo "serve_retriever.sh: BACKEND must be bm25 or dense, got '$BACKEND'" >&2; exit 2 ;;
esac

exec "$PYTHON" -m search_env.retrieval "${args[@]}" "$@"
