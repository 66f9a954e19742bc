"""SearchAgentLoop through verl's own AgentLoopWorker (in process), tiny Qwen3.5, real BM25 server.

The scripted tests drive the loop with a fake LLM client returning fixed token ids, and compare
the whole token sequence and loss mask with the study's, built independently from the study's
rules (``tests/study_reference.py`` holds the study's literals).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from conftest import search_rollout_config
from study_reference import study_first_prompt, study_tool_turn
from transformers import AutoTokenizer
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from search_env import protocol
from search_env.agent_loop import StudyQueryParser
from search_env.retrieval.process import free_port
from search_env.verl_glue import (
    compose_rollout_config,
    rollout_records,
    rows_to_batch,
    write_tool_config,
)

pytestmark = pytest.mark.timeout(300)

QUESTION = "who was evan morris"
Q1, Q2 = "Evan Morris lobbyist", "Genentech parent company"
T1 = "The question asks about a person.\n</think>\n\n" + protocol.render_search_call(Q1)
T2 = "He worked for Genentech.\n</think>\n\n" + protocol.render_search_call(Q2)
T3 = "Found it.\n</think>\n\n<answer> lobbyist </answer>"


class ScriptedClient(LLMServerClient):
    """A fake LLM server: the k-th call of a trajectory returns the ids of ``turns[k]``."""

    def __init__(self, config: Any, tokenizer: Any, turns: list[str]):
        super().__init__(config, load_balancer_handle=None)
        self.tokenizer, self.turns = tokenizer, turns
        self.calls: dict[str, list[dict[str, Any]]] = {}

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **_: Any):
        calls = self.calls.setdefault(request_id, [])
        calls.append({"prompt_ids": list(prompt_ids), "sampling_params": dict(sampling_params)})
        ids = self.tokenizer.encode(self.turns[len(calls) - 1], add_special_tokens=False)
        ids = ids[: sampling_params.get("max_tokens", len(ids))]
        return TokenOutput(
            token_ids=ids,
            log_probs=[-0.5] * len(ids),
            stop_reason="completed",
            extra_fields={"global_steps": 0, "min_global_steps": 0, "max_global_steps": 0},
        )


def _row(index: int = 0, agent_name: str = "search_agent", question_mark: bool = False) -> dict:
    return {
        "prompt": protocol.build_messages(QUESTION, question_mark),
        "data_source": "demo",
        "agent_name": agent_name,
        "reward_model": {"ground_truth": {"target": ["lobbyist"]}},
        "extra_info": {"index": index, "tools_kwargs": {"search": {"create_kwargs": {"id": str(index)}}}},
    }


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, tiny_model_dir, retrieval_server_url):
    """``run(turns, **loop_options)`` -> (batch, client): verl's worker over a ScriptedClient."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def run(turns: list[str], max_assistant_turns: int = 10, rows=None, response_length: int = 8192, **loop):
        config = search_rollout_config(
            tmp_path_factory.mktemp("scripted"),
            tiny_model_dir,
            [retrieval_server_url],
            max_retries=0,
            response_length=response_length,
            max_assistant_turns=max_assistant_turns,
            **loop,
        )
        client = ScriptedClient(config, tok, turns)
        worker = AgentLoopWorker(config, llm_client=client)
        batch = rows_to_batch(rows or [_row()], n=1)
        batch.meta_info["validate"] = False
        return asyncio.run(worker.generate_sequences(batch)), client

    return tok, run


def _retrieved(url: str, query: str) -> list[str]:
    body = {"queries": [query], "topk": protocol.TOPK, "return_scores": False}
    hits = httpx.post(f"{url}/retrieve", json=body, timeout=10).json()["result"][0]
    return [h.get("document", h)["contents"] for h in hits]


def _sequence(batch, i: int = 0) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, response mask) of rollout ``i``, padding removed."""
    width = batch.batch["prompts"].shape[1]
    attention = batch.batch["attention_mask"][i]
    prompt = batch.batch["prompts"][i][attention[:width] == 1].tolist()
    n = int(attention[width:].sum())
    return prompt, batch.batch["responses"][i, :n].tolist(), batch.batch["response_mask"][i, :n].tolist()


class CountingTokenizer:
    """A tokenizer's ``decode``, recording every call's ids."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.decoded = tokenizer, []

    def decode(self, ids: list[int]) -> str:
        self.decoded.append(list(ids))
        return self.tokenizer.decode(ids)


def test_parser_decodes_each_turn_once(tiny_model_dir):
    """verl's parser call and the loop's termination label share one decode of the turn."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    counting = CountingTokenizer(tok)
    parser = StudyQueryParser(counting, protocol.STOP_STRINGS, [tok.eos_token_id])
    call, answer = (tok.encode(t, add_special_tokens=False) for t in (T1, T3))
    text, calls = asyncio.run(parser.extract_tool_calls(call))
    assert text == tok.decode(call) and [c.name for c in calls] == [protocol.TOOL_NAME]
    assert parser.read(list(call)) == protocol.classify_turn(text) and parser.read(call).query == Q1
    assert parser.read(answer).termination == "answer" and parser.read(answer).answered
    assert counting.decoded == [call, answer]


def test_two_search_rollout_is_the_study_token_sequence(scripted, retrieval_server_url):
    tok, run = scripted
    batch, client = run([T1, T2, T3])
    prompt, response, mask = _sequence(batch)

    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    env1 = enc(study_tool_turn(_retrieved(retrieval_server_url, Q1)))
    env2 = enc(study_tool_turn(_retrieved(retrieval_server_url, Q2)))
    assert prompt == enc(study_first_prompt(QUESTION))
    assert response == enc(T1) + env1 + enc(T2) + env2 + enc(T3)
    assert mask == [1] * len(enc(T1)) + [0] * len(env1) + [1] * len(enc(T2)) + [0] * len(env2) + [1] * len(
        enc(T3)
    )
    # the model saw exactly the study's context before each turn, and was asked to stop the study's way
    (calls,) = client.calls.values()
    assert [c["prompt_ids"] for c in calls] == [
        prompt,
        prompt + enc(T1) + env1,
        prompt + enc(T1) + env1 + enc(T2) + env2,
    ]
    params = calls[0]["sampling_params"]
    assert params["stop"] == list(protocol.STOP_STRINGS) and params["include_stop_str_in_output"] is True
    assert tok.convert_tokens_to_ids("</tool_call>") in params["stop_token_ids"]
    assert params["max_tokens"] == 1024
    assert calls[2]["sampling_params"]["max_tokens"] == 1024
    record = {
        k: batch.non_tensor_batch[k][0] for k in ("termination", "searches", "answered", "model_tokens")
    }
    assert record == {"termination": "answer", "searches": 2, "answered": True, "model_tokens": sum(mask)}
    assert tok.decode(response).endswith("<answer> lobbyist </answer>")  # no <|im_end|> after the stop


def test_unmasked_ablation_keeps_the_sequence_and_trains_on_tool_tokens(scripted):
    _, run = scripted
    batch, _ = run([T1, T3], rows=[_row(0), _row(1, "search_agent_unmasked")])
    (_, masked_ids, masked), (_, unmasked_ids, unmasked) = _sequence(batch, 0), _sequence(batch, 1)
    assert masked_ids == unmasked_ids and 0 in masked
    assert unmasked == [1] * len(unmasked_ids)
    assert batch.non_tensor_batch["retrieved_tokens"][1] == masked.count(0) > 100


def test_tool_call_on_the_last_turn_is_turn_cap(scripted):
    tok, run = scripted
    batch, _ = run([T1], max_assistant_turns=1)
    _, response, _ = _sequence(batch)
    assert response == tok.encode(T1, add_special_tokens=False)  # verl stops before running the tool
    assert (
        batch.non_tensor_batch["termination"][0] == "turn_cap" and batch.non_tensor_batch["searches"][0] == 0
    )


def test_unreadable_call_ends_or_retries(scripted):
    tok, run = scripted
    bad = "hmm</think>\n\n<tool_call>\nsearch for evan\n</tool_call>"
    batch, _ = run([bad, T3])
    assert batch.non_tensor_batch["termination"][0] == "error" and batch.non_tensor_batch["searches"][0] == 0
    batch, client = run([bad, T3], invalid_action="retry", stop_strings=list(protocol.EVAL_STOP_STRINGS))
    _, response, mask = _sequence(batch)
    note = tok.encode(protocol.INVALID_ACTION_TEXT, add_special_tokens=False)
    turn1, turn3 = tok.encode(bad, add_special_tokens=False), tok.encode(T3, add_special_tokens=False)
    assert response == turn1 + note + turn3  # the study's evaluation loop: note, then the same turn goes on
    assert mask == [1] * len(turn1) + [0] * len(note) + [1] * len(turn3)
    assert batch.non_tensor_batch["termination"][0] == "answer"
    assert next(iter(client.calls.values()))[0]["sampling_params"]["stop"] == list(protocol.EVAL_STOP_STRINGS)


def test_tool_turn_over_the_budget_is_cut_and_ends(scripted):
    tok, run = scripted
    batch, client = run([T1, T3], response_length=60)
    _, response, mask = _sequence(batch)
    turn1 = tok.encode(T1, add_special_tokens=False)
    assert len(response) == 60 and response[: len(turn1)] == turn1  # the study keeps what fits, then stops
    assert mask == [1] * len(turn1) + [0] * (60 - len(turn1))
    assert batch.non_tensor_batch["termination"][0] == "length_cap"
    assert len(next(iter(client.calls.values()))) == 1


def test_turn_budget_and_total_budget(scripted):
    tok, run = scripted
    batch, client = run(["x" * 400], max_turn_tokens=7)
    assert next(iter(client.calls.values()))[0]["sampling_params"]["max_tokens"] == 7
    assert batch.non_tensor_batch["termination"][0] == "length_cap"  # cut without a stop
    prompt_len = len(tok(study_first_prompt(QUESTION), add_special_tokens=False)["input_ids"])
    _, client = run(["x" * 400], max_total_tokens=prompt_len + 5)
    assert next(iter(client.calls.values()))[0]["sampling_params"]["max_tokens"] == 5


def test_study_eval_question_mark_reaches_the_prompt(scripted):
    tok, run = scripted
    batch, _ = run([T3], rows=[_row(question_mark=True)])
    prompt, _, _ = _sequence(batch)
    assert tok.decode(prompt).endswith(
        "Question: who was evan morris?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_retrieval_failure_becomes_the_study_error_text(scripted, tmp_path_factory, tiny_model_dir):
    tok, _ = scripted
    dead_url = f"http://127.0.0.1:{free_port()}"  # a loopback port with nothing listening
    folder = tmp_path_factory.mktemp("dead")
    tools = write_tool_config(folder / "tools.yaml", [dead_url], timeout=2.0, max_retries=0)
    config = compose_rollout_config(tiny_model_dir, tools, response_length=2048)
    worker = AgentLoopWorker(config, llm_client=ScriptedClient(config, tok, [T1, T3]))
    batch = rows_to_batch([_row()], n=1)
    batch.meta_info["validate"] = False
    out = asyncio.run(worker.generate_sequences(batch))
    (record,) = rollout_records(out, tok)
    assert record["searches"] == 1 and record["search_errors"] == 1
    assert out.non_tensor_batch["retrieval_failures"][0] == 1
    assert "<|im_start|>user\n<tool_response>\nRetriever failed: " in record["response"]
    assert record["termination"] == "answer"


def test_sampled_turns_with_the_hf_generator_stop_or_are_cut(make_local_rollout):
    """The real HF generator (tiny random model): a turn ends at EOS/a stop string, or is length_cap."""
    rollout = make_local_rollout(scripted_first_turn=T1, max_assistant_turns=2, max_turn_tokens=64)
    (record,) = rollout_records(rollout.generate([_row()]), rollout.tokenizer)
    assert record["searches"] == 1
    assert record["response"].startswith(T1 + "<|im_end|>\n<|im_start|>user\n<tool_response>\n")
    assert record["termination"] in {"length_cap", "answer", "error"}
    assert record["model_tokens"] + record["retrieved_tokens"] == record["response_length"]


def test_any_function_name_with_a_query_searches(scripted):
    """The study runs the query whatever the function is called (early policies copied the
    template's `example_function_name`); a call without a `query` parameter runs nothing."""
    _, run = scripted
    named = T1.replace("<function=search>", "<function=example_function_name>")
    batch, _ = run([named, T3])
    assert batch.non_tensor_batch["searches"][0] == 1 and batch.non_tensor_batch["termination"][0] == "answer"
    no_query = T1.replace("<parameter=query>", "<parameter=example_parameter_1>")
    batch, _ = run([no_query, T3])
    assert batch.non_tensor_batch["searches"][0] == 0 and batch.non_tensor_batch["termination"][0] == "error"


def test_stock_verl_tool_loop_renders_the_same_blocks(scripted, retrieval_server_url):
    """Under verl's own ToolAgentLoop (agent ``tool_agent``) the SearchTool text renders as the
    study's blocks; only verl's turn framing differs (recipes/tools.yaml documents both)."""
    tok, run = scripted
    batch, _ = run([T1, T3], rows=[_row(agent_name="tool_agent")])
    _, response, _ = _sequence(batch)
    text = tok.decode(response)
    study = study_tool_turn(_retrieved(retrieval_server_url, Q1))
    blocks = study[len("<|im_end|>\n<|im_start|>user\n") : -len("<|im_end|>\n<|im_start|>assistant\n")]
    assert f"<|im_start|>user\n{blocks}<|im_end|>\n<|im_start|>assistant\n<think>\n" in text
    assert study not in text  # verl neither closes the stopped turn nor leaves <think> out
