"""The tests a study file states before its runs (``tests:``), checked and evaluated on its cells.

Two kinds: ``{last_place: SHAPE}`` (the exact permutation test that SHAPE is strictly last at every
seed, with its conservative alternatives) and ``{gap: {axis, better, worse, metric}}`` (the mean of
per-seed differences between two levels of one axis, every other axis held equal, with a
seed-bootstrap 95 % CI). Definitions: docs/studies.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from eval.report.tables import order_shapes
from eval.stats import RankingTest, binomial_tail, ci_text, ranking_test, seed_ci
from study.spec import StudyError

METRICS = {
    "gain": "gain in test EM (Avg all) from step 0 to the best checkpoint at the matched horizon",
    "best_em": "test EM (Avg all) of the best checkpoint at the matched horizon",
    "first_em": "test EM (Avg all) at the first checkpoint",
    "ties": "fraction of generated groups whose rewards all tie (zero variance), steps 1..matched",
    "rollouts_per_step": "rollouts generated per training step (refills included), steps 1..matched",
}
"""Per-cell metrics a gap test may compare (columns of the report's cells.csv)."""
MIN_SEEDS = 3
"""Paired seeds a gap's verdict needs: with two, the resampled means only span the two values."""


@dataclass(frozen=True)
class LastPlace:
    shape: str
    label: str


@dataclass(frozen=True)
class Gap:
    axis: str
    better: Any
    worse: Any
    metric: str
    label: str
    labelled: bool = False  # the label was stated in the file (what a positive gap says)


Test = LastPlace | Gap


def parse_tests(entries: list[dict[str, Any]], axes: set[str]) -> list[Test]:
    """The file's ``tests`` list checked against the study's axes; errors name the entry and the fix."""
    out: list[Test] = []
    for i, entry in enumerate(entries):
        where = f"tests.{i}"
        kinds = [k for k in entry if k in ("last_place", "gap")]
        if len(kinds) != 1 or set(entry) - {"last_place", "gap", "label"}:
            raise StudyError(
                f"{where}: {entry!r}. Fix: one of {{last_place: SHAPE}} or {{gap: {{axis, better, worse}}}}"
            )
        if kinds[0] == "last_place":
            shape = str(entry["last_place"])
            out.append(LastPlace(shape, str(entry.get("label") or f"{shape} last")))
            continue
        gap = entry["gap"]
        if not isinstance(gap, dict) or not {"axis", "better", "worse"} <= set(gap):
            raise StudyError(
                f"{where}.gap: needs axis, better and worse. Fix: e.g. {{axis: shape, better: f1_only, worse: em_only}}"
            )
        unknown = set(gap) - {"axis", "better", "worse", "metric"}
        if unknown:
            raise StudyError(
                f"{where}.gap: unknown key {sorted(unknown)[0]!r}. Fix: axis, better, worse, metric"
            )
        axis = str(gap["axis"])
        if axis not in axes:
            raise StudyError(
                f"{where}.gap.axis: {axis!r} is not an axis of this study. Fix: one of {sorted(axes)}"
            )
        metric = str(gap.get("metric", "gain"))
        if metric not in METRICS:
            raise StudyError(f"{where}.gap.metric: {metric!r} is unknown. Fix: one of {', '.join(METRICS)}")
        label = str(entry.get("label") or f"{axis} {gap['better']} - {gap['worse']} ({metric})")
        out.append(Gap(axis, gap["better"], gap["worse"], metric, label, "label" in entry))
    return out


def axis_column(axis: str) -> str:
    """The cells frame's column holding ``axis``'s value."""
    return "shape" if axis == "shape" else f"axis:{axis}"


def _same(a: Any, b: Any) -> bool:
    return a == b or str(a).lower() == str(b).lower()


def gap_pairs(frame: pd.DataFrame, test: Gap) -> dict[str, list[tuple[int, float]]]:
    """Per setting of the other axes (e.g. each shape): ``(seed, better - worse)`` of the test's metric,
    one pair per seed holding both levels."""
    col = axis_column(test.axis)
    others = [c for c in frame.columns if c.startswith("axis:") and c != col] + (
        ["shape"] if col != "shape" else []
    )
    out: dict[str, list[tuple[int, float]]] = {}
    for key, sub in frame.groupby(others, dropna=False, sort=False) if others else [((), frame)]:
        key = key if isinstance(key, tuple) else (key,)
        name = ", ".join(f"{c.removeprefix('axis:')}={v}" for c, v in zip(others, key, strict=True)) or "all"
        pairs = []
        for seed, by_seed in sub.groupby("seed"):
            hi = by_seed[[_same(v, test.better) for v in by_seed[col]]]
            lo = by_seed[[_same(v, test.worse) for v in by_seed[col]]]
            if len(hi) == 1 and len(lo) == 1:
                pairs.append((int(seed), float(hi[test.metric].iloc[0]) - float(lo[test.metric].iloc[0])))
        if pairs:
            out[name] = pairs
    return out


def gap_lines(frame: pd.DataFrame, test: Gap, n_boot: int) -> list[str]:
    """One line per setting: mean gap, its seed CI, the per-seed gaps and the verdict."""
    pairs = gap_pairs(frame, test)
    if not pairs:
        return [f"- **{test.label}:** no seed holds both levels; not tested."]
    lines = [f"- **{test.label}** ({METRICS[test.metric]}; better - worse, paired by seed):"]
    for name, values in pairs.items():
        gaps = [v for _, v in sorted(values)]
        low, high = seed_ci(gaps, n_boot, f"gap/{test.axis}/{test.better}-{test.worse}/{test.metric}/{name}")
        mean = float(np.mean(gaps))
        if math.isnan(low):
            verdict = "no CI"
        elif len(gaps) < MIN_SEEDS:
            verdict = f"not tested: {len(gaps)} seed(s), a seed-bootstrap CI needs {MIN_SEEDS}"
        elif low > 0:
            verdict = "holds: the CI excludes 0"
        elif high < 0:
            verdict = "reversed: the CI is below 0"
        else:
            verdict = "not shown: the CI covers 0"
        seeds = ", ".join(f"{s}: {v:+.3f}" for s, v in sorted(values))
        lines.append(f"  - {name}: {mean:+.3f} {ci_text((low, high))} ({seeds}); {verdict}.")
    return lines


def last_place_test(frame: pd.DataFrame, shape: str) -> RankingTest:
    """The ranking test on best EM by seed, over the shapes of ``frame`` (one setting of the other axes)."""
    table: dict[int, dict[str, float]] = {}
    for _, r in frame.iterrows():
        table.setdefault(int(r["seed"]), {})[r["shape"]] = float(r["best_em"])
    return ranking_test(table, order_shapes(frame["shape"].unique()))


def last_place_lines(frame: pd.DataFrame, test: LastPlace) -> list[str]:
    """Per results tree holding ``test.shape`` and another shape: the exact test and its alternatives."""
    lines = [f"- **{test.label}** (best EM at the matched horizon, by seed):"]
    for tree, sub in frame.groupby("tree", sort=False):
        if test.shape not in set(sub["shape"]) or sub["shape"].nunique() < 2:
            continue
        res = last_place_test(sub, test.shape)
        k, s = len(res.shapes), len(res.seeds)
        if not s:
            lines.append(f"  - {tree or 'main'}: no seed has every shape; not tested.")
            continue
        hits = sum(1 for sd in res.seeds if res.last_by_seed[sd] == test.shape)
        lasts = "; ".join(f"{sd}: {res.last_by_seed[sd] or 'tie'}" for sd in res.seeds)
        p = res.p_given_shape
        binom = binomial_tail(k, s, hits) if hits else None
        lines.append(
            f"  - {tree or 'main'} ({k} shapes x {s} seeds; last per seed — {lasts}): {test.shape} strictly last at "
            f"{hits} of {s}; exact P (last at every seed) = {p} = {float(p):.4f}, "
            f"{'reached' if hits == s else 'not reached'}; binomial P (>= {hits} of {s}) = "
            f"{'1' if binom is None else f'{float(binom):.4f}'}; post hoc (any shape last everywhere): "
            f"{res.last_everywhere[0] if res.last_everywhere else 'none'}."
        )
    return lines
