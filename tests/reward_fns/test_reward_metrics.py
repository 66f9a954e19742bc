"""Golden cases for the answer metrics: FlashRAG's evaluation metrics (EM, F1 with the yes/no rule,
ACC) and the study's training F1 (``f1_check``), which differ where the cases say so."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reward_fns import cover_match, evaluation_scores, exact_match, normalize_answer, token_f1, train_f1


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
    ("pred", "golds", "em", "f1", "train", "acc"),
    [
        ("The U.S.A.", "USA", 1, 1, 1, 1),
        ("James Madison", ["james madison"], 1, 1, 1, 1),
        ("no", "No.", 1, 1, 1, 1),
        ("yes", "no", 0, 0, 0, 0),
        ("yes it is", ["yes"], 0, 0, 0.5, 1),  # FlashRAG's yes/no rule; f1_check has none
        ("noanswer", "no answer", 0, 0, 0, 0),
        ("Titan IIIE rocket", "Titan IIIE", 0, 0.8, 0.8, 1),
        ("Olivia", ["Olivia", "MFSK"], 1, 1, 1, 1),  # multi-gold: max over golds
        ("MFSK mode", ["Olivia", "MFSK"], 0, 2 / 3, 2 / 3, 1),
        ("", ["Beijing"], 0, 0, 0, 0),  # empty prediction
        ("Beijing", [], 0, 0, 0, 0),  # no golds
        ("the", ["a"], 1, 0, 1, 1),  # both normalise to "": EM 1 (both studies), f1_check 1, FlashRAG F1 0
        ("Paris", ["the", "Paris"], 1, 1, 1, 1),
        ("house", ["us"], 0, 0, 0, 1),  # ACC is a plain substring test on normalised text
    ],
)
def test_metric_golden_cases(pred, golds, em, f1, train, acc):
    assert exact_match(pred, golds) == em
    assert token_f1(pred, golds) == pytest.approx(f1)
    assert train_f1(pred, golds) == pytest.approx(train)
    assert cover_match(pred, golds) == acc


def test_accepts_any_iterable_of_golds():
    assert exact_match("x", np.array(["y", "x"])) == 1.0
    assert exact_match("x", ("x",)) == 1.0


def test_evaluation_scores_a_missing_answer_as_flashrag_does():
    assert evaluation_scores("no answer here", ["Paris"]) == {
        "prediction": None,
        "em": 0.0,
        "f1": 0.0,
        "acc": 0.0,
        "well_formed": False,
    }
    # FlashRAG scores `extract_solution(...) or ""`: a gold that normalises to nothing matches it
    assert evaluation_scores("nothing", ["the"])["em"] == 1.0
    scored = evaluation_scores("t</think><answer>yes it is</answer>", ["yes"])
    assert (scored["prediction"], scored["f1"], scored["acc"], scored["well_formed"]) == (
        "yes it is",
        0.0,
        1.0,
        True,
    )


WORDS = st.lists(st.sampled_from(["the", "a", "yes", "no", "paris", "lyon", "x", "", "."]), max_size=5).map(
    " ".join
)


@settings(max_examples=300, deadline=None)
@given(pred=WORDS, golds=st.lists(WORDS, max_size=3))
def test_properties(pred, golds):
    em, f1, tf1, acc = (fn(pred, golds) for fn in (exact_match, token_f1, train_f1, cover_match))
    assert all(0.0 <= v <= 1.0 for v in (em, f1, tf1, acc))
    assert em <= acc and em <= tf1  # an exact match is covered and has full training F1
    if em and normalize_answer(pred):
        assert f1 == 1.0
    assert f1 <= tf1 or not golds  # the yes/no rule only removes credit
    assert token_f1(pred, golds) == token_f1(pred.upper(), [g.upper() for g in golds])
