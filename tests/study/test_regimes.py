"""`python -m study.regimes` (study/regimes.py): cells, the ranking test with its conservative
alternatives, the group-size table and the conclusion, on real exported results (the committed
dense micro study) and on a sparse tree made from them with a G = 10 copy."""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path

import pandas as pd
import pytest

from eval.stats import binomial_tail, seed_ci
from search_env.paths import REPO_ROOT
from study.regimes import gap_verdict, main, paired_gap, ranking

DENSE = REPO_ROOT / "docs" / "micro_study" / "raw"

needs_dense = pytest.mark.skipif(not (DENSE / "test").is_dir(), reason="docs/micro_study/raw holds no run")


CLAIMS = ["--last-place", "em_only", "--gap", "f1_only", "em_only"]
"""The claims the sparse study file states (recipes/studies/micro_sparse.yaml)."""


def test_binomial_tail_is_exact():
    assert binomial_tail(3, 5, 5) == Fraction(1, 243)  # = the pre-stated test's P when last everywhere
    assert binomial_tail(3, 5, 0) == 1
    assert binomial_tail(3, 5, 4) == Fraction(11, 243)  # C(5,4) 2/3^5 + 1/3^5
    assert binomial_tail(3, 3, 2) == Fraction(7, 27)


def test_ranking_counts_only_seeds_with_every_shape():
    frame = pd.DataFrame(
        [
            ("em_only", 42, 0.1),
            ("f1_only", 42, 0.3),
            ("em_only", 43, 0.2),
            ("f1_only", 43, 0.5),
            ("em_only", 44, 0.9),
        ],
        columns=["shape", "seed", "best_em"],
    )
    test = ranking(frame)
    assert test.seeds == (42, 43) and test.incomplete_seeds == (44,)
    assert test.last_everywhere == ("em_only",) and test.p_given_shape == Fraction(1, 4)


def test_seed_ci_brackets_the_mean_and_regenerates():
    gains = [0.10, 0.30, 0.20, 0.25, 0.15]
    low, high = seed_ci(gains, 2000, "gain/sparse/em_only")
    assert min(gains) <= low < 0.2 < high <= max(gains)
    assert (low, high) == seed_ci(gains, 2000, "gain/sparse/em_only")  # seeded by what it describes
    assert seed_ci([0.4, 0.4, 0.4], 500, "k") == (pytest.approx(0.4), pytest.approx(0.4))
    assert all(x != x for x in seed_ci([], 500, "k") + seed_ci(gains, 0, "k"))  # NaN: no CI


def test_paired_gap_pairs_by_seed_and_skips_unpaired():
    frame = pd.DataFrame(
        [
            ("em_only", 42, 0.1),
            ("f1_only", 42, 0.3),
            ("em_only", 43, 0.2),
            ("f1_only", 43, 0.1),
            ("em_only", 44, 0.5),
        ],
        columns=["shape", "seed", "gain"],
    )
    assert paired_gap(frame, "f1_only", "em_only") == [pytest.approx(0.2), pytest.approx(-0.1)]
    assert paired_gap(frame, "f1_format", "em_only") == []


def test_only_a_gap_that_excludes_zero_can_be_closed():
    assert gap_verdict({5: (0.004, (-0.007, 0.013)), 10: (-0.001, (-0.003, 0.002))}, 5, 10).startswith(
        "no gap"
    )
    assert gap_verdict({5: (0.10, (0.05, 0.15)), 10: (0.02, (-0.01, 0.05))}, 5, 10) == "G = 10 narrows it"
    assert (
        gap_verdict({5: (-0.10, (-0.15, -0.05)), 10: (-0.12, (-0.2, -0.05))}, 5, 10)
        == "G = 10 does not narrow it"
    )


def _sparse_from_dense(tmp: Path) -> Path:
    """A sparse-layout tree: the dense results as the main tree, and em_only/f1_only of seeds 42-43
    as G = 10 runs (run.json config rollout.n = 10) in g10/."""
    sparse = tmp / "sparse"
    shutil.copytree(DENSE, sparse)
    for sub in ("test", "val", "logs"):
        (sparse / "g10" / sub).mkdir(parents=True)
    for shape in ("em_only", "f1_only"):
        for seed in (42, 43):
            run = f"{shape}_s{seed}"
            for split in ("test", "val"):
                shutil.copytree(DENSE / split / run, sparse / "g10" / split / run)
                info = json.loads((sparse / "g10" / split / run / "run.json").read_text())
                info["config"].setdefault("actor_rollout_ref", {}).setdefault("rollout", {})["n"] = 10
                (sparse / "g10" / split / run / "run.json").write_text(json.dumps(info))
            shutil.copytree(DENSE / "logs" / run, sparse / "g10" / "logs" / run)
    return sparse


@needs_dense
@pytest.mark.slow
def test_regimes_report_from_real_results(tmp_path):
    sparse = _sparse_from_dense(tmp_path)
    out = tmp_path / "report"
    argv = ["--dense", str(DENSE), "--sparse", str(sparse), "--bootstrap", "400", *CLAIMS]
    assert main([*argv, "--out", str(out)]) == 0
    cells = pd.read_csv(out / "cells.csv")
    assert len(cells) == 9 + 9 + 4
    assert set(cells.loc[cells["group"] == 10, "run"]) == {
        "em_only_s42",
        "em_only_s43",
        "f1_only_s42",
        "f1_only_s43",
    }
    dense = cells[cells["regime"] == "dense"].set_index("run")
    # the dense study's own numbers (docs/micro_study/README.md): step 0 0.600, em_only_s42 best 0.775 at step 6
    assert dense["floor_em"].round(3).eq(0.6).all()
    assert dense.loc["em_only_s42", "best_em"] == pytest.approx(0.775)
    assert dense.loc["em_only_s42", "gain"] == pytest.approx(0.175)
    # its first checkpoint (step 6) is its best, as in the committed README's per-checkpoint table
    assert dense.loc["em_only_s42", "first_step"] == 6
    assert dense.loc["em_only_s42", "first_em"] == pytest.approx(0.775)
    assert (dense["step"] <= 18).all() and dense["zero_var"].between(0, 1).all()
    index = (out / "index.md").read_text()
    for claim in ("C2 (EM-only last), dense", "§6.3", "§6.4", "§6.5", "Group size (§7)"):
        assert claim in index
    assert "em_only last at 1 of 3 seeds (exact P 1/27" in index
    table = (out / "table1.md").read_text()
    assert "Conservative (post hoc: any shape last at every seed): P = 1/9" in table
    group_size = (out / "group_size.md").read_text()
    assert group_size.startswith("# Group size (seeds 42, 43)")
    assert "| em_only | 10 |" in group_size and "Gain gap f1_only - em_only, paired by seed" in group_size
    # every mean gain carries its seed CI, and the interval holds the mean
    for line in table.splitlines():
        if line.startswith(("| em_only |", "| f1_only |", "| f1_format |")):
            gain, ci = line.split("|")[5:7]
            low, high = (float(x) for x in ci.strip(" []").split(","))
            assert low <= float(gain) <= high
    assert "mean gain (95% seed CI) em_only +" in index and "at G = 10" in index
    assert (out / "fig_zero_variance_gain.png").stat().st_size > 10_000
    again = tmp_path / "again"
    assert main([*argv, "--out", str(again)]) == 0
    for name in ("cells.csv", "table1.md", "group_size.md", "index.md"):
        assert (again / name).read_text() == (out / name).read_text()


def test_regimes_rejects_a_negative_bootstrap(tmp_path, capsys):
    argv = ["--sparse", str(tmp_path), "--out", str(tmp_path / "o"), "--bootstrap", "-1", *CLAIMS]
    assert main(argv) == 2
    assert "--bootstrap -1" in capsys.readouterr().out and not (tmp_path / "o").exists()


def test_regimes_without_results_names_the_fix(tmp_path, capsys):
    (tmp_path / "sparse" / "test").mkdir(parents=True)
    assert main(["--sparse", str(tmp_path / "sparse"), "--out", str(tmp_path / "o"), *CLAIMS]) == 2
    assert "Fix" in capsys.readouterr().out
