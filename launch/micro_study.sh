#!/usr/bin/env bash
# The micro study on a laptop (docs/micro_study/): `python -m study run recipes/studies/micro_<regime>.yaml`.
#   bash launch/micro_study.sh [--regime dense|sparse|transfer] [--list]    CELLS="em_only_s42 f1_only_s42" JOBS=2 PORT=18500
# RUNS, RESULTS and EXPORT (default: the study file's export, e.g. docs/micro_study) choose the folders.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"
REGIME=dense CMD=(run --jobs "${JOBS:-2}" --port "${PORT:-18500}")
while [[ $# -gt 0 ]]; do
  case "$1" in
    --regime) REGIME="${2:-}"; shift 2 ;; --regime=*) REGIME="${1#*=}"; shift ;; --list) CMD=(list); shift ;;
    *) die "unknown argument $1 (use --regime dense|sparse|transfer, --list)" ;;
  esac
done
exec "$PYTHON" -m study "${CMD[@]}" "recipes/studies/micro_$REGIME.yaml" ${CELLS:+--cells $CELLS} ${RUNS:+--runs "$RUNS"} ${RESULTS:+--results "$RESULTS"} ${EXPORT:+--export "$EXPORT"}
