"""Statistics for the reward-shape comparison: rankings, the exact ranking test, bootstrap CIs.

The ranking test (paper §6.2): under the null that the k shapes are exchangeable at every seed
(each of the k! orderings equally likely, seeds independent), a shape named in advance is
strictly last at all s seeds with probability (1/k)^s — 1/27 for 3 shapes x 3 seeds. Because the
direction was not pre-registered, the post-hoc probability that *some* shape is last at every
seed, k * (1/k)^s (the events are disjoint), is reported as the conservative alternative.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

MAX_DRAW_ELEMENTS = 2_000_000
"""Cap on resample indices drawn at once (int64): bounds bootstrap memory to ~16 MB per chunk."""


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean (``math.fsum``); NaN for no values."""
    return math.fsum(values) / len(values) if values else math.nan


def rank_groups(values: Mapping[str, float]) -> list[list[str]]:
    """Names ordered best (highest) first; names with equal values share a group (sorted by name)."""
    groups: list[list[str]] = []
    for name in sorted(values, key=lambda n: (-values[n], n)):
        if groups and values[groups[-1][0]] == values[name]:
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def strictly_last(values: Mapping[str, float]) -> str | None:
    """The unique lowest name, or None when the lowest value is tied (or fewer than 2 names)."""
    groups = rank_groups(values)
    if len(groups) < 2 or len(groups[-1]) != 1:
        return None
    return groups[-1][0]


def last_everywhere_probability(k: int, seeds: int) -> Fraction:
    """Exact P(a pre-specified shape is strictly last at every seed) = (1/k)^seeds under exchangeability."""
    if k < 2 or seeds < 1:
        raise ValueError(f"need at least 2 shapes and 1 seed, got k={k}, seeds={seeds}")
    return Fraction(1, k) ** seeds


def any_last_everywhere_probability(k: int, seeds: int) -> Fraction:
    """Exact P(some shape is strictly last at every seed) = k (1/k)^seeds (disjoint events)."""
    return k * last_everywhere_probability(k, seeds)


@dataclass(frozen=True)
class RankingTest:
    """Outcome of the last-place ranking test over the seeds where every shape has a value.

    ``last_by_seed`` maps each complete seed to its strictly-last shape (None on a tie for last);
    ``last_everywhere`` lists shapes strictly last at every complete seed (at most one).
    """

    shapes: tuple[str, ...]
    seeds: tuple[int, ...]
    incomplete_seeds: tuple[int, ...]
    last_by_seed: dict[int, str | None]
    last_everywhere: tuple[str, ...]
    p_given_shape: Fraction | None
    p_any_shape: Fraction | None


def ranking_test(table: Mapping[int, Mapping[str, float]], shapes: Sequence[str]) -> RankingTest:
    """Run the test on ``table[seed][shape] = value`` (higher is better).

    k = number of shapes, s = number of seeds holding a value for every shape; probabilities are
    None when k < 2 or s = 0.
    """
    complete = tuple(sorted(s for s, row in table.items() if all(sh in row for sh in shapes)))
    incomplete = tuple(sorted(s for s in table if s not in complete))
    last = {s: strictly_last({sh: table[s][sh] for sh in shapes}) for s in complete}
    everywhere = tuple(sh for sh in shapes if complete and all(last[s] == sh for s in complete))
    testable = len(shapes) >= 2 and len(complete) >= 1
    return RankingTest(
        shapes=tuple(shapes),
        seeds=complete,
        incomplete_seeds=incomplete,
        last_by_seed=last,
        last_everywhere=everywhere,
        p_given_shape=last_everywhere_probability(len(shapes), len(complete)) if testable else None,
        p_any_shape=any_last_everywhere_probability(len(shapes), len(complete)) if testable else None,
    )


def bootstrap_means(values: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap distribution of column means of ``values`` (n rows x m metrics): (n_boot, m).

    Rows are resampled with replacement; draws are chunked to at most ``MAX_DRAW_ELEMENTS``
    indices at once. An empty ``values`` gives NaN.
    """
    n = values.shape[0]
    if n == 0:
        return np.full((n_boot, values.shape[1]), np.nan)
    chunk = max(1, MAX_DRAW_ELEMENTS // n)
    out = np.empty((n_boot, values.shape[1]))
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        out[start:stop] = values[idx].mean(axis=1)
    return out


def stream_seed(seed: int, run: str, step: int) -> list[int]:
    """The bootstrap seed of one checkpoint: ``seed`` with the run's name and the step mixed in, so
    different checkpoints draw independent resamples (and the same one always the same)."""
    return [seed, zlib.crc32(run.encode()), step]


def bootstrap_macro(
    groups: Mapping[str, np.ndarray],
    subsets: Mapping[str, Sequence[str]],
    n_boot: int,
    seed: int | Sequence[int],
) -> dict[str, np.ndarray]:
    """Stratified bootstrap: resample rows within each benchmark, then macro-average.

    ``groups[benchmark]`` is an (n_b x m) array of per-question metrics. Returns, for each
    benchmark, its (n_boot x m) bootstrap means, and for each ``subsets[name]`` the unweighted mean
    of its members' bootstrap means (same replicate index = same resample). Benchmarks are drawn in
    sorted order from one ``numpy`` generator seeded with ``seed``, so results are reproducible.
    """
    rng = np.random.default_rng(seed)
    draws = {b: bootstrap_means(np.asarray(groups[b], dtype=float), n_boot, rng) for b in sorted(groups)}
    for name, members in subsets.items():
        draws[name] = np.mean([draws[b] for b in members], axis=0)
    return draws


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval of bootstrap ``samples`` along axis 0: (low, high) arrays."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail], axis=0)
    return low, high


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one question with ``c`` correct among ``n`` samples (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), the chance that k of the n samples drawn without replacement hold a
    correct one; computed as 1 - prod(1 - k / (n-c+1 .. n)) (no large binomials); 1 when
    n - c < k. ValueError unless 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_at_ks(correct: np.ndarray) -> np.ndarray:
    """Per question, pass@1..pass@n and avg@n from an (questions x n samples) 0/1 array:
    (questions x (n + 1)); pass@1 equals avg@n (the mean correctness)."""
    correct = np.asarray(correct, dtype=float)
    n = correct.shape[1]
    counts = correct.sum(axis=1).round().astype(int)
    out = np.empty((correct.shape[0], n + 1))
    for i, c in enumerate(counts):
        out[i, :n] = [pass_at_k(n, int(c), k) for k in range(1, n + 1)]
    out[:, n] = correct.mean(axis=1)
    return out


AGREEMENT = ("em1_judge1", "em1_judge0", "em0_judge1", "em0_judge0")
"""A summary's ``judge_agreement`` keys per benchmark: rows by EM pass (1) or fail (0) and judge
correct (1) or not (0); in this order they are :func:`agreement`'s ``a, b, c, d``."""
AGREEMENT_MEASURES = ("em_fail_judge_pass", "em_pass_judge_fail", "kappa")
"""The judge-against-EM agreement measures (:func:`agreement`), in the report's order."""


def agreement(a: float, b: float, c: float, d: float) -> dict[str, float]:
    """Judge against EM from the 2x2 counts ``a`` = EM pass & judge correct, ``b`` = EM pass & judge
    not, ``c`` = EM fail & judge correct, ``d`` = EM fail & judge not (``unparsed`` counts as not):
    the share of EM failures the judge accepts c/(c+d), of EM passes it rejects b/(a+b), and
    Cohen's kappa (p_o - p_e)/(1 - p_e). NaN where a denominator is 0 (no EM failures, no EM
    passes, or p_e = 1: both raters constant)."""
    n = a + b + c + d
    nan = math.nan
    p_o = (a + d) / n if n else nan
    p_e = ((a + b) * (a + c) + (c + d) * (b + d)) / n**2 if n else nan
    return {
        "em_fail_judge_pass": c / (c + d) if c + d else nan,
        "em_pass_judge_fail": b / (a + b) if a + b else nan,
        "kappa": (p_o - p_e) / (1 - p_e) if n and p_e < 1 else nan,
    }


def bootstrap_agreement(
    counts: Sequence[int], n_boot: int, seed: int | Sequence[int], level: float = 0.95
) -> dict[str, tuple[float, float]]:
    """Percentile intervals of :func:`agreement`'s measures, resampling the rows: a multinomial draw
    of the 2x2 ``counts`` (a, b, c, d) is exactly a resample of its rows with replacement.
    Replicates where a measure is undefined are left out; (NaN, NaN) when none is defined."""
    counts = np.asarray(counts, dtype=float)
    n = int(counts.sum())
    if n == 0:
        return {m: (math.nan, math.nan) for m in AGREEMENT_MEASURES}
    draws = np.random.default_rng(seed).multinomial(n, counts / n, size=n_boot).astype(float)
    a, b, c, d = draws.T
    with np.errstate(divide="ignore", invalid="ignore"):
        p_o = (a + d) / n
        p_e = ((a + b) * (a + c) + (c + d) * (b + d)) / n**2
        values = {
            "em_fail_judge_pass": c / (c + d),
            "em_pass_judge_fail": b / (a + b),
            "kappa": np.where(p_e < 1, (p_o - p_e) / (1 - p_e), np.nan),
        }
    tail = (1 - level) / 2 * 100
    out = {}
    for name, v in values.items():
        v = v[np.isfinite(v)]
        out[name] = (
            (float(np.percentile(v, tail)), float(np.percentile(v, 100 - tail)))
            if len(v)
            else (math.nan, math.nan)
        )
    return out


def binomial_tail(k: int, seeds: int, hits: int) -> Fraction:
    """Exact P(a pre-specified shape is strictly last at >= ``hits`` of ``seeds`` seeds), each seed
    last with probability 1/k: the conservative test when it is last at only some seeds."""
    p = Fraction(1, k)
    return sum(
        (math.comb(seeds, j) * p**j * (1 - p) ** (seeds - j) for j in range(hits, seeds + 1)), Fraction(0)
    )


def seed_ci(values: Sequence[float], n_boot: int, key: str) -> tuple[float, float]:
    """95 % percentile interval of the mean of per-seed ``values`` over ``n_boot`` resamples of
    the seeds; the generator is seeded from ``key`` (what the interval describes), so a report
    regenerates exactly. NaN values are dropped; (NaN, NaN) with no value or ``n_boot`` < 1."""
    data = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if not len(data) or n_boot < 1:
        return math.nan, math.nan
    rng = np.random.default_rng(list(key.encode()))
    low, high = percentile_interval(bootstrap_means(data[:, None], n_boot, rng))
    return float(low[0]), float(high[0])


def ci_text(interval: tuple[float, float]) -> str:
    """A CI as ``[+low, +high]``; '-' when undefined (NaN)."""
    return "-" if math.isnan(interval[0]) else f"[{interval[0]:+.3f}, {interval[1]:+.3f}]"
