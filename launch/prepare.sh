#!/usr/bin/env bash
# Fetch what the GPU recipes need, into the paths recipes/base.yaml expects.
#
#   bash launch/prepare.sh [all|model|encoder|corpus|index|data ...]     (default: all)
#   bash launch/prepare.sh --check                                       (only list what is missing)
#
#   model    data/models/Qwen3.5-0.8B           <- HF Qwen/Qwen3.5-0.8B                      (~1.7 GB)
#   encoder  data/models/e5-base-v2             <- HF intfloat/e5-base-v2                    (~0.4 GB)
#   corpus   data/wiki18/wiki-18.jsonl          <- HF dataset PeterJinGo/wiki-18-corpus      (~14 GB)
#   index    data/wiki18/e5_IVF4096_SQ8.index   <- INDEX_SOURCE=study (default): the study's own IVF4096,SQ8
#                                                  index, HF dataset pantomiman/reason-over-search,
#                                                  retriever/wiki18_100w_e5_ivf4096_sq8.index (~16 GB: bit for
#                                                  bit the study's retrieval);
#                                               <- INDEX_SOURCE=flat: HF dataset PeterJinGo/wiki-18-e5-index
#                                                  (Flat, 64.5 GB), re-packed by python -m search_env
#                                                  convert-index (~16 GB; builds on disk where RAM is short)
#   data     data/parquet/musique_train.parquet, data/parquet/val.parquet, data/parquet/suite/
#                                               <- HF dataset RUC-NLPIR/FlashRAG_datasets (python -m search_env.data)
#
# Existing files are kept (delete one to fetch it again). Without network access the script
# downloads nothing and prints, for each missing item, its path and the command that provides it
# (run it where a network exists and copy the file over). DATA_DIR overrides the data/ prefix only
# for the downloads; the recipes keep data/..., so pass the matching overrides to launch/run.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"

DATA_DIR="${DATA_DIR:-data}"
MODEL_DIR="$DATA_DIR/models/Qwen3.5-0.8B"
ENCODER_DIR="$DATA_DIR/models/e5-base-v2"
CORPUS="$DATA_DIR/wiki18/wiki-18.jsonl"
INDEX="$DATA_DIR/wiki18/e5_IVF4096_SQ8.index"
INDEX_SOURCE="${INDEX_SOURCE:-study}"
STUDY_REPO=pantomiman/reason-over-search
STUDY_INDEX=retriever/wiki18_100w_e5_ivf4096_sq8.index
[[ "$INDEX_SOURCE" == study || "$INDEX_SOURCE" == flat ]] || die "INDEX_SOURCE='$INDEX_SOURCE': use study or flat"
PARQUET="$DATA_DIR/parquet"

CHECK_ONLY=0
TARGETS=()
for arg in "$@"; do
  case "$arg" in
    --check) CHECK_ONLY=1 ;;
    all) TARGETS+=(model encoder corpus index data) ;;
    model | encoder | corpus | index | data) TARGETS+=("$arg") ;;
    -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown target '$arg' (use: all model encoder corpus index data, or --check)" ;;
  esac
done
((${#TARGETS[@]})) || TARGETS=(model encoder corpus index data)

present() {  # present TARGET -> 0 when its files exist
  case "$1" in
    model) [[ -f "$MODEL_DIR/config.json" ]] ;;
    encoder) [[ -f "$ENCODER_DIR/config.json" ]] ;;
    corpus) [[ -f "$CORPUS" ]] ;;
    index) [[ -f "$INDEX" ]] ;;
    data) [[ -f "$PARQUET/musique_train.parquet" && -f "$PARQUET/val.parquet" ]] ;;
  esac
}

hf_snapshot() {  # hf_snapshot REPO_ID LOCAL_DIR [REPO_TYPE] [PATTERN]
  "$PYTHON" - "$@" <<'PY'
import sys
from huggingface_hub import snapshot_download
repo, local, kind, pattern = (sys.argv[1:] + [None, None])[:4]
snapshot_download(repo_id=repo, local_dir=local, repo_type=kind or "model",
                  allow_patterns=[pattern] if pattern else None)
PY
}

where() {  # where TARGET -> the path(s) TARGET provides
  case "$1" in
    model) echo "$MODEL_DIR" ;;
    encoder) echo "$ENCODER_DIR" ;;
    corpus) echo "$CORPUS" ;;
    index) echo "$INDEX" ;;
    data) echo "$PARQUET/musique_train.parquet, $PARQUET/val.parquet" ;;
  esac
}

howto() {  # the command that provides TARGET
  case "$1" in
    model) echo "$PYTHON -c \"from huggingface_hub import snapshot_download as s; s('Qwen/Qwen3.5-0.8B', local_dir='$MODEL_DIR')\"" ;;
    encoder) echo "$PYTHON -c \"from huggingface_hub import snapshot_download as s; s('intfloat/e5-base-v2', local_dir='$ENCODER_DIR')\"" ;;
    corpus) echo "download wiki-18.jsonl.gz from HF dataset PeterJinGo/wiki-18-corpus, then: gunzip -c wiki-18.jsonl.gz > $CORPUS" ;;
    index) echo "either (INDEX_SOURCE=study, default, ~16 GB) the study's IVF4096,SQ8 index: $PYTHON -c \"from huggingface_hub import hf_hub_download as h; h('$STUDY_REPO', '$STUDY_INDEX', repo_type='dataset', local_dir='$DATA_DIR/wiki18/download')\" && mv $DATA_DIR/wiki18/download/$STUDY_INDEX $INDEX"
      echo "      or (INDEX_SOURCE=flat, 64.5 GB) download part_aa part_ab from HF dataset PeterJinGo/wiki-18-e5-index, cat part_aa part_ab > e5_Flat.index, then: $PYTHON -m search_env convert-index --flat e5_Flat.index --out $INDEX" ;;
    data) echo "$PYTHON -m search_env.data train --source hub --out $PARQUET && $PYTHON -m search_env.data val --source hub --out $PARQUET && $PYTHON -m search_env.data suite --source hub --out $PARQUET" ;;
  esac
}

fetch() {
  case "$1" in
    model) hf_snapshot Qwen/Qwen3.5-0.8B "$MODEL_DIR" ;;
    encoder) hf_snapshot intfloat/e5-base-v2 "$ENCODER_DIR" ;;
    corpus)
      hf_snapshot PeterJinGo/wiki-18-corpus "$DATA_DIR/wiki18/download" dataset "wiki-18.jsonl.gz"
      gunzip -c "$DATA_DIR/wiki18/download/wiki-18.jsonl.gz" >"$CORPUS.partial" && mv "$CORPUS.partial" "$CORPUS"
      ;;
    index)
      if [[ "$INDEX_SOURCE" == study ]]; then
        hf_snapshot "$STUDY_REPO" "$DATA_DIR/wiki18/download" dataset "$STUDY_INDEX"
        mv "$DATA_DIR/wiki18/download/$STUDY_INDEX" "$INDEX"
        return
      fi
      hf_snapshot PeterJinGo/wiki-18-e5-index "$DATA_DIR/wiki18/download" dataset "part_a*"
      cat "$DATA_DIR"/wiki18/download/part_a? >"$DATA_DIR/wiki18/e5_Flat.index"
      "$PYTHON" -m search_env convert-index --flat "$DATA_DIR/wiki18/e5_Flat.index" --out "$INDEX"
      ;;
    data)
      "$PYTHON" -m search_env.data train --source hub --out "$PARQUET"
      "$PYTHON" -m search_env.data val --source hub --out "$PARQUET"
      "$PYTHON" -m search_env.data suite --source hub --out "$PARQUET"
      ;;
  esac
}

online() {
  "$PYTHON" -c "import urllib.request; urllib.request.urlopen('https://huggingface.co', timeout=5)" 2>/dev/null
}

MISSING=()
for target in "${TARGETS[@]}"; do present "$target" || MISSING+=("$target"); done
if ((${#MISSING[@]} == 0)); then
  log "everything requested is present under $DATA_DIR/"
  exit 0
fi
if ((CHECK_ONLY)) || ! online; then
  ((CHECK_ONLY)) || log "no network access to huggingface.co: nothing downloaded"
  echo "missing (path <- command):" >&2
  for target in "${MISSING[@]}"; do
    echo "  - $target: $(where "$target")" >&2
    echo "      $(howto "$target")" >&2
  done
  exit 1
fi
mkdir -p "$DATA_DIR/models" "$DATA_DIR/wiki18" "$PARQUET"
for target in "${MISSING[@]}"; do
  log "fetching $target"
  fetch "$target" || die "fetching $target failed; by hand: $(howto "$target")"
done
log "done: ${MISSING[*]}"
