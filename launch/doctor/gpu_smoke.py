"""The GPU smoke test: every GPU-only path once, <= 10 minutes in all, each stage under its own
timeout, and a Markdown report of what passed (the one script a lent GPU runs).

    bash launch/gpu_smoke.sh            # = python -m launch.doctor.gpu_smoke run
    python -m launch.doctor.gpu_smoke cuda | versions | dense WORK | gpu-index WORK | tiny OUT [--data DIR]
        | grpo SMOKE_DIR | checkpoints CKPT_DIR | rollout-logprobs METRICS | eval SMOKE_DIR
        | packed MODEL [--cpu] | memory [MODEL_DIR] | judge MODEL_DIR WORK

``run`` gates on ``cuda`` (without a CUDA device it exits 2 at once, with the driver/torch
diagnosis), empties SMOKE_DIR (``fresh-dir``), then runs each of :func:`stages` as its own
subcommand in its own process group under its own timeout, capped by what is left of the budget
(BUDGET_S, 600 s; a stage with under 5 s left is SKIPPED), and writes SMOKE_DIR/report.md: one
summary row per stage (PASS, FAIL (exit N), TIMEOUT (N s) or SKIPPED, seconds, its ``RESULT:``
line), the total, then each stage's ``| item | value |`` rows. Logs: SMOKE_DIR/<stage>.log. Exit
status 0 when every stage passed, 1 otherwise, 2 without a device or with a SMOKE_DIR it may not
wipe. Environment: SMOKE_DIR [runs/gpu_smoke], BUDGET_S [600], JUDGE_MODEL_DIR
[data/models/Qwen3.5-0.8B].

``cuda`` is the gate (0: torch sees a device); each other subcommand prints Markdown lines for the
report (``| item | value |`` rows, then ``RESULT: ...``) and exits 0 when its check passes, 1 when
it fails. ``cuda``, ``gpu-index`` and ``judge`` exit 2 without a CUDA device. What each checks:
docs/gpu.md ("`launch/gpu_smoke.sh` — the one script a lent GPU runs").
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch.doctor.smoke_checks import (
    DENSE_INDEX,
    TINY_MODEL,
    cmd_checkpoints,
    cmd_cuda,
    cmd_dense,
    cmd_gpu_index,
    cmd_judge,
    cmd_memory,
    cmd_packed,
    cmd_rollout_logprobs,
    cmd_tiny,
    cmd_versions,
    result,
    row,
)
from launch.procs import exit_status, stop_group
from search_env.checkpoint_layout import step_dir_name
from search_env.paths import REPO_ROOT
from search_env.safe_fs import UnsafeDeleteError, clear_owned

MARKER = ".gpu_smoke"
"""The file ``run`` writes into its SMOKE_DIR: the next run may wipe only a folder holding it."""


def fresh_dir(given: str) -> Path | None:
    """Make ``given`` an empty folder holding :data:`MARKER` and return its real path. An existing one
    is wiped only when it is empty or holds the marker (symlinks resolved first; `/`, the home folder
    and the repository never); else None, after saying why on stderr, nothing deleted."""
    folder = Path(os.path.realpath(given))
    try:
        clear_owned(folder, MARKER)
    except UnsafeDeleteError as err:
        print(
            f"gpu_smoke: SMOKE_DIR={given}: {err}. Fix: SMOKE_DIR=<a new or empty folder>, or one "
            f"an earlier gpu_smoke run wrote (it holds {MARKER})",
            file=sys.stderr,
        )
        return None
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text("written by launch/gpu_smoke.sh; its next run wipes this folder\n")
    return folder


CHECKPOINTS = Path("run") / "checkpoints"
"""The grpo stage's checkpoints under SMOKE_DIR (run.sh's trainer.default_local_dir for
RLVR_RUN_DIR=SMOKE_DIR/run)."""
EVAL_PORT = 18292
"""The eval stage's retriever port."""


def cmd_grpo(args: argparse.Namespace) -> int:
    """2 GRPO steps of the tiny model (recipes/gpu_smoke.yaml) through launch/run.sh into
    SMOKE_DIR/run; searching the dense stage's index when it was built (its encoder then shares
    cuda:0 with vLLM and FSDP), else BM25."""
    smoke = Path(args.smoke_dir)
    overrides = [f"actor_rollout_ref.model.path={smoke / TINY_MODEL}"]
    overrides += [f"data.train_files={smoke / 'data' / 'train.parquet'}"]
    overrides += [f"data.val_files={smoke / 'data' / 'val.parquet'}"]
    if (smoke / DENSE_INDEX).is_file():
        overrides += ["retriever.backend=dense", f"retriever.index={smoke / DENSE_INDEX}"]
        overrides += [f"retriever.encoder={smoke / 'encoder'}", "retriever.nprobe=4", "retriever.gpu=auto"]
    env = {**os.environ, "RLVR_RUN_DIR": str(smoke / "run")}
    command = ["bash", "launch/run.sh", "recipes/gpu_smoke.yaml", *overrides]
    return exit_status(subprocess.run(command, cwd=REPO_ROOT, env=env).returncode)


def cmd_eval(args: argparse.Namespace) -> int:
    """launch/eval.sh with the vLLM backend on both grpo checkpoints (1 row per benchmark) into
    SMOKE_DIR/eval, searching the dense stage's index (eval.sh starts it with --gpu on here: the
    index on the GPU beside vLLM), else BM25. Passes when both steps have a summary.json."""
    smoke = Path(args.smoke_dir)
    dense = (smoke / DENSE_INDEX).is_file()
    env = {
        **os.environ,
        "INDEX": str(smoke / DENSE_INDEX) if dense else "",
        "ENCODER": str(smoke / "encoder") if dense else "",
        "BACKEND": "vllm",
        "SUITE": "samples",
        "LIMIT": "1",
        "OUT": str(smoke / "eval"),
        "RETRIEVER_PORT": str(EVAL_PORT),
    }
    command = ["bash", "launch/eval.sh", str(smoke / CHECKPOINTS), "--steps", "1", "2", "--max-turns", "2"]
    command += ["--max-turn-tokens", "64", "--response-length", "256", "--gpu-memory-utilization", "0.3"]
    returncode = subprocess.run(command, cwd=REPO_ROOT, env=env).returncode
    if returncode:
        return exit_status(returncode)
    missing = []
    for step in (1, 2):
        summaries = sorted((smoke / "eval").glob(f"*/{step_dir_name(step)}/summary.json"))
        row(f"{step_dir_name(step)} summary", summaries[0] if summaries else "MISSING")
        missing += [] if summaries else [step_dir_name(step)]
    return result(not missing, f"summaries of both steps (missing: {missing or 'none'})")


REAL_MODEL = REPO_ROOT / "data" / "models" / "Qwen3.5-0.8B"
"""The memory stage's shape, and the judge stage's model unless JUDGE_MODEL_DIR names another."""
BUDGET_S = 600
"""The whole run's budget (BUDGET_S overrides): a stage gets at most what is left of it."""
SKIP_BELOW_S = 5
"""A stage with less than this left of the budget is SKIPPED."""
KILL_GRACE_S = 10
"""A timed-out stage's process group gets SIGTERM, then SIGKILL after this many seconds."""


@dataclass(frozen=True)
class Stage:
    """One stage of ``run``: ``python -m launch.doctor.gpu_smoke ARGS`` under its own timeout."""

    name: str
    timeout_s: int
    args: tuple[str, ...]


def stages(smoke: Path, judge_model: Path) -> list[Stage]:
    """The stages of ``run`` in order, with their timeouts in seconds (what each checks: docs/gpu.md)."""
    model = str(smoke / TINY_MODEL)
    return [
        Stage("versions", 30, ("versions",)),
        Stage("dense", 90, ("dense", str(smoke))),
        Stage("gpu-index", 60, ("gpu-index", str(smoke))),
        Stage("tiny", 40, ("tiny", model, "--data", str(smoke / "data"))),
        Stage("grpo", 260, ("grpo", str(smoke))),
        Stage("policy", 15, ("checkpoints", str(smoke / CHECKPOINTS))),
        Stage("logprobs", 10, ("rollout-logprobs", str(smoke / "run" / "metrics.jsonl"))),
        Stage("eval", 100, ("eval", str(smoke))),
        Stage("packed", 40, ("packed", model)),
        Stage("memory", 90, ("memory", str(REAL_MODEL))),
        Stage("judge", 120, ("judge", str(judge_model), str(smoke / "judge"))),
    ]


@dataclass
class Outcome:
    """One stage's report: its summary row and its ``| item | value |`` rows."""

    name: str
    status: str
    seconds: int
    line: str
    rows: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return f"| {self.name} | {self.status} | {self.seconds} | {self.line} |"


def read_log(log: str, log_path: Path) -> tuple[str, list[str]]:
    """(result line, report rows) of a stage's output: its last ``RESULT:`` line (else its last
    non-blank line, 160 characters at most), ``|`` made ``/`` so the table holds; its ``| `` rows,
    else one row naming the log."""
    lines = log.splitlines()
    results = [line.removeprefix("RESULT: ") for line in lines if line.startswith("RESULT:")]
    text = [line for line in lines if line.strip()]
    line = results[-1] if results else (text[-1][:160] if text else "")
    rows = [row for row in lines if row.startswith("| ")]
    return line.replace("|", "/"), rows or [f"| log | {log_path} |"]


def run_stage(stage: Stage, smoke: Path, limit_s: int) -> Outcome:
    """Run ``stage`` in its own process group for at most ``limit_s`` seconds, output to
    SMOKE_DIR/<name>.log; whatever of its group is left afterwards is stopped."""
    log_path = smoke / f"{stage.name}.log"
    start = time.monotonic()
    command = [sys.executable, "-m", "launch.doctor.gpu_smoke", *stage.args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=limit_s)
            status = "PASS" if returncode == 0 else f"FAIL (exit {exit_status(returncode)})"
        except subprocess.TimeoutExpired:
            status = f"TIMEOUT ({limit_s} s)"
        finally:
            stop_group(process.pid, grace_s=KILL_GRACE_S)
            process.wait()
    line, rows = read_log(log_path.read_text(errors="replace"), log_path)
    return Outcome(stage.name, status, round(time.monotonic() - start), line, rows)


def report_text(head: list[str], outcomes: list[Outcome], footer: list[str]) -> str:
    """The Markdown report: ``head``, the summary table, ``footer``, then each stage's rows."""
    lines = [*head, "| stage | status | seconds | result |", "|---|---|---|---|"]
    lines += [o.summary() for o in outcomes]
    if footer:
        lines += ["", *footer, ""]
        for o in outcomes:
            if o.rows:
                lines += [f"### {o.name}", "", "| item | value |", "|---|---|", *o.rows, ""]
    return "\n".join(lines) + "\n"


def run(smoke: Path, stages: list[Stage], budget_s: int) -> int:
    """Run ``stages`` one after the other under ``budget_s`` seconds in all, writing
    SMOKE_DIR/report.md after each; print the report. 0 when every stage passed, else 1."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.strip()
    now = datetime.datetime.now(datetime.timezone.utc)
    head = [f"# GPU smoke test ({now:%Y-%m-%dT%H:%MZ}, {socket.gethostname()})", ""]
    head += [f"python: {sys.executable}; commit {commit or 'unknown'}", ""]
    report = smoke / "report.md"
    start = time.monotonic()
    outcomes: list[Outcome] = []
    for stage in stages:
        left = budget_s - round(time.monotonic() - start)
        if left < SKIP_BELOW_S:
            outcomes.append(Outcome(stage.name, "SKIPPED", 0, f"the {budget_s} s budget is spent"))
        else:
            limit = min(stage.timeout_s, left)
            print(f"[{time.strftime('%H:%M:%S')}] stage {stage.name} (timeout {limit} s)", file=sys.stderr)
            outcomes.append(run_stage(stage, smoke, limit))
        report.write_text(report_text(head, outcomes, []))
    total = f"Total: {round(time.monotonic() - start)} s of a {budget_s} s budget. Logs: {smoke}/<stage>.log"
    report.write_text(report_text(head, outcomes, [total]))
    print(report.read_text(), end="")
    return 0 if all(o.status == "PASS" for o in outcomes) else 1


def cmd_run(_: argparse.Namespace) -> int:
    """The CUDA gate, a fresh SMOKE_DIR, then :func:`run` of :func:`stages` (module docstring)."""
    gate = subprocess.run([sys.executable, "-m", "launch.doctor.gpu_smoke", "cuda"], cwd=REPO_ROOT)
    if gate.returncode != 0:
        print("gpu_smoke: no CUDA device; nothing run", file=sys.stderr)
        return 2
    smoke = fresh_dir(os.environ.get("SMOKE_DIR") or str(REPO_ROOT / "runs" / "gpu_smoke"))
    if smoke is None:
        return 2
    judge_model = Path(os.environ.get("JUDGE_MODEL_DIR") or REAL_MODEL)
    return run(smoke, stages(smoke, judge_model), int(os.environ.get("BUDGET_S") or BUDGET_S))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("cuda")
    sub.add_parser("versions")
    tiny = sub.add_parser("tiny")
    tiny.add_argument("out")
    tiny.add_argument("--data", help="also write DATA/{train,val}.parquet (the NQ sample questions)")
    sub.add_parser("dense").add_argument("work")
    sub.add_parser("gpu-index").add_argument("work")
    packed = sub.add_parser("packed")
    packed.add_argument("model")
    packed.add_argument("--cpu", action="store_true", help="fp32 + sdpa on CPU (checks the harness itself)")
    sub.add_parser("rollout-logprobs").add_argument("metrics")
    sub.add_parser("checkpoints").add_argument("ckpt_dir")
    sub.add_parser("memory").add_argument("model_dir", nargs="?")
    sub.add_parser("grpo").add_argument("smoke_dir")
    sub.add_parser("eval").add_argument("smoke_dir")
    sub.add_parser("run")
    judge = sub.add_parser("judge")
    judge.add_argument("model_dir")
    judge.add_argument("work")
    args = parser.parse_args(argv)
    handler = {
        "cuda": cmd_cuda,
        "versions": cmd_versions,
        "tiny": cmd_tiny,
        "dense": cmd_dense,
        "gpu-index": cmd_gpu_index,
        "packed": cmd_packed,
        "rollout-logprobs": cmd_rollout_logprobs,
        "judge": cmd_judge,
        "checkpoints": cmd_checkpoints,
        "memory": cmd_memory,
        "grpo": cmd_grpo,
        "eval": cmd_eval,
        "run": cmd_run,
    }[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
