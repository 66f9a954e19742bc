"""Unit checks of eval.stats: exact ranking probabilities, tie handling, the stratified bootstrap."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from eval.stats import (
    any_last_everywhere_probability,
    bootstrap_macro,
    bootstrap_means,
    last_everywhere_probability,
    percentile_interval,
    rank_groups,
    ranking_test,
    strictly_last,
)


def test_exact_probabilities():
    assert last_everywhere_probability(3, 3) == Fraction(1, 27)
    assert any_last_everywhere_probability(3, 3) == Fraction(1, 9)
    assert last_everywhere_probability(4, 2) == Fraction(1, 16)
    assert any_last_everywhere_probability(2, 1) == 1
    with pytest.raises(ValueError, match="at least 2 shapes"):
        last_everywhere_probability(1, 3)


def test_rank_groups_and_ties():
    assert rank_groups({"a": 0.3, "b": 0.5, "c": 0.3}) == [["b"], ["a", "c"]]
    assert strictly_last({"a": 0.3, "b": 0.5, "c": 0.2}) == "c"
    assert strictly_last({"a": 0.3, "b": 0.5, "c": 0.3}) is None
    assert strictly_last({"a": 0.3}) is None


def test_ranking_test_counts_only_complete_seeds():
    table = {
        42: {"em": 0.27, "f1": 0.30, "fmt": 0.31},
        43: {"em": 0.26, "f1": 0.29, "fmt": 0.30},
        44: {"em": 0.25, "f1": 0.33, "fmt": 0.30},
        45: {"em": 0.10, "f1": 0.20},  # lacks a shape: left out, does not change s
    }
    test = ranking_test(table, ["em", "f1", "fmt"])
    assert test.seeds == (42, 43, 44) and test.incomplete_seeds == (45,)
    assert test.last_everywhere == ("em",)
    assert test.p_given_shape == Fraction(1, 27) and test.p_any_shape == Fraction(1, 9)
    table[43]["f1"] = 0.26  # tie for last at seed 43: em is no longer strictly last everywhere
    tied = ranking_test(table, ["em", "f1", "fmt"])
    assert tied.last_by_seed[43] is None and tied.last_everywhere == ()
    assert tied.p_given_shape == Fraction(1, 27)  # the null probability does not depend on the outcome
    assert ranking_test({42: {"em": 0.1}}, ["em"]).p_given_shape is None


def test_bootstrap_matches_normal_theory_for_a_proportion():
    rng = np.random.default_rng(1)
    values = (rng.random((4000, 1)) < 0.3).astype(float)
    draws = bootstrap_means(values, 2000, np.random.default_rng(0))
    lo, hi = percentile_interval(draws)
    p = values.mean()
    half = 1.96 * np.sqrt(p * (1 - p) / len(values))
    assert lo[0] < p < hi[0]
    assert (hi[0] - lo[0]) / 2 == pytest.approx(half, rel=0.1)


def test_bootstrap_macro_is_stratified_and_reproducible():
    groups = {"a": np.ones((5, 2)), "b": np.zeros((50, 2)), "c": np.array([[0.0, 1.0], [1.0, 0.0]])}
    draws = bootstrap_macro(groups, {"avg": ["a", "b", "c"], "ab": ["a", "b"]}, 300, seed=7)
    # constant benchmarks never move; the macro of a and b is exactly 0.5 in every replicate
    assert np.all(draws["a"] == 1.0) and np.all(draws["b"] == 0.0) and np.all(draws["ab"] == 0.5)
    assert draws["avg"].shape == (300, 2)
    np.testing.assert_allclose(draws["avg"], (1.0 + 0.0 + draws["c"]) / 3)
    again = bootstrap_macro(groups, {"avg": ["a", "b", "c"]}, 300, seed=7)
    np.testing.assert_array_equal(again["avg"], draws["avg"])
    assert np.isnan(bootstrap_means(np.empty((0, 3)), 4, np.random.default_rng(0))).all()
