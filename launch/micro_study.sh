#!/usr/bin/env bash
# The whole study on a laptop: the 3 x 3 reward-shape ablation on the synthetic world, end to end.
#
#   bash launch/micro_study.sh                     # train 9 cells, evaluate every checkpoint, report
#   CELLS="em_only_s42 f1_only_s42" bash launch/micro_study.sh   # a subset, in this order
#
# For each cell {em_only, f1_only, f1_format} x seed {42, 43, 44} (seed-major order, so every seed
# is complete before the next starts):
#   1. train:  RLVR_RUN_DIR=$RUNS/<cell> bash launch/run.sh recipes/micro_<cell>.yaml retriever.port=$PORT
#              (recipes/micro_<cell>.yaml = recipes/micro.yaml + shape, seed and step cap only)
#   2. eval:   launch/eval.sh on every checkpoint of the cell, on the world's test split and on its
#              validation split (OUT=$RESULTS/test, $RESULTS/val). Step 0 (the shared warm start)
#              is evaluated once per seed, with the seed's first cell.
# then
#   3. report: python -m eval report --results $RESULTS/test --val-results $RESULTS/val --logs $RUNS
#              --matched-horizon auto (= the smallest cap, the analogue of the GPU cells' 180)
#   4. export: with EXPORT set, the raw evaluation summaries + rows, run.json and each cell's
#              metrics.jsonl (not checkpoints) are copied to $EXPORT/raw and the report is written
#              from that copy to $EXPORT/report, its arguments in $EXPORT/report_args.txt (what
#              docs/micro_study/ holds; tests/test_micro_study.py regenerates the tables from it).
#
# Resumable: killed at any point (Ctrl-C, SIGTERM, SIGKILL) and run again, it continues. A cell's
# training is done when $RUNS/<cell>/.micro_trained exists (written atomically once run.sh exited 0
# with the cell's cap checkpointed); an interrupted cell resumes from its latest checkpoint
# (verl resume_mode=auto). A split is done when $RUNS/<cell>/.micro_eval_<split> exists; inside it
# eval's store skips every checkpoint whose summary.json is written and every row already on disk.
# One study at a time: a lock on $RUNS/.lock, held by every process the study starts (so leftovers
# of a SIGKILLed study also block a second one until they exit).
# Progress: one line per cell and stage on stderr (also appended to $RUNS/progress.log); the
# children's output goes to $RUNS/<cell>/micro_{train,eval_test,eval_val}.log.
#
# Environment (defaults in brackets):
#   CELLS          cells to run, in order                                 [all nine, seed-major]
#   RUNS           run directories                                        [runs/micro]
#   RESULTS        evaluation results                                     [results/micro]
#   REPORT         report folder (without EXPORT)                         [$RESULTS/report]
#   EXPORT         copy raw results + report here, e.g. docs/micro_study  []
#   PORT           retriever port of training; evaluation uses PORT+1     [18500]
#   WORLD          the synthetic world the cells train on                 [the recipes' launch.assets.world]
#   TEST_SUITE     test split of the world (eval --suite)                 [$WORLD/test]
#   VAL_SUITE      validation split of the world                          [$WORLD/val.parquet]
#   CORPUS         the world's corpus (BM25 retriever of evaluation)      [$WORLD/corpus.jsonl]
#   TEST_LIMIT     questions per benchmark of the test split; empty = all [100]
#   VAL_LIMIT      questions per benchmark of the validation split        [50]
#   BOOTSTRAP      bootstrap resamples of the report                      [1000]
#   EXTRA          extra hydra overrides for every cell (e.g. "data.train_batch_size=4")  []
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"

SHAPES=(em_only f1_only f1_format)
SEEDS=(42 43 44)
DEFAULT_CELLS=()
for seed in "${SEEDS[@]}"; do for shape in "${SHAPES[@]}"; do DEFAULT_CELLS+=("${shape}_s$seed"); done; done
read -ra CELL_LIST <<<"${CELLS:-${DEFAULT_CELLS[*]}}"
RUNS="${RUNS:-runs/micro}"
RESULTS="${RESULTS:-results/micro}"
EXPORT="${EXPORT:-}"
REPORT="${REPORT:-$RESULTS/report}"
PORT="${PORT:-18500}"
TEST_LIMIT="${TEST_LIMIT-100}"
VAL_LIMIT="${VAL_LIMIT-50}"
BOOTSTRAP="${BOOTSTRAP:-1000}"
read -ra EXTRA_ARGS <<<"${EXTRA:-}"

for cell in "${CELL_LIST[@]}"; do
  [[ -f "recipes/micro_$cell.yaml" ]] || die "no recipe recipes/micro_$cell.yaml (CELLS takes names like f1_only_s44)"
done
mkdir -p "$RUNS" "$RESULTS"
if [[ -z "${WORLD:-}" ]]; then  # where run.sh builds (or finds) the world the recipes train on
  WORLD="$("$PYTHON" - "recipes/micro_${CELL_LIST[0]}.yaml" <<'PY'
import sys
from pathlib import Path
from hydra import compose, initialize_config_dir
recipe = Path(sys.argv[1]).resolve()
with initialize_config_dir(config_dir=str(recipe.parent), version_base=None):
    print(compose(config_name=recipe.stem).launch.assets.world)
PY
)" || die "could not read launch.assets.world from recipes/micro_${CELL_LIST[0]}.yaml; set WORLD"
fi
TEST_SUITE="${TEST_SUITE:-$WORLD/test}"
VAL_SUITE="${VAL_SUITE:-$WORLD/val.parquet}"
CORPUS="${CORPUS:-$WORLD/corpus.jsonl}"

exec 7>"$RUNS/.lock"
flock -n 7 || die "another micro study (or a process left by a killed one) holds $RUNS/.lock; wait for it or stop it"

CHILD=""
stop_child() {  # the running stage's process group: run.sh / eval.sh stop what they started
  if [[ -n "$CHILD" ]]; then
    stop_group "$CHILD" 90
    wait "$CHILD" 2>/dev/null || true
    CHILD=""
  fi
}
trap 'stop_child' EXIT
trap 'log "interrupted: stopping the running stage (run again to resume)"; stop_child; exit 130' INT TERM

progress() {  # one line on stderr and in $RUNS/progress.log
  local line
  line="[$(date -u +%H:%M:%S)] $*"
  printf '%s\n' "$line" >&2
  printf '%s\n' "$line" >>"$RUNS/progress.log"
}

mark() {  # mark FILE TEXT: write a completion marker atomically (temp file + rename)
  printf '%s\n' "$2" >"$1.tmp"
  mv -f "$1.tmp" "$1"
}

run_stage() {  # run_stage LOG CMD...: the command in its own process group, output appended to LOG.log
  local log="$1.log"
  shift
  setsid "$@" >>"$log" 2>&1 </dev/null &
  CHILD=$!
  local rc=0
  wait "$CHILD" || rc=$?
  CHILD=""
  return "$rc"
}

step_cap() {  # the trainer.total_training_steps of a micro cell recipe
  awk '/total_training_steps:/ { print $2 }' "recipes/micro_$1.yaml"
}

train_summary() {  # train_summary METRICS.JSONL: "reward/mean first 3 steps -> last 3 steps, zero-var"
  "$PYTHON" - "$1" <<'PY'
import json, sys
steps = {}
for line in open(sys.argv[1]):
    line = line.strip()
    if line:
        rec = json.loads(line)
        steps[rec["step"]] = rec["data"]
vals = [steps[s] for s in sorted(steps)]
def mean(key, part):
    xs = [d[key] for d in part if isinstance(d.get(key), (int, float))]
    return f"{sum(xs) / len(xs):.3f}" if xs else "-"
k = min(3, len(vals))
print(f"reward/mean {mean('reward/mean', vals[:k])} -> {mean('reward/mean', vals[-k:])}"
      f" (first/last {k} steps), zero-variance groups {mean('grpo/zero_variance_group_frac', vals)}")
PY
}

eval_summary() {  # eval_summary OUT RUN: "k checkpoints, macro EM step0 x -> best y @s"
  "$PYTHON" - "$1/$2" <<'PY'
import json, sys
from pathlib import Path
em = {}
for p in Path(sys.argv[1]).glob("global_step_*/summary.json"):
    s = json.loads(p.read_text())
    if s.get("complete"):
        em[int(s["step"])] = s["macro"]["em"]
trained = {k: v for k, v in em.items() if k >= 1}
best = max(trained, key=lambda k: (trained[k], -k)) if trained else None
floor = f"step 0 EM {em[0]:.3f}, " if 0 in em else ""
top = f"best EM {trained[best]:.3f} @{best}" if best is not None else "no trained checkpoint"
print(f"{len(em)} checkpoints, {floor}{top}")
PY
}

train_cell() {
  local cell="$1" dir="$RUNS/$1" cap latest t0
  cap="$(step_cap "$cell")"
  if [[ -f "$dir/.micro_trained" ]]; then
    progress "$cell train: done before ($(cat "$dir/.micro_trained"))"
    return 0
  fi
  mkdir -p "$dir"
  latest="$(cat "$dir/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)"
  t0=$SECONDS
  if ! RLVR_RUN_DIR="$dir" run_stage "$dir/micro_train" bash launch/run.sh "recipes/micro_$cell.yaml" \
      "retriever.port=$PORT" "${EXTRA_ARGS[@]}"; then
    progress "$cell train: FAILED, see $dir/micro_train.log and $dir/train.log"
    tail -n 30 "$dir/micro_train.log" >&2
    return 1
  fi
  latest="$(cat "$dir/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)"
  if [[ "$latest" != "$cap" ]]; then
    progress "$cell train: FAILED, latest checkpoint is step $latest, the cap is $cap (see $dir/train.log)"
    return 1
  fi
  mark "$dir/.micro_trained" "cap $cap, $((SECONDS - t0)) s this run"
  progress "$cell train: $cap steps in $((SECONDS - t0)) s, $(train_summary "$dir/metrics.jsonl")"
}

eval_cell() {
  local cell="$1" split="$2" dir="$RUNS/$1" suite limit out t0 first="$3"
  if [[ -f "$dir/.micro_eval_$split" ]]; then
    progress "$cell eval $split: done before ($(cat "$dir/.micro_eval_$split"))"
    return 0
  fi
  suite="$TEST_SUITE" limit="$TEST_LIMIT"
  [[ "$split" == val ]] && suite="$VAL_SUITE" limit="$VAL_LIMIT"
  out="$RESULTS/$split"
  local base=()
  [[ "$first" == 1 ]] || base=(--base-model none)
  t0=$SECONDS
  if ! SUITE="$suite" LIMIT="$limit" OUT="$out" BACKEND=hf CORPUS="$CORPUS" RETRIEVER_PORT=$((PORT + 1)) \
      run_stage "$dir/micro_eval_$split" bash launch/eval.sh "$dir/checkpoints" --run-name "$cell" "${base[@]}"; then
    progress "$cell eval $split: FAILED, see $dir/micro_eval_$split.log"
    tail -n 30 "$dir/micro_eval_$split.log" >&2
    return 1
  fi
  local summary
  summary="$(eval_summary "$out" "$cell")"
  mark "$dir/.micro_eval_$split" "$summary"
  progress "$cell eval $split: $((SECONDS - t0)) s, $summary"
}

export_raw() {  # the raw results (no checkpoints, no merged weights) and training logs -> $EXPORT/raw
  local raw="$EXPORT/raw" split cell
  rm -rf "$raw.tmp"
  for split in test val; do
    for cell in "${CELL_LIST[@]}"; do
      local src="$RESULTS/$split/$cell" dst="$raw.tmp/$split/$cell"
      [[ -f "$src/run.json" ]] || continue
      mkdir -p "$dst"
      cp "$src/run.json" "$dst/"
      for step in "$src"/global_step_*; do
        [[ -f "$step/summary.json" ]] || continue
        mkdir -p "$dst/$(basename "$step")"
        cp "$step/summary.json" "$step/rows.jsonl" "$dst/$(basename "$step")/"
      done
    done
  done
  for cell in "${CELL_LIST[@]}"; do
    if [[ -f "$RUNS/$cell/metrics.jsonl" ]]; then
      mkdir -p "$raw.tmp/logs/$cell"
      cp "$RUNS/$cell/metrics.jsonl" "$raw.tmp/logs/$cell/"
    fi
  done
  cp "$RUNS/progress.log" "$raw.tmp/progress.log"
  rm -rf "$raw"
  mv "$raw.tmp" "$raw"
}

write_report() {  # write_report RESULTS_ROOT LOGS_ROOT OUT [ARGS_FILE]: ARGS_FILE records the arguments but --out
  local args=(--results "$1/test" --logs "$2" --matched-horizon auto --bootstrap "$BOOTSTRAP")
  [[ -d "$1/val" ]] && args+=(--val-results "$1/val")
  [[ -n "${4:-}" ]] && printf '%s\n' "${args[*]}" >"$4"
  "$PYTHON" -m eval report "${args[@]}" --out "$3"
}

T0=$SECONDS
progress "micro study: ${#CELL_LIST[@]} cells, world $WORLD, runs in $RUNS, results in $RESULTS (test $TEST_SUITE limit ${TEST_LIMIT:-all}, val $VAL_SUITE limit ${VAL_LIMIT:-all})"
declare -A SEEN_SEED=()
i=0
for cell in "${CELL_LIST[@]}"; do
  i=$((i + 1))
  seed="${cell##*_s}"
  first=0
  [[ -z "${SEEN_SEED[$seed]:-}" ]] && first=1
  SEEN_SEED[$seed]=1
  train_cell "$cell" || exit 1
  eval_cell "$cell" test "$first" || exit 1
  eval_cell "$cell" val "$first" || exit 1
done

if [[ -n "$EXPORT" ]]; then
  export_raw
  write_report "$EXPORT/raw" "$EXPORT/raw/logs" "$EXPORT/report" "$EXPORT/report_args.txt" >&2
  REPORT="$EXPORT/report"
else
  write_report "$RESULTS" "$RUNS" "$REPORT" >&2
fi
progress "micro study done in $((SECONDS - T0)) s (this invocation); report: $REPORT/index.md"
