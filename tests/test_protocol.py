"""The one protocol module: prompt, schema, parser (verl qwen3_coder), passage formatter."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from search_env import protocol
from search_env.retrieval.corpus import Passage


def test_normalize_question():
    assert protocol.normalize_question("  who wrote hamlet ") == "who wrote hamlet?"
    assert protocol.normalize_question("Who wrote Hamlet?") == "Who wrote Hamlet?"
    with pytest.raises(ValueError, match="question"):
        protocol.normalize_question("  ")


def test_messages_carry_instruction_and_question():
    (message,) = protocol.build_messages("who wrote hamlet")
    assert message["role"] == "user"
    assert message["content"].endswith("Question: who wrote hamlet?")
    assert "<answer>" in message["content"] and "</answer>" in message["content"]


def test_schema_is_one_required_string_query():
    fn = protocol.SEARCH_TOOL_SCHEMA["function"]
    assert fn["name"] == "search" and fn["parameters"]["required"] == ["query"]
    assert fn["parameters"]["properties"] == {
        "query": {"type": "string", "description": fn["parameters"]["properties"]["query"]["description"]}
    }


def test_format_passages_and_cap():
    passages = [Passage(id=str(i), title=f"T{i}", text=f"text {i}") for i in range(7)]
    assert protocol.format_passages(passages[:2]) == "Doc 1 (Title: T0) text 0\nDoc 2 (Title: T1) text 1"
    assert protocol.format_passages(passages).count("\n") == protocol.TOPK - 1
    assert protocol.format_passages([]) == "No passages found."
    huge = [Passage(id="x", title="t" * 500, text="w" * 5000) for _ in range(protocol.TOPK)]
    text = protocol.format_passages(huge)
    assert len(text) <= protocol.TOOL_RESPONSE_CHAR_CAP
    assert text.startswith("Doc 1 (Title: " + "t" * 97 + "...) " + "w" * 997 + "...")


def test_parser_matches_verl_parser_on_model_tokens(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Let me look.\n\n" + protocol.render_search_call("capital of France") + "<|im_end|>"
    calls = protocol.parse_tool_calls(text)
    content, verl_calls = asyncio.run(protocol.get_tool_parser(tok).extract_tool_calls(tok.encode(text)))
    assert content == "Let me look.\n\n"
    assert calls == verl_calls and [c.name for c in calls] == ["search"]
    assert json.loads(calls[0].arguments) == {"query": "capital of France"}
    assert protocol.search_queries(text) == ["capital of France"]
    assert protocol.search_queries("<answer> Paris </answer>") == []


def test_answer_extractor_is_reward_fns():
    from reward_fns import extract_answer

    assert protocol.extract_answer is extract_answer
    assert (
        protocol.extract_answer("<tool_response><answer>x</answer></tool_response><answer> Paris </answer>")
        == "Paris"
    )


def test_chat_template_declares_tool_natively(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(
        protocol.build_messages("q"),
        tools=[protocol.SEARCH_TOOL_SCHEMA],
        tokenize=False,
        add_generation_prompt=True,
        **protocol.CHAT_TEMPLATE_KWARGS,
    )
    assert text.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + json.dumps(protocol.SEARCH_TOOL_SCHEMA)
    )
    assert text.endswith("Question: q?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
