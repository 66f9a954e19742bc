#!/usr/bin/env bash
# Train one recipe end to end: preflight, (demo assets), retriever, verl GRPO, cleanup.
#
#   bash launch/run.sh RECIPE.yaml [hydra overrides...]
#   bash launch/run.sh recipes/f1_only_s44.yaml                 # a cell, on a GPU node
#   bash launch/run.sh recipes/demo_cpu.yaml                    # CPU demo, GRPO that learns, ~7 min
#   bash launch/run.sh recipes/demo_cpu.yaml trainer.total_training_steps=3   # resumes, trains step 3
#
# 0. Stops, naming each PID, its listening ports and command, when a process an earlier run of the
#    same run directory started is still running (a killed run's leftover, or a run still going);
#    removes the Ray temp dir a killed run left (python -m search_env.resume strays).
# 1. launch/preflight.py composes the recipe with verl's config, validates it and checks every
#    prerequisite (GPUs, model, parquet, corpus/index/encoder, free port); it lists each missing
#    item with the command that provides it, before anything starts. With resume_mode=auto,
#    checkpoints/latest_checkpointed_iteration.txt must then name a complete checkpoint; if it
#    does not, the newest complete one is named instead, or the run stops (python -m
#    search_env.resume checkpoint).
# 2. Demo recipes (launch.build_demo_assets) build the synthetic world and the SFT warm-started model
#    first, when missing or stale (python -m search_demo assets).
# 3. Starts the retriever (python -m search_env serve, 127.0.0.1:retriever.port, --gpu retriever.gpu)
#    and waits for GET /health, unless retriever.urls names running ones (multi-node: one URL per
#    node); then sends each one real POST /retrieve and stops, naming backend, index and error,
#    if it fails (a backend that cannot search would otherwise train every step on error texts).
#    While the trainer runs, a watchdog checks the retriever it started every second (by PID) and
#    restarts it on the same port when it has exited, at most retriever.max_restarts times, each
#    restart logged in train.log and retriever.log; searches meanwhile retry for
#    retriever.retry_budget_s, and the trainer stops after retriever.max_failed_steps steps in a
#    row with failed searches (docs/retrieval.md "Faults during training").
# 4. Runs python -m verl.trainer.main_ppo in its own process group (under `timeout` when the
#    recipe sets launch.timeout_s), with the overrides passed through; resume_mode=auto continues
#    from the latest checkpoint of the run directory.
# 5. On exit, error or Ctrl-C stops the trainer's process group (Ray included) and the retriever,
#    by PID, and prints where the checkpoint and the logs are.
#
# Killed as a whole (SIGKILL of this script and all it started: power loss, OOM killer, scheduler),
# in a step or in a checkpoint save: run the same command again. It resumes from the last complete
# checkpoint (verl names a checkpoint only once it is written; a half-written global_step_N is
# ignored and later overwritten), metrics.jsonl keeps each step once (lines after the resumed step
# are dropped), the retriever's port and Ray's ports are free again (the kernel closes them), and
# no lock outlives its holder (all are flock locks). See docs/training.md "Killed runs".
#
# Interpreter: $PYTHON, else the active virtualenv / conda env, else python on PATH (the repo's .venv
# only when those cannot import verl); the first log line names it (launch/_common.sh).
#
# Run directory: $RLVR_RUN_DIR, default runs/<recipe name>: train.log, retriever.log, retriever.pid,
# metrics.jsonl (verl file logger, kept across resumes), checkpoints/global_step_N/, tools.yaml,
# recipe.yaml (the composed config), launch.env, preflight.log, .ray_tmp (the Ray temp dir, while
# running).
# Multi-node: start Ray on every node, export RAY_ADDRESS=<head>:6379 on the head, pass
# trainer.nnodes=N and retriever.urls=[http://node1:8000,http://node2:8000] (retrievers started
# with launch/serve_retriever.sh or python -m search_env serve on each node).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
RECIPE="$1"
shift
need_verl
[[ -f "$RECIPE" ]] || die "recipe $RECIPE not found (the recipes are in $ROOT/recipes)"
RECIPE="$(cd "$(dirname "$RECIPE")" && pwd)/$(basename "$RECIPE")"
NAME="$(basename "$RECIPE" .yaml)"
cd "$ROOT"
RUN_DIR="${RLVR_RUN_DIR:-$ROOT/runs/$NAME}"
mkdir -p "$RUN_DIR"
RUN_DIR="$(cd "$RUN_DIR" && pwd)"
CKPT_DIR="$RUN_DIR/checkpoints"
TRAIN_LOG="$RUN_DIR/train.log"

# 0. leftovers of an earlier run of this run directory ---------------------------------------
# Everything started below inherits RLVR_LAUNCH_RUN_DIR; a process still carrying it now outlived a
# killed run (or belongs to one still going) and may hold the retriever's port or write into the run
# directory: stop, naming PIDs and ports (search_env/resume.py). Then remove the private Ray temp
# dir a killed run could not remove (.ray_tmp records it).
STRAYS="$("$PYTHON" -m search_env.resume strays "$RUN_DIR" --exclude-tree $$)" || die "$STRAYS"
export RLVR_LAUNCH_RUN_DIR="$RUN_DIR"
if [[ -f "$RUN_DIR/.ray_tmp" ]]; then
  OLD_RAY_TMP="$(<"$RUN_DIR/.ray_tmp")"
  if [[ "$OLD_RAY_TMP" =~ ^/tmp/rlvr_ray\.[A-Za-z0-9]{6}$ && -d "$OLD_RAY_TMP" ]]; then
    rm -rf "$OLD_RAY_TMP"
    log "removed $OLD_RAY_TMP, the Ray temp dir of an earlier run that was killed"
  fi
  rm -f "$RUN_DIR/.ray_tmp"
fi

TRAINER_PGID="" RETRIEVER_PID="" RAY_TMP=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -n "$TRAINER_PGID" ]]; then  # also whatever Ray left behind after a normal exit
    stop_group "$TRAINER_PGID" 30
    wait "$TRAINER_PGID" 2>/dev/null || true
  fi
  if [[ -n "$RETRIEVER_PID" ]]; then
    stop_pid "$RETRIEVER_PID" 10
    rm -f "$RUN_DIR/retriever.pid"
  fi
  if [[ -n "$RAY_TMP" && -d "$RAY_TMP" ]]; then rm -rf "$RAY_TMP" "$RUN_DIR/.ray_tmp"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted: stopping what this run started"; exit 130' INT TERM

# 1. preflight -----------------------------------------------------------------------------
log "preflight: $NAME (run dir $RUN_DIR)"
if ! "$PYTHON" launch/preflight.py --run-dir "$RUN_DIR" "$RECIPE" "$@" >"$RUN_DIR/preflight.log" 2>&1; then
  if grep -q '^error:' "$RUN_DIR/preflight.log"; then
    sed -n '/^error:/,$p' "$RUN_DIR/preflight.log" >&2
  else
    tail -n 30 "$RUN_DIR/preflight.log" >&2
  fi
  exit 2
fi
# shellcheck disable=SC1091
source "$RUN_DIR/launch.env"
# resume_mode=auto: latest_checkpointed_iteration.txt must name a complete checkpoint; when it does
# not (empty, missing folder, torn shards), the newest complete one is named, else stop.
RESUME="$("$PYTHON" -m search_env.resume checkpoint "$CKPT_DIR" --config "$RUN_DIR/recipe.yaml")" || die "$RESUME"
log "resume: $RESUME"

# 2. demo assets (a lock keeps concurrent runs from building the same files) ------------------
# The synthetic world (python -m search_demo.world) and the SFT warm start
# (python -m search_demo.warm_start), each rebuilt only when missing or stale.
if [[ -n "${DEMO_ASSETS:-}" ]]; then
  eval "DEMO_ARGS=($DEMO_ASSETS)"
  log "demo assets: world + warm start (first build ~3 min on 2 cores, then cached; log: $RUN_DIR/assets.log)"
  (
    exec 9>"${TMPDIR:-/tmp}/rlvr_demo_assets.lock"
    flock 9
    "$PYTHON" -m search_demo assets "${DEMO_ARGS[@]}"
  ) >>"$RUN_DIR/assets.log" 2>&1 || die "building the demo assets failed; see $RUN_DIR/assets.log"
  tail -n 1 "$RUN_DIR/assets.log" | sed 's/^/  /' >&2
fi

# 3. retriever -----------------------------------------------------------------------------
# start_retriever: the local retriever in the background, its output appended to retriever.log;
# sets RETRIEVER_PID and writes it to retriever.pid.
start_retriever() {
  "$PYTHON" -m search_env "${RETRIEVER_CMD[@]}" >>"$RUN_DIR/retriever.log" 2>&1 &
  RETRIEVER_PID=$!
  echo "$RETRIEVER_PID" >"$RUN_DIR/retriever.pid"
}
# run_note MESSAGE: log MESSAGE on stderr and append it to train.log and retriever.log.
run_note() {
  log "$*"
  printf '[%s] launch/run.sh: %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$TRAIN_LOG" >>"$RUN_DIR/retriever.log"
}
# keep_retriever_up: the watchdog's check, every second while the trainer runs. When the retriever
# this script started has exited, start it again (same command and port), at most
# RETRIEVER_MAX_RESTARTS times; after that it stays down and the trainer's stop rule takes over.
RETRIEVER_RESTARTS=0
keep_retriever_up() {
  [[ -n "$RETRIEVER_PID" ]] || return 0
  pid_alive "$RETRIEVER_PID" && return 0
  local rc=0 dead="$RETRIEVER_PID"
  wait "$dead" 2>/dev/null || rc=$?
  if ((RETRIEVER_RESTARTS >= RETRIEVER_MAX_RESTARTS)); then
    RETRIEVER_PID=""
    rm -f "$RUN_DIR/retriever.pid"
    run_note "retriever (PID $dead) exited with status $rc and is not restarted (retriever.max_restarts=$RETRIEVER_MAX_RESTARTS used up): searches fail from now on and the trainer stops after retriever.max_failed_steps such steps; see $RUN_DIR/retriever.log"
    return 0
  fi
  RETRIEVER_RESTARTS=$((RETRIEVER_RESTARTS + 1))
  start_retriever
  run_note "retriever (PID $dead) exited with status $rc; restarted as PID $RETRIEVER_PID (restart $RETRIEVER_RESTARTS of retriever.max_restarts=$RETRIEVER_MAX_RESTARTS)"
}
if [[ -z "${RETRIEVER_EXTERNAL:-}" ]]; then
  eval "RETRIEVER_CMD=($RETRIEVER_ARGS)"
  log "retriever: python -m search_env ${RETRIEVER_CMD[*]}"
  : >"$RUN_DIR/retriever.log"
  start_retriever
  export RLVR_RETRIEVER_LOG="$RUN_DIR/retriever.log"  # named in the trainer's retriever-down message
  wait_health "$RETRIEVER_URLS" "${RETRIEVER_STARTUP_S:-900}" "$RETRIEVER_PID" ||
    die "retriever did not answer GET $RETRIEVER_URLS/health within ${RETRIEVER_STARTUP_S:-900} s; see $RUN_DIR/retriever.log"
else
  unset RLVR_RETRIEVER_LOG
  for url in ${RETRIEVER_URLS//,/ }; do
    wait_health "$url" 30 || die "retriever $url does not answer GET /health (retriever.urls)"
  done
fi
for url in ${RETRIEVER_URLS//,/ }; do
  if ! PROBE="$(probe_retrieve "$url" "$([[ "$RETRIEVER_BACKEND" == dense ]] && echo 1 || echo 0)")"; then
    where="${RETRIEVER_PID:+; see $RUN_DIR/retriever.log}"
    die "retriever self-test failed (backend $RETRIEVER_BACKEND, index ${RETRIEVER_INDEX:-none}): $PROBE$where; training was not started"
  fi
done
log "retriever ready: $RETRIEVER_URLS (backend $RETRIEVER_BACKEND, one real /retrieve answered)"

# 4. trainer -------------------------------------------------------------------------------
export VERL_FILE_LOGGER_PATH="$RUN_DIR/metrics.jsonl"
[[ "$DEVICE" == cpu ]] && export VERL_PLATFORM=cpu
ARGS=(--config-path "$(dirname "$RECIPE")" --config-name "$NAME" "$@")
eval "ARGS+=($EXTRA_OVERRIDES)"
ARGS+=(
  "data.train_files=$TRAIN_FILES" "data.val_files=$VAL_FILES"
  "actor_rollout_ref.model.path=$MODEL_PATH"
  "actor_rollout_ref.rollout.multi_turn.tool_config_path=$TOOL_CONFIG"
  "actor_rollout_ref.rollout.agent.agent_loop_config_path=$AGENT_LOOP_CONFIG"
  "trainer.default_local_dir=$CKPT_DIR"
)
if [[ -z "${RAY_ADDRESS:-}" ]]; then  # a private local Ray instance, removed on exit
  RAY_TMP="$(mktemp -d /tmp/rlvr_ray.XXXXXX)"
  echo "$RAY_TMP" >"$RUN_DIR/.ray_tmp"  # removed by the next run when this one is killed
  log "private Ray instance, temp dir $RAY_TMP (removed on exit)"
  ARGS+=("+ray_kwargs.ray_init._temp_dir=$RAY_TMP")
else  # join the running cluster (README "Multi-node"): its nodes bring their own CPUs and GPUs,
  # and its workers do not inherit this shell's environment, so the run's variables go with the job
  log "joining the Ray cluster at $RAY_ADDRESS (its nodes' resources; ray_kwargs.ray_init.num_cpus/num_gpus dropped)"
  ARGS+=("++ray_kwargs.ray_init.num_cpus=null" "++ray_kwargs.ray_init.num_gpus=null"
    "++ray_kwargs.ray_init.include_dashboard=null")
  for var in VERL_FILE_LOGGER_PATH VERL_PLATFORM RLVR_LAUNCH_RUN_DIR RLVR_RETRIEVER_LOG HF_HUB_OFFLINE \
    TRANSFORMERS_OFFLINE WANDB_MODE TOKENIZERS_PARALLELISM; do
    # quoted: Ray takes only string values (hydra would read HF_HUB_OFFLINE=1 as an int)
    if [[ -n "${!var:-}" ]]; then ARGS+=("++ray_kwargs.ray_init.runtime_env.env_vars.$var='${!var}'"); fi
  done
fi
TIMEOUT=()
((TIMEOUT_S > 0)) && TIMEOUT=(timeout -k 30 "$TIMEOUT_S")
log "training $EXPERIMENT ($TOTAL_STEPS steps, device $DEVICE); log: $TRAIN_LOG"
# setsid: the trainer and every Ray process it spawns share one process group, stopped together.
setsid "${TIMEOUT[@]}" "$PYTHON" -m verl.trainer.main_ppo "${ARGS[@]}" \
  > >(tee -a "$TRAIN_LOG" | awk -f "$ROOT/launch/progress.awk" >&2) 2>&1 &
TRAINER_PGID=$!  # setsid did not fork (a background job is no group leader): its PID is the group id
while pid_alive "$TRAINER_PGID"; do  # the retriever watchdog
  keep_retriever_up
  sleep 1
done
RC=0
wait "$TRAINER_PGID" || RC=$?
((RC == 124)) && log "the trainer hit launch.timeout_s=$TIMEOUT_S s and was stopped"

# 5. summary -------------------------------------------------------------------------------
LATEST="$(cat "$CKPT_DIR/latest_checkpointed_iteration.txt" 2>/dev/null || true)"
STEPS="$( (grep -c . "$VERL_FILE_LOGGER_PATH" 2>/dev/null) || echo 0)"
{
  echo
  if ((RC == 0)); then echo "training finished: $EXPERIMENT"; else echo "training FAILED (exit $RC): $EXPERIMENT"; fi
  if [[ -n "$LATEST" ]]; then
    echo "  checkpoint: $CKPT_DIR/global_step_$LATEST/actor   (resume: run the same command again)"
  else
    echo "  checkpoint: none written yet under $CKPT_DIR"
  fi
  echo "  train log:  $TRAIN_LOG"
  [[ -z "${RETRIEVER_EXTERNAL:-}" ]] && echo "  retriever:  $RUN_DIR/retriever.log"
  echo "  metrics:    $VERL_FILE_LOGGER_PATH ($STEPS steps logged)"
  echo "  config:     $RUN_DIR/recipe.yaml"
} >&2
if ((RC != 0)); then
  echo "--- last lines of $TRAIN_LOG ---" >&2
  grep -v 'target_num_threads' "$TRAIN_LOG" | tail -n 25 >&2
fi
exit "$RC"
