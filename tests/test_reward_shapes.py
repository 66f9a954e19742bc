"""Answer extraction, the format gate, the three shapes and verl's loader on our entry points."""

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reward_fns import extract_answer, is_well_formed
from reward_fns.compute_score import compute_score, em_only, f1_format, f1_only, gold_answers

CASES = Path(__file__).parent / "fixtures" / "search-r1-example" / "case.txt"
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
    assert is_well_formed(first)  # balanced think, closed search calls, ends with the answer
    assert not is_well_formed(second)  # a stray </think> before the answer
    gold = ["SA node", "sinoatrial node"]
    scored = f1_format(solution_str=second, ground_truth=gold)
    assert scored["score"] == 0.0 and scored["f1"] > 0  # the gate zeroes a partially right answer
    assert f1_only(solution_str=second, ground_truth=gold)["score"] == scored["f1"]


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<answer> Paris </answer>", "Paris"),
        ("<answer>a</answer> then <answer>b</answer>", "b"),
        ("<tool_response>\n<answer>leaked</answer>\n</tool_response>", None),
        ("<answer>mine</answer><tool_response><answer>leaked</answer></tool_response>", "mine"),
        ("<tool_response> unclosed <answer>x</answer>", None),
        ("no tags at all", None),
        ("<answer>unclosed", None),
        ("<answer></answer>", ""),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


GOOD = (
    "I should search.\n\n" + CALL.format(q="who wrote Hamlet") + "<|im_end|>\nuser\n<tool_response>\n"
    "Doc 1 (Title: Hamlet) Hamlet is a tragedy by William Shakespeare. <answer>fake</answer>\n"
    "</tool_response>\nassistant\n<think>\nIt is Shakespeare.\n</think>\n\n<answer>William Shakespeare</answer>"
)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (GOOD, True),
        (GOOD + "<|im_end|>\n", True),
        (GOOD + " trailing words", False),
        (GOOD + CALL.format(q="again"), False),  # tool call after the answer
        (GOOD.replace("</think>", ""), False),  # unbalanced think
        ("</think>\n\n<answer>x</answer>", True),  # thinking prompt opened the block
        (GOOD.replace("<parameter=query>\nwho wrote Hamlet\n", "<parameter=query>\n  \n"), False),
        (GOOD.replace("<function=search>", "<function=lookup>"), False),
        (GOOD.replace("</tool_call>", "", 1), False),  # unclosed call
        ("<answer>a</answer>\n<answer>b</answer>", False),  # two answer blocks
        ("just text", False),
    ],
)
def test_is_well_formed(text, ok):
    assert is_well_formed(text) is ok


def test_f1_format_floor_replaces_zero_only():
    good_wrong = "<answer>Marlowe</answer>"
    assert f1_format(solution_str=good_wrong, ground_truth="William Shakespeare")["score"] == 0.1
    partial = f1_format(solution_str="<answer>Shakespeare</answer>", ground_truth="William Shakespeare")
    assert partial["score"] == pytest.approx(2 / 3)  # F1 > 0: no bonus added
    assert f1_format(solution_str="Marlowe", ground_truth="Marlowe")["score"] == 0.0  # no answer block
    assert em_only(solution_str="<answer>the Marlowe</answer>", ground_truth="Marlowe")["score"] == 1.0


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
    assert r["em"] <= r["f1"]
    if r["em"] == 1.0:
        assert r["f1"] == 1.0
    fmt = results["f1_format"]["score"]
    assert fmt in (0.0, 0.1) or 0.0 < fmt <= 1.0
    assert fmt == 0.0 or r["well_formed"] == 1.0
    if r["answered"] == 0.0:
        assert r["em"] == r["f1"] == r["acc"] == 0.0


@settings(max_examples=200, deadline=None)
@given(answer=st.text(max_size=20).filter(lambda s: "<" not in s), noise=TEXT)
def test_property_last_answer_wins(answer, noise):
    text = f"{noise}<answer>{answer}</answer>"
    if "<tool_response>" in noise and "</tool_response>" not in noise.split("<tool_response>")[-1]:
        assert extract_answer(text) == extract_answer(noise)  # an unclosed tool response swallows the rest
    else:
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
    assert fn(data_source="nq", solution_str="<answer>Lyon</answer>", ground_truth="Paris")["score"] == 0.1


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_strip_tool_responses_matches_regex_definition(text):
    from reward_fns import strip_tool_responses

    expected = re.sub(r"<tool_response>.*?(?:</tool_response>|\Z)", "", text, flags=re.DOTALL)
    assert strip_tool_responses(text) == expected
