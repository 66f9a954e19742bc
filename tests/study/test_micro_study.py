"""The micro study (launch/micro_study.sh, docs/micro_study/, docs/micro_study_sparse/,
docs/micro_study_transfer/): its committed
reports are exactly what `python -m eval report` and `python -m eval regimes` regenerate from the
committed raw results, its cells mirror the GPU cells,
and the report options it relies on (`--matched-horizon auto`, `--val-results`, the zero-variance
outputs, the search profile of a suite without the paper's multi-hop benchmarks) work."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eval.report.select import horizon_arg, resolve_matched_horizon
from search_env.paths import REPO_ROOT
from study.spec import load_study

STUDY = REPO_ROOT / "docs" / "micro_study"
RECIPES = REPO_ROOT / "recipes"
SHAPES = ("em_only", "f1_only", "f1_format")
GPU_CAPS = {42: 180, 43: 230, 44: 312}


SPARSE = REPO_ROOT / "docs" / "micro_study_sparse"
SPARSE_CAPS = {42: 18, 43: 23, 44: 31, 45: 18, 46: 23}
"""The caps rule for five seeds (docs/micro_study/regimes.md): seed 42 + k takes seed 42 + (k mod 3)'s."""
TRANSFER = REPO_ROOT / "docs" / "micro_study_transfer"


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
            TRANSFER / "raw",
            {f"{sh}_s{sd}": 18 for sh in SHAPES for sd in range(42, 47)},
            id="transfer",
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


@pytest.mark.slow
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


# ---- the report options, on a small synthetic study (tests/conftest.py: small_report) -------------


def _csv(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
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
