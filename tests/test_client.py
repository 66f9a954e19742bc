"""RetrievalClient against real bm25 servers on loopback: results, round-robin, 4xx vs retryable
failures, and retries that ride out a server restart."""

import asyncio
import threading
import time

import httpx
import pytest

from search_env import DEMO_CORPUS
from search_env.retrieval.bm25 import BM25Retriever
from search_env.retrieval.client import RetrievalClient, RetrievalError, parse_retrieve_response
from search_env.retrieval.corpus import Corpus, Passage
from search_env.retrieval.server import free_port, spawn_server

SERVE_ARGS = ["--backend", "bm25", "--corpus", str(DEMO_CORPUS)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("client-servers")
    started = [
        spawn_server(SERVE_ARGS, startup_timeout_s=60, log_path=log_dir / f"s{i}.log") for i in range(2)
    ]
    yield started
    for server in started:
        server.stop()


def test_retrieve_returns_passages_like_a_direct_search(servers) -> None:
    direct = BM25Retriever.build(Corpus(DEMO_CORPUS))
    queries = ["Evan Morris lobbyist", "American football player", "the of"]

    async def run() -> list[list[Passage]]:
        async with RetrievalClient(servers[0].url) as client:
            return await client.retrieve(queries, topk=3)

    got = asyncio.run(run())
    expected = direct.search(queries, 3)
    assert [[p.id for p in ps] for ps in got] == [[p.id for p in ps] for ps in expected]
    assert got[0][0].title == "Evan Morris" and got[0][0].text.startswith("Evan Morris Evan L. Morris")
    assert got[0][0].score == pytest.approx(expected[0][0].score, rel=1e-5)
    assert got[2] == []  # stop words only: no passages


def test_round_robin_spreads_requests_over_servers(servers) -> None:
    before = [httpx.get(f"{s.url}/health").json()["queries_served"] for s in servers]

    async def run() -> None:
        client = RetrievalClient([s.url + "/" for s in servers], max_retries=0)
        for _ in range(6):
            await client.retrieve(["Evan Morris"], topk=1)
        await client.aclose()

    asyncio.run(run())
    after = [httpx.get(f"{s.url}/health").json()["queries_served"] for s in servers]
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 3]


def test_dead_url_in_the_list_is_skipped_by_retries(servers) -> None:
    dead = f"http://127.0.0.1:{free_port()}"

    async def run() -> list[list[Passage]]:
        async with RetrievalClient([dead, servers[0].url], max_retries=1, backoff=0.01) as client:
            return [(await client.retrieve(["Evan Morris"], topk=1))[0][0] for _ in range(3)]

    assert [p.id for p in asyncio.run(run())] == ["0", "0", "0"]


def test_client_error_is_not_retried(servers) -> None:
    async def run() -> None:
        async with RetrievalClient(servers[0].url, max_retries=5, backoff=5.0) as client:
            await client.retrieve(["ok"], topk=0)

    start = time.monotonic()
    with pytest.raises(RetrievalError, match="HTTP 422.*topk"):
        asyncio.run(run())
    assert time.monotonic() - start < 2.0  # no 5 s backoff happened


def test_unreachable_servers_raise_after_bounded_tries() -> None:
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]

    async def run() -> None:
        async with RetrievalClient(urls, timeout=1.0, max_retries=2, backoff=0.01) as client:
            await client.retrieve(["x"])

    with pytest.raises(RetrievalError, match="after 3 tries") as info:
        asyncio.run(run())
    assert urls[0] in str(info.value) and urls[1] in str(info.value)


def test_retries_ride_out_a_server_restart(tmp_path) -> None:
    port = free_port()
    first = spawn_server(SERVE_ARGS, port=port, startup_timeout_s=60, log_path=tmp_path / "first.log")
    restarted: list = []

    def restart_later() -> None:
        time.sleep(0.5)
        restarted.append(
            spawn_server(SERVE_ARGS, port=port, startup_timeout_s=60, log_path=tmp_path / "second.log")
        )

    async def run() -> tuple[list, list]:
        async with RetrievalClient(first.url, timeout=5.0, max_retries=8, backoff=0.25) as client:
            before = await client.retrieve(["Evan Morris"], topk=2)
            first.stop()
            thread = threading.Thread(target=restart_later)
            thread.start()
            try:
                after = await client.retrieve(["Evan Morris"], topk=2)
            finally:
                await asyncio.to_thread(thread.join)
            return before, after

    try:
        before, after = asyncio.run(run())
    finally:
        first.stop()
        for server in restarted:
            server.stop()
    assert first.process.returncode is not None and restarted
    assert [p.id for p in after[0]] == [p.id for p in before[0]] == ["0", before[0][1].id]


def test_parse_accepts_both_shapes_and_rejects_others() -> None:
    doc = {"id": "7", "contents": '"T"\nbody'}
    assert parse_retrieve_response({"result": [[{"document": doc, "score": 1.5}]]}, 1) == [
        [Passage("7", "T", "body", 1.5, '"T"\nbody')]
    ]
    assert parse_retrieve_response({"result": [[doc], []]}, 2) == [
        [Passage("7", "T", "body", None, '"T"\nbody')],
        [],
    ]
    for bad, n in [
        ({"result": [[doc]]}, 2),
        ({"results": []}, 0),
        ({"result": [[{"x": 1}]]}, 1),
        ({"result": ["nope"]}, 1),
        ([], 0),
    ]:
        with pytest.raises(ValueError):
            parse_retrieve_response(bad, n)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"urls": []}, "empty"),
        ({"urls": "127.0.0.1:8000"}, "http://"),
        ({"urls": "http://x", "timeout": 0}, "timeout"),
        ({"urls": "http://x", "max_retries": -1}, "max_retries"),
        ({"urls": "http://x", "backoff": -1}, "backoff"),
    ],
)
def test_bad_client_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        RetrievalClient(**kwargs)


def test_empty_query_list_needs_no_server() -> None:
    async def run() -> list:
        async with RetrievalClient(f"http://127.0.0.1:{free_port()}") as client:
            return await client.retrieve([])

    assert asyncio.run(run()) == []
