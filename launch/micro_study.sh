#!/usr/bin/env bash
# The whole study on a laptop: the micro study's reward-shape ablation on the synthetic world, end to end.
#
#   bash launch/micro_study.sh                     # dense regime: train 9 cells, evaluate every checkpoint, report
#   bash launch/micro_study.sh --regime sparse     # sparse regime: 15 + 6 cells (below)
#   bash launch/micro_study.sh --regime sparse --list   # print the cells (cell, cap, group size, results tree)
#   CELLS="em_only_s42 f1_only_s42" bash launch/micro_study.sh   # a subset, in this order
#
# Regimes (docs/micro_study/regimes.md):
#   dense   {em_only, f1_only, f1_format} x seed {42, 43, 44}, recipes/micro_<cell>.yaml (shape, seed and
#           step cap only), the demo world and warm start.
#   sparse  recipes/micro_sparse.yaml (verbose warm start, paper-shaped study world), cells set by
#           overrides: {em_only, f1_only, f1_format} x seed {42..46} at G = 5 (the results tree), then
#           {em_only, f1_only} x seed {42, 43, 44} at G = 10 (cells <shape>_g10_s<seed>, the g10 tree,
#           capped at the matched horizon, the smallest cap). Step caps: the GPU study's
#           180 : 230 : 312 x 1/10 for seeds 42 : 43 : 44, and seed 42 + k takes seed 42 + (k mod 3)'s
#           cap (45 -> 18, 46 -> 23): the same three horizons, so the matched horizon stays the smallest.
#
# For each cell (seed-major order, so every seed is complete before the next starts):
#   1. train:  RLVR_RUN_DIR=$RUNS/<cell> bash launch/run.sh <recipe> retriever.port=$PORT [overrides]
#   2. eval:   launch/eval.sh on every checkpoint of the cell, on the world's test split and on its
#              validation split (OUT=$RESULTS[/g10]/test, .../val). Step 0 (the shared warm start)
#              is evaluated once per seed and results tree, with that seed's first cell there.
# then
#   3. report: python -m eval report --results $RESULTS/test --val-results $RESULTS/val --logs $RUNS
#              --matched-horizon auto (= the smallest cap, the analogue of the GPU cells' 180);
#              sparse: also the group-size tree ($RESULTS/g10) and, with DENSE set to the dense
#              study's export, the two regimes side by side (python -m eval regimes).
#   4. export: with EXPORT set, the raw evaluation summaries + rows, run.json and each cell's
#              metrics.jsonl (not checkpoints) are copied to $EXPORT/raw and the report is written
#              from that copy to $EXPORT/report, its arguments in $EXPORT/report_args.txt (sparse:
#              also report_args_g10.txt and report_args_regimes.txt), what docs/micro_study/ and
#              docs/micro_study_sparse/ hold; tests/test_micro_study.py regenerates the tables from it.
#
# Resumable: killed at any point (Ctrl-C, SIGTERM, SIGKILL) and run again, it continues. With EXPORT,
# the export is refreshed after every cell, and a cell finished there but unknown to $RUNS (the
# study continued on another machine from the committed export) is restored, not rerun. A cell's
# training is done when $RUNS/<cell>/.micro_trained exists (written atomically once run.sh exited 0
# with the cell's cap checkpointed); an interrupted cell resumes from its latest checkpoint
# (verl resume_mode=auto). A split is done when $RUNS/<cell>/.micro_eval_<split> exists; inside it
# eval's store skips every checkpoint whose summary.json is written and every row already on disk.
# Side by side: JOBS cells at a time (default 2), each taking the next cell of the list when it is
# done (cell j's retriever ports: PORT + 10 j for training, + 1 for evaluation). A GRPO step on CPU
# keeps one process busy at a time (rollout, log-probs, update), so two cells share two cores
# well. Rollouts are seeded per request, so a neighbour changes a cell only through timing: which
# of the cell's own requests share a batch in its engine (float rounding at near ties), as any
# other load does to a cell run alone. A failed cell stops the study once the cells beside it are
# done (exit 1).
# One study at a time: a lock on $RUNS/.lock, held by every process the study starts (so leftovers
# of a SIGKILLed study also block a second one until they exit).
# Progress: one line per cell and stage on stderr (also appended to $RUNS/progress.log); the
# children's output goes to $RUNS/<cell>/micro_{train,eval_test,eval_val}.log.
#
# Environment (defaults in brackets; sparse defaults after the bar):
#   CELLS          cells to run, in order                                 [all of the regime, seed-major]
#   RUNS           run directories                                        [runs/micro | runs/sparse]
#   RESULTS        evaluation results                                     [results/micro | results/sparse]
#   REPORT         report folder (without EXPORT)                         [$RESULTS/report]
#   EXPORT         copy raw results + report here, e.g. docs/micro_study  []
#   DENSE          sparse only: the dense study's export, for the side-by-side report [docs/micro_study]
#   PORT           retriever port of training; evaluation uses PORT+1     [18500]
#   JOBS           cells run side by side (ports PORT + 10 j for the j-th)  [2]
#   WORLD          the synthetic world the cells train on                 [the recipes' launch.assets.world]
#   TEST_SUITE     test split of the world (eval --suite)                 [$WORLD/test]
#   VAL_SUITE      validation split of the world                          [$WORLD/val.parquet]
#   CORPUS         the world's corpus (BM25 retriever of evaluation)      [$WORLD/corpus.jsonl]
#   TEST_LIMIT     questions per benchmark of the test split; empty = all [100 | 60]
#   VAL_LIMIT      questions per benchmark of the validation split        [50 | 30]
#   BOOTSTRAP      bootstrap resamples of the report                      [1000]
#   EXTRA          extra hydra overrides for every cell (e.g. "data.train_batch_size=4")  []
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"

REGIME=dense
LIST=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --regime) REGIME="${2:-}"; shift 2 ;;
    --regime=*) REGIME="${1#--regime=}"; shift ;;
    --list) LIST=1; shift ;;
    *) die "unknown argument $1 (use --regime dense|sparse, --list)" ;;
  esac
done
[[ "$REGIME" == dense || "$REGIME" == sparse ]] || die "--regime must be dense or sparse, got '$REGIME'"

SHAPES=(em_only f1_only f1_format)
GPU_CAPS=(180 230 312)  # the GPU study's step caps of seeds 42, 43, 44
declare -A CAP=() GROUP=() TREE=() SHAPE_OF=() SEED_OF=()
DEFAULT_CELLS=()
add_cell() {  # add_cell CELL SHAPE SEED CAP G TREE
  DEFAULT_CELLS+=("$1")
  SHAPE_OF[$1]="$2" SEED_OF[$1]="$3" CAP[$1]="$4" GROUP[$1]="$5" TREE[$1]="$6"
}
sparse_cap() {  # seed 42 + k: the GPU cap of seed 42 + (k mod 3), x 1/10, rounded to whole steps
  local c=${GPU_CAPS[$(( ($1 - 42) % 3 ))]}
  echo $(( (c + 5) / 10 ))
}
if [[ "$REGIME" == dense ]]; then
  for seed in 42 43 44; do for shape in "${SHAPES[@]}"; do
    cell="${shape}_s$seed"
    add_cell "$cell" "$shape" "$seed" "$(awk '/total_training_steps:/ { print $2 }' "recipes/micro_$cell.yaml" 2>/dev/null)" 5 ""
  done; done
  RUNS="${RUNS:-runs/micro}" RESULTS="${RESULTS:-results/micro}"
  TEST_LIMIT="${TEST_LIMIT-100}" VAL_LIMIT="${VAL_LIMIT-50}"
else
  for seed in 42 43 44 45 46; do for shape in "${SHAPES[@]}"; do
    add_cell "${shape}_s$seed" "$shape" "$seed" "$(sparse_cap "$seed")" 5 ""
  done; done
  MATCHED=$(sparse_cap 42)
  for seed in 42 43 44; do for shape in em_only f1_only; do
    add_cell "${shape}_g10_s$seed" "$shape" "$seed" "$MATCHED" 10 g10
  done; done
  RUNS="${RUNS:-runs/sparse}" RESULTS="${RESULTS:-results/sparse}"
  TEST_LIMIT="${TEST_LIMIT-60}" VAL_LIMIT="${VAL_LIMIT-30}"
fi
if [[ "$LIST" == 1 ]]; then
  for cell in "${DEFAULT_CELLS[@]}"; do printf '%s cap=%s G=%s tree=%s\n' "$cell" "${CAP[$cell]}" "${GROUP[$cell]}" "${TREE[$cell]:-main}"; done
  exit 0
fi
read -ra CELL_LIST <<<"${CELLS:-${DEFAULT_CELLS[*]}}"
EXPORT="${EXPORT:-}"
DENSE="${DENSE:-docs/micro_study}"
REPORT="${REPORT:-$RESULTS/report}"
PORT="${PORT:-18500}"
JOBS="${JOBS:-2}"
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || die "JOBS must be a whole number >= 1 (cells run side by side), got '$JOBS'"
BOOTSTRAP="${BOOTSTRAP:-1000}"
read -ra EXTRA_ARGS <<<"${EXTRA:-}"

recipe_of() {  # the recipe file a cell trains with
  if [[ "$REGIME" == dense ]]; then echo "recipes/micro_$1.yaml"; else echo recipes/micro_sparse.yaml; fi
}
overrides_of() {  # the hydra overrides that make a cell of the recipe (none for dense: its recipe is the cell)
  [[ "$REGIME" == dense ]] && return 0
  printf '%s\n' "shape=${SHAPE_OF[$1]}" "seed=${SEED_OF[$1]}" "trainer.total_training_steps=${CAP[$1]}" \
    "actor_rollout_ref.rollout.n=${GROUP[$1]}" "trainer.experiment_name=$1"
}
results_of() {  # the results tree of a cell ($RESULTS or $RESULTS/g10)
  if [[ -n "${TREE[$1]:-}" ]]; then echo "$RESULTS/${TREE[$1]}"; else echo "$RESULTS"; fi
}

for cell in "${CELL_LIST[@]}"; do
  [[ -n "${CAP[$cell]:-}" ]] || die "no cell $cell in the $REGIME regime (CELLS takes names like f1_only_s44; --list prints them)"
done
mkdir -p "$RUNS" "$RESULTS"
if [[ -z "${WORLD:-}" ]]; then  # where run.sh builds (or finds) the world the recipes train on
  WORLD="$("$PYTHON" - "$(recipe_of "${CELL_LIST[0]}")" <<'PY'
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
  cap="${CAP[$cell]}"
  if [[ -f "$dir/.micro_trained" ]]; then
    progress "$cell train: done before ($(cat "$dir/.micro_trained"))"
    return 0
  fi
  mkdir -p "$dir"
  latest="$(cat "$dir/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)"
  t0=$SECONDS
  local cell_args=()
  mapfile -t cell_args < <(overrides_of "$cell")
  if ! RLVR_RUN_DIR="$dir" run_stage "$dir/micro_train" bash launch/run.sh "$(recipe_of "$cell")" \
      "${cell_args[@]}" "retriever.port=$PORT" "${EXTRA_ARGS[@]}"; then
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
  out="$(results_of "$cell")/$split"
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

TREES=("")  # results trees: "" = $RESULTS (the main study), g10 = $RESULTS/g10 (sparse: group size)
[[ "$REGIME" == sparse ]] && TREES+=(g10)

cells_in() {  # cells_in TREE: the cells of CELL_LIST whose results go to TREE
  local cell
  for cell in "${CELL_LIST[@]}"; do [[ "${TREE[$cell]:-}" == "$1" ]] && echo "$cell"; done
  return 0
}

export_raw() {  # the raw results (no checkpoints, no merged weights) and training logs -> $EXPORT/raw[/g10],
  # merged into what the export holds: a cell this invocation has no results for (run elsewhere and
  # not restored, or outside CELLS) keeps its exported files. One refresh at a time (cells finish
  # side by side).
  (
    flock 8
    export_raw_now
  ) 8>"$RUNS/.export.lock"
}

export_raw_now() {
  local raw="$EXPORT/raw" split cell tree
  rm -rf "$raw.tmp"
  if [[ -d "$raw" ]]; then cp -r "$raw" "$raw.tmp"; else mkdir -p "$raw.tmp"; fi
  for tree in "${TREES[@]}"; do
    local from="$RESULTS${tree:+/$tree}" to="$raw.tmp${tree:+/$tree}"
    for cell in $(cells_in "$tree"); do
      for split in test val; do
        local src="$from/$split/$cell" dst="$to/$split/$cell"
        [[ -f "$src/run.json" ]] || continue
        rm -rf "$dst"
        mkdir -p "$dst"
        cp "$src/run.json" "$dst/"
        for step in "$src"/global_step_*; do
          [[ -f "$step/summary.json" ]] || continue
          mkdir -p "$dst/$(basename "$step")"
          cp "$step/summary.json" "$step/rows.jsonl" "$dst/$(basename "$step")/"
        done
      done
      if [[ -f "$RUNS/$cell/metrics.jsonl" ]]; then
        mkdir -p "$to/logs/$cell"
        cp "$RUNS/$cell/metrics.jsonl" "$to/logs/$cell/"
      fi
    done
  done
  cp "$RUNS/progress.log" "$raw.tmp/progress.log"
  rm -rf "$raw"
  mv "$raw.tmp" "$raw"
}

restore_cell() {  # a cell complete in $EXPORT/raw but not here (run by an earlier, interrupted invocation on
  # another machine: the export is committed, the runs folder is not) -> its results and markers
  local cell="$1" tree="${TREE[$1]:-}" split
  [[ -n "$EXPORT" && ! -f "$RUNS/$cell/.micro_trained" ]] || return 0
  local raw="$EXPORT/raw${tree:+/$tree}" res
  res="$(results_of "$cell")"
  [[ -f "$raw/logs/$cell/metrics.jsonl" ]] || return 0
  for split in test val; do
    [[ -f "$raw/$split/$cell/global_step_${CAP[$cell]}/summary.json" ]] || return 0
  done
  mkdir -p "$RUNS/$cell"
  for split in test val; do
    mkdir -p "$res/$split"
    rm -rf "$res/$split/$cell"
    cp -r "$raw/$split/$cell" "$res/$split/$cell"
    mark "$RUNS/$cell/.micro_eval_$split" "restored from $raw"
  done
  cp "$raw/logs/$cell/metrics.jsonl" "$RUNS/$cell/metrics.jsonl"
  mark "$RUNS/$cell/.micro_trained" "cap ${CAP[$cell]}, restored from $raw (trained elsewhere; no checkpoints here)"
  progress "$cell: restored from $raw (train and eval done by an earlier invocation)"
}

write_report() {  # write_report RESULTS_ROOT OUT ARGS_FILE LOGS...: ARGS_FILE (may be empty) records the arguments but --out
  local root="$1" out="$2" args_file="$3"
  shift 3
  local args=(--results "$root/test" --logs "$@" --matched-horizon auto --bootstrap "$BOOTSTRAP")
  [[ -d "$root/val" ]] && args+=(--val-results "$root/val")
  [[ -n "$args_file" ]] && printf '%s\n' "${args[*]}" >"$args_file"
  "$PYTHON" -m eval report "${args[@]}" --out "$out"
}

write_reports() {  # every tree's report, then (sparse) the regimes side by side; sets REPORT
  local tree cell logs
  for tree in "${TREES[@]}"; do
    [[ -d "$RESULTS${tree:+/$tree}/test" ]] || continue
    if [[ -n "$EXPORT" ]]; then
      write_report "$EXPORT/raw${tree:+/$tree}" "$EXPORT/report${tree:+/$tree}" \
        "$EXPORT/report_args${tree:+_$tree}.txt" "$EXPORT/raw${tree:+/$tree}/logs" >&2
    else
      logs=()
      for cell in $(cells_in "$tree"); do
        [[ -f "$RUNS/$cell/metrics.jsonl" ]] && logs+=("$RUNS/$cell/metrics.jsonl")
      done
      write_report "$RESULTS${tree:+/$tree}" "$REPORT${tree:+/$tree}" "" "${logs[@]}" >&2
    fi
  done
  [[ -n "$EXPORT" ]] && REPORT="$EXPORT/report"
  if [[ "$REGIME" == sparse ]]; then
    local raw="$RESULTS" logs_root="$RUNS"
    [[ -n "$EXPORT" ]] && raw="$EXPORT/raw" logs_root=""
    local args=(--dense "$DENSE/raw" --sparse "$raw" ${logs_root:+--sparse-logs "$logs_root"} --bootstrap "$BOOTSTRAP")
    [[ -n "$EXPORT" ]] && printf '%s\n' "${args[*]}" >"$EXPORT/report_args_regimes.txt"
    "$PYTHON" -m eval regimes "${args[@]}" --out "$REPORT/regimes" >&2
  fi
}

T0=$SECONDS
if [[ -n "$EXPORT" && ! -f "$RUNS/progress.log" && -f "$EXPORT/raw/progress.log" ]]; then
  cp "$EXPORT/raw/progress.log" "$RUNS/progress.log"  # continued elsewhere: keep the earlier lines
fi
progress "micro study ($REGIME): ${#CELL_LIST[@]} cells, world $WORLD, runs in $RUNS, results in $RESULTS (test $TEST_SUITE limit ${TEST_LIMIT:-all}, val $VAL_SUITE limit ${VAL_LIMIT:-all})"
for cell in "${DEFAULT_CELLS[@]}"; do
  restore_cell "$cell"  # every exported cell of the regime first (CELLS may leave some out)
done
declare -A SEEN_SEED=()
FIRST=()  # per cell of CELL_LIST: 1 if it evaluates its seed's step 0 (once per seed and results tree)
for cell in "${CELL_LIST[@]}"; do
  key="${TREE[$cell]:-main}:${SEED_OF[$cell]}"
  if [[ -z "${SEEN_SEED[$key]:-}" ]]; then FIRST+=(1); else FIRST+=(0); fi
  SEEN_SEED[$key]=1
done

run_cell() {  # run_cell INDEX SLOT: train, evaluate on test and val, refresh the export
  local cell="${CELL_LIST[$1]}" first="${FIRST[$1]}"
  local PORT=$((PORT + 10 * $2))  # this slot's ports (train_cell and eval_cell read PORT)
  train_cell "$cell" || return 1
  eval_cell "$cell" test "$first" || return 1
  eval_cell "$cell" val "$first" || return 1
  [[ -z "$EXPORT" ]] || export_raw  # the export always holds every finished cell (commit it to keep them)
}

QUEUE="$RUNS/.queue"  # index in CELL_LIST of the next cell to start, shared by the slots
claim() {  # the next cell's index on stdout; status 1 when none is left or a cell failed
  (
    flock 9
    [[ ! -f "$RUNS/.failed" ]] || exit 1
    local next
    next="$(<"$QUEUE")"
    ((next < ${#CELL_LIST[@]})) || exit 1
    echo $((next + 1)) >"$QUEUE"
    echo "$next"
  ) 9>"$RUNS/.queue.lock"
}

slot() {  # slot J: run cells from the queue until it is empty; a failed cell stops every slot's next start
  local index
  trap 'stop_child; exit 130' TERM
  while index="$(claim)"; do
    if ! run_cell "$index" "$1"; then
      : >"$RUNS/.failed"
      return 1
    fi
  done
}

rm -f "$RUNS/.failed"
echo 0 >"$QUEUE"
SLOTS=()
for ((j = 0; j < JOBS; j++)); do
  slot "$j" &
  SLOTS+=("$!")
done
trap 'log "interrupted: stopping the running stages (run again to resume)"; kill -TERM "${SLOTS[@]}" 2>/dev/null; wait; exit 130' INT TERM
failed=0
for pid in "${SLOTS[@]}"; do
  wait "$pid" || failed=1
done
if ((failed)); then
  log "a cell failed (its lines above; $RUNS/progress.log): fix it and run again to resume"
  exit 1
fi

write_reports
progress "micro study done in $((SECONDS - T0)) s (this invocation); report: $REPORT/index.md"
