"""Answer extraction, the study's format gate (one golden pass/fail pair per rule), the three shapes
and verl's loader on our entry points."""

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reward_fns import extract_answer, format_violation, is_well_formed
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
