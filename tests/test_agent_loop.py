"""SearchAgentLoop through verl's own AgentLoopWorker (in process), tiny Qwen3.5, real BM25 server."""

from __future__ import annotations

import socket

import pytest

from search_env import protocol
from search_env.cpu.local_rollout import rollout_records

pytestmark = pytest.mark.timeout(300)

QUESTION = "who was evan morris"
SEARCH_TURN = protocol.render_search_call("Evan Morris lobbyist Genentech")


def _row(agent_name: str = "search_agent", index: int = 0) -> dict:
    return {
        "prompt": protocol.build_messages(QUESTION),
        "data_source": "demo",
        "agent_name": agent_name,
        "reward_model": {"ground_truth": {"target": ["lobbyist"]}},
        "extra_info": {"index": index, "tools_kwargs": {"search": {"create_kwargs": {"id": str(index)}}}},
    }


def test_tool_call_on_last_turn_is_turn_cap(make_local_rollout):
    rollout = make_local_rollout(scripted_first_turn=SEARCH_TURN, max_assistant_turns=1, max_turn_tokens=64)
    batch = rollout.generate([_row()], n=2)
    for record in rollout_records(batch, rollout.tokenizer):
        # the only allowed assistant turn still calls the tool: verl stops before running it
        assert record["termination"] == "turn_cap"
        assert record["searches"] == 0 and record["search_errors"] == 0
        assert record["answered"] is False
        assert record["response"] == SEARCH_TURN + "<|im_end|>"
        assert record["model_tokens"] + record["retrieved_tokens"] == record["response_length"]
    assert set(batch.non_tensor_batch["agent_name"]) == {"search_agent"}


def test_search_result_reaches_model_and_counts(make_local_rollout):
    rollout = make_local_rollout(scripted_first_turn=SEARCH_TURN, max_assistant_turns=2, max_turn_tokens=64)
    (record,) = rollout_records(rollout.generate([_row()]), rollout.tokenizer)
    assert record["searches"] == 1
    assert "<tool_response>\nDoc 1 (Title: Evan Morris) Evan Morris Evan L. Morris" in record["response"]
    assert record["retrieved_tokens"] > 100  # the passages are in the response, masked
    # second turn: 64 sampled tokens (cut) or an earlier EOS; either way the loop says why it ended
    assert record["termination"] in {"length_cap", "answer", "error"}
    assert record["model_tokens"] == record["response_length"] - record["retrieved_tokens"]


def test_answer_first_turn(make_local_rollout):
    rollout = make_local_rollout(scripted_first_turn="<answer> lobbyist </answer>", max_turn_tokens=64)
    (record,) = rollout_records(rollout.generate([_row()]), rollout.tokenizer)
    assert record == {
        **record,
        "termination": "answer",
        "answered": True,
        "searches": 0,
        "retrieved_tokens": 0,
    }


def test_unreadable_tool_call_is_error(make_local_rollout):
    rollout = make_local_rollout(
        scripted_first_turn="<tool_call>\nsearch for evan\n</tool_call>", max_turn_tokens=64
    )
    (record,) = rollout_records(rollout.generate([_row()]), rollout.tokenizer)
    assert record["termination"] == "error" and record["searches"] == 0


def test_turn_token_cap_is_length_cap(make_local_rollout):
    rollout = make_local_rollout(scripted_first_turn=None, max_turn_tokens=4)
    records = rollout_records(rollout.generate([_row()], n=2), rollout.tokenizer)
    # the random tiny model does not emit EOS within 4 tokens with these seeds
    assert [r["termination"] for r in records] == ["length_cap", "length_cap"]
    assert [r["model_tokens"] for r in records] == [4, 4]


def test_tool_response_over_response_length_is_dropped(make_local_rollout):
    rollout = make_local_rollout(scripted_first_turn=SEARCH_TURN, response_length=120, max_turn_tokens=64)
    (record,) = rollout_records(rollout.generate([_row()]), rollout.tokenizer)
    assert record["termination"] == "length_cap" and record["searches"] == 1
    assert "<tool_response>" not in record["response"] and record["retrieved_tokens"] == 0


def test_tool_response_over_total_budget_is_dropped(make_local_rollout):
    prompt_tokens = len(
        make_local_rollout().tokenizer.apply_chat_template(
            protocol.build_messages(QUESTION),
            tools=[protocol.SEARCH_TOOL_SCHEMA],
            add_generation_prompt=True,
            enable_thinking=False,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
    rollout = make_local_rollout(
        scripted_first_turn=SEARCH_TURN, max_total_tokens=prompt_tokens + 120, max_turn_tokens=64
    )
    (record,) = rollout_records(rollout.generate([_row()]), rollout.tokenizer)
    assert record["termination"] == "length_cap" and record["searches"] == 1
    assert "<tool_response>" not in record["response"]
    assert record["response"].startswith(SEARCH_TURN)


def test_retrieval_failure_becomes_error_text_not_exception(make_local_rollout):
    with socket.socket() as sock:  # a loopback port with nothing listening
        sock.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    rollout = make_local_rollout(
        scripted_first_turn=SEARCH_TURN,
        retrieval_urls=[dead_url],
        max_retries=0,
        max_assistant_turns=2,
        max_turn_tokens=64,
    )
    (record,) = rollout_records(rollout.generate([_row()]), rollout.tokenizer)
    assert record["searches"] == 1 and record["search_errors"] == 1
    assert "<tool_response>\nSearch failed: the search service did not answer." in record["response"]


def test_extra_fields_reach_the_batch(make_local_rollout):
    rollout = make_local_rollout(scripted_first_turn=SEARCH_TURN, max_assistant_turns=2, max_turn_tokens=64)
    batch = rollout.generate([_row(index=0), _row(index=1)], n=2)
    for key in ("termination", "searches", "search_errors", "model_tokens", "retrieved_tokens", "answered"):
        assert len(batch.non_tensor_batch[key]) == 4, key
    assert list(batch.non_tensor_batch["index"]) == [0, 0, 1, 1]
