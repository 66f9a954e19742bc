"""Answer extraction, the study's format gate (one golden pass/fail pair per rule), the three shapes
and verl's loader on our entry points."""

import random
import re
import string
from collections import Counter
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reward_fns import (
    cover_match,
    exact_match,
    extract_answer,
    format_violation,
    is_well_formed,
    normalize_answer,
    token_f1,
    train_f1,
)
from reward_fns.compute_score import compute_score, em_only, f1_format, f1_only, gold_answers
from search_env.paths import REPO_ROOT

CASES = REPO_ROOT / "tests" / "fixtures" / "search-r1-example" / "case.txt"
CALL = "<tool_call>\n<function=search>\n<parameter=query>\n{q}\n</parameter>\n</function>\n</tool_call>"


def _to_qwen35(search_r1_text: str) -> str:
    """Rewrite a Search-R1 transcript into Qwen3.5's native tags (same content, same order)."""
    text = re.sub(r"<search>\s*(.*?)\s*</search>", lambda m: CALL.format(q=m.group(1)), search_r1_text)
    return text.replace("<information>", "<tool_response>\n").replace("</information>", "\n</tool_response>")


def _trajectories() -> list[str]:
    raw = CASES.read_text()
    return [t for t in raw.split("<|im_start|>system") if t.strip()]


def _response(trajectory: str) -> str:
    return trajectory.split("<|im_start|>assistant\n", 1)[1]


def test_real_trajectories_extract_last_answer():
    first, second = (_to_qwen35(t) for t in _trajectories())
    # The full text still holds the prompt's "<answer> Beijing </answer>" example: the last one wins.
    assert extract_answer(first) == "Charger"
    assert extract_answer(second) == "sinoatrial (SA) node"
    assert extract_answer(_response(second)) == "sinoatrial (SA) node"


def test_real_trajectories_format_gate():
    first, second = (_response(_to_qwen35(t)) for t in _trajectories())
    assert is_well_formed(first)
    # a stray extra </think> is allowed by the study's rule (opens <= closes: the template opens turns)
    assert second.count("</think>") > second.count("<think>") and is_well_formed(second)
    gold = ["SA node", "sinoatrial node"]
    scored = f1_format(solution_str=second, ground_truth=gold)
    assert scored["score"] == scored["f1"] == f1_only(solution_str=second, ground_truth=gold)["score"] > 0


OK = (
    "plan</think>\n\n"
    + CALL.format(q="q")
    + "\nuser\n<tool_response>\nP\n</tool_response>\nassistant\nso</think>\n\n<answer> x </answer>"
)


@pytest.mark.parametrize(
    ("rule", "passing", "failing"),
    [
        ("1 needs a </think>", "a</think><answer>x</answer>", "<answer>x</answer>"),
        (
            "1 opens <= closes",
            "<think>a</think>b</think><answer>x</answer>",
            "<think><think>a</think><answer>x</answer>",
        ),
        ("2 calls balanced", OK, OK.replace("</tool_call>", "", 1)),
        (
            "3 call body shape",
            "t</think><tool_call><function=example_function_name><parameter=x></parameter></function></tool_call><answer>a</answer>",
            "t</think><tool_call>search for x</tool_call><answer>a</answer>",
        ),
        (
            "3 empty body / non-identifier name",
            "t</think><tool_call> <function=f_1><parameter=q_2>v</parameter></function> </tool_call><answer>a</answer>",
            "t</think><tool_call><function=my-tool><parameter=q>v</parameter></function></tool_call><answer>a</answer>",
        ),
        ("4 answers balanced", "t</think><answer>a</answer>", "t</think><answer>a</answer><answer>"),
        ("4 at least one answer", "t</think><answer></answer>", "t</think>no answer at all"),
        ("5 ends with </answer>", "t</think><answer>a</answer> \n\n", "t</think><answer>a</answer> extra"),
    ],
)
def test_gate_rules_golden(rule, passing, failing):
    assert format_violation(passing) is None, rule
    assert format_violation(failing) is not None, rule
    assert f1_format(solution_str=failing, ground_truth="a")["score"] == 0.0


def test_gate_reads_tool_responses_as_the_study_does():
    # the study scores the joined assistant + tool text: tags inside retrieved passages count too
    leaked = OK.replace("\nP\n", "\nP <think> Q\n")
    assert OK.count("<think>") == 0 and format_violation(leaked) is None  # 1 open <= 2 closes
    assert format_violation(OK.replace("\nP\n", "\n<answer>\n")) is not None


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<answer> Paris </answer>", "Paris"),
        ("<answer>a</answer> then <answer>b</answer>", "b"),
        ("<answer>mine</answer><tool_response><answer>passage</answer></tool_response>", "passage"),
        ("<answer>a<answer>b</answer>", "a<answer>b"),  # leftmost, shortest match (re.finditer)
        ("no tags at all", None),
        ("<answer>unclosed", None),
        ("<answer>\n multi\nline \n</answer>", "multi\nline"),
    ],
)
def test_extract_answer_is_the_study_rule(text, answer):
    assert extract_answer(text) == answer


def test_f1_format_floor_replaces_zero_only():
    good_wrong = "x</think><answer>Marlowe</answer>"
    assert f1_format(solution_str=good_wrong, ground_truth="William Shakespeare")["score"] == 0.1
    partial = f1_format(
        solution_str="x</think><answer>Shakespeare</answer>", ground_truth="William Shakespeare"
    )
    assert partial["score"] == pytest.approx(2 / 3)  # F1 > 0: no bonus added
    assert (
        f1_format(solution_str="<answer>Marlowe</answer>", ground_truth="Marlowe")["score"] == 0.0
    )  # no </think>
    assert f1_format(solution_str="Marlowe", ground_truth="Marlowe")["score"] == 0.0  # no answer block
    assert (
        em_only(solution_str="<answer>the Marlowe</answer>", ground_truth="Marlowe")["score"] == 1.0
    )  # no gate


def test_training_f1_has_no_yes_no_rule():
    # training_m5_1's f1_check: "yes it is" vs "yes" overlaps; FlashRAG's evaluation F1 would give 0
    assert f1_only(solution_str="<answer>yes it is</answer>", ground_truth="yes")["score"] == pytest.approx(
        0.5
    )
    assert f1_only(solution_str="<answer> the </answer>", ground_truth="a")["score"] == 1.0  # both empty


@pytest.mark.parametrize(
    "ground_truth",
    [
        "Paris",
        ["Lyon", "Paris"],
        np.array(["Lyon", "Paris"], dtype=object),
        {"target": ["Paris"]},
        {"target": np.array(["Paris", "City of Light"], dtype=object)},
    ],
)
def test_ground_truth_forms(ground_truth):
    out = compute_score("musique", "<answer>Paris</answer>", ground_truth, shape="em_only")
    assert set(out) == {"score", "em", "f1", "acc", "well_formed", "answered"}
    assert out["score"] == out["em"] == 1.0


def test_gold_answers_flattens_and_drops_none():
    assert gold_answers({"target": np.array([["a", None], ["b"]], dtype=object)}) == ["a", "b"]
    assert gold_answers(None) == []


def test_unknown_shape_names_the_field():
    with pytest.raises(ValueError, match="reward_kwargs.shape"):
        compute_score("nq", "<answer>x</answer>", "x", shape="f2")


def test_non_string_solution_scores_zero():
    out = compute_score("nq", None, "x")
    assert out["score"] == 0.0 and out["answered"] == 0.0


TAGS = st.sampled_from(
    [
        "<answer>",
        "</answer>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
        "<function=search>",
        "<parameter=query>",
        "</parameter>",
        "</function>",
        "<|im_end|>",
        " the ",
        "yes",
        "no",
        "Paris",
        "\n",
        ".",
        "",
    ]
)
TEXT = st.lists(st.one_of(TAGS, st.text(max_size=12)), max_size=30).map("".join)
GOLDS = st.one_of(st.text(max_size=15), st.lists(st.one_of(st.text(max_size=10), TAGS), max_size=4))


@settings(max_examples=400, deadline=None)
@given(text=TEXT, golds=GOLDS)
def test_properties_never_raise_and_bounded(text, golds):
    results = {
        shape: compute_score("x", text, golds, shape=shape) for shape in ("em_only", "f1_only", "f1_format")
    }
    for out in results.values():
        assert all(0.0 <= v <= 1.0 for v in out.values())
    r = results["f1_only"]
    assert r["em"] <= r["acc"]
    if r["em"] == 1.0:
        assert r["f1"] == 1.0
    fmt = results["f1_format"]["score"]
    assert fmt in (0.0, 0.1) or 0.0 < fmt <= 1.0
    assert fmt == 0.0 or r["well_formed"] == 1.0
    if r["answered"] == 0.0:
        assert r["em"] == r["f1"] == r["acc"] == 0.0
    if r["well_formed"]:
        assert r["answered"] == 1.0 and text.rstrip().endswith("</answer>")


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_property_gate_ignores_role_markers_and_trailing_space(text):
    """The study scores text with role markers; verl decodes without them: the gate cannot tell."""
    marked = text.replace("<tool_response>", "<|im_end|>\n<|im_start|>user\n<tool_response>")
    assert is_well_formed(marked) == is_well_formed(text) == is_well_formed(text + " \n")
    if is_well_formed(text):
        assert not is_well_formed(text + "x") and not is_well_formed(text + "<answer>")


@settings(max_examples=200, deadline=None)
@given(answer=st.text(max_size=20).filter(lambda s: "<answer>" not in s and "</answer>" not in s), noise=TEXT)
def test_property_last_answer_wins(answer, noise):
    text = f"{noise}<answer>{answer}</answer>"
    if noise.count("<answer>") > noise.count("</answer>"):
        return  # an open <answer> in the noise pairs with our closing tag (leftmost match)
    assert extract_answer(text) == answer.strip()


def test_entry_points_load_through_verl():
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.import_utils import load_extern_object

    for name in ("em_only", "f1_only", "f1_format", "compute_score"):
        fn = load_extern_object("pkg://reward_fns.compute_score", name)
        assert (
            fn(data_source="musique", solution_str="<answer>Paris</answer>", ground_truth=["Paris"])["em"]
            == 1.0
        )
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": "pkg://reward_fns.compute_score",
                    "name": "f1_format",
                    "reward_kwargs": {},
                }
            }
        }
    )
    fn = get_custom_reward_fn(cfg)
    assert (
        fn(data_source="nq", solution_str="t</think><answer>Lyon</answer>", ground_truth="Paris")["score"]
        == 0.1
    )


def test_a_shape_added_to_the_registry_is_a_verl_entry_point(monkeypatch):
    """One SHAPES entry is all a built-in shape needs: verl loads it by name, the same object every
    time (Ray pickles it by reference), and the launcher's and study's name checks accept it."""
    import pickle

    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.import_utils import load_extern_object

    import reward_fns.compute_score as entry_points
    from reward_fns.shapes import SHAPES
    from study.spec import shape_overrides

    def half_em(s):
        """Half credit for an exact match."""
        return s.em / 2

    assert not set(SHAPES) & set(vars(entry_points)), "a module global would hide a shape's entry point"
    monkeypatch.setitem(SHAPES, "half_em", half_em)
    monkeypatch.setattr(entry_points, "_ENTRY_POINTS", {})
    fn = load_extern_object("pkg://reward_fns.compute_score", "half_em")
    assert fn is entry_points.half_em and fn.__name__ == "half_em" and pickle.loads(pickle.dumps(fn)) is fn
    right = "t</think><answer>Paris</answer>"
    assert fn(data_source="nq", solution_str=right, ground_truth=["Paris"]) == {
        "score": 0.5,
        "em": 1.0,
        "f1": 1.0,
        "acc": 1.0,
        "well_formed": 1.0,
        "answered": 1.0,
    }
    cfg = {"path": "pkg://reward_fns.compute_score", "name": "half_em", "reward_kwargs": {}}
    verl_fn = get_custom_reward_fn(OmegaConf.create({"reward": {"custom_reward_function": cfg}}))
    assert verl_fn(data_source="nq", solution_str=right, ground_truth="Paris")["score"] == 0.5
    assert shape_overrides("half_em", "cells") == ("half_em", ["shape=half_em"])
    with pytest.raises(AttributeError, match="no_such_shape"):
        load_extern_object("pkg://reward_fns.compute_score", "no_such_shape")
    with pytest.raises(AttributeError, match="built-in shapes"):
        entry_points.no_such_shape  # noqa: B018


# --- the metrics against the textbook SQuAD / FlashRAG / f1_check code, on seeded random text ---


@lru_cache(maxsize=4096)  # the tests call it with the same strings many times
def _ref_normalize(s: str) -> str:
    """SQuAD v1.1's ``normalize_answer``, as written there."""

    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def _ref_overlap(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = 1.0 * num_same / len(pred_tokens)
    recall = 1.0 * num_same / len(gold_tokens)
    return (2 * precision * recall) / (precision + recall)


def _ref_em(pred: str, golds: list[str]) -> float:
    return max((float(_ref_normalize(pred) == _ref_normalize(g)) for g in golds), default=0.0)


def _ref_acc(pred: str, golds: list[str]) -> float:
    return max((float(_ref_normalize(g) in _ref_normalize(pred)) for g in golds), default=0.0)


def _ref_f1_check(pred: str, golds: list[str]) -> float:
    """The study's ``f1_check``: both empty 1.0, one empty 0, else token F1; max over golds."""
    best = 0.0
    for gold in golds:
        p, g = _ref_normalize(pred).split(), _ref_normalize(gold).split()
        if not p and not g:
            best = max(best, 1.0)
        elif p and g:
            best = max(best, _ref_overlap(p, g))
    return best


def _ref_flashrag_f1(pred: str, golds: list[str]) -> float:
    """FlashRAG's ``F1_Score``: yes/no/noanswer differing from the other side is skipped."""
    best = 0.0
    for gold in golds:
        p, g = _ref_normalize(pred), _ref_normalize(gold)
        if p in ["yes", "no", "noanswer"] and p != g:
            continue
        if g in ["yes", "no", "noanswer"] and p != g:
            continue
        best = max(best, _ref_overlap(p.split(), g.split()))
    return best


_PIECES = (
    ["the", "The", "THE", "a", "A", "an", "An", "yes", "No", "noanswer", "Paris", "word", "thea", "ant"]
    + ["théâtre", "Röntgen", "straße", "İstanbul", "ǅ", "²", "Ⅻ", "٣", "日本", "😀", "x_y", "1999"]
    + list(string.punctuation)
    + ["—", "–", "“", "”", "’", "…", "\u0301", "\u200b", "\x00", "\x7f", "\ud800", "\udc00", "€"]
)
_SPACES = [" ", " ", " ", "  ", "\t", "\n", "\xa0", "\u3000", "\x1c", ""]


def _random_text(rng: random.Random, n_pieces: int) -> str:
    return "".join(rng.choice(_PIECES) + rng.choice(_SPACES) for _ in range(n_pieces))


def _random_case(rng: random.Random) -> tuple[str, list[str]]:
    long = rng.random() < 0.1
    pred = _random_text(rng, rng.randint(300, 1500) if long else rng.randint(0, 8))
    golds = [_random_text(rng, rng.randint(0, 4)) for _ in range(rng.randint(0, 3))]
    roll = rng.random()
    if roll < 0.15:
        golds.append(pred.upper() + rng.choice(["", ".", " the", "!!"]))  # normalises to pred, mostly
    elif roll < 0.3 and pred:
        start = rng.randrange(len(pred))
        golds.append(pred[start : start + rng.randint(1, 30)])  # a piece of the prediction
    rng.shuffle(golds)
    return pred, golds


def test_metrics_equal_the_textbook_definitions_on_random_text():
    from reward_fns.registry import evaluation_metrics, training_metrics

    rng = random.Random(20240611)
    long_preds = 0
    for _ in range(3000):
        pred, golds = _random_case(rng)
        long_preds += len(pred) > 512
        assert normalize_answer(pred) == _ref_normalize(pred), pred
        for gold in golds:
            assert normalize_answer(gold) == _ref_normalize(gold), gold
        em, acc = _ref_em(pred, golds), _ref_acc(pred, golds)
        train, flash = _ref_f1_check(pred, golds), _ref_flashrag_f1(pred, golds)
        # exact float equality: the same operations in the same order, not approximately equal
        assert (exact_match(pred, golds), cover_match(pred, golds)) == (em, acc), (pred, golds)
        assert (train_f1(pred, golds), token_f1(pred, golds)) == (train, flash), (pred, golds)
        assert training_metrics(pred, golds) == {"em": em, "f1": train, "acc": acc}, (pred, golds)
        assert evaluation_metrics(pred, golds) == {"em": em, "f1": flash, "acc": acc}, (pred, golds)
        if golds:  # a single gold string is the one-element list
            assert train_f1(pred, golds[0]) == _ref_f1_check(pred, golds[:1])
    assert long_preds > 200  # the uncached path for long predictions is exercised too


def test_metrics_on_one_long_answer_body():
    """The worst case of bench/scoring.py: one answer of ~40,000 tokens, scored against short golds."""
    from reward_fns.registry import evaluation_metrics, training_metrics

    for body in ("word " * 40_000, "Wörd, the— " * 18_000, " ".join(str(i) for i in range(20_000))):
        for golds in (["word", "Paris"], ["wörd —"], ["19999", "the 7"], [body.upper()], ["no"]):
            em, acc = _ref_em(body, golds), _ref_acc(body, golds)
            assert training_metrics(body, golds) == {"em": em, "f1": _ref_f1_check(body, golds), "acc": acc}
            assert evaluation_metrics(body, golds) == {
                "em": em,
                "f1": _ref_flashrag_f1(body, golds),
                "acc": acc,
            }
