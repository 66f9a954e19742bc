#!/usr/bin/env bash
# The one script a lent GPU runs: every GPU-only path once, <= 10 minutes in all, each stage under
# its own timeout, and a Markdown report of what passed.
#
#   bash launch/gpu_smoke.sh                 # report: runs/gpu_smoke/report.md (SMOKE_DIR overrides)
#
# Stages (timeout in seconds; a stage that would pass the 10-minute budget gets what is left):
#   versions    30   driver, torch + CUDA, GPUs, vllm, flash-attn, fla, transformers, verl, faiss-gpu
#   dense       90   E5-path encoder on the GPU + IVF-SQ8 built with GPU faiss and served from CPU faiss
#                    (retriever.gpu=auto, training's placement): build, serve, one real /retrieve, a
#                    512-query burst (the retrieval setting of docs/gpu.md)
#   gpu-index   60   a real IVF1024,SQ8 index (100,000 x 768) moved to the GPU as `serve --gpu on`
#                    (evaluation) places it: same top-10 as on CPU, copy and search timings
#   tiny        40   a tiny random Qwen3.5 with the real 248,320-token vocabulary (+ NQ fixture parquet)
#   grpo       260   2 GRPO steps of it (recipes/gpu_smoke.yaml): vLLM rollout, use_remove_padding,
#                    flash-attention, dynamic bsz, hf_model saves, the checkpoint policy, searching the
#                    dense stage's index (its encoder on cuda:0 next to vLLM and FSDP; BM25 if absent)
#   policy      15   step 1 pruned to HF weights, step 2 complete
#   logprobs    10   vLLM rollout log-probs vs the FSDP recompute (verl's rollout_probs_diff metrics)
#   eval       100   launch/eval.sh with the vLLM backend on both checkpoints (1 row per benchmark),
#                    searching the dense stage's index on the GPU (eval.sh's default there; BM25 if absent)
#   packed      40   packed (remove-padding, cu_seqlens) vs one-by-one log-probs on a few sequences
#   memory      90   peak memory of one 16K- and one 32K-token forward+backward at the real 0.8B shape
#   judge      120   a real judge on a real model: launch/serve_judge.sh data/models/Qwen3.5-0.8B (vLLM,
#                    30 % of the GPU), 8 verdicts batched at T = 0 into a verdict store, then a rerun
#                    that must call nothing (JUDGE_MODEL_DIR overrides the model)
# Without a CUDA device it exits 2 at once ("no CUDA device", with the driver/torch diagnosis).
# Exit status: 0 when every stage passed, 1 otherwise. Logs: SMOKE_DIR/<stage>.log.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
cd "$ROOT"

if ! "$PYTHON" -m launch.gpu_smoke cuda; then
  echo "gpu_smoke: no CUDA device; nothing run" >&2
  exit 2
fi

BUDGET_S="${BUDGET_S:-600}"
# wiped only when absent, empty or marked .gpu_smoke by an earlier run (real path; never /, home, repo)
SMOKE_DIR="$("$PYTHON" -m launch.gpu_smoke fresh-dir "${SMOKE_DIR:-$ROOT/runs/gpu_smoke}")" || exit 2
REPORT="$SMOKE_DIR/report.md"
START=$SECONDS
FAILED=0
MODEL="$SMOKE_DIR/tiny_qwen35_v248k"
CKPT="$SMOKE_DIR/run/checkpoints"   # run.sh's trainer.default_local_dir for RLVR_RUN_DIR=$SMOKE_DIR/run
export SMOKE_DIR MODEL CKPT

{
  echo "# GPU smoke test ($(date -u +%Y-%m-%dT%H:%MZ), $(hostname))"
  echo
  echo "python: $PYTHON; commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo "| stage | status | seconds | result |"
  echo "|---|---|---|---|"
} >"$REPORT"
DETAILS="$SMOKE_DIR/details.md"
: >"$DETAILS"

# stage NAME TIMEOUT_S CMD...: run CMD under its timeout (capped by what is left of the budget),
# log to SMOKE_DIR/NAME.log, add a summary row and the command's `| item | value |` rows.
stage() {
  local name="$1" limit="$2" status rc t0 left line
  shift 2
  left=$((BUDGET_S - (SECONDS - START)))
  if ((left < 5)); then
    echo "| $name | SKIPPED | 0 | the ${BUDGET_S} s budget is spent |" >>"$REPORT"
    FAILED=1
    return
  fi
  ((limit > left)) && limit=$left
  log "stage $name (timeout $limit s)"
  t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$SMOKE_DIR/$name.log" 2>&1
  rc=$?
  if ((rc == 0)); then status=PASS; elif ((rc == 124 || rc == 137)); then status="TIMEOUT ($limit s)"; else status="FAIL (exit $rc)"; fi
  ((rc == 0)) || FAILED=1
  line="$(grep '^RESULT:' "$SMOKE_DIR/$name.log" | tail -n 1 | sed 's/^RESULT: //; s/|/\//g')"
  [[ -n "$line" ]] || line="$(grep -v '^\s*$' "$SMOKE_DIR/$name.log" | tail -n 1 | cut -c1-160 | sed 's/|/\//g')"
  echo "| $name | $status | $((SECONDS - t0)) | $line |" >>"$REPORT"
  {
    echo "### $name"
    echo
    echo "| item | value |"
    echo "|---|---|"
    grep '^| ' "$SMOKE_DIR/$name.log" || echo "| log | $SMOKE_DIR/$name.log |"
    echo
  } >>"$DETAILS"
}

# The two multi-command stages, as exported functions that `timeout bash -c` can run.
grpo() {  # with the dense stage's retriever when it was built: its encoder then shares cuda:0 with vLLM
  local retriever=()
  if [[ -f "$SMOKE_DIR/demo_IVF16_SQ8.index" ]]; then
    retriever=(retriever.backend=dense "retriever.index=$SMOKE_DIR/demo_IVF16_SQ8.index"
      "retriever.encoder=$SMOKE_DIR/encoder" retriever.nprobe=4 retriever.gpu=auto)
  fi
  RLVR_RUN_DIR="$SMOKE_DIR/run" bash launch/run.sh recipes/gpu_smoke.yaml \
    "actor_rollout_ref.model.path=$MODEL" \
    "data.train_files=$SMOKE_DIR/data/train.parquet" "data.val_files=$SMOKE_DIR/data/val.parquet" \
    "${retriever[@]}"
}

evaluate() {  # eval.sh starts the dense retriever with --gpu on here: its index on the GPU beside vLLM
  local index="" encoder=""
  if [[ -f "$SMOKE_DIR/demo_IVF16_SQ8.index" ]]; then
    index="$SMOKE_DIR/demo_IVF16_SQ8.index" encoder="$SMOKE_DIR/encoder"
  fi
  INDEX="$index" ENCODER="$encoder" BACKEND=vllm SUITE=fixtures LIMIT=1 OUT="$SMOKE_DIR/eval" RETRIEVER_PORT=18292 \
    bash launch/eval.sh "$CKPT" --steps 1 2 --max-turns 2 --max-turn-tokens 64 --response-length 256 \
    --gpu-memory-utilization 0.3 &&
    ls "$SMOKE_DIR"/eval/*/global_step_1/summary.json "$SMOKE_DIR"/eval/*/global_step_2/summary.json
}
export -f grpo evaluate

stage versions 30 "$PYTHON" -m launch.gpu_smoke versions
stage dense 90 "$PYTHON" -m launch.gpu_smoke dense "$SMOKE_DIR"
stage gpu-index 60 "$PYTHON" -m launch.gpu_smoke gpu-index "$SMOKE_DIR"
stage tiny 40 "$PYTHON" -m launch.gpu_smoke tiny "$MODEL" --data "$SMOKE_DIR/data"
stage grpo 260 bash -c grpo
stage policy 15 "$PYTHON" -m launch.gpu_smoke checkpoints "$CKPT"
stage logprobs 10 "$PYTHON" -m launch.gpu_smoke rollout-logprobs "$SMOKE_DIR/run/metrics.jsonl"
stage eval 100 bash -c evaluate
stage packed 40 "$PYTHON" -m launch.gpu_smoke packed "$MODEL"
stage memory 90 "$PYTHON" -m launch.gpu_smoke memory "$ROOT/data/models/Qwen3.5-0.8B"
stage judge 120 "$PYTHON" -m launch.gpu_smoke judge "${JUDGE_MODEL_DIR:-$ROOT/data/models/Qwen3.5-0.8B}" "$SMOKE_DIR/judge"

{
  echo
  echo "Total: $((SECONDS - START)) s of a ${BUDGET_S} s budget. Logs: $SMOKE_DIR/<stage>.log"
  echo
  cat "$DETAILS"
} >>"$REPORT"
rm -f "$DETAILS"
cat "$REPORT"
exit "$FAILED"
