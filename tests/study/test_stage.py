"""``python -m study cell`` (one stage of one cell) and ``run --on slurm``'s plan, without a trainer
or a Slurm: input checks, the report's refusal, the stage locks, the jobs a dry run prints and what a
second submission leaves out. The stages on a real Slurm: tests/e2e/test_slurm_e2e.py."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import pytest

from search_env.paths import REPO_ROOT
from study.__main__ import main
from study.runner import study_lock
from study.slurm import plan
from study.spec import StudyError, load_study
from study.stage import StageFailed, stage_lock
from study.status import Queued, stage_states
from study.store import layout

STUDY = """\
name: two
base: recipes/demo_cpu.yaml
axes: {shape: [f1_format], seed: [42, 43]}
steps: 2
eval: {test_limit: 2, val_limit: 1, backend: hf}
"""


@pytest.fixture
def two(tmp_path: Path) -> Path:
    path = tmp_path / "two.yaml"
    path.write_text(STUDY)
    return path


def test_a_stage_refuses_bad_input_with_exit_2_naming_the_fix(two, tmp_path, capsys):
    where = ["--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "res")]
    assert main(["cell", str(two), "--stage", "train", *where]) == 2
    assert (
        "--stage train: needs --cell C. Fix: one of f1_format_s42, f1_format_s43" in capsys.readouterr().err
    )
    assert main(["cell", str(two), "--stage", "eval", "--cell", "nope", *where]) == 2
    assert "no cell 'nope'" in capsys.readouterr().err
    assert main(["cell", str(two), "--stage", "train", "--cell", "f1_format_s42", "--set", "x", *where]) == 2
    assert "--set x: not KEY=VALUE" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists(), "bad input must write nothing"


def test_a_stage_before_its_inputs_fails_naming_what_is_missing(two, tmp_path, capsys):
    where = ["--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "res")]
    assert main(["cell", str(two), "--stage", "report", *where]) == 1
    assert "report: 2 cells not complete: f1_format_s42, f1_format_s43" in capsys.readouterr().err
    assert main(["cell", str(two), "--stage", "eval", "--cell", "f1_format_s43", *where]) == 1
    assert (
        "f1_format_s43 eval: trained to step None, not its cap 2. Fix: run --stage train first"
        in capsys.readouterr().err
    )


def test_stages_of_different_cells_run_at_once_and_a_local_run_excludes_them(tmp_path):
    runs = tmp_path / "runs"
    with stage_lock(runs, ".cell.a.lock"), stage_lock(runs, ".cell.b.lock"):
        with pytest.raises(StageFailed, match=r"\.cell\.a\.lock: held by another process running this stage"):
            with stage_lock(runs, ".cell.a.lock", wait_s=0):
                pass
        with pytest.raises(StudyError, match="another study"):
            with study_lock(runs):
                pass
    with study_lock(runs):
        with pytest.raises(StageFailed, match=r"\.lock: held by a local `study run`"):
            with stage_lock(runs, ".cell.a.lock"):
                pass


@pytest.mark.slow
def test_the_paper_dry_run_prints_nine_trains_their_evals_and_the_report(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))  # no Slurm: the queue is empty
    paper = str(REPO_ROOT / "recipes" / "studies" / "paper.yaml")
    assert (
        main(
            [
                "run",
                paper,
                "--on",
                "slurm",
                "--dry-run",
                "--runs",
                str(tmp_path / "runs"),
                "--time",
                "24:00:00",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    jobs = dict(re.findall(r"^(paper\.\S+): sbatch (.*)$", out, re.M))
    cells = [f"{s}_s{seed}" for seed in (42, 43, 44) for s in ("em_only", "f1_only", "f1_format")]
    assert sorted(jobs) == sorted(
        [f"paper.{c}.{st}" for c in cells for st in ("train", "eval")] + ["paper.report"]
    )
    for c in cells:
        train, evaluation = jobs[f"paper.{c}.train"], jobs[f"paper.{c}.eval"]
        for opts in (train, evaluation):
            assert (
                "--gres=gpu:1" in opts
                and "--time=24:00:00" in opts
                and "--requeue --signal=B:USR1@300" in opts
            )
        assert train.endswith("--dependency=singleton")
        assert evaluation.endswith(f"--dependency=afterok:paper.{c}.train,singleton")
    report = jobs["paper.report"]
    assert "--gres" not in report and "--time" not in report
    assert report.endswith(f"--dependency=afterok:{':'.join(f'paper.{c}.eval' for c in cells)},singleton")
    assert "dry run: 19 jobs, none submitted" in out and "scontrol requeue" in out
    assert not (tmp_path / "runs").exists(), "a dry run writes nothing"


def test_a_second_submission_leaves_out_what_is_done_or_queued(two, tmp_path):
    study = load_study(two)
    where = layout(study, tmp_path / "runs", tmp_path / "res")
    a, b = study.cells
    ckpt = where.runs / a.name / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(a.cap))  # a: trained
    queued = {f"two.{a.name}.eval": Queued("17", "PENDING", "Resources")}
    states = stage_states(study, where, study.cells, queued, {})
    assert [s.describe() for s in states.values()] == [
        "done", "pending: Resources (job 17)", "not done, not queued", "not done, not queued", "not done, not queued",
    ]  # fmt: skip
    args = argparse.Namespace(
        gpus_per_cell=None, time=None, partition=None, account="acct", sbatch_line=["#SBATCH --qos=low"],
        train_only=False, no_report=False, signal_s=300, set=[], retrievers="private",
    )  # fmt: skip
    jobs = plan(study, where, states, study.cells, args, tmp_path / "slurm")
    assert [(j.name, j.after) for j in jobs] == [
        (f"two.{b.name}.train", []),
        (f"two.{b.name}.eval", [f"two.{b.name}.train"]),
        ("two.report", [f"two.{a.name}.eval", f"two.{b.name}.eval"]),
    ]
    assert all("--account=acct" in j.options and "--qos=low" in j.options for j in jobs)
    assert not any(o.startswith("--gres") for j in jobs for o in j.options), "a CPU recipe asks for no GPU"
