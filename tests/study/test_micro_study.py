"""The micro study (launch/micro_study.sh, docs/micro_study/, docs/micro_study_sparse/): its committed
reports are exactly what `python -m eval report` and `python -m eval regimes` regenerate from the
committed raw results, its cells mirror the GPU cells,
and the report options it relies on (`--matched-horizon auto`, `--val-results`, the zero-variance
outputs, the search profile of a suite without the paper's multi-hop benchmarks) work."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eval.report import main as report_main
from eval.select import horizon_arg, resolve_matched_horizon
from search_env.paths import REPO_ROOT
from study.spec import load_study

STUDY = REPO_ROOT / "docs" / "micro_study"
RECIPES = REPO_ROOT / "recipes"
SHAPES = ("em_only", "f1_only", "f1_format")
GPU_CAPS = {42: 180, 43: 230, 44: 312}


SPARSE = REPO_ROOT / "docs" / "micro_study_sparse"
SPARSE_CAPS = {42: 18, 43: 23, 44: 31, 45: 18, 46: 23}
"""The caps rule for five seeds (docs/micro_study/regimes.md): seed 42 + k takes seed 42 + (k mod 3)'s."""

needs_committed_run = pytest.mark.skipif(
    not (STUDY / "report_args.txt").is_file(),
    reason="docs/micro_study/ holds no run yet: EXPORT=docs/micro_study bash launch/micro_study.sh writes it",
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(STUDY / "raw", {f"{sh}_s{sd}": None for sh in SHAPES for sd in GPU_CAPS}, id="dense"),
        pytest.param(
            SPARSE / "raw",
            {f"{sh}_s{sd}": cap for sh in SHAPES for sd, cap in SPARSE_CAPS.items()},
            id="sparse",
        ),
        pytest.param(
            SPARSE / "raw" / "g10",
            {f"{sh}_g10_s{sd}": 18 for sh in SHAPES[:2] for sd in (42, 43, 44)},
            id="sparse-g10",
        ),
    ],
)
def test_committed_raw_results_are_complete_and_checkpoint_free(raw: Path, expected: dict[str, int | None]):
    """Every cell of the regime, evaluated at every checkpoint up to its cap (None: the cap its
    run.json records), with its training log; no model weights committed."""
    if (
        not (raw.parent / "report_args.txt").is_file()
        and not (raw.parent.parent / "report_args.txt").is_file()
    ):
        pytest.skip(f"{raw.relative_to(REPO_ROOT)}: no finished study committed")
    for split in ("test", "val"):
        runs = sorted(p.name for p in (raw / split).iterdir() if p.is_dir())
        assert runs == sorted(expected)
        for run in runs:
            info = json.loads((raw / split / run / "run.json").read_text())
            steps = sorted(int(p.name.split("_")[-1]) for p in (raw / split / run).glob("global_step_*"))
            assert steps and steps[-1] == info["horizon"] == (expected[run] or info["horizon"]), (
                f"{split}/{run}"
            )
            for step in steps:
                summary = json.loads((raw / split / run / f"global_step_{step}" / "summary.json").read_text())
                assert summary["complete"] and summary["step"] == step
    for run in expected:
        assert (raw / "logs" / run / "metrics.jsonl").stat().st_size > 0
    assert not [p for p in raw.parent.rglob("*") if p.suffix in {".pt", ".safetensors", ".bin"}]


def _dotted(tree: dict, prefix: str = "") -> list[str]:
    """``{"a": {"b": 1}}`` -> ``["a.b=1"]`` (hydra overrides of every leaf)."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _dotted(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


def test_micro_cells_are_the_demo_recipe_plus_their_own_keys():
    """Each dense cell of recipes/studies/micro_dense.yaml composes to exactly the demo recipe with
    micro.yaml's keys and the cell's shape, seed and step cap on top: same model, data, world, rollout
    and optimiser; the caps keep the GPU proportion 180 : 230 : 312."""
    micro = {k: v for k, v in yaml.safe_load((RECIPES / "micro.yaml").read_text()).items() if k != "defaults"}
    study = load_study(REPO_ROOT / "recipes" / "studies" / "micro_dense.yaml")
    assert {c.name for c in study.cells} == {f"{sh}_s{sd}" for sh in SHAPES for sd in GPU_CAPS}
    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        for cell in study.cells:
            cfg = compose(config_name="micro_dense", overrides=list(cell.overrides))
            keys = {"shape": cell.shape, "seed": cell.seed, "trainer": {"total_training_steps": cell.cap}}
            demo = compose(config_name="demo_cpu", overrides=_dotted(micro) + _dotted(keys))
            demo.trainer.experiment_name = cell.name
            assert OmegaConf.to_container(cfg, resolve=True) == OmegaConf.to_container(demo, resolve=True)
            assert cfg.trainer.experiment_name == cell.name and cfg.data.seed == cell.seed
    scale = study.cell("em_only_s42").cap / GPU_CAPS[42]
    for seed, gpu in GPU_CAPS.items():  # the GPU proportion up to rounding to whole steps
        assert abs(study.cell(f"f1_only_s{seed}").cap - gpu * scale) <= 0.5 + 1e-9


def test_matched_horizon_auto_is_the_smallest_known_cap():
    assert resolve_matched_horizon("auto", [9, 7, None, 12]) == 7
    assert resolve_matched_horizon(180, [7]) == 180
    assert horizon_arg("auto") == "auto" and horizon_arg("15") == 15
    with pytest.raises(ValueError, match="known horizon"):
        resolve_matched_horizon("auto", [None])
    for bad in ("0", "-3", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive step count"):
            horizon_arg(bad)


# ---- a small synthetic study with a world-like suite (no paper benchmark) ----------------------

CAPS = {42: 4, 43: 5, 44: 7}
# (shape, seed) -> {step: correct answers out of 4 per benchmark}; step 0 only in the first shape
TEST_TREE = {
    ("em_only", 42): {0: 1, 3: 1, 4: 2},
    ("f1_only", 42): {3: 2, 4: 3},
    ("f1_format", 42): {3: 3, 4: 2},
    ("em_only", 43): {0: 1, 3: 1, 5: 1},
    ("f1_only", 43): {3: 3, 5: 2},
    ("f1_format", 43): {3: 2, 5: 4},
    ("em_only", 44): {0: 1, 3: 2, 6: 1, 7: 4},
    ("f1_only", 44): {3: 3, 6: 3, 7: 3},
    ("f1_format", 44): {3: 3, 6: 2, 7: 2},
}
BENCHES = ("single_hop", "two_hop")


def _write_tree(root: Path, tree: dict, prefix: str) -> None:
    for (shape, seed), steps in tree.items():
        run = f"{shape}_s{seed}"
        (root / run).mkdir(parents=True)
        info = {"run": run, "shape": shape, "seed": seed, "horizon": CAPS[seed], "config": {}}
        (root / run / "run.json").write_text(json.dumps(info))
        for step, right in steps.items():
            d = root / run / f"global_step_{step}"
            d.mkdir()
            rows, summary = [], {}
            for bench in BENCHES:
                part = []
                for i in range(4):
                    ok = i < right
                    part.append(
                        {
                            "benchmark": bench,
                            "id": f"{bench}-{i}",
                            "question": f"{prefix} {bench} {i}?",
                            "prediction": "a" if ok else ("b" if i % 2 else None),
                            "em": float(ok),
                            "f1": 1.0 if ok else 0.25,
                            "acc": float(ok),
                            "searches": 1 + i % 2 + (bench == "two_hop"),
                            "termination": "answer" if ok or i % 2 else "turn_cap",
                        }
                    )
                rows += part
                summary[bench] = {
                    "n": 4,
                    **{k: sum(r[k] for r in part) / 4 for k in ("em", "f1", "acc")},
                    "abort_rate": sum(r["prediction"] is None for r in part) / 4,
                    "searches_mean": sum(r["searches"] for r in part) / 4,
                }
            macro = {k: sum(s[k] for s in summary.values()) / len(summary) for k in ("em", "f1", "acc")}
            (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (d / "summary.json").write_text(
                json.dumps({"benchmarks": summary, "macro": macro, "step": step, "complete": True})
            )


def _write_logs(root: Path) -> None:
    for shape, seed in TEST_TREE:
        zero = {"em_only": 0.75, "f1_only": 0.25, "f1_format": 0.5}[shape]
        lines = [
            {
                "step": s,
                "data": {"reward/mean": s / 10, "grpo/zero_variance_group_frac": zero + (s % 2) * 0.25},
            }
            for s in range(1, CAPS[seed] + 1)
        ]
        (root / f"{shape}_s{seed}").mkdir(parents=True)
        (root / f"{shape}_s{seed}" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
    base = tmp_path_factory.mktemp("micro")
    _write_tree(base / "test", TEST_TREE, "t")
    # validation prefers the earliest trained checkpoint of every run (3 right at step 3, fewer later)
    val_tree = {key: {s: (3 if s == 3 else 1) for s in steps} for key, steps in TEST_TREE.items()}
    _write_tree(base / "val", val_tree, "v")
    _write_logs(base / "logs")
    out = base / "report"
    argv = ["--results", str(base / "test"), "--val-results", str(base / "val"), "--logs", str(base / "logs")]
    assert report_main([*argv, "--matched-horizon", "auto", "--bootstrap", "50", "--out", str(out)]) == 0
    return base, out


def _csv(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open() as f:
        return list(csv.DictReader(f))


def test_auto_matched_horizon_selects_within_the_smallest_cap(small_report):
    _, out = small_report
    matched = {
        (r["row"], r["seed"]): int(r["step"]) for r in _csv(out / "table1.csv") if r["rule"] == "matched"
    }
    own = {(r["row"], r["seed"]): int(r["step"]) for r in _csv(out / "table1.csv") if r["rule"] == "own"}
    assert max(matched.values()) <= 4  # smallest cap (seed 42)
    assert matched[("em_only", "44")] == 3 and own[("em_only", "44")] == 7
    assert matched[("f1_format", "43")] == 3 and own[("f1_format", "43")] == 5
    assert "matched horizon (step <= 4)" in (out / "table1.md").read_text()


def test_validation_selected_table(small_report):
    _, out = small_report
    rows = {(r["rule"], r["run"]): r for r in _csv(out / "table1_val.csv")}
    assert len(rows) == 18
    for r in rows.values():
        assert int(r["val_step"]) == 3 and float(r["val_em"]) == 0.75
    r = rows[("val_own", "em_only_s44")]
    assert (int(r["test_step"]), float(r["test_pick_em"]), float(r["test_em"])) == (7, 1.0, 0.5)
    text = (out / "table1_val.md").read_text()
    assert "0.500 @3 (test-chosen: 1.000 @7)" in text


def test_zero_variance_per_shape(small_report):
    _, out = small_report
    per_run = {r["run"]: r for r in _csv(out / "zero_variance.csv")}
    assert len(per_run) == 9
    r = per_run["f1_only_s44"]  # steps 1..7: 0.5, 0.25, 0.5, 0.25, 0.5, 0.25, 0.5
    assert int(r["steps"]) == 7
    assert float(r["mean"]) == pytest.approx((4 * 0.5 + 3 * 0.25) / 7)
    assert float(r["first_half"]) == pytest.approx((0.5 + 0.25 + 0.5) / 3)
    assert (out / "fig_zero_variance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| em_only |" in (out / "zero_variance.md").read_text()


def test_search_profile_pools_every_benchmark_without_multi_hop_ones(small_report):
    _, out = small_report
    profile = _csv(out / "search_profile.csv")
    assert {int(r["searches"]) for r in profile} == {1, 2, 3}
    assert "pools every benchmark" in (out / "index.md").read_text()


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


@pytest.mark.e2e
def test_a_study_skips_finished_cells_and_writes_the_report(small_report, tmp_path):
    """Every cell marked done: the study neither trains nor evaluates, only reports (resume path)."""
    base, _ = small_report
    study = tmp_path / "small.yaml"
    study.write_text(
        "name: small\nbase: recipes/micro_dense.yaml\naxes: {shape: [em_only, f1_only, f1_format], seed: [42, 43, 44]}\n"
        f"steps: {json.dumps(CAPS)}\nreport: {{bootstrap: 20}}\n"
    )
    runs = tmp_path / "runs"
    for shape, seed in TEST_TREE:
        cell = runs / f"{shape}_s{seed}"
        cell.mkdir(parents=True)
        (cell / ".study_trained").write_text(f"{CAPS[seed]} done in an earlier run\n")
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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
