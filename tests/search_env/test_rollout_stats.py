"""The per-step training metrics on hand-computed rollouts."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from search_env.rollout_stats import group_metrics, group_of, rollout_metrics


def _rollout(score, termination="answer", searches=1, answered=True, em=None):
    return {
        "termination": termination,
        "searches": searches,
        "search_errors": 0,
        "model_tokens": 100,
        "retrieved_tokens": 300 * searches,
        "answered": answered,
        "reward_extra_info": {"score": score, "em": score if em is None else em, "f1": score, "acc": score},
    }


def test_hand_computed_step():
    fields = [
        _rollout(1.0),
        _rollout(0.0, searches=2),
        _rollout(1.0),  # group a: mixed
        _rollout(0.0, "length_cap", 3, answered=False),
        _rollout(0.0, "turn_cap", 0, answered=False),
        _rollout(0.0, "error", 0, answered=False),  # group b: all zero -> zero variance
    ]
    groups = ["a", "a", "a", "b", "b", "b"]
    m = rollout_metrics(fields, groups)
    assert m["reward/mean"] == pytest.approx(2 / 6)
    assert m["rollout/searches_mean"] == pytest.approx(7 / 6)
    assert m["rollout/retrieved_tokens_mean"] == pytest.approx(300 * 7 / 6)
    assert m["rollout/abort_ratio"] == pytest.approx(0.5)
    assert m["rollout/termination/answer"] == pytest.approx(0.5)
    assert m["rollout/termination/length_cap"] == m["rollout/length_clip_ratio"] == pytest.approx(1 / 6)
    assert m["rollout/termination/turn_cap"] == m["rollout/termination/error"] == pytest.approx(1 / 6)
    assert m["grpo/zero_variance_group_frac"] == 0.5
    assert m["grpo/group_reward_std_mean"] == pytest.approx(math.sqrt(2 / 9) / 2)


def test_search_errors_and_retrieval_failures_are_counted_per_step():
    fields = [
        {**_rollout(1.0), "search_errors": 2, "retrieval_failures": 1},  # + one "no documents"
        {**_rollout(0.0), "search_errors": 1, "retrieval_failures": 1},
        {**_rollout(0.0), "search_errors": 1, "retrieval_failures": 0},  # an empty query
    ]
    m = rollout_metrics(fields, ["a", "a", "b"])
    assert m["rollout/search_errors"] == 4.0 and m["rollout/search_errors_mean"] == pytest.approx(4 / 3)
    assert m["rollout/retrieval_failures"] == 2.0
    assert "rollout/retrieval_failures" not in rollout_metrics([_rollout(1.0)], ["a"])  # not recorded


def test_missing_fields_are_absent_not_zero():
    m = rollout_metrics([{"reward_extra_info": {"score": 0.5}}], ["a"])
    assert m == {"reward/mean": 0.5}
    assert rollout_metrics([], []) == {}
    with pytest.raises(ValueError, match="differ in length"):
        rollout_metrics([{}], [])


def test_group_of_transfer_queue_keys():
    assert group_of("3f2a_b1_4_0") == "3f2a_b1"
    assert group_of("uid_2_0") == "uid"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abcd"), st.sampled_from([0.0, 0.1, 0.5, 1.0])), min_size=1, max_size=40
    )
)
def test_group_metrics_bounded_and_consistent(pairs):
    groups, scores = zip(*pairs, strict=True)
    m = group_metrics(scores, groups)
    if not m:
        return
    assert 0.0 <= m["grpo/zero_variance_group_frac"] <= 1.0
    assert 0.0 <= m["grpo/group_reward_std_mean"] <= 0.5
    constant = sum(
        len({s for g2, s in pairs if g2 == g}) == 1
        for g in set(groups)
        if sum(g2 == g for g2, _ in pairs) >= 2
    )
    assert m["grpo/zero_variance_group_frac"] == pytest.approx(constant / m["grpo/groups"])
