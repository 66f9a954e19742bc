"""``python -m study run STUDY --on slurm`` against a real Slurm (the ``slurm`` fixture: a private
single-node Slurm from ``launch.slurm.testbed``, installed where missing, two fake GPUs; skipped, with
the reason, only where it cannot be installed or started; at teardown no process of it may be
left): a user's own reward study (recipes/studies/my_rewards.py on PYTHONPATH, as
recipes/studies/example.yaml runs it locally), 2 cells of the CPU demo recipe, one train job
requeued mid-run with ``scontrol requeue``. Both cells finish, the requeued one resumes from its
checkpoint, every step is logged once, the reward is labelled by its function's name, and the report
job's report is the one ``study report`` writes here from the same rows."""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ensure_ci_assets, processes_with_env
from heavy_slot import acquire_all, slot_count

from launch.slurm.testbed import PrivateSlurm, SlurmSetupError, start, stop
from search_env.checkpoint_layout import TRACKER
from search_env.paths import REPO_ROOT
from study.slurm import Job, script_text

STUDY = """\
name: slurm2
base: recipes/demo_cpu.yaml
axes: {shape: ['my_rewards:half_credit'], seed: [42, 43]}
steps: {42: 2, 43: 1}
overrides:
  launch.assets.warm_start: .demo/warm_start_ci
  launch.assets.sft_steps: 250
  data.train_batch_size: 4
  actor_rollout_ref.actor.ppo_mini_batch_size: 4
  trainer.save_freq: 1
eval: {test_limit: 2, val_limit: 1, backend: hf}
"""
"""Two cells of the CI demo (its warm start, 4 prompts a step) with the example user reward, a
checkpoint every step: the one requeued after its first step has 2, the other 1."""
REQUEUED, OTHER = "half_credit_s42", "half_credit_s43"
USER_REWARDS = "recipes/studies"
"""PYTHONPATH of the user's reward module, relative to the folder the study is submitted from, as
recipes/studies/example.yaml says to run it locally."""
TRAPPED = """\
import os, signal, sys, time
log = open(sys.argv[1], "a")
if os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
    log.write(f"restarted {os.environ['SLURM_RESTART_COUNT']}\\n")
    sys.exit(0)
def stop(*_):
    log.write("stopped cleanly\\n")
    sys.exit(3)
signal.signal(signal.SIGTERM, stop)
time.sleep(600)
"""
"""A stage that logs a clean stop on SIGTERM and, run again after a requeue, ends at once."""
STUDY_TIMEOUT_S = 1500

pytestmark = pytest.mark.timeout(STUDY_TIMEOUT_S + 300)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateSlurm]:
    root = tmp_path_factory.mktemp("slurm") / "cluster"
    try:
        bed = start(root)
    except SlurmSetupError as err:
        pytest.skip(f"no Slurm here: {err}")
    try:
        yield bed
    finally:
        stopped = stop(bed)
        assert stopped, "no daemon PID file"
        left = processes_with_env(f"SLURM_CONF={bed.conf}")
        assert not left, f"left behind: {[(p.pid, p.name()) for p in left]}"


def _study(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "study", *args]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done


def _queue_empty(slurm: PrivateSlurm) -> bool:
    """Whether the private cluster's queue lists no job (completing ones count as listed)."""
    return not slurm.run("squeue", "-h", "-o", "%i").stdout.strip()


def _wait(what: str, ready, deadline: float, slurm: PrivateSlurm, logs: Path) -> None:  # noqa: ANN001
    """Poll ``ready()`` until ``deadline``; fail at once, with the batch logs, when no job is left.

    The queue is read before ``ready()``: a job that ends between the two reads has then done its
    work before ``ready()`` looks, so an empty queue with ``ready()`` still false means it never will.
    """
    while True:
        gone = _queue_empty(slurm)
        if ready():
            return
        if gone or time.monotonic() > deadline:
            tails = {p.name: p.read_text(errors="replace")[-1500:] for p in sorted(logs.glob("*.out"))}
            pytest.fail(f"not {what} {'and no job left' if gone else 'in time'}; batch logs: {tails}")
        time.sleep(1)


def _steps(run_dir: Path) -> list[int]:
    """The steps of ``run_dir/metrics.jsonl``, one per complete line, in file order."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("\n")]


def _same_tree(a: Path, b: Path) -> list[str]:
    """Files that differ or exist on one side only (byte comparison)."""
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    diff = sorted(str(p) for p in files_a ^ files_b)
    diff += [str(p) for p in sorted(files_a & files_b) if not filecmp.cmp(a / p, b / p, shallow=False)]
    return diff


def test_a_study_on_slurm_resumes_a_requeued_cell_and_reports_as_a_local_run(
    slurm: PrivateSlurm, tmp_path: Path
):
    ensure_ci_assets()
    study = tmp_path / "slurm2.yaml"
    study.write_text(STUDY)
    runs, res = tmp_path / "runs", tmp_path / "res"
    where = ["--runs", str(runs), "--results", str(res)]
    env = {**slurm.env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [USER_REWARDS, env.get("PYTHONPATH")]))
    slots = acquire_all(slot_count(), os.environ.get("RLVR_HEAVY_LOCK_DIR", "/tmp"))  # two cells at once
    try:
        t0 = time.monotonic()
        deadline = t0 + STUDY_TIMEOUT_S
        # beside the study (CPU only): a 3-minute job whose USR1 trap (90 s before the limit, after the
        # first USR1_IGNORED_S) stops its stage and requeues it
        trap_log = tmp_path / "trapped.log"
        opts = ["--time=3", "--requeue", "--signal=B:USR1@90", f"--output={tmp_path}/trapped.%j.out"]
        trapped = Job("trapped", opts, [sys.executable, "-c", TRAPPED, str(trap_log)], requeue=True)
        (tmp_path / "trapped.sh").write_text(script_text(trapped, [], tmp_path))
        assert slurm.run("sbatch", str(tmp_path / "trapped.sh")).returncode == 0
        # one fake GPU per cell: the two train jobs take both, the evaluations queue behind them
        sub = _study(env, "run", str(study), "--on", "slurm", "--gpus-per-cell", "1", *where)
        ids = dict(re.findall(r"^(\S+): submitted job (\d+)", sub.stdout, re.M))
        assert sorted(ids) == sorted(
            [f"slurm2.{c}.{s}" for c in (REQUEUED, OTHER) for s in ("train", "eval")] + ["slurm2.report"]
        ), sub.stdout
        script = (runs / "slurm" / f"slurm2.{REQUEUED}.eval.sh").read_text()
        assert f"#SBATCH --dependency=afterok:{ids[f'slurm2.{REQUEUED}.train']},singleton" in script
        assert "#SBATCH --gres=gpu:1" in script and "#SBATCH --signal=B:USR1@300" in script

        tracker = runs / REQUEUED / "checkpoints" / TRACKER

        # mid-run: step 1 checkpointed and logged (verl logs a step after saving it), step 2 not yet
        def step1() -> bool:
            return tracker.is_file() and tracker.read_text().strip() == "1" and _steps(runs / REQUEUED) == [1]

        _wait("step 1 checkpointed and logged", step1, deadline, slurm, runs / "slurm")
        job = ids[f"slurm2.{REQUEUED}.train"]
        assert slurm.run("scontrol", "requeue", job).returncode == 0
        again = _study(env, "run", str(study), "--on", "slurm", "--gpus-per-cell", "1", *where)
        assert "submitted" not in again.stdout, again.stdout  # every stage is queued or running
        requeued = rf"^slurm2\.{REQUEUED}\.train: (completing|pending: \S+) \(job {job}\)$"  # the same job
        assert re.search(requeued, again.stdout, re.M), again.stdout

        report = res / "report" / "study.md"
        _wait("the report", report.is_file, deadline, slurm, runs / "slurm")
        _wait("every job ended", lambda: _queue_empty(slurm), deadline, slurm, runs / "slurm")
        elapsed = time.monotonic() - t0
    finally:
        for fd in slots:
            os.close(fd)
    # the time-limit signal reached the trap: the stage stopped cleanly, the job ran again and ended
    assert trap_log.read_text().splitlines() == ["stopped cleanly", "restarted 1"]
    status = _study(env, "status", str(study), *where).stdout
    assert "5 of 5 stages done" in status, status
    train_log = (runs / REQUEUED / "study_train.log").read_text()
    assert re.search(r"Resuming from \S+/global_step_1\b", train_log), train_log[-3000:]
    assert _steps(runs / REQUEUED) == [1, 2], "each step logged once"
    assert _steps(runs / OTHER) == [1]
    assert "half_credit" in (res / "report" / "table1.md").read_text()  # labelled by the function's name
    assert "half_credit" in (res / "report" / "study.md").read_text()
    assert json.loads((res / "test" / REQUEUED / "run.json").read_text())["shape"] == "half_credit"
    shutil.move(res / "report", tmp_path / "report_slurm")
    _study(env, "report", str(study), *where)
    assert _same_tree(tmp_path / "report_slurm", res / "report") == []
    print(f"study on slurm: {elapsed:.0f} s from submission to the report")
