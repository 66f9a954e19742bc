#!/usr/bin/env bash
# Train the nine cells of the study (reward shape x seed), one after the other, on this node.
#
#   bash launch/sweep.sh [hydra overrides...]            # all nine: em_only, f1_only, f1_format x 42, 43, 44
#   CELLS="f1_only_s44 em_only_s44" bash launch/sweep.sh  # a subset, in the given order
#
# Each cell is `bash launch/run.sh recipes/<cell>.yaml [overrides...]` with its own run directory
# runs/<cell>/ (RLVR_RUN_DIR is ignored here); a finished cell is skipped (its latest checkpoint equals the step cap), and an
# interrupted one resumes from its latest checkpoint when the sweep is started again. The sweep
# stops at the first failing cell (exit status of run.sh) and prints a per-cell summary.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"

DEFAULT_CELLS="em_only_s42 f1_only_s42 f1_format_s42 em_only_s43 f1_only_s43 f1_format_s43 em_only_s44 f1_only_s44 f1_format_s44"
read -ra CELL_LIST <<<"${CELLS:-$DEFAULT_CELLS}"
for cell in "${CELL_LIST[@]}"; do
  [[ -f "recipes/$cell.yaml" ]] || die "no recipe recipes/$cell.yaml (CELLS takes names like f1_only_s44)"
done

step_cap() {  # the trainer.total_training_steps a cell file sets
  awk '/total_training_steps:/ { print $2 }' "recipes/$1.yaml"
}

SUMMARY=()
for cell in "${CELL_LIST[@]}"; do
  latest="$(cat "runs/$cell/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)"
  if [[ "$latest" == "$(step_cap "$cell")" ]]; then
    SUMMARY+=("$cell: already done (global_step_$latest)")
    continue
  fi
  log "cell $cell (from step $latest)"
  if env -u RLVR_RUN_DIR bash launch/run.sh "recipes/$cell.yaml" "$@"; then
    SUMMARY+=("$cell: done ($(cat "runs/$cell/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null || echo '?') steps)")
  else
    rc=$?
    SUMMARY+=("$cell: FAILED (exit $rc), see runs/$cell/train.log")
    printf '%s\n' "${SUMMARY[@]}" >&2
    exit "$rc"
  fi
done
printf '%s\n' "${SUMMARY[@]}" >&2
