"""RetrievalClient against real bm25 servers on loopback: results, round-robin, 4xx vs retryable
failures, a retry budget in seconds that rides out a server restart, and failover between two
replicas (one SIGKILLed by PID, restarted on its port, taken back after its /health answers)."""

import asyncio
import socket
import threading
import time

import httpx
import pytest

from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.bm25 import BM25Retriever
from search_env.retrieval.client import RetrievalClient, RetrievalError, parse_retrieve_response
from search_env.retrieval.corpus import Corpus, Passage
from search_env.retrieval.process import free_port, free_ports, spawn_server

SERVE_ARGS = ["--backend", "bm25", "--corpus", str(SAMPLE_CORPUS)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("client-servers")
    started = [
        spawn_server(SERVE_ARGS, startup_timeout_s=60, log_path=log_dir / f"s{i}.log") for i in range(2)
    ]
    yield started
    for server in started:
        server.stop()


@pytest.mark.slow
def test_retrieve_returns_passages_like_a_direct_search(servers) -> None:
    direct = BM25Retriever.build(Corpus(SAMPLE_CORPUS))
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
    urls = [f"http://127.0.0.1:{port}" for port in free_ports(2)]

    async def run() -> None:
        async with RetrievalClient(urls, timeout=1.0, max_retries=2, backoff=0.01) as client:
            await client.retrieve(["x"])

    with pytest.raises(RetrievalError, match="after 3 tries") as info:
        asyncio.run(run())
    assert urls[0] in str(info.value) and urls[1] in str(info.value)


def test_retry_budget_bounds_the_time_not_the_count() -> None:
    dead = f"http://127.0.0.1:{free_port()}"

    async def run(budget: float) -> None:
        async with RetrievalClient(
            dead, timeout=1.0, backoff=0.05, max_backoff=0.2, retry_budget_s=budget
        ) as c:
            await c.retrieve(["x"])

    start = time.monotonic()
    with pytest.raises(RetrievalError, match=r"retry_budget_s=1\.5") as info:
        asyncio.run(run(1.5))
    elapsed = time.monotonic() - start
    assert 1.5 <= elapsed < 1.5 + 1.0 + 1.0  # budget + one try's timeout + scheduling slack
    tries = int(info.value.args[0].split("after ")[1].split(" tries")[0])
    assert tries > 6, "refused connections fail at once: the budget, not a count, ends the tries"
    start = time.monotonic()
    with pytest.raises(RetrievalError, match="after 1 tries"):
        asyncio.run(run(0.0))  # budget 0: the first try only
    assert time.monotonic() - start < 1.0


@pytest.mark.slow
def test_retries_ride_out_a_server_restart(tmp_path) -> None:
    """SIGKILL the only server; one call waits (within its retry budget) until the restarted one answers."""
    port = free_port()
    first = spawn_server(SERVE_ARGS, port=port, startup_timeout_s=60, log_path=tmp_path / "first.log")
    restarted: list = []

    def restart_later() -> None:
        time.sleep(0.5)
        restarted.append(
            spawn_server(SERVE_ARGS, port=port, startup_timeout_s=60, log_path=tmp_path / "second.log")
        )

    async def run() -> tuple[list, list]:
        async with RetrievalClient(first.url, timeout=5.0, backoff=0.25, retry_budget_s=60) as client:
            before = await client.retrieve(["Evan Morris"], topk=2)
            first.process.kill()
            first.process.wait(timeout=10)
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


def _served(servers) -> list[int]:
    return [httpx.get(f"{s.url}/health", timeout=10).json()["queries_served"] for s in servers]


@pytest.mark.slow
def test_failover_skips_a_killed_replica_and_takes_it_back(tmp_path, monkeypatch) -> None:
    """Two replicas; SIGKILL one by PID: every search is answered by the other, and after the first
    failure none is sent to the dead one. Restarted on its port, it is probed (GET /health at most
    every health_interval_s) and gets its share of the round robin again."""
    a, b = (spawn_server(SERVE_ARGS, startup_timeout_s=60, log_path=tmp_path / f"{n}.log") for n in "ab")
    port_a = int(a.url.rsplit(":", 1)[1])
    posted: list[str] = []
    original_post = httpx.AsyncClient.post

    async def recording_post(self, url, *args, **kwargs):
        posted.append(str(url))
        return await original_post(self, url, *args, **kwargs)

    monkeypatch.setattr(httpx.AsyncClient, "post", recording_post)
    client = RetrievalClient([a.url, b.url], timeout=5.0, backoff=0.05, health_interval_s=0.5)
    servers = [a, b]

    async def search(n: int) -> list[str]:
        return [(await client.retrieve(["Evan Morris"], topk=1))[0][0].id for _ in range(n)]

    try:
        loop = asyncio.new_event_loop()
        assert loop.run_until_complete(search(4)) == ["0"] * 4 and not client.down
        a.process.kill()  # by PID
        a.process.wait(timeout=10)
        before_b = _served([b])[0]
        posted.clear()
        assert loop.run_until_complete(search(6)) == ["0"] * 6
        assert client.down == [a.url]
        assert _served([b])[0] - before_b == 6, "the surviving replica answered every search"
        assert sum(u.startswith(a.url) for u in posted) == 1, "only the first failure went to the dead one"
        servers[0] = a = spawn_server(
            SERVE_ARGS, port=port_a, startup_timeout_s=60, log_path=tmp_path / "a2.log"
        )
        time.sleep(0.6)  # past health_interval_s: the next pick probes it
        before = _served(servers)
        assert loop.run_until_complete(search(6)) == ["0"] * 6
        assert not client.down
        gained = [x - y for x, y in zip(_served(servers), before, strict=True)]
        assert sum(gained) == 6 and gained[0] >= 2, (
            f"the restarted replica is back in the round robin: {gained}"
        )
        loop.run_until_complete(client.aclose())
        loop.close()
    finally:
        for server in servers:
            server.stop()


def test_all_replicas_down_are_still_tried() -> None:
    """Every replica marked down: calls still go to them (no deadlock) and fail after the budget."""
    urls = [f"http://127.0.0.1:{port}" for port in free_ports(2)]

    async def run() -> list[str]:
        async with RetrievalClient(urls, timeout=1.0, backoff=0.05, retry_budget_s=0.3) as client:
            for _ in range(2):
                with pytest.raises(RetrievalError, match="tries"):
                    await client.retrieve(["x"])
            return client.down

    assert asyncio.run(run()) == urls


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"urls": []}, "empty"),
        ({"urls": "127.0.0.1:8000"}, "http://"),
        ({"urls": "http://x", "timeout": 0}, "timeout"),
        ({"urls": "http://x", "max_retries": -1}, "max_retries"),
        ({"urls": "http://x", "backoff": -1}, "backoff"),
        ({"urls": "http://x", "backoff": 0}, "backoff 0 needs max_retries"),
        ({"urls": "http://x", "retry_budget_s": -1}, "retry_budget_s"),
        ({"urls": "http://x", "health_interval_s": 0}, "health_interval_s"),
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


def test_free_ports_are_distinct_and_free() -> None:
    """Ports read one at a time can repeat (a Ray head refused two components on one port)."""
    ports = free_ports(64)
    assert len(set(ports)) == 64
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
