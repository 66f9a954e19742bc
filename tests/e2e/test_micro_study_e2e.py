"""The micro study run end to end (launch/micro_study.sh, ``python -m study run``): a study whose
cells are all done only reports, cells run side by side and a failed cell stops the next starts, a
study started outside the repository keeps its stages in its own folders, and a cell the committed
export holds is restored, not rerun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import SMALL_STUDY_CAPS, SMALL_STUDY_TREE

from search_env.paths import REPO_ROOT

STUDY = REPO_ROOT / "docs" / "micro_study"

needs_committed_run = pytest.mark.skipif(
    not (STUDY / "report_args.txt").is_file(),
    reason="docs/micro_study/ holds no run yet: EXPORT=docs/micro_study bash launch/micro_study.sh writes it",
)


def _study(timeout: int, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``bash launch/micro_study.sh ARGS`` (a wrapper of ``python -m study run``) from the repository root
    with ``env`` over this process's environment, its output captured; killed after ``timeout`` seconds."""
    return subprocess.run(
        ["bash", "launch/micro_study.sh", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_study_skips_finished_cells_and_writes_the_report(small_report, tmp_path):
    """Every cell marked done: the study neither trains nor evaluates, only reports (resume path)."""
    base, _ = small_report
    study = tmp_path / "small.yaml"
    study.write_text(
        "name: small\nbase: recipes/micro_dense.yaml\naxes: {shape: [em_only, f1_only, f1_format], seed: [42, 43, 44]}\n"
        f"steps: {json.dumps(SMALL_STUDY_CAPS)}\nreport: {{bootstrap: 20}}\n"
    )
    runs = tmp_path / "runs"
    for shape, seed in SMALL_STUDY_TREE:
        cell = runs / f"{shape}_s{seed}"
        cell.mkdir(parents=True)
        (cell / ".study_trained").write_text(f"{SMALL_STUDY_CAPS[seed]} done in an earlier run\n")
        for split in ("test", "val"):
            (cell / f".study_eval_{split}").write_text("done in an earlier run\n")
        (cell / "metrics.jsonl").write_text((base / "logs" / cell.name / "metrics.jsonl").read_text())
    proc = subprocess.run(
        [sys.executable, "-m", "study", "run", str(study), "--runs", str(runs), "--results", str(base)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "done before" in line]
    assert len(lines) == 27  # 9 cells x (train, eval test, eval val)
    assert (base / "report" / "table1.md").is_file() and (base / "report" / "table1_val.md").is_file()
    assert (runs / "progress.log").read_text().count("done before") == 27


def test_cells_run_side_by_side_and_a_failed_cell_stops_the_next_starts(tmp_path):
    """JOBS=2: two cells start together; both fail in preflight (an unknown
    reward shape), so the third never starts and the study exits non-zero, naming the failure."""
    env = {
        "RUNS": str(tmp_path / "runs"),
        "RESULTS": str(tmp_path / "results"),
        "EXPORT": str(tmp_path / "export"),
        "PORT": "18740",
        "JOBS": "2",
        "CELLS": "em_only_s42 f1_only_s42 f1_format_s42",
    }
    done = _study_with_set(600, env, "shape=no_such_shape")
    assert done.returncode == 2, done.stderr[-3000:]
    logs = [p.read_text() for p in (tmp_path / "runs").glob("*/study_train.log")]
    assert sum("reward shape 'no_such_shape' is unknown" in text for text in logs) == 2
    assert "train: exit" in done.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()) == [
        "em_only_s42",
        "f1_only_s42",
    ]
    bad = _study(60, **{**env, "JOBS": "0"})
    assert bad.returncode == 2 and "--jobs" in bad.stderr


def test_a_study_started_outside_the_repository_runs_its_stages_in_its_own_folders(tmp_path):
    """``python -m study run`` from another folder with a relative ``--runs``: the training stage
    (``python -m launch run``, from the repository root) writes into that relative folder, and its
    preflight's error is the cell's failure (an unknown shape: stops before training)."""
    cmd = [sys.executable, "-m", "study", "run", str(REPO_ROOT / "recipes" / "studies" / "micro_dense.yaml")]
    cmd += ["--runs", "runs", "--results", "res", "--export", "export", "--port", "18760"]
    cmd += ["--cells", "em_only_s42", "--set", "shape=no_such_shape"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    log = (tmp_path / "runs" / "em_only_s42" / "study_train.log").read_text()
    assert "reward shape 'no_such_shape' is unknown" in log, log[-3000:]
    assert "em_only_s42 train: exit 2" in done.stderr
    preflight = tmp_path / "runs" / "em_only_s42" / "preflight.log"  # the launcher's run dir is the study's
    assert "no_such_shape" in preflight.read_text()


def _study_with_set(timeout: int, env: dict[str, str], override: str) -> subprocess.CompletedProcess:
    """``python -m study run`` of the dense micro study with one extra hydra override for every cell."""
    cmd = [sys.executable, "-m", "study", "run", "recipes/studies/micro_dense.yaml", "--jobs", env["JOBS"]]
    cmd += [
        "--port",
        env["PORT"],
        "--runs",
        env["RUNS"],
        "--results",
        env["RESULTS"],
        "--export",
        env["EXPORT"],
    ]
    cmd += ["--cells", *env["CELLS"].split(), "--set", override]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


@needs_committed_run
def test_a_cell_finished_in_the_committed_export_is_restored_not_rerun(tmp_path):
    """A study continued on a machine without its runs folder: the cell the export already holds
    is restored (results, log, markers), nothing is trained or evaluated, and the export keeps its
    results and its earlier progress lines. A finished cell outside CELLS is left in the export."""
    export = tmp_path / "export"
    for cell in ("em_only_s42", "f1_only_s42"):
        for sub in ("test", "val", "logs"):
            shutil.copytree(STUDY / "raw" / sub / cell, export / "raw" / sub / cell)
    shutil.copy(STUDY / "raw" / "progress.log", export / "raw" / "progress.log")
    done = _study(
        300,
        RUNS=str(tmp_path / "runs"),
        RESULTS=str(tmp_path / "results"),
        EXPORT=str(export),
        CELLS="em_only_s42",
        PORT="18720",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "em_only_s42: restored from" in done.stderr and "train: done before" in done.stderr
    assert not (tmp_path / "runs" / "em_only_s42" / "study_train.log").exists()  # nothing was run
    for cell in ("em_only_s42", "f1_only_s42"):
        for sub in ("test", "val", "logs"):
            for f in (STUDY / "raw" / sub / cell).rglob("*"):
                if f.is_file():
                    rel = f.relative_to(STUDY / "raw")
                    assert (export / "raw" / rel).read_bytes() == f.read_bytes(), rel
    log = (tmp_path / "runs" / "progress.log").read_text()
    assert log.startswith((STUDY / "raw" / "progress.log").read_text()) and "restored from" in log
    assert (export / "report" / "table1.md").is_file()
