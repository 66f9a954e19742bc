"""SearchTool against the real BM25 server on loopback; failures become text, never exceptions."""

from __future__ import annotations

import asyncio
import time

import pytest
from verl.experimental.agent_loop.tool_agent_loop import AgentData
from verl.tools.tool_registry import initialize_tools_from_config

from search_env import protocol
from search_env.paths import REPO_ROOT
from search_env.retrieval.process import free_port
from search_env.tool import EMPTY_QUERY_TEXT, SearchTool


def _agent_data() -> AgentData:
    return AgentData(
        messages=[],
        image_data=None,
        video_data=None,
        audio_data=None,
        mm_processor_kwargs=None,
        metrics={},
        request_id="r",
        tools_kwargs={},
    )


def _run(tool: SearchTool, parameters: dict, agent_data: AgentData):
    async def go():
        instance_id, _ = await tool.create(create_kwargs={})
        try:
            return await tool.execute(instance_id, parameters, agent_data=agent_data)
        finally:
            await tool.release(instance_id)

    return asyncio.run(go())


def test_search_returns_one_block_per_raw_passage(retrieval_server_url, tiny_model_dir):
    tool = SearchTool({"type": "native", "retrieval_urls": [retrieval_server_url], "topk": 3})
    data = _agent_data()
    response, reward, _ = _run(tool, {"query": "Evan Morris lobbyist in Washington"}, data)
    chunks = protocol.tool_response_contents(protocol.tool_turn_text(response.text))
    assert len(chunks) == 3 and reward == 0.0
    assert chunks[0].startswith('"Evan Morris"\nEvan Morris Evan L. Morris (January 26, 1977')
    assert all(len(c) <= protocol.CHUNK_CHAR_CAP for c in chunks)
    _run(tool, {"query": "Roche"}, data)
    assert data.extra_fields == {"searches": 2}
    capped = SearchTool(
        {
            "type": "native",
            "retrieval_urls": [retrieval_server_url],
            "chunk_cap": 40,
            "chunk_cap_unit": "chars",
        }
    )
    first = protocol.tool_response_contents(
        protocol.tool_turn_text(_run(capped, {"query": "Evan Morris"}, data)[0].text)
    )
    assert all(len(c) <= 40 for c in first) and first[0].endswith(protocol.TRUNCATION_MARKER)
    tokens = SearchTool(
        {
            "type": "native",
            "retrieval_urls": [retrieval_server_url],
            "chunk_cap": 12,
            "chunk_cap_unit": "tokens",
            "tokenizer": str(tiny_model_dir),
        }
    )
    text = _run(tokens, {"query": "Evan Morris"}, data)[0].text
    assert all(
        len(tokens.tokenizer.encode(c)) <= 12 + 2
        for c in protocol.tool_response_contents(protocol.tool_turn_text(text))
    )  # decode/re-encode may merge at most a token at each end


def test_unreachable_server_gives_error_text_and_count():
    dead = f"http://127.0.0.1:{free_port()}"
    tool = SearchTool(
        {"type": "native", "retrieval_urls": dead, "max_retries": 1, "backoff": 0.01, "timeout": 2}
    )
    data = _agent_data()
    response, _, _ = _run(tool, {"query": "anything"}, data)
    assert response.text.startswith("Retriever failed: retrieval failed after 2 tries")
    assert data.extra_fields == {"searches": 1, "search_errors": 1, "retrieval_failures": 1}


def test_retry_budget_bounds_a_failed_search(tmp_path):
    """Without max_retries the tool's retry_budget_s (seconds) ends the tries, then the error text."""
    dead = f"http://127.0.0.1:{free_port()}"
    tool = SearchTool(
        {"type": "native", "retrieval_urls": [dead], "retry_budget_s": 1.0, "backoff": 0.05, "timeout": 2}
    )
    assert tool.client.max_retries is None and tool.client.retry_budget_s == 1.0
    data = _agent_data()
    start = time.monotonic()
    response, _, metrics = _run(tool, {"query": "anything"}, data)
    assert 1.0 <= time.monotonic() - start < 4.0
    assert (
        response.text.startswith("Retriever failed: retrieval failed after ")
        and "retry_budget_s=1" in response.text
    )
    assert metrics == {"error": "retrieval"} and data.extra_fields["retrieval_failures"] == 1


def test_no_documents_is_a_search_error_not_a_retrieval_failure(retrieval_server_url):
    tool = SearchTool({"type": "native", "retrieval_urls": [retrieval_server_url]})
    data = _agent_data()
    response, _, metrics = _run(tool, {"query": "the of"}, data)  # stop words only: BM25 finds nothing
    assert protocol.NO_DOCUMENTS_TEXT.format("the of") in response.text and metrics == {"hits": 0}
    assert data.extra_fields == {"searches": 1, "search_errors": 1}


@pytest.mark.parametrize("parameters", [{}, {"query": "   "}, {"query": 3}])
def test_bad_query_gives_error_text(retrieval_server_url, parameters):
    tool = SearchTool({"type": "native", "retrieval_urls": [retrieval_server_url]})
    data = _agent_data()
    assert _run(tool, parameters, data)[0].text == EMPTY_QUERY_TEXT
    assert data.extra_fields == {"searches": 1, "search_errors": 1}


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="retrieval_urls"):
        SearchTool({"type": "native"})
    with pytest.raises(ValueError, match="topk"):
        SearchTool({"type": "native", "retrieval_urls": ["http://127.0.0.1:1"], "topk": 0})
    with pytest.raises(ValueError, match="tokenizer"):
        SearchTool({"type": "native", "retrieval_urls": ["http://127.0.0.1:1"], "chunk_cap_unit": "tokens"})
    with pytest.raises(ValueError, match="chunk_cap"):
        SearchTool({"type": "native", "retrieval_urls": ["http://127.0.0.1:1"], "chunk_cap_unit": "words"})


def test_recipe_tool_yaml_loads_through_verl():
    (tool,) = initialize_tools_from_config(str(REPO_ROOT / "recipes" / "tools.yaml"))
    assert isinstance(tool, SearchTool) and tool.name == "search" and tool.topk == protocol.TOPK
    assert (tool.chunk_cap, tool.chunk_cap_unit) == (protocol.CHUNK_CHAR_CAP, "chars")
    assert tool.client.urls == ["http://127.0.0.1:8000"]
    assert (tool.client.retry_budget_s, tool.client.max_retries) == (60, None)
    assert tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) == protocol.SEARCH_TOOL_SCHEMA
