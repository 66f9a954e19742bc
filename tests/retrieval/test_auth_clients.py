"""Every client of a retriever started with ``--auth-token-file`` sends the bearer token from one
token file: RetrievalClient, the start-up probe, the evaluation's check and the search tool (also as
verl builds it from a run's tools.yaml). A missing or wrong token is a 401 that names
``retriever.auth_token_file`` at once, without retries; an unusable file fails before any request."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import token_file
from verl.tools.tool_registry import initialize_tools_from_config

from search_env import protocol
from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.auth import AuthFileError
from search_env.retrieval.client import RetrievalClient, RetrievalError
from search_env.retrieval.probe import ProbeError, check_retrievers, probe, search_once, wait_healthy
from search_env.retrieval.process import spawn_server
from search_env.tool import SearchTool
from search_env.verl_glue import write_tool_config

TOKEN = "right-token-0123456789abcdef"
WRONG = "wrong-token-0123456789abcdef"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> tuple[Path, Path]:
    """(the server's token file, a file holding another token)."""
    folder = tmp_path_factory.mktemp("tokens")
    return token_file(folder / "right", TOKEN), token_file(folder / "wrong", WRONG)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokens):
    log = tmp_path_factory.mktemp("auth-server") / "server.log"
    args = ["--backend", "bm25", "--corpus", str(SAMPLE_CORPUS), "--auth-token-file", str(tokens[0])]
    with spawn_server(args, startup_timeout_s=60, log_path=log) as started:
        yield started


@pytest.fixture()
def sent(monkeypatch) -> list[str]:
    """The URL of every request an httpx.AsyncClient sends from now on (retries and probes too)."""
    urls: list[str] = []
    send = httpx.AsyncClient.send

    async def counting(self, request, **kwargs):
        urls.append(f"{request.method} {request.url}")
        return await send(self, request, **kwargs)

    monkeypatch.setattr(httpx.AsyncClient, "send", counting)
    return urls


def _retrieve(client: RetrievalClient, query: str = "Evan Morris lobbyist") -> list:
    async def go() -> list:
        async with client:
            return await client.retrieve([query], topk=3)

    return asyncio.run(go())


@pytest.mark.slow
def test_client_with_the_token_gets_passages(server, tokens) -> None:
    got = _retrieve(RetrievalClient(server.url, max_retries=0, auth_token_file=tokens[0]))
    assert got[0][0].title == "Evan Morris"


@pytest.mark.parametrize("which", ["none", "wrong"])
def test_a_missing_or_wrong_token_fails_at_once_naming_the_setting(server, tokens, sent, which) -> None:
    file = None if which == "none" else tokens[1]
    client = RetrievalClient(
        [server.url, server.url], max_retries=5, backoff=5.0, health_interval_s=0.01, auth_token_file=file
    )
    with pytest.raises(RetrievalError, match=r"HTTP 401: .*retriever\.auth_token_file") as err:
        _retrieve(client)
    assert sent == [f"POST {server.url}/retrieve"]  # one request: no retry, no /health probe
    assert client.down == []  # the replica is fine; the token is not
    text = str(err.value)
    assert TOKEN not in text and WRONG not in text
    assert (str(tokens[1]) in text and "refused" in text) if file else "none was sent" in text


def test_an_unusable_token_file_fails_at_construction_naming_it(tmp_path) -> None:
    missing = tmp_path / "absent"
    with pytest.raises(AuthFileError, match=f"{missing}: cannot read it"):
        RetrievalClient("http://127.0.0.1:9", auth_token_file=missing)
    shared = token_file(tmp_path / "shared", TOKEN, mode=0o644)
    with pytest.raises(AuthFileError, match=f"{shared} has mode -rw-r--r--.*chmod 600"):
        RetrievalClient("http://127.0.0.1:9", auth_token_file=shared)


def test_probe_sends_the_token_and_names_the_setting_on_401(server, tokens) -> None:
    health = probe(server.url, health_timeout_s=5, require_hits=True, auth_token_file=tokens[0])
    assert health["corpus"] == str(SAMPLE_CORPUS)  # the full /health: the token was sent
    assert wait_healthy(server.url, 5)["corpus"] == SAMPLE_CORPUS.name  # public: no absolute path
    with pytest.raises(ProbeError, match=r"HTTP 401: the server requires a bearer token.*auth_token_file"):
        search_once(server.url)
    with pytest.raises(ProbeError, match=f"HTTP 401: the server refused the token in {tokens[1]}"):
        probe(server.url, auth_token_file=tokens[1])
    with pytest.raises(ProbeError, match=r"retriever\.auth_token_file: auth token file .* cannot read it"):
        probe(server.url, auth_token_file=tokens[0].parent / "absent")


@pytest.mark.slow
def test_the_probe_command_sends_the_token_file(server, tokens) -> None:
    cmd = [sys.executable, "-m", "search_env.retrieval", "probe", server.url, "--timeout", "5"]
    ok = subprocess.run(
        [*cmd, "--auth-token-file", str(tokens[0])], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "retriever.auth_token_file" in refused.stderr


def test_the_evaluation_check_sends_the_token(server, tokens) -> None:
    identity = check_retrievers([server.url], auth_token_file=str(tokens[0]))
    assert identity["backend"] == "bm25" and identity["corpus_size"] == 1000
    with pytest.raises(RuntimeError, match=r"failed its test search: .*HTTP 401.*retriever\.auth_token_file"):
        check_retrievers([server.url])


def _tool_text(tool: SearchTool) -> str:
    async def go() -> str:
        instance_id, _ = await tool.create(create_kwargs={})
        try:
            response, _, _ = await tool.execute(instance_id, {"query": "Evan Morris lobbyist"})
        finally:
            await tool.release(instance_id)
            await tool.client.aclose()
        return response.text

    return asyncio.run(go())


def test_the_search_tool_built_from_a_tools_yaml_sends_the_token(server, tokens, tmp_path) -> None:
    yaml_path = write_tool_config(
        tmp_path / "tools.yaml", [server.url], max_retries=0, auth_token_file=tokens[0]
    )
    assert TOKEN not in yaml_path.read_text()  # the path only
    (tool,) = initialize_tools_from_config(str(yaml_path))
    chunks = protocol.tool_response_contents(protocol.tool_turn_text(_tool_text(tool)))
    assert chunks[0].startswith('"Evan Morris"')
    bare = SearchTool({"type": "native", "retrieval_urls": [server.url], "max_retries": 0})
    assert "retriever.auth_token_file" in _tool_text(bare)
