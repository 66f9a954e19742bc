"""The one protocol module against the study's own code (sandheepp/reason_over_search @16ed974).

``tests/study_reference.py`` holds the study's values copied from its files (facts, not code):
they are what the protocol must equal, so each test can fail if ours drifts.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from study_reference import STUDY_PROMPT, STUDY_TOOL, study_first_prompt, study_tool_turn, study_truncate
from transformers import AutoTokenizer
from verl.tools.schemas import OpenAIFunctionToolSchema
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

from search_env import protocol
from search_env.retrieval.corpus import Passage


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_prompt_text_schema_and_thinking_are_the_study_values():
    assert protocol.PROMPT_TEMPLATE == STUDY_PROMPT
    assert protocol.SEARCH_TOOL_SCHEMA == STUDY_TOOL
    assert json.dumps(protocol.SEARCH_TOOL_SCHEMA) == json.dumps(STUDY_TOOL)  # key order: rendered by tojson
    assert protocol.CHAT_TEMPLATE_KWARGS == {"enable_thinking": True}
    assert protocol.STOP_STRINGS == ("</tool_call>", "</search>", "</answer>")
    assert protocol.CHUNK_CHAR_CAP == 1024 and protocol.TOPK == 5


@pytest.mark.parametrize("question", ["who wrote hamlet", "Who wrote Hamlet?", "  spaced question  "])
def test_first_prompt_equals_the_study_rendering_byte_for_byte(tok, question):
    """verl's own prompt builder (the agent loop's first tokens) == the study's rendered string."""
    schema = OpenAIFunctionToolSchema.model_validate(protocol.SEARCH_TOOL_SCHEMA)
    tools = [schema.model_dump(exclude_unset=True, exclude_none=True)]  # what ToolAgentLoop passes
    builder = create_continuous_token_builder(
        tok, hf_model_type="qwen3_5", chat_template_kwargs=protocol.CHAT_TEMPLATE_KWARGS
    )
    ids = builder.build_initial_tokens(protocol.build_messages(question), tools=tools)
    expected = study_first_prompt(question)
    assert tok.decode(ids) == expected
    assert ids == tok(expected, add_special_tokens=False)["input_ids"]  # the study tokenises the string


def test_question_rules():
    assert protocol.format_question("  who wrote hamlet ") == "  who wrote hamlet "  # training: as given
    assert protocol.format_question("  who wrote hamlet ", question_mark=True) == "who wrote hamlet?"
    assert protocol.format_question("Who?", question_mark=True) == "Who?"
    with pytest.raises(ValueError, match="question"):
        protocol.format_question("  ")
    with pytest.raises(TypeError):
        protocol.format_question(None)  # type: ignore[arg-type]
    (message,) = protocol.build_messages("who wrote hamlet", question_mark=True)
    assert message == {"role": "user", "content": STUDY_PROMPT.format("who wrote hamlet?")}


@pytest.mark.parametrize(
    ("text", "query"),
    [
        (protocol.render_search_call("capital of France"), "capital of France"),
        (
            "think</think>\n\n<tool_call>\n<function=lookup>\n<parameter=query>\n  q1 \n</parameter>\n</function>\n</tool_call>",
            "q1",
        ),
        (
            "<tool_call><function=search><parameter=query>a</parameter></function></tool_call>"
            "<tool_call><function=search><parameter=query>b</parameter></function></tool_call>",
            "a",
        ),
        (
            "<tool_call>\n<function=search>\n<parameter=query>\nq\n</parameter>\n</function>\n",
            None,
        ),  # unclosed
        (
            "<tool_call>\n<function=search>\n<parameter=query>\n \n</parameter>\n</function>\n</tool_call>",
            None,
        ),
        ("<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>\n</tool_call>", None),
        ("<answer> Paris </answer>", None),
    ],
)
def test_parse_query_is_the_study_rule(text, query):
    assert protocol.parse_query(text) == query


TURN_PIECES = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<function=search>",
        "<parameter=query>",
        "</parameter>",
        "<answer>",
        "</answer>",
        "</search>",
        "</think>",
        " ",
        "\n",
        "q",
    ]
)
TURN_TEXTS = st.lists(TURN_PIECES | st.text(alphabet="<>/=_ \nacelnopqrstuwy", max_size=3), max_size=12).map(
    "".join
)


@settings(max_examples=500)
@given(TURN_TEXTS, st.booleans(), st.sampled_from([protocol.STOP_STRINGS, protocol.EVAL_STOP_STRINGS]))
def test_property_classify_turn_is_the_two_step_reading(text, ended, stops):
    """``classify_turn`` gives what the agent loop's two separate readings of a turn gave."""
    extract_answer = protocol.extract_answer
    # verl's parser: a turn holding an answer calls nothing, else the study's query.
    query = None if extract_answer(text) is not None else protocol.parse_query(text)
    # The loop's termination label, from a second reading of the same text.
    stopped = ended or protocol.find_stop(text, stops) is not None
    answered = stopped and extract_answer(text) is not None
    if not stopped:
        termination = "length_cap"
    elif answered:
        termination = "answer"
    elif protocol.parse_query(text) is not None:
        termination = "turn_cap"
    elif "</tool_call>" in text:
        termination = "error"
    else:
        termination = "answer"
    assert protocol.classify_turn(text, ended, stops) == protocol.TurnReading(
        text, query, answered, termination
    )


@pytest.mark.parametrize(
    ("text", "ended", "query", "answered", "termination"),
    [
        (protocol.render_search_call("q"), False, "q", False, "turn_cap"),
        (protocol.render_search_call("q") + protocol.render_answer("a"), False, None, True, "answer"),
        ("<tool_call>\n<parameter=q>\nx\n</parameter>\n</tool_call>", False, None, False, "error"),
        ("no tags", True, None, False, "answer"),
        ("<answer> cut", False, None, False, "length_cap"),
        ("", False, None, False, "length_cap"),
    ],
)
def test_classify_turn_cases(text, ended, query, answered, termination):
    turn = protocol.classify_turn(text, ended)
    assert (turn.query, turn.answered, turn.termination) == (query, answered, termination)


def test_stop_rules(tok):
    assert protocol.find_stop("a</answer>b</tool_call>") == len("a</answer>")
    assert protocol.find_stop("no stop here") is None
    params = protocol.stop_sampling_params(tok)
    assert params["stop"] == list(protocol.STOP_STRINGS) and params["include_stop_str_in_output"] is True
    # </tool_call> is one token (as in Qwen3.5); </answer> and </search> are not
    assert params["stop_token_ids"] == [tok.convert_tokens_to_ids("</tool_call>")]
    call = "x</think>\n\n" + protocol.render_search_call("q")
    assert protocol.scripted_turn_ids(tok, call + "<tool_response>invented") == tok.encode(call)
    assert protocol.scripted_turn_ids(tok, "plain") == tok.encode("plain") + [tok.eos_token_id]


def test_chunk_caps(tok):
    exact = "x" * 1024
    assert protocol.cap_chunk(exact) == exact
    cut = protocol.cap_chunk(exact + "y")
    assert len(cut) == 1024 and cut == study_truncate(exact + "y", 1024)
    long = " ".join(f"word{i}" for i in range(400))
    capped = protocol.cap_chunk(long, 120, "tokens", tok)
    marker_ids = tok.encode(protocol.TRUNCATION_MARKER, add_special_tokens=False)
    head = tok.decode(
        tok.encode(long, add_special_tokens=False)[: 120 - len(marker_ids)], skip_special_tokens=True
    )
    assert capped == head + protocol.TRUNCATION_MARKER  # active_pipeline.py's token cap
    assert protocol.cap_chunk("short", 120, "tokens", tok) == "short"
    with pytest.raises(ValueError, match="tokenizer"):
        protocol.cap_chunk(long, 120, "tokens")
    with pytest.raises(ValueError, match=">= 1"):
        protocol.cap_chunk("x", 0)


@given(docs=st.lists(st.text(min_size=1, max_size=1500), min_size=1, max_size=5))
def test_tool_turn_equals_format_docs_qwen_native(docs):
    chunks = [protocol.cap_chunk(d) for d in docs]
    text = protocol.tool_turn_text(protocol.tool_response_text(chunks))
    assert text == study_tool_turn(docs)
    assert len(protocol.tool_response_text(chunks)) <= protocol.TOOL_RESPONSE_CHAR_CAP


def test_one_tool_message_renders_one_block_per_passage(tok):
    """The tool text, as ONE template tool message, renders like one tool message per passage."""
    docs = ['"Paris"\nParis is the capital of France.', '"France"\nFrance is a country.']
    prefix = protocol.build_messages("q") + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "search", "arguments": {"query": "x"}}}],
        }
    ]
    one = tok.apply_chat_template(
        prefix + [{"role": "tool", "content": protocol.tool_response_text(docs)}], tokenize=False
    )
    many = tok.apply_chat_template(prefix + [{"role": "tool", "content": d} for d in docs], tokenize=False)
    assert one == many
    assert protocol.tool_response_contents(one) == docs


def test_passage_contents_prefers_the_raw_row():
    assert (
        protocol.passage_contents(Passage(id="1", title="Paris", text="Paris is big."))
        == '"Paris"\nParis is big.'
    )


def test_presets():
    train, study = protocol.PRESETS["train"], protocol.PRESETS["study_eval"]
    assert (train.max_assistant_turns, train.max_turn_tokens, train.max_total_tokens) == (10, 1024, 8192)
    assert (train.chunk_cap, train.chunk_cap_unit, train.invalid_action, train.question_mark) == (
        1024,
        "chars",
        "end",
        False,
    )
    assert (study.max_assistant_turns, study.max_turn_tokens, study.max_total_tokens) == (5, 8192, 8192)
    assert (study.chunk_cap, study.chunk_cap_unit, study.invalid_action, study.question_mark) == (
        120,
        "tokens",
        "retry",
        True,
    )
    assert study.stop_strings == ("</tool_call>", "</answer>")


def test_answer_helpers():
    from reward_fns import extract_answer

    assert protocol.extract_answer is extract_answer
    assert protocol.render_answer("Paris") == "<answer> Paris </answer>"
    assert extract_answer(protocol.render_answer("Paris")) == "Paris"
