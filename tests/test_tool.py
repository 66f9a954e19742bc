"""SearchTool against the real BM25 server on loopback; failures become text, never exceptions."""

from __future__ import annotations

import asyncio
import socket

import pytest
from verl.experimental.agent_loop.tool_agent_loop import AgentData
from verl.tools.tool_registry import initialize_tools_from_config

from search_env import protocol
from search_env.cpu.local_rollout import REPO_ROOT
from search_env.tool import EMPTY_QUERY_TEXT, RETRIEVAL_FAILED_TEXT, SearchTool


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


def test_search_returns_formatted_passages(retrieval_server_url):
    tool = SearchTool({"type": "native", "retrieval_urls": [retrieval_server_url], "topk": 3})
    data = _agent_data()
    response, reward, _ = _run(tool, {"query": "Evan Morris lobbyist in Washington"}, data)
    lines = response.text.split("\n")
    assert len(lines) == 3 and reward == 0.0
    assert lines[0].startswith("Doc 1 (Title: Evan Morris) Evan Morris Evan L. Morris (January 26, 1977")
    assert [line.split(" (Title: ")[0] for line in lines] == ["Doc 1", "Doc 2", "Doc 3"]
    _run(tool, {"query": "Roche"}, data)
    assert data.extra_fields == {"searches": 2}


def test_unreachable_server_gives_error_text_and_count():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    tool = SearchTool(
        {"type": "native", "retrieval_urls": dead, "max_retries": 1, "backoff": 0.01, "timeout": 2}
    )
    data = _agent_data()
    response, _, _ = _run(tool, {"query": "anything"}, data)
    assert response.text == RETRIEVAL_FAILED_TEXT
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


def test_recipe_tool_yaml_loads_through_verl():
    (tool,) = initialize_tools_from_config(str(REPO_ROOT / "recipes" / "tools.yaml"))
    assert isinstance(tool, SearchTool) and tool.name == "search" and tool.topk == protocol.TOPK
    assert tool.client.urls == ["http://127.0.0.1:8000"]
    assert tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) == protocol.SEARCH_TOOL_SCHEMA
