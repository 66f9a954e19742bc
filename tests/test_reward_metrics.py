"""Golden cases for the answer metrics (SQuAD/FlashRAG semantics, HotpotQA yes/no rule)."""

import numpy as np
import pytest

from reward_fns import all_metrics, cover_match, exact_match, normalize_answer, token_f1


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("The U.S.A.", "usa"),
        ("  An   apple, a day!  ", "apple day"),
        ("Théâtre — “Le” Monde", "théâtre — “le” monde"),  # unicode punctuation survives (SQuAD)
        ("the", ""),
        ("", ""),
        ("Wilhelm Conrad Röntgen", "wilhelm conrad röntgen"),
    ],
)
def test_normalize_answer(raw, norm):
    assert normalize_answer(raw) == norm


@pytest.mark.parametrize(
    ("pred", "golds", "em", "f1", "acc"),
    [
        ("The U.S.A.", "USA", 1, 1, 1),
        ("James Madison", ["james madison"], 1, 1, 1),
        ("no", "No.", 1, 1, 1),
        ("yes", "no", 0, 0, 0),
        ("yes it is", ["yes"], 0, 0, 1),  # HotpotQA rule: gold is "yes", pred differs -> F1 0
        ("Titan IIIE rocket", "Titan IIIE", 0, 0.8, 1),
        ("Olivia", ["Olivia", "MFSK"], 1, 1, 1),  # multi-gold: max over golds
        ("MFSK mode", ["Olivia", "MFSK"], 0, 2 / 3, 1),
        ("", ["Beijing"], 0, 0, 0),  # empty prediction
        ("Beijing", [], 0, 0, 0),  # no golds
        ("the", ["a"], 0, 0, 0),  # both normalise to "": skipped, never EM=1 with F1=0
        ("Paris", ["the", "Paris"], 1, 1, 1),
        ("house", ["us"], 0, 0, 1),  # ACC is a plain substring test on normalised text
    ],
)
def test_metric_golden_cases(pred, golds, em, f1, acc):
    assert exact_match(pred, golds) == em
    assert token_f1(pred, golds) == pytest.approx(f1)
    assert cover_match(pred, golds) == acc
    assert all_metrics(pred, golds) == pytest.approx((em, f1, acc))


def test_yes_no_rule_matches_hotpotqa():
    # "yes it is" normalises to "yes it is", which is not a special answer; gold "yes" is, and differs.
    assert token_f1("yes it is", "yes") == 0.0
    assert token_f1("noanswer", "no answer") == 0.0
    assert token_f1("yes", "yes") == 1.0


def test_accepts_any_iterable_of_golds():
    assert exact_match("x", np.array(["y", "x"])) == 1.0
    assert exact_match("x", ("x",)) == 1.0
