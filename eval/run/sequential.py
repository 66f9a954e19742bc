"""The sequential evaluation plan: screen every checkpoint on a small nested subsample, keep those that
may be within ``delta`` of the best, confirm those (and step 0) to a requested precision
(docs/evaluation.md, "Sequential plan"). Pure functions; :mod:`eval.run.runner` carries them out,
``python -m eval plan`` (:mod:`eval.report.plan_rows`) sizes them.

Precision is stated against the full-suite value: with equal allocation of n rows per benchmark
(n_b = min(n, N_b)) the macro average's standard error is
``(1/B) * sqrt(sum_b p_b (1 - p_b) / n_b * (N_b - n_b) / (N_b - 1))``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

Z95 = 1.959963984540054
"""Two-sided 95 % normal quantile."""
SCREEN_ROWS = 200
"""Rows per benchmark every checkpoint is screened on (``--screen-rows``)."""
DELTA = 0.01
"""A checkpoint survives screening while it may be within this of the best (macro EM, ``--delta``)."""
HALFWIDTH = 0.01
"""Confirmed numbers' 95 % half-width against the full-suite value (macro EM, ``--halfwidth``)."""
STUDY_TRAINED = {
    "nq": 0.40,
    "triviaqa": 0.53,
    "popqa": 0.40,
    "hotpotqa": 0.30,
    "2wikimultihopqa": 0.25,
    "musique": 0.07,
    "bamboogle": 0.25,
}
"""Illustrative per-benchmark EM of a trained checkpoint on the study's suite
(``search_env.benchmarks.STUDY_SIZES``; macro 0.314; docs/evaluation.md, "Precision")."""


def macro_halfwidth(
    p: Mapping[str, float], n: Mapping[str, int], sizes: Mapping[str, int], z: float = Z95
) -> float:
    """95 % half-width of a macro average over ``sizes``'s benchmarks, ``n[b]`` rows each, against
    the full-suite value (finite-population corrected; a whole benchmark adds no error)."""
    var = 0.0
    for b, size in sizes.items():
        nb = min(n[b], size)
        if nb < size:
            var += p[b] * (1 - p[b]) / nb * (size - nb) / max(size - 1, 1)
    return z * math.sqrt(var) / len(sizes)


def rows_for_halfwidth(halfwidth: float, p: Mapping[str, float], sizes: Mapping[str, int]) -> dict[str, int]:
    """The fewest equal-allocation rows per benchmark (capped at its size) whose macro half-width
    against the full-suite value is at most ``halfwidth``."""
    if halfwidth <= 0:
        raise ValueError(f"--halfwidth must be > 0 (macro EM), got {halfwidth}")
    lo, hi = 1, max(sizes.values())
    while lo < hi:
        mid = (lo + hi) // 2
        if macro_halfwidth(p, dict.fromkeys(sizes, mid), sizes) <= halfwidth:
            hi = mid
        else:
            lo = mid + 1
    return {b: min(lo, size) for b, size in sizes.items()}


def smoothed_rate(correct: float, n: int) -> float:
    """A conservative proportion for planning: (k + 2) / (n + 4), never 0 or 1."""
    return (correct + 2) / (n + 4)


@dataclass(frozen=True)
class Gap:
    """Paired macro difference of a checkpoint against the best one on shared questions: the point
    estimate and its one-sided upper 95 % bound (both in macro EM)."""

    diff: float
    upper: float


Scores = Mapping[str, np.ndarray]
"""One checkpoint's per-question scores: benchmark -> scores, in the same question order for every
checkpoint compared (the suite's subsample order)."""


def paired_gap(rows: Scores, best: Scores, z: float = 1.6448536269514722) -> Gap:
    """Macro average over benchmarks of the mean per-question difference ``rows - best``, with a
    one-sided upper bound from the per-question differences' variance (per benchmark, then averaged
    as the macro is). ValueError when a benchmark's two score arrays differ in length."""
    diffs, var = [], 0.0
    for b, scores in rows.items():
        d = np.asarray(scores, dtype=float) - np.asarray(best[b], dtype=float)
        if len(scores) != len(best[b]) or not len(d):
            raise ValueError(
                f"benchmark {b}: {len(scores)} vs {len(best[b])} scores; compare on the same questions"
            )
        diffs.append(d.mean())
        if len(d) > 1:
            var += d.var(ddof=1) / len(d)
    diff = float(np.mean(diffs))
    return Gap(diff, diff + z * math.sqrt(var) / len(diffs))


def macro(rows: Scores) -> float:
    """Unweighted mean over benchmarks of the mean score."""
    return float(np.mean([np.mean(s) for s in rows.values()]))


@dataclass
class Decision:
    """Screening's outcome: per selection rule its best screened step and survivors, and per step why
    it stays or stops (``gap``: paired macro difference to its rule's best, with upper bound)."""

    best: dict[str, int] = field(default_factory=dict)
    survivors: dict[str, list[int]] = field(default_factory=dict)
    why: dict[int, str] = field(default_factory=dict)
    gaps: dict[int, Gap] = field(default_factory=dict)

    @property
    def confirm(self) -> list[int]:
        """Every step some rule keeps."""
        return sorted({s for steps in self.survivors.values() for s in steps})


def decide(
    screened: Mapping[int, Scores],
    rules: Mapping[str, Iterable[int]],
    delta: float = DELTA,
) -> Decision:
    """For each rule (name -> its eligible steps), the best screened step (highest macro, earliest on a
    tie) and the steps whose paired gap to it has an upper bound >= -``delta``. All steps must be
    screened on the same questions; the outcome does not depend on the order they were screened in."""
    out = Decision()
    for rule, eligible in rules.items():
        steps = sorted(s for s in eligible if s in screened)
        if not steps:
            continue
        best = max(steps, key=lambda s: (macro(screened[s]), -s))
        out.best[rule] = best
        keep = []
        for s in steps:
            gap = Gap(0.0, 0.0) if s == best else paired_gap(screened[s], screened[best])
            if s not in out.gaps or gap.upper > out.gaps[s].upper:
                out.gaps[s] = gap
            if gap.upper >= -delta:
                keep.append(s)
                out.why[s] = (
                    f"{rule}: best screened" if s == best else f"{rule}: may be within {delta} of the best"
                )
            else:
                out.why.setdefault(s, f"stopped: at least {delta} below the best screened ({rule})")
        out.survivors[rule] = keep
    return out


def confirm_rows(
    decision: Decision,
    screened: Mapping[int, Scores],
    sizes: Mapping[str, int],
    screen_n: Mapping[str, int],
    halfwidth: float,
    confirm: str = "auto",
) -> dict[str, int]:
    """Rows per benchmark the survivors and step 0 are confirmed on: every row (``confirm="full"``),
    else the fewest for ``halfwidth`` at the best screened checkpoint's smoothed EM levels, and never
    fewer than were screened."""
    if confirm == "full":
        return dict(sizes)
    best = screened[decision.best["own"]] if decision.best else {}
    p = {b: smoothed_rate(float(np.sum(best.get(b, []))), len(best.get(b, []))) for b in sizes}
    return {b: max(n, screen_n[b]) for b, n in rows_for_halfwidth(halfwidth, p, sizes).items()}
