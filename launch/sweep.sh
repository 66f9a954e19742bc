#!/usr/bin/env bash
# Train the paper's nine cells (recipes/studies/paper.yaml), one after the other, on this node:
#   bash launch/sweep.sh [hydra overrides...]             CELLS="f1_only_s44 em_only_s44" for a subset, in order
# Each cell trains in runs/<cell>/; a finished cell is skipped, an interrupted one resumes from its latest
# checkpoint; the sweep stops at the first failing cell. Evaluate and report: python -m study run recipes/studies/paper.yaml
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"
exec "$PYTHON" -m study run recipes/studies/paper.yaml --runs runs --train-only --jobs 1 ${CELLS:+--cells $CELLS} ${1:+--set "$@"}
