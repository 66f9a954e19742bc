"""The linear-time scanners against the study's regexes: a seeded differential test on 120,000
generated strings, hypothesis properties, and 200 kB floods (correct results, no timing).

The oracle is the study's code as regexes (``tests/study_reference.py``), kept independently of
the project's scanners. The study's function-block regex backtracks exponentially in the number of
``<parameter=…>`` blocks without a ``</function>``, so the generated strings stay short (at most a
dozen fragments).
"""

from __future__ import annotations

import random
import re
import sys
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from study_reference import (
    study_extract_answer,
    study_format_violation,
    study_parse_query,
    study_tool_response_contents,
)

from reward_fns import SHAPES, extract_answer, format_violation, score_rollout
from reward_fns.compute_score import compute_score
from reward_fns.shapes import BatchShape
from search_env.protocol import parse_query, render_search_call, tool_response_contents

PAIRS: list[tuple[str, Callable[[str], object], Callable[[str], object]]] = [
    ("extract_answer", extract_answer, study_extract_answer),
    ("format_violation", format_violation, study_format_violation),
    ("parse_query", parse_query, study_parse_query),
    ("tool_response_contents", tool_response_contents, study_tool_response_contents),
]

# --- generated strings -----------------------------------------------------------------------

TAGS = [
    "<answer>",
    "</answer>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<function=search>",
    "<function=f_1>",
    "<function=_>",
    "<function=my-tool>",
    "<function=1x>",
    "<function=>",
    "<function=é>",
    "</function>",
    "<parameter=query>",
    "<parameter=q>",
    "<parameter=Query>",
    "<parameter=>",
    "</parameter>",
    "<tool_response>\n",
    "\n</tool_response>",
    "<tool_response>",
    "</tool_response>",
]
PIECES = ["<", ">", "/", "=", "<answer", "</answer", "<function=", "<parameter=", "query>", "tool_", "_call>"]
SPACE = [
    " ",
    "  ",
    "\n",
    "\t",
    "\r\n",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x1f",
    "\x85",
    "\xa0",
    "\u2003",
    "\u2028",
    "\u3000",
]
NOT_SPACE = ["\u200b", "\ufeff", "\x00"]  # zero-width space, BOM, NUL: not \s, not str.isspace
WORDS = ["x", "Paris", "a b", "é", "日本語", "🙂", "\ud800", "query", "answer", "function", "q1 ", " v "]
VOCAB = TAGS + PIECES + SPACE + NOT_SPACE + WORDS
CHARS = "<>/=_ \nabcefilnopqrstuwy"


def _fragment(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.55:
        return rng.choice(TAGS)
    if roll < 0.65:  # a random slice of a tag
        tag = rng.choice(TAGS)
        i = rng.randrange(len(tag))
        return tag[i : rng.randint(i + 1, len(tag))]
    if roll < 0.9:
        return rng.choice(VOCAB)
    return "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 4)))


def _rollout(rng: random.Random) -> str:
    """A well-formed rollout (calls, tool responses, a final answer) with whitespace variants."""

    def ws() -> str:
        return "".join(rng.choice(SPACE) for _ in range(rng.randint(0, 2)))

    parts = ["plan", ws(), "</think>", ws()]
    for _ in range(rng.randint(0, 2)):
        params = "".join(
            f"{ws()}<parameter={rng.choice(['query', 'q', 'k_2'])}>{ws()}{rng.choice(WORDS + [''])}{ws()}</parameter>{ws()}"
            for _ in range(rng.randint(1, 2))
        )
        parts.append(
            f"<tool_call>{ws()}<function={rng.choice(['search', 'f_1'])}>{params}</function>{ws()}</tool_call>"
        )
        parts.append(f"<tool_response>\n{rng.choice(WORDS)}\n</tool_response>{ws()}so</think>")
    parts.append(f"<answer>{ws()}{rng.choice(WORDS + [''])}{ws()}</answer>{ws()}")
    return "".join(parts)


def _mutate(text: str, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 3)):
        i = rng.randint(0, len(text))
        roll = rng.random()
        if roll < 0.5:
            text = text[:i] + _fragment(rng) + text[i:]
        elif roll < 0.8:
            text = text[:i] + text[rng.randint(i, min(len(text), i + 12)) :]
        else:
            j = rng.randint(i, min(len(text), i + 30))
            text = text[:j] + text[i:j] + text[j:]
    return text


def generated_strings(n: int, seed: int = 0) -> list[str]:
    """``n`` strings: random fragment sequences (60%), well-formed rollouts, mutated (30%) or not."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.6:
            out.append("".join(_fragment(rng) for _ in range(rng.randint(0, 12))))
        elif roll < 0.9:
            out.append(_mutate(_rollout(rng), rng))
        else:
            out.append(_rollout(rng))
    return out


N_DIFFERENTIAL = 120_000


def test_differential_against_the_study_regexes():
    texts = generated_strings(N_DIFFERENTIAL)
    assert len(texts) == N_DIFFERENTIAL
    outcomes: Counter[str] = Counter()
    for name, ours, study in PAIRS:
        for text in texts:
            got, want = ours(text), study(text)
            assert got == want, (name, text)
            outcomes[f"{name}:{_kind(name, want)}"] += 1
    # the strings reach every outcome, each many times
    for kind in [
        "extract_answer:None",
        "extract_answer:empty",
        "extract_answer:text",
        "format_violation:None",
        "format_violation:no </think>",
        "format_violation:more <think>",
        "format_violation:<tool_call> opens",
        "format_violation:tool call",
        "format_violation:<answer> opens",
        "format_violation:no <answer> block",
        "format_violation:does not end with </answer>",
        "parse_query:None",
        "parse_query:text",
        "tool_response_contents:empty",
        "tool_response_contents:text",
    ]:
        assert outcomes[kind] >= 100, (kind, outcomes)


def _kind(name: str, result: object) -> str:
    """The outcome class of one result: None / empty / text, or the rule a format message names."""
    if result is None:
        return "None"
    if name == "format_violation":
        assert isinstance(result, str)
        for prefix in ("no </think>", "more <think>", "<tool_call> opens", "tool call", "<answer> opens"):
            if result.startswith(prefix):
                return prefix
        return result
    return "text" if result else "empty"


def test_regex_whitespace_is_str_whitespace():
    """``\\s`` (what the regexes skip) and ``str.isspace`` (what ``str.strip`` drops) agree on every code point."""
    every = "".join(map(chr, range(sys.maxunicode + 1)))
    assert re.findall(r"\s", every) == [c for c in every if c.isspace()]


# --- hypothesis ------------------------------------------------------------------------------

fragments = st.lists(
    st.sampled_from(VOCAB) | st.text(alphabet=CHARS + "é\xa0\u2003", max_size=3), max_size=14
)
texts = fragments.map("".join)


@settings(max_examples=600)
@given(texts)
def test_property_extract_answer_is_the_study_regex(text):
    assert extract_answer(text) == study_extract_answer(text)


@settings(max_examples=600)
@given(texts)
def test_property_format_violation_is_the_study_regex(text):
    assert format_violation(text) == study_format_violation(text)


@settings(max_examples=600)
@given(texts)
def test_property_parse_query_is_the_study_regex(text):
    assert parse_query(text) == study_parse_query(text)
    assert tool_response_contents(text) == study_tool_response_contents(text)


@given(texts, st.text(max_size=20))
def test_property_closed_answer_is_found(prefix, value):
    """After a prefix without ``<answer>``, a closed answer is the answer."""
    assume("<answer>" not in prefix and "</answer>" not in value)
    assert extract_answer(f"{prefix}<answer>{value}</answer>") == value.strip()


@given(texts, st.text(max_size=20), texts)
def test_property_closed_call_is_found(prefix, value, noise):
    """After a prefix without a call, a query in the first closed call is the query, whatever follows."""
    assume(not any(tag in prefix + value for tag in ("<tool_call>", "<parameter=query>", "</parameter>")))
    assert parse_query(prefix + render_search_call(value) + noise) == (value.strip() or None)


# --- 200 kB floods: the results, not the time -------------------------------------------------

FLOOD = 200_000
"""Characters per flood text."""


def _flood(unit: str, size: int = FLOOD) -> str:
    return unit * (size // len(unit))


@pytest.mark.parametrize("tag", TAGS)
def test_flood_of_one_tag(tag):
    text = "</think>" + _flood(tag)
    n = text.count(tag)
    expected_gate = {
        "<think>": f"more <think> ({n}) than </think> (1)",
        "<tool_call>": f"<tool_call> opens {n} != closes 0",
        "</tool_call>": f"<tool_call> opens 0 != closes {n}",
        "<answer>": f"<answer> opens {n} != closes 0",
        "</answer>": f"<answer> opens 0 != closes {n}",
    }
    assert format_violation(text) == expected_gate.get(tag, "no <answer> block")
    assert extract_answer(text) is None
    assert parse_query(text) is None
    assert tool_response_contents(text) == []


def test_floods_that_reach_each_scan():
    # every <tool_call> after all the closes: balanced counts, yet no block, so no call to check
    k = FLOOD // 23
    calls = "</think>" + "</tool_call>" * k + "<tool_call>" * k
    assert format_violation(calls) == "no <answer> block"
    assert parse_query(calls) is None
    # one call holding many parameters and no </function>: the study's regex would backtrack 2^k
    params = _flood("<parameter=p>v</parameter>")
    body = "</think><tool_call><function=f>" + params + "{}</tool_call><answer>a</answer>"
    assert format_violation(body.format("")) == (
        "tool call 0 holds no <function=NAME><parameter=NAME>…</parameter></function>"
    )
    assert format_violation(body.format("</function>")) is None
    # many function heads without a </parameter>
    heads = "</think><tool_call>" + _flood("<function=f><parameter=p>") + "</tool_call><answer>a</answer>"
    assert format_violation(heads).startswith("tool call 0 holds no")
    # the query parser: floods of its tags and of whitespace
    queries = "<tool_call>" + _flood("<parameter=query>") + "</parameter></tool_call>"
    assert parse_query(queries) == "<parameter=query>" * (queries.count("<parameter=query>") - 1)
    assert parse_query("<tool_call><parameter=query>" + _flood("q</parameter>")) is None
    spaces = "<tool_call><parameter=query>" + _flood(" \n\u3000") + "{}</parameter></tool_call>"
    assert parse_query(spaces.format("")) is None
    assert parse_query(spaces.format("x")) == "x"
    # answers: many closed pairs, one long answer, answers inside a flood of opens
    assert extract_answer(_flood("<answer>a</answer>") + "<answer> last </answer>") == "last"
    long_body = _flood("word ")
    assert extract_answer(f"<answer>{long_body}</answer>") == long_body.strip()
    assert extract_answer(_flood("<answer>") + "x</answer>") == "<answer>" * (FLOOD // 8 - 1) + "x"
    responses = _flood("<tool_response>\n")
    assert tool_response_contents(responses + "\n</tool_response>") == [responses[16:]]


@pytest.mark.parametrize("shape", sorted(n for n, s in SHAPES.items() if not isinstance(s, BatchShape)))
def test_flood_scores_every_shape(shape):
    flooded = "</think>" + _flood("<answer>", FLOOD // 2) + _flood("<tool_call>", FLOOD // 2)
    assert compute_score(solution_str=flooded, ground_truth="a", shape=shape)["score"] == 0.0
    right = "</think>" + _flood("<answer>a</answer>") + "<answer> Paris </answer>"
    scored = score_rollout(right, ["Paris"])
    assert scored.well_formed == 1.0 and scored.em == 1.0
    assert compute_score(solution_str=right, ground_truth="Paris", shape=shape)["score"] == 1.0
