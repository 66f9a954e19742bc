"""The retrieval server's limits against one abusive client (issue #41; security review M1-M4, L9,
L11): query text and length, queries x topk, a failing micro-batch, the queue and connection bounds,
JSON built off the event loop, the body-read deadline, Origin / Content-Type / Host, and the error
format of unparsable bodies. In process through httpx's ASGI transport where no socket is needed;
real `python -m search_env.retrieval serve` children on loopback for the socket-level ones and the
dense test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from search_env.retrieval import SAMPLE_CORPUS, admission
from search_env.retrieval import batcher as batcher_module
from search_env.retrieval import server as server_module
from search_env.retrieval.admission import Overloaded, Refused
from search_env.retrieval.backend import Retriever
from search_env.retrieval.batcher import BackendFailure, MicroBatcher
from search_env.retrieval.cache import QueryCache
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.limits import Limits
from search_env.retrieval.process import spawn_server
from search_env.retrieval.server import create_app

GOOD = {"queries": ["Evan Morris lobbyist"], "topk": 2}
WAIT_S = 30.0
"""Upper bound of every wait on a condition in this file (never a timing assertion)."""


class _Stub(Retriever):
    """Rows 0..topk-1 for every query; search_rows blocks while `gate` is clear."""

    backend = "stub"

    def __init__(self) -> None:
        self.corpus = Corpus(SAMPLE_CORPUS)
        self.gate = threading.Event()
        self.gate.set()

    def search_rows(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        assert self.gate.wait(WAIT_S)
        rows = np.tile(np.arange(topk, dtype=np.int64), (len(queries), 1))
        return rows, np.ones_like(rows, dtype=np.float32)

    def describe(self) -> dict:
        return {"index_type": "stub", "nprobe": None}


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from search_env.retrieval.encoder import build_tiny_encoder

    return build_tiny_encoder(tmp_path_factory.mktemp("tiny-bert") / "bert", hidden_size=32)


def _in_process(check, retriever: Retriever | None = None, loopback: bool = True, **limits) -> None:
    """Run `await check(client, app)` against create_app(retriever, Limits(**limits)) in process."""
    app = create_app(retriever or _Stub(), Limits(**limits), loopback=loopback)

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=transport, base_url="http://127.0.0.1:8000", timeout=WAIT_S
            ) as client,
        ):
            await check(client, app)

    asyncio.run(run())


def _refused(response: httpx.Response, status: int, field: str | None, *words: str) -> None:
    """`response` is `status` in the server's error format, for `field`, naming every word."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) >= {"error", "field"} and body["field"] == field, body
    for word in words:
        assert word in body["error"], body["error"]


# ---------------------------------------------------------------- M1: query text


def test_a_lone_surrogate_gets_422_naming_the_query_index() -> None:
    async def check(client: httpx.AsyncClient, _) -> None:
        body = b'{"queries": ["who won the world cup", "\\ud800 x"], "topk": 1}'
        _refused(await client.post("/retrieve", content=body), 422, "queries", "query 1", "Unicode")
        _refused(await client.post("/search", content=b'{"query": "\\udfff"}'), 422, "query", "nicode")
        raw_surrogate = '{"query": ["ok", "\ud800"]}'.encode("utf-8", "surrogatepass")  # UTF-8 bytes ED A0 80
        _refused(await client.post("/batch_search", content=raw_surrogate), 422, "query", "query 1")
        assert (await client.post("/retrieve", json=GOOD)).status_code == 200

    _in_process(check)


def test_a_failed_batch_is_searched_request_by_request_so_only_the_bad_request_fails() -> None:
    calls: list[list[str]] = []

    def search(queries: list[str], topk: int) -> list:
        calls.append(list(queries))
        if "poison" in queries:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
        return [[({"id": q, "contents": q}, 1.0)] for q in queries]

    async def run() -> list:
        batcher = MicroBatcher(search, max_batch=100, max_wait_ms=50)
        await batcher.start()
        try:
            asks = [["a", "b"], ["poison", "c"], ["d"], ["e"]]
            return await asyncio.gather(*(batcher.submit(q, 1) for q in asks), return_exceptions=True)
        finally:
            await batcher.stop()

    good_a, bad, good_d, good_e = asyncio.run(run())
    assert calls[0] == ["a", "b", "poison", "c", "d", "e"]  # one batch first, then each request alone
    assert sorted(map(tuple, calls[1:])) == [("a", "b"), ("d",), ("e",), ("poison", "c")]
    assert isinstance(bad, BackendFailure) and "TypeError" in str(bad)
    assert [[hit["document"]["id"] for hit in json.loads(hits.scored)] for hits in good_a] == [["a"], ["b"]]
    assert [json.loads(good[0].docs())[0]["id"] for good in (good_d, good_e)] == ["d", "e"]


# ---------------------------------------------------------------- M2: query length


def test_a_query_longer_than_max_query_chars_gets_422_naming_the_flag() -> None:
    async def check(client: httpx.AsyncClient, _) -> None:
        assert (await client.post("/retrieve", json={"queries": ["x" * 64]})).status_code == 200
        long = {"queries": ["ok", "x" * 65]}
        _refused(
            await client.post("/retrieve", json=long), 422, "queries", "queries.1", "--max-query-chars 64"
        )
        _refused(await client.post("/search", json={"query": "y" * 65}), 422, "query", "--max-query-chars")

    _in_process(check, max_query_chars=64)


def test_the_default_query_limit_is_4096_characters() -> None:
    async def check(client: httpx.AsyncClient, _) -> None:
        huge = {"queries": ["word " * 200_000]}  # 1 MB: the review's 7.9 MB query, scaled down
        _refused(await client.post("/retrieve", json=huge), 422, "queries", "--max-query-chars 4096")

    _in_process(check)


def test_the_encoder_never_tokenises_more_text_than_it_keeps(tiny_bert) -> None:
    from search_env.retrieval.encoder import CHARS_PER_TOKEN_BOUND, Encoder

    encoder = Encoder(tiny_bert, use_gpu=False, query_max_length=32)
    seen: list[int] = []

    class Recording:  # the encoder's tokenizer, recording the length of every text it is given
        def __init__(self, inner) -> None:
            self.inner = inner

        def __call__(self, texts: list[str], **options):
            seen.extend(len(text) for text in texts)
            return self.inner(texts, **options)

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

    encoder.tokenizer = Recording(encoder.tokenizer)
    huge = "evan morris lobbyist " * 50_000  # 1 MB
    vectors = encoder.encode_queries([huge, "evan morris"])
    cut = encoder.encode_queries([huge[: CHARS_PER_TOKEN_BOUND * 32]])
    assert max(seen) <= CHARS_PER_TOKEN_BOUND * 32
    np.testing.assert_allclose(vectors[0], cut[0], atol=1e-6)  # the same 32 tokens either way


# ---------------------------------------------------------------- M3: amplification, queue, event loop


def test_queries_times_topk_over_max_hits_gets_422_and_a_search_r1_batch_passes() -> None:
    async def check(client: httpx.AsyncClient, _) -> None:
        search_r1 = {"queries": [f"question {i}" for i in range(512)], "topk": 3}
        answer = await client.post("/retrieve", json=search_r1)
        assert answer.status_code == 200 and len(answer.json()["result"]) == 512
        flood = {"queries": ["Evan Morris"] * 1024, "topk": 100}  # the review's 69 MB answer
        _refused(await client.post("/retrieve", json=flood), 422, "queries", "102400 hits", "--max-hits 8192")
        batch = {"query": ["Evan Morris"] * 100, "top_n": 100}
        _refused(await client.post("/batch_search", json=batch), 422, "query", "--max-hits 8192", "top_n")

    _in_process(check)


def test_past_max_queued_queries_a_request_gets_429_with_retry_after() -> None:
    stub = _Stub()
    stub.gate.clear()
    wait_for = _wait_for

    async def check(client: httpx.AsyncClient, app) -> None:
        batcher = app.state.batcher
        first = asyncio.create_task(client.post("/retrieve", json={"queries": ["a"]}))
        await wait_for(lambda: batcher.busy)  # searching, blocked on the gate
        second = asyncio.create_task(client.post("/retrieve", json={"queries": ["b", "c"]}))
        await wait_for(lambda: batcher._queued_queries == 2)  # queued behind it: the bound is full
        refused = await client.post("/retrieve", json={"queries": ["d"]})
        _refused(refused, 429, None, "--max-queued-queries 2")
        assert refused.headers["retry-after"] == "1"
        stub.gate.set()
        assert [(await t).status_code for t in (first, second)] == [200, 200]
        assert (await client.post("/retrieve", json={"queries": ["d"]})).status_code == 200

    _in_process(check, stub, max_queued_queries=2, max_wait_ms=0)


def test_a_request_larger_than_the_queue_bound_is_taken_when_it_is_alone() -> None:
    async def run() -> None:
        batcher = MicroBatcher(lambda qs, k: [[] for _ in qs], max_batch=4, max_wait_ms=0, max_queued=2)
        await batcher.start()
        try:
            assert len(await batcher.submit(["a", "b", "c"], 1)) == 3
        finally:
            await batcher.stop()

    asyncio.run(run())
    with pytest.raises(ValueError, match="--max-queued-queries"):
        MicroBatcher(lambda qs, k: [], 4, 0, max_queued=0)
    assert issubclass(Overloaded, Refused)


def test_answers_are_joined_off_the_event_loop(monkeypatch) -> None:
    threads: list[str] = []

    def recording(join):
        def joined(*args: object) -> bytes:
            threads.append(threading.current_thread().name)
            return join(*args)

        return joined

    for name in ("retrieve_body", "search_body", "batch_search_body"):
        monkeypatch.setattr(server_module, name, recording(getattr(server_module, name)))

    async def check(client: httpx.AsyncClient, _) -> None:
        loop_thread = threading.current_thread().name
        assert (await client.post("/retrieve", json=GOOD)).status_code == 200
        assert (await client.post("/search", json={"query": "Evan Morris"})).status_code == 200
        assert (await client.post("/batch_search", json={"query": ["Evan Morris"]})).status_code == 200
        assert len(threads) >= 3 and loop_thread not in threads  # every piece in the answer pool

    _in_process(check)


# ---------------------------------------------------------------- L9, L11: refused headers and bodies


def test_origin_and_non_json_content_types_are_refused() -> None:
    async def check(client: httpx.AsyncClient, _) -> None:
        body = json.dumps(GOOD).encode()
        evil = {"Origin": "http://evil.example", "Content-Type": "application/json"}
        _refused(await client.post("/retrieve", content=body, headers=evil), 403, None, "Origin")
        _refused(await client.get("/health", headers={"Origin": "http://evil.example"}), 403, None, "Origin")
        for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            answer = await client.post("/retrieve", content=body, headers={"Content-Type": kind})
            _refused(answer, 415, None, "Content-Type", "application/json")
        for kind in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
            assert (
                await client.post("/retrieve", content=body, headers={"Content-Type": kind})
            ).status_code == 200
        assert (await client.post("/retrieve", content=body)).status_code == 200  # no Content-Type: JSON

    _in_process(check)


def test_a_loopback_server_checks_the_host_header() -> None:
    async def check(client: httpx.AsyncClient, _) -> None:
        _refused(await client.get("/health", headers={"Host": "evil.example"}), 421, None, "Host", "loopback")
        _refused(await client.get("/health", headers={"Host": "127.0.0.1.evil.example"}), 421, None, "Host")
        answer = await client.post("/retrieve", json=GOOD, headers={"Host": "evil.example:8000"})
        _refused(answer, 421, None, "evil.example")
        for host in ("127.0.0.1", "localhost:1234", "[::1]:8000", "LOCALHOST", "127.0.0.2:80"):
            assert (await client.get("/health", headers={"Host": host})).status_code == 200, host

    _in_process(check)

    async def not_loopback(client: httpx.AsyncClient, _) -> None:
        assert (await client.get("/health", headers={"Host": "node7.cluster"})).status_code == 200

    _in_process(not_loopback, loopback=False)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b'{"queries": ["caf\xe9"]}', ("UTF-8",)),
        (b"[" * 100_000, ("nested",)),
        (b'{"queries": ' + b"[" * 5000 + b"]" * 5000 + b"}", ("nested",)),
    ],
    ids=["invalid-utf8", "100k-brackets", "nested-queries"],
)
def test_unparsable_bodies_get_the_servers_error_format(body: bytes, words: tuple[str, ...]) -> None:
    async def check(client: httpx.AsyncClient, _) -> None:
        answer = await client.post("/retrieve", content=body, headers={"Content-Type": "application/json"})
        _refused(answer, 422, "body", "body:", *words)
        assert (await client.get("/health")).json()["status"] == "healthy"

    _in_process(check)


def test_other_http_errors_use_the_format_too() -> None:
    async def check(client: httpx.AsyncClient, _) -> None:
        _refused(await client.get("/nowhere"), 404, None, "Not Found")
        _refused(await client.get("/retrieve"), 405, None, "Method Not Allowed")

    _in_process(check)


# ---------------------------------------------------------------- real sockets


@pytest.fixture(scope="module")
def bm25_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("limits") / "server.log"
    serve = ["--backend", "bm25", "--corpus", str(SAMPLE_CORPUS), "--body-timeout-s", "0.5"]
    with spawn_server(serve, startup_timeout_s=60, log_path=log) as server:
        yield server


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (socket.timeout if it never does)."""
    sock.settimeout(WAIT_S)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.slow
def test_a_half_sent_body_gets_408_and_the_connection_is_closed(bm25_server) -> None:
    with socket.create_connection(_address(bm25_server.url), timeout=WAIT_S) as sock:
        head = "POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: 100\r\n\r\n".encode() + b'{"queries"')  # 10 of 100 bytes
        answer = _read_until_closed(sock)  # then silence: the server answers and hangs up
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), answer
    error = json.loads(body)
    assert error["field"] == "body" and "--body-timeout-s 0.5" in error["error"]
    assert httpx.get(f"{bm25_server.url}/health").json()["status"] == "healthy"


def test_a_foreign_host_header_is_refused_on_a_real_socket(bm25_server) -> None:
    with socket.create_connection(_address(bm25_server.url), timeout=WAIT_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: rebind.evil.example\r\nConnection: close\r\n\r\n")
        answer = _read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 421") and "rebind.evil.example" in json.loads(body)["error"]
    text_plain = httpx.post(
        f"{bm25_server.url}/retrieve", content=json.dumps(GOOD), headers={"Content-Type": "text/plain"}
    )
    _refused(text_plain, 415, None, "text/plain")
    assert httpx.post(f"{bm25_server.url}/retrieve", json=GOOD).status_code == 200


@pytest.mark.slow
def test_on_the_dense_server_a_bad_query_fails_alone_beside_good_ones(tmp_path, tiny_bert) -> None:
    """The review's M1 reproduction: tiny local BERT + a real faiss index (the dense retriever in this
    process); a lone-surrogate request sent with concurrent good requests (batched together: 200 ms
    wait) is refused with 422 and every good request is answered."""
    from search_env.retrieval.encoder import Encoder
    from search_env.retrieval.index import DenseRetriever, load_index
    from search_env.retrieval.index_build import build_index

    corpus, encoder = Corpus(SAMPLE_CORPUS), Encoder(tiny_bert, use_gpu=False)
    index_path = tmp_path / "demo_flat.index"
    build_index(corpus, encoder, index_path, "Flat", use_gpu=False)
    retriever = DenseRetriever(corpus, encoder, load_index(index_path, use_gpu=False))
    questions = ["who won the world cup", "Evan Morris lobbyist", "American football", "first novel"]

    async def check(client: httpx.AsyncClient, _app) -> None:
        bodies = [json.dumps({"queries": [q], "topk": 3}).encode() for q in questions]
        bodies.insert(2, b'{"queries": ["\\ud800 x"], "topk": 3}')
        answers = await asyncio.gather(*(client.post("/retrieve", content=body) for body in bodies))
        bad = answers.pop(2)
        _refused(bad, 422, "queries", "query 0", "Unicode")
        assert [a.status_code for a in answers] == [200] * 4, [a.text[:200] for a in answers]
        assert all(len(a.json()["result"][0]) == 3 for a in answers)
        health = (await client.get("/health")).json()
        assert health["status"] == "healthy" and health["queries_served"] == 4

    _in_process(check, retriever, max_wait_ms=200, cache_size=0)


# ---------------------------------------------------------------- fairness between clients (#41 flood)


class _Recorder:
    """search_fn for a MicroBatcher: records each batch's queries; the first call blocks until `gate`."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __call__(self, queries: list[str], topk: int) -> list:
        self.calls.append(list(queries))
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        return [[({"id": q, "contents": q}, 1.0)] for q in queries]


def _flood(n: int = 64, per: int = 64) -> list[list[str]]:
    return [[f"flood {r}.{j}" for j in range(per)] for r in range(n)]


def _with_first_batch_blocked(recorder: _Recorder, batcher: MicroBatcher, then) -> object:
    """Start `batcher`, let a first one-query batch (client "flood") block in the search, run
    `await then()` (which queues more work and returns awaitables), release the search, gather."""

    async def run() -> object:
        await batcher.start()
        try:
            first = asyncio.create_task(batcher.submit(["first"], 1, "flood"))
            assert await asyncio.to_thread(recorder.entered.wait, WAIT_S)
            waiting = await then()
            recorder.gate.set()
            return await asyncio.gather(first, *waiting, return_exceptions=True)
        finally:
            await batcher.stop()

    return asyncio.run(run())


def test_a_light_clients_request_is_searched_next_without_the_floods_backlog() -> None:
    recorder = _Recorder()
    batcher = MicroBatcher(recorder, max_batch=256, max_wait_ms=0)
    batcher.shared_batch = lambda: 32  # as if 32 queries' measured search time fit --fair-batch-ms

    async def then() -> list:
        flood = [asyncio.create_task(batcher.submit(qs, 5, "flood")) for qs in _flood()]  # 4,096 queries
        await asyncio.sleep(0)  # all queued
        good = asyncio.create_task(batcher.submit(["good"], 5, "good"))
        await asyncio.sleep(0)
        assert batcher._queued_queries == 4097
        return [*flood, good]

    *_, good = _with_first_batch_blocked(recorder, batcher, then)
    assert json.loads(good[0].docs())[0]["id"] == "good"
    assert recorder.calls[0] == ["first"]
    assert recorder.calls[1] == ["good"]  # the flood (largest backlog, served before) waits for it
    assert all(len(c) <= 32 for c in recorder.calls[2:])  # the flood's own batches stay short meanwhile
    assert sorted(q for c in recorder.calls for q in c) == sorted(["first", "good", *sum(_flood(), [])])


def test_two_heavy_clients_share_the_batches_equally() -> None:
    recorder = _Recorder()
    batcher = MicroBatcher(recorder, max_batch=256, max_wait_ms=0)
    batcher.shared_batch = lambda: 10

    async def then() -> list:
        a = asyncio.create_task(batcher.submit([f"a{i}" for i in range(200)], 1, "a"))
        b = asyncio.create_task(batcher.submit([f"b{i}" for i in range(200)], 1, "b"))
        await asyncio.sleep(0)
        return [a, b]

    _with_first_batch_blocked(recorder, batcher, then)
    shares = [
        (sum(q.startswith("a") for q in c), sum(q.startswith("b") for q in c)) for c in recorder.calls[1:]
    ]
    assert all(sum(share) == 10 for share in shares)
    running = [0, 0]
    for a, b in shares[:-1]:  # served so far never drifts apart by more than one batch
        running[0] += a
        running[1] += b
        assert abs(running[0] - running[1]) <= 10


def test_shared_batches_of_repeated_queries_do_not_grow_the_shared_batch() -> None:
    """The abuse bench's amplify client (1,024 copies of one query a request) beside a light one:
    each shared batch searches one query however many it holds, so the shared batch stays small and
    the next client's first shared batch does not search hundreds (a 270 ms stall, measured)."""
    gate = _Recorder()
    gate.gate.set()
    batcher = MicroBatcher(
        gate, 256, 0, QueryCache(1000, 2**20), fair_batch_ms=10_000
    )  # the server's cache on

    async def run() -> None:
        await batcher.start()
        try:
            for _ in range(20):
                await asyncio.gather(
                    batcher.submit(["same"] * 1024, 5, "amplify"), batcher.submit(["light"], 5, "light")
                )
        finally:
            await batcher.stop()

    asyncio.run(run())
    assert max(len(call) for call in gate.calls) <= 2  # one text searched per client and batch
    assert batcher.shared_batch() <= 2, batcher.shared_batch()


def test_the_shared_batch_grows_while_batches_search_within_fair_batch_ms_and_shrinks_after() -> None:
    batcher = MicroBatcher(_Recorder(), max_batch=256, max_wait_ms=0, fair_batch_ms=10)
    assert batcher.shared_batch() == 1
    sizes = []
    for _ in range(30):  # 3 ms fixed + 0.5 ms per query: 14 queries fit in 10 ms
        size = batcher.shared_batch()
        batcher._timed(size, 0.003 + 0.0005 * size, shared=True)
        sizes.append(size)
    assert sizes[:6] == [1, 2, 3, 4, 5, 6] and max(sizes) <= 17 and 10 <= sizes[-1] <= 17
    before = batcher.shared_batch()
    batcher._timed(2, 0.005, shared=True)  # a batch short of work does not grow it
    assert batcher.shared_batch() == before
    batcher._timed(2, 0.5, shared=True)  # any slow one shrinks it
    assert batcher.shared_batch() < before
    for _ in range(40):
        batcher._timed(batcher.shared_batch(), 60.0, shared=True)
    assert batcher.shared_batch() == 1  # never below one query
    for _ in range(60):
        batcher._timed(batcher.shared_batch(), 0.0, shared=True)
    assert batcher.shared_batch() == 256  # never above --max-batch
    with pytest.raises(ValueError, match="--fair-batch-ms"):
        MicroBatcher(_Recorder(), 4, 0, fair_batch_ms=0)


def test_a_search_with_a_large_fixed_cost_keeps_large_shared_batches() -> None:
    """A GPU flat index scans every vector per batch (~13 ms for wiki-18 however few the queries): the
    shared batch aims at 1.5 x the quickest recent batch instead of --fair-batch-ms, so it grows
    instead of searching one query per 13 ms."""
    batcher = MicroBatcher(_Recorder(), max_batch=256, max_wait_ms=0, fair_batch_ms=5)
    for _ in range(60):
        batcher._timed(batcher.shared_batch(), 0.013 + 0.00005 * batcher.shared_batch(), shared=True)
    assert batcher.shared_batch() >= 100


def test_a_light_clients_quick_batches_keep_the_shared_batch_short() -> None:
    batcher = MicroBatcher(_Recorder(), max_batch=256, max_wait_ms=0, fair_batch_ms=5)
    for _ in range(100):  # CPU: 3 ms + 0.5 ms per query; a light client's one-query batch between
        batcher._timed(1, 0.0035, shared=True)
        batcher._timed(batcher.shared_batch(), 0.003 + 0.0005 * batcher.shared_batch(), shared=True)
    assert batcher.shared_batch_s() == pytest.approx(1.5 * 0.0035, rel=0.02)  # risen by one batch
    assert batcher.shared_batch() <= 6  # 3 ms + 0.5 ms x n <= 5.25 ms, give or take one step


def test_only_shared_batches_adapt_the_shared_batch() -> None:
    async def run(clients: list[str]) -> int:
        batcher = MicroBatcher(lambda qs, k: [[] for _ in qs], max_batch=8, max_wait_ms=0)
        await batcher.start()
        try:
            for client in clients:
                await batcher.submit(["one", "two"], 1, client)
            return batcher.shared_batch()
        finally:
            await batcher.stop()

    assert asyncio.run(run(["a", "a", "a"])) == 1  # one client: full batches, nothing learnt
    assert asyncio.run(run(["a", "b", "a", "b"])) > 1  # fast shared batches let it grow


def test_usage_halves_every_half_life() -> None:
    batcher = MicroBatcher(_Recorder(), max_batch=8, max_wait_ms=0)
    batcher._charge("a", 64, now=100.0)
    assert batcher.usage("a", 100.0) == 64
    assert batcher.usage("a", 100.0 + batcher_module.USAGE_HALF_LIFE_S) == pytest.approx(32)
    assert batcher.usage("b", 100.0) == 0


def test_refusals_past_the_rate_are_held_up_to_retry_after_per_address(monkeypatch) -> None:
    throttle = admission.RefusalThrottle(app=None, rate=10.0)  # burst: 2 s x 10 = 20 refusals
    delays = [throttle.delay("10.0.0.1", 0.0) for _ in range(20)]
    assert delays == [0.0] * 20
    held = [throttle.delay("10.0.0.1", 0.0) for _ in range(15)]
    assert held[0] == pytest.approx(0.1) and held == sorted(held)  # debt grows: 0.1, 0.2, ... s
    assert max(held) == admission.RETRY_AFTER_S  # never longer than Retry-After
    assert throttle.delay("10.0.0.2", 0.0) == 0.0  # another address has its own allowance
    assert throttle.delay("10.0.0.1", 60.0) == 0.0  # a quiet spell restores the allowance
    monkeypatch.setattr(admission, "MAX_TRACKED_ADDRESSES", 2)
    small = admission.RefusalThrottle(app=None, rate=10.0)
    for address in ("10.1.0.1", "10.1.0.2", "10.1.0.1", "10.1.0.3"):
        small.delay(address, 0.0)
    assert list(small._allowance) == ["10.1.0.1", "10.1.0.3"]  # bounded: the least recently refused goes
    with pytest.raises(ValueError, match="--max-refusal-rate"):
        admission.RefusalThrottle(app=None, rate=-1)


def test_a_client_repeating_bad_requests_is_slowed_but_good_requests_are_not() -> None:
    async def check(client: httpx.AsyncClient, _app) -> None:
        bad = {"queries": ["x" * 5000], "topk": 1}  # past --max-query-chars
        started = time.perf_counter()
        statuses = [(await client.post("/retrieve", json=bad)).status_code for _ in range(14)]
        assert statuses == [422] * 14
        assert time.perf_counter() - started >= 0.6  # a burst of 10 at once, then ~0.2 s held each
        started = time.perf_counter()
        assert (await client.post("/retrieve", json=GOOD)).status_code == 200
        assert time.perf_counter() - started < WAIT_S  # answered, not held (only refusals are)

    _in_process(check, max_refusal_rate=5.0)


def test_a_lone_client_still_gets_full_batches_of_whole_requests() -> None:
    recorder = _Recorder()
    batcher = MicroBatcher(recorder, max_batch=256, max_wait_ms=0)

    async def then() -> list:
        flood = [asyncio.create_task(batcher.submit(qs, 5, "flood")) for qs in _flood()]
        await asyncio.sleep(0)
        return flood

    results = _with_first_batch_blocked(recorder, batcher, then)
    assert not [r for r in results if isinstance(r, BaseException)]
    assert [len(c) for c in recorder.calls] == [1] + [256] * 16  # 4 whole 64-query requests each


def test_past_max_queued_per_client_that_client_gets_429_while_another_is_admitted() -> None:
    recorder = _Recorder()
    batcher = MicroBatcher(recorder, max_batch=256, max_wait_ms=0, max_queued_per_client=4)
    refused: list[Overloaded] = []

    async def then() -> list:
        queued = asyncio.create_task(batcher.submit(["a", "b", "c"], 1, "flood"))
        await asyncio.sleep(0)
        try:
            await batcher.submit(["d", "e"], 1, "flood")  # 3 + 2 > 4
        except Overloaded as err:
            refused.append(err)
        other = asyncio.create_task(batcher.submit(["x", "y", "z"], 1, "good"))  # its own bound
        await asyncio.sleep(0)
        return [queued, other]

    _, queued, other = _with_first_batch_blocked(recorder, batcher, then)
    assert len(refused) == 1 and "--max-queued-per-client 4" in refused[0].message
    assert refused[0].headers == {"Retry-After": "1"}
    assert len(queued) == 3 and [json.loads(hits.docs())[0]["id"] for hits in other] == ["x", "y", "z"]
    with pytest.raises(ValueError, match="--max-queued-per-client"):
        MicroBatcher(recorder, 4, 0, max_queued_per_client=0)


def test_a_cancelled_request_leaves_the_queue_before_its_queries_are_searched() -> None:
    recorder = _Recorder()
    batcher = MicroBatcher(recorder, max_batch=256, max_wait_ms=0)

    async def then() -> list:
        gone = asyncio.create_task(batcher.submit(["gone 1", "gone 2"], 1, "flood"))
        stays = asyncio.create_task(batcher.submit(["stays"], 1, "flood"))
        await asyncio.sleep(0)
        assert batcher._queued_queries == 3
        gone.cancel()
        await asyncio.sleep(0)
        assert batcher._queued_queries == 1 and batcher.describe()["queued_queries"] == 1
        return [gone, stays]

    _, gone, stays = _with_first_batch_blocked(recorder, batcher, then)
    assert isinstance(gone, asyncio.CancelledError) and json.loads(stays[0].docs())[0]["id"] == "stays"
    assert recorder.calls == [["first"], ["stays"]]


async def _wait_for(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _on_loopback(app, limits: Limits, stub: _Stub):
    """uvicorn serving `app` in this process on a free loopback port with `limits`' connection
    options (as `serve` runs it); yields an httpx client of it; on exit the stub's gate is opened
    and the server stopped."""
    import uvicorn

    from search_env.retrieval.process import free_port
    from search_env.retrieval.server import uvicorn_options

    port = free_port()
    options = uvicorn_options(limits)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options))
    serving = asyncio.create_task(server.serve())
    await _wait_for(lambda: server.started)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S) as client:
            yield client
    finally:
        stub.gate.set()
        server.should_exit = True
        await asyncio.wait_for(serving, WAIT_S)


def test_per_client_bound_on_a_real_server_keys_clients_by_token_and_drops_disconnected_requests() -> None:
    """uvicorn on a loopback socket, in process (the stub's search is gated): two tokens are two
    clients; a request whose client hangs up while queued is never searched."""
    stub, searched = _Stub(), []
    stub.gate.clear()
    search_rows = stub.search_rows
    stub.search_rows = lambda qs, k: (searched.extend(qs), search_rows(qs, k))[1]  # type: ignore[method-assign]
    limits = Limits(max_wait_ms=0, max_queued_per_client=3)
    app = create_app(stub, limits, auth_tokens=["tok-a", "tok-b"])
    a, b = ({"Authorization": f"Bearer {t}"} for t in ("tok-a", "tok-b"))

    async def run() -> None:
        batcher = app.state.batcher
        async with _on_loopback(app, limits, stub) as client:
            first = asyncio.create_task(client.post("/retrieve", json={"queries": ["q1"]}, headers=a))
            await _wait_for(lambda: batcher.busy)
            second = asyncio.create_task(client.post("/retrieve", json={"queries": ["q2", "q3"]}, headers=a))
            await _wait_for(lambda: batcher._queued_queries == 2)
            refused = await client.post("/retrieve", json={"queries": ["q4", "q5"]}, headers=a)
            _refused(refused, 429, None, "--max-queued-per-client 3")
            assert refused.headers["retry-after"] == "1"
            other = asyncio.create_task(client.post("/retrieve", json={"queries": ["b1"]}, headers=b))
            await _wait_for(lambda: batcher._queued_queries == 3)
            body = json.dumps({"queries": ["hung 1", "hung 2"]}).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", client.base_url.port)
            writer.write(
                f"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer tok-b\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            await _wait_for(lambda: batcher._queued_queries == 5)
            writer.close()  # hangs up while its queries are queued
            await _wait_for(lambda: batcher._queued_queries == 3)
            stub.gate.set()
            assert [(await t).status_code for t in (first, second, other)] == [200, 200, 200]
        assert sorted(searched) == ["b1", "q1", "q2", "q3"]

    asyncio.run(run())


def test_cached_answers_count_against_the_per_client_bound_on_a_real_server() -> None:
    """Security review 3 N3: a warm cache no longer skips the queue: a client's cached queries wait
    their turn in the batches, count against --max-queued-per-client and get its 429."""
    stub = _Stub()
    limits = Limits(max_wait_ms=0, max_queued_per_client=3)
    app = create_app(stub, limits)
    hot = {"queries": ["hot", "hot"], "topk": 2}

    async def run() -> None:
        batcher = app.state.batcher
        async with _on_loopback(app, limits, stub) as client:
            assert (await client.post("/retrieve", json=hot)).status_code == 200  # the cache is warm
            searched = batcher.stats.searched
            stub.gate.clear()
            first = asyncio.create_task(client.post("/retrieve", json={"queries": ["q1"]}))
            await _wait_for(lambda: batcher.busy)
            cached = asyncio.create_task(client.post("/retrieve", json=hot))
            await _wait_for(lambda: batcher._queued_queries == 2)  # queued like any other query
            _refused(await client.post("/retrieve", json=hot), 429, None, "--max-queued-per-client 3")
            stub.gate.set()
            assert [(await t).status_code for t in (first, cached)] == [200, 200]
            assert batcher.stats.searched == searched + 1  # only q1: the cached ones from the cache

    asyncio.run(run())


def test_answers_not_yet_built_count_against_the_clients_bound() -> None:
    """Security review 3 N4: a client's answered queries still count until its answer is built
    (`keep`, then `release`), so answers waiting for a client that does not read are bounded too."""

    async def run() -> None:
        batcher = MicroBatcher(lambda qs, k: [[] for _ in qs], 256, 0, max_queued_per_client=4)
        await batcher.start()
        try:
            assert len(await batcher.submit(["a", "b", "c"], 1, "slow reader", keep=True)) == 3
            with pytest.raises(Overloaded, match="--max-queued-per-client 4"):
                await batcher.submit(["d", "e"], 1, "slow reader")  # 3 + 2 > 4: its answer is not built
            assert len(await batcher.submit(["x", "y"], 1, "other")) == 2
            batcher.release("slow reader", 3)
            assert len(await batcher.submit(["d", "e"], 1, "slow reader")) == 2
        finally:
            await batcher.stop()

    asyncio.run(run())
