"""Retrieval server: a real `python -m search_env.retrieval serve --backend bm25` subprocess on a
loopback port (both API dialects, 64 concurrent clients, malformed requests), plus in-process checks of the
micro-batcher and the -1 rule through httpx's ASGI transport."""

import asyncio
import json

import httpx
import numpy as np
import pytest

from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.backend import Retriever
from search_env.retrieval.batcher import MicroBatcher
from search_env.retrieval.bm25 import BM25Retriever
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.limits import MAX_QUERIES
from search_env.retrieval.process import spawn_server
from search_env.retrieval.server import create_app

NQ_QUESTIONS = "assets/eval_samples/flashrag-quickstart/nq_test.jsonl"


@pytest.fixture(scope="module")
def direct() -> BM25Retriever:
    return BM25Retriever.build(Corpus(SAMPLE_CORPUS))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = spawn_server(
        ["--backend", "bm25", "--corpus", str(SAMPLE_CORPUS), "--max-wait-ms", "5"],
        startup_timeout_s=60,
        log_path=log,
    )
    yield proc
    proc.stop()
    assert proc.process.returncode is not None


def _queries() -> list[str]:
    with open(NQ_QUESTIONS) as handle:
        questions = [json.loads(line)["question"] for line in handle]
    corpus = Corpus(SAMPLE_CORPUS)
    titles = [corpus.passage(i).title + " history" for i in range(0, 1000, 21)]
    return (questions + titles)[:64]


def test_health_reports_backend_and_corpus(server) -> None:
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "healthy"
    assert health["backend"] == "bm25" and health["corpus_size"] == 1000
    assert health["index_type"] == "bm25s" and health["nprobe"] is None


def test_retrieve_search_r1_shape_with_and_without_scores(server, direct) -> None:
    queries = ["Evan Morris lobbyist", "who won the world cup"]
    body = httpx.post(
        f"{server.url}/retrieve", json={"queries": queries, "topk": 3, "return_scores": True}
    ).json()
    expected = direct.search(queries, 3)
    assert len(body["result"]) == 2
    for items, passages in zip(body["result"], expected, strict=True):
        assert [it["document"]["id"] for it in items] == [p.id for p in passages]
        assert [it["score"] for it in items] == pytest.approx([p.score for p in passages], rel=1e-5)
        assert all(
            set(it) == {"document", "score"} and set(it["document"]) == {"id", "contents"} for it in items
        )
    assert body["result"][0][0]["document"]["contents"] == Corpus(SAMPLE_CORPUS).contents(0)

    plain = httpx.post(
        f"{server.url}/retrieve", json={"queries": queries, "topk": 3, "return_scores": False}
    ).json()
    assert plain["result"] == [[it["document"] for it in items] for items in body["result"]]
    default = httpx.post(f"{server.url}/retrieve", json={"queries": queries}).json()  # server topk 5
    assert [len(r) for r in default["result"]] == [len(p) for p in direct.search(queries, 5)]


def test_flashrag_search_and_batch_search(server, direct) -> None:
    (expected,) = direct.search(["Evan Morris"], 4)
    docs = httpx.post(f"{server.url}/search", json={"query": "Evan Morris", "top_n": 4}).json()
    assert [d["id"] for d in docs] == [p.id for p in expected]
    docs, scores = httpx.post(
        f"{server.url}/search", json={"query": "Evan Morris", "top_n": 4, "return_score": True}
    ).json()
    assert scores == pytest.approx([p.score for p in expected], rel=1e-5)

    queries = ["Evan Morris", "American football player"]
    batch = httpx.post(f"{server.url}/batch_search", json={"query": queries, "top_n": 2}).json()
    assert [[d["id"] for d in docs] for docs in batch] == [
        [p.id for p in ps] for ps in direct.search(queries, 2)
    ]
    docs, scores = httpx.post(
        f"{server.url}/batch_search", json={"query": queries, "top_n": 2, "return_score": True}
    ).json()
    assert [len(s) for s in scores] == [len(d) for d in docs] == [2, 2]


def test_64_concurrent_clients_match_direct_search(server, direct) -> None:
    queries = _queries()
    assert len(set(queries)) == 64

    async def ask(client: httpx.AsyncClient, query: str, topk: int) -> list:
        response = await client.post(
            f"{server.url}/retrieve", json={"queries": [query], "topk": topk, "return_scores": True}
        )
        assert response.status_code == 200, response.text
        return response.json()["result"][0]

    async def run() -> list:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(ask(client, q, 1 + i % 5) for i, q in enumerate(queries)))

    before = httpx.get(f"{server.url}/health").json()
    answers = asyncio.run(run())
    after = httpx.get(f"{server.url}/health").json()
    for i, (query, items) in enumerate(zip(queries, answers, strict=True)):
        (expected,) = direct.search([query], 1 + i % 5)
        assert [it["document"]["id"] for it in items] == [p.id for p in expected], query
        assert [it["score"] for it in items] == pytest.approx([p.score for p in expected], rel=1e-5)
    assert after["queries_served"] - before["queries_served"] == 64
    assert after["batches"] - before["batches"] <= 64


MALFORMED = [
    ({"queries": []}, 422, "queries"),
    ({"queries": [""]}, 422, "queries"),
    ({"queries": ["   "]}, 422, "queries"),
    ({"queries": ["ok", 3]}, 422, "queries.1"),
    ({"queries": "one string"}, 422, "queries"),
    ({"topk": 3}, 422, "queries"),
    ({"queries": ["ok"], "topk": 0}, 422, "topk"),
    ({"queries": ["ok"], "topk": 101}, 422, "topk"),
    ({"queries": ["ok"], "topk": "5"}, 422, "topk"),
    ({"queries": ["ok"], "return_scores": "yes"}, 422, "return_scores"),
    ({"queries": ["q"] * (MAX_QUERIES + 1)}, 422, "queries"),
    ("[1, 2]", 422, "body"),
    ('{"queries": ["unterminated"', 422, "body"),
    ('{"queries": ["' + "x" * (9 * 1024 * 1024) + '"]}', 413, "body"),
]


@pytest.mark.parametrize(
    ("payload", "status", "field"), MALFORMED, ids=[f"{m[1]}-{m[2]}-{i}" for i, m in enumerate(MALFORMED)]
)
def test_malformed_retrieve_is_rejected_and_server_stays_healthy(server, payload, status, field) -> None:
    if isinstance(payload, str):
        response = httpx.post(
            f"{server.url}/retrieve", content=payload.encode(), headers={"content-type": "application/json"}
        )
    else:
        response = httpx.post(f"{server.url}/retrieve", json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error.startswith(field) or f"; {field}" in error, error
    assert httpx.get(f"{server.url}/health").json()["status"] == "healthy"


@pytest.mark.parametrize(
    ("path", "payload", "field"),
    [
        ("/search", {"query": ""}, "query"),
        ("/search", {"query": "x", "top_n": 0}, "top_n"),
        ("/batch_search", {"query": "not a list"}, "query"),
        ("/batch_search", {"query": ["a"], "top_n": 500}, "top_n"),
    ],
)
def test_malformed_flashrag_requests(server, path, payload, field) -> None:
    response = httpx.post(f"{server.url}{path}", json=payload)
    assert response.status_code == 422 and response.json()["error"].startswith(field)


# ---------------------------------------------------------------- in-process


def test_micro_batcher_merges_concurrent_requests_into_one_batch_searched_once_per_topk() -> None:
    calls: list[tuple[list[str], int]] = []

    def search(queries: list[str], topk: int) -> list:
        calls.append((queries, topk))
        return [[({"id": q, "contents": q}, float(k)) for k in range(topk)] for q in queries]

    async def run() -> list:
        batcher = MicroBatcher(search, max_batch=100, max_wait_ms=20)
        await batcher.start()
        try:
            return await asyncio.gather(*(batcher.submit([f"q{i}", f"r{i}"], 1 + i % 3) for i in range(10)))
        finally:
            await batcher.stop()

    results = asyncio.run(run())
    assert sorted(topk for _, topk in calls) == [1, 2, 3]  # one batch: one search per topk asked
    for queries, topk in calls:
        assert queries == [f"{c}{i}" for i in range(10) if 1 + i % 3 == topk for c in "qr"]
    for i, per_request in enumerate(results):
        assert [[doc["id"] for doc in json.loads(hits.docs())] for hits in per_request] == [
            [f"q{i}"] * (1 + i % 3),
            [f"r{i}"] * (1 + i % 3),
        ]


def test_micro_batcher_respects_max_batch_and_never_splits_a_request() -> None:
    sizes: list[int] = []

    def search(queries: list[str], topk: int) -> list:
        sizes.append(len(queries))
        return [[] for _ in queries]

    async def run() -> None:
        batcher = MicroBatcher(search, max_batch=4, max_wait_ms=0)
        await batcher.start()
        try:
            await asyncio.gather(*(batcher.submit(["a"] * n, 1) for n in (3, 3, 6, 1)))
        finally:
            await batcher.stop()

    asyncio.run(run())
    assert sizes == [3, 3, 6, 1]
    sizes.clear()

    async def run_single() -> None:  # max_batch=1: the one-request-at-a-time design
        batcher = MicroBatcher(search, max_batch=1, max_wait_ms=5)
        await batcher.start()
        try:
            await asyncio.gather(*(batcher.submit(["a"], 1) for _ in range(5)))
        finally:
            await batcher.stop()

    asyncio.run(run_single())
    assert sizes == [1] * 5


class _StubRetriever(Retriever):
    """Returns rows [2, -1, 0, -1] for every query, or raises on the query 'boom'."""

    backend = "stub"

    def __init__(self) -> None:
        self.corpus = Corpus(SAMPLE_CORPUS)

    def search_rows(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        if "boom" in queries:
            raise RuntimeError("backend exploded")
        rows = np.tile(np.array([2, -1, 0, -1], dtype=np.int64)[:topk], (len(queries), 1))
        return rows, np.ones_like(rows, dtype=np.float32)

    def describe(self) -> dict:
        return {"index_type": "stub", "nprobe": None}


def test_no_hit_rows_never_become_passages_and_errors_are_json() -> None:
    app = create_app(_StubRetriever())

    async def run() -> None:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client,
        ):
            body = (
                await client.post("/retrieve", json={"queries": ["a", "b"], "topk": 4, "return_scores": True})
            ).json()
            assert [[it["document"]["id"] for it in items] for items in body["result"]] == [["2", "0"]] * 2
            failed = await client.post("/retrieve", json={"queries": ["boom"]})
            assert failed.status_code == 500 and "backend exploded" in failed.json()["error"]
            after = await client.post("/retrieve", json={"queries": ["a"], "topk": 1})
            assert after.json()["result"] == [[Corpus(SAMPLE_CORPUS).row(2)]]

    asyncio.run(run())


# ---------------------------------------------------------------- query cache


@pytest.fixture(scope="module")
def uncached_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "uncached.log"
    proc = spawn_server(
        ["--backend", "bm25", "--corpus", str(SAMPLE_CORPUS), "--max-wait-ms", "5", "--cache-size", "0"],
        startup_timeout_s=60,
        log_path=log,
    )
    yield proc
    proc.stop()


def _grpo_like_requests() -> list[tuple[str, dict]]:
    """64 requests over the three endpoints: 16 distinct queries sent 4 times each (as a GRPO group
    repeats its first search), with topk varying per query."""
    queries = _queries()[:16]
    requests = []
    for repeat in range(4):
        for i, query in enumerate(queries):
            k = 1 + i % 5
            kind = (i + repeat) % 3
            if kind == 0:
                requests.append(("/retrieve", {"queries": [query], "topk": k, "return_scores": True}))
            elif kind == 1:
                requests.append(("/search", {"query": query, "top_n": k, "return_score": True}))
            else:
                requests.append(("/batch_search", {"query": [query, queries[-1 - i]], "top_n": k}))
    return requests


def _ask_concurrently(url: str, requests: list[tuple[str, dict]]) -> list:
    async def ask(client: httpx.AsyncClient, path: str, body: dict) -> object:
        response = await client.post(f"{url}{path}", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    async def run() -> list:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(ask(client, path, body) for path, body in requests))

    return asyncio.run(run())


@pytest.mark.slow
def test_cache_gives_identical_answers_under_64_concurrent_clients(server, uncached_server, direct) -> None:
    requests = _grpo_like_requests()
    assert len(requests) == 64
    before = httpx.get(f"{server.url}/health").json()["cache"]
    cached = [_ask_concurrently(server.url, requests) for _ in range(2)]  # 2nd round: all from the cache
    after = httpx.get(f"{server.url}/health").json()["cache"]
    uncached = _ask_concurrently(uncached_server.url, requests)
    assert cached[0] == cached[1] == uncached
    for (path, body), answer in zip(requests, uncached, strict=True):  # and both equal direct search
        if path == "/retrieve":
            (expected,) = direct.search(body["queries"], body["topk"])
            assert [it["document"]["id"] for it in answer["result"][0]] == [p.id for p in expected]
        elif path == "/search":
            (expected,) = direct.search([body["query"]], body["top_n"])
            assert [d["id"] for d in answer[0]] == [p.id for p in expected]
    n_queries = sum(
        len(b["queries"]) if p == "/retrieve" else len(b["query"]) if p == "/batch_search" else 1
        for p, b in requests
    )
    asked = (after["hits"] - before["hits"]) + (after["misses"] - before["misses"])
    assert asked == 2 * n_queries
    assert after["hits"] - before["hits"] >= n_queries  # the whole second round, at least
    assert after["size"] >= 16 and after["bytes"] <= after["max_bytes"] and after["enabled"]
    off = httpx.get(f"{uncached_server.url}/health").json()
    assert off["cache"]["enabled"] is False and off["cache"]["hits"] == 0 and off["cache"]["size"] == 0
    assert off["queries_searched"] == off["queries_served"] >= n_queries


# ---------------------------------------------------------------- oversized bodies

BIG_BODY = b'{"queries": ["' + b"x" * (30 * 1000 * 1000) + b'"]}'  # 30 MB > the default 1 MiB limit


def _assert_413_json(status: int, body: bytes) -> None:
    assert status == 413
    error = json.loads(body)["error"]
    assert error.startswith("body: request body of") and "exceeds the limit of 1048576 bytes" in error


def test_30mb_body_from_urllib_gets_the_413_json(server) -> None:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"{server.url}/retrieve", data=BIG_BODY, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    _assert_413_json(caught.value.code, caught.value.read())
    assert httpx.get(f"{server.url}/health").json()["status"] == "healthy"


def test_30mb_body_from_httpx_gets_the_413_json_and_the_connection_is_reused(server) -> None:
    def chunks():  # no Content-Length: chunked transfer, counted while it streams
        for i in range(0, len(BIG_BODY), 1 << 20):
            yield BIG_BODY[i : i + (1 << 20)]

    with httpx.Client(timeout=60) as client:
        response = client.post(f"{server.url}/retrieve", content=BIG_BODY)
        _assert_413_json(response.status_code, response.content)
        assert response.headers.get("connection") != "close"  # fully read: keep-alive still works
        streamed = client.post(f"{server.url}/retrieve", content=chunks())
        _assert_413_json(streamed.status_code, streamed.content)
        ok = client.post(f"{server.url}/retrieve", json={"queries": ["Evan Morris"], "topk": 1})
        assert ok.status_code == 200 and len(ok.json()["result"][0]) == 1
    assert httpx.get(f"{server.url}/health").json()["status"] == "healthy"


def _guard_call(guard_kwargs: dict, messages, headers: list[tuple[bytes, bytes]]) -> tuple[list[dict], int]:
    """Run JsonBodyGuard over an ASGI POST whose body comes from the async iterator `messages`;
    returns what it sent and how many receive() calls it made."""
    from search_env.retrieval.admission import JsonBodyGuard

    async def app(scope, receive, send):  # pragma: no cover - an oversized body never reaches the app
        raise AssertionError("the app must not see an oversized body")

    sent: list[dict] = []
    calls = 0

    async def receive() -> dict:
        nonlocal calls
        calls += 1
        return await messages.__anext__()

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/retrieve", "headers": headers}
    asyncio.run(JsonBodyGuard(app, **guard_kwargs)(scope, receive, send))
    return sent, calls


def test_draining_an_oversized_body_stops_at_its_byte_bound() -> None:
    async def endless():
        while True:
            yield {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    sent, calls = _guard_call({"max_bytes": 10_000, "drain_bytes": 50_000}, endless(), [])
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]
    assert 50 <= calls <= 52  # read up to the 50 kB bound, then gave up
    assert json.loads(sent[1]["body"])["field"] == "body"

    declared = [(b"content-length", b"60000")]  # larger than the drain bound: answered at once
    sent, calls = _guard_call({"max_bytes": 10_000, "drain_bytes": 50_000}, endless(), declared)
    assert calls == 0 and sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]

    expect = [(b"content-length", b"20000"), (b"expect", b"100-continue")]  # body not sent yet
    sent, calls = _guard_call({"max_bytes": 10_000, "drain_bytes": 50_000}, endless(), expect)
    assert calls == 0 and sent[0]["status"] == 413


def test_draining_an_oversized_body_stops_at_its_time_bound() -> None:
    async def stalled():
        yield {"type": "http.request", "body": b"x" * 2000, "more_body": True}
        await asyncio.sleep(3600)  # the client stops sending

    sent, _ = _guard_call({"max_bytes": 1000, "drain_timeout_s": 0.2}, stalled(), [])
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]

    async def complete():
        for last in (False, False, True):
            yield {"type": "http.request", "body": b"x" * 800, "more_body": not last}

    sent, calls = _guard_call({"max_bytes": 1000}, complete(), [(b"content-length", b"2400")])
    assert calls == 3 and sent[0]["status"] == 413 and (b"connection", b"close") not in sent[0]["headers"]


# ---------------------------------------------------------------- search child process


@pytest.mark.slow
def test_search_child_process_death_makes_health_503_and_searches_500(tmp_path) -> None:
    import os
    import signal

    with spawn_server(
        ["--backend", "bm25", "--corpus", str(SAMPLE_CORPUS)], log_path=tmp_path / "s.log"
    ) as server:
        health = httpx.get(f"{server.url}/health").json()
        child = health["search_process"]
        assert child != server.process.pid and health["status"] == "healthy"
        ok = httpx.post(f"{server.url}/retrieve", json={"queries": ["Evan Morris"], "topk": 1})
        assert ok.status_code == 200
        os.kill(child, signal.SIGKILL)  # the search child this test's server started
        failed = httpx.post(f"{server.url}/retrieve", json={"queries": ["something new"], "topk": 1})
        assert failed.status_code == 500 and "search process" in failed.json()["error"]
        after = httpx.get(f"{server.url}/health")
        assert after.status_code == 503 and after.json()["status"] == "unhealthy"


@pytest.mark.slow
def test_search_child_build_error_reaches_the_command_line(tmp_path) -> None:
    import subprocess
    import sys

    missing = tmp_path / "missing.index"
    result = subprocess.run(
        [sys.executable, "-m", "search_env.retrieval", "serve", "--backend", "dense", "--index", str(missing),
         "--encoder", str(tmp_path), "--port", "18399"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"error: --index: no such faiss index file {missing}" in result.stderr
