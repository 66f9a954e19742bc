"""The retrieval server's bearer-token auth and what `/health` shows (issue #41; security review M4):
a real `python -m search_env.retrieval serve --auth-token-file` on loopback, the start-up refusals (a token
file others can read, a non-loopback bind without a token), and `/health` without paths or PIDs
for callers the server does not trust (nor traffic or cache counters; each token its own cache:
security review 3 N10)."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.__main__ import serve_auth
from search_env.retrieval.admission import is_loopback
from search_env.retrieval.backend import Retriever
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.process import free_port, spawn_server
from search_env.retrieval.server import HIDDEN_HEALTH_KEYS, create_app, public_health

TOKEN = "s3cret-token-for-the-auth-tests-0123456789"
GOOD = {"queries": ["Evan Morris lobbyist"], "topk": 1}
POSTS = [("/retrieve", GOOD), ("/search", {"query": "Evan Morris"}), ("/batch_search", {"query": ["Evan"]})]


def _token_file(folder: Path, mode: int = 0o600, text: str = f"# retriever\n{TOKEN}\n") -> Path:
    path = folder / "retriever.token"
    path.write_text(text)
    path.chmod(mode)
    return path


def _serve(args: list[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """`python -m search_env.retrieval serve ARGS` expected to refuse to start (it must exit by itself)."""
    command = [sys.executable, "-m", "search_env.retrieval", "serve", "--backend", "bm25", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("auth")
    serve = [
        "--backend",
        "bm25",
        "--corpus",
        str(SAMPLE_CORPUS),
        "--auth-token-file",
        str(_token_file(folder, text=f"# retriever\n{TOKEN}\n{'b' * 32}\n")),
    ]
    with spawn_server(serve, startup_timeout_s=60, log_path=folder / "server.log") as server:
        yield server


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize(("path", "body"), POSTS, ids=[p for p, _ in POSTS])
@pytest.mark.slow
def test_every_post_needs_a_valid_bearer_token(token_server, path: str, body: dict) -> None:
    url = f"{token_server.url}{path}"
    for headers, word in (({}, "missing"), (_bearer("x" * 40), "wrong"), ({"Authorization": TOKEN}, "wrong")):
        answer = httpx.post(url, json=body, headers=headers)
        assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer", answer.text
        error = answer.json()
        assert error["field"] is None and word in error["error"] and "--auth-token-file" in error["error"]
    assert httpx.post(url, json=body, headers=_bearer(TOKEN)).status_code == 200


def test_health_answers_without_a_token_but_shows_no_paths_pids_or_counters(token_server) -> None:
    public = httpx.get(f"{token_server.url}/health")
    assert public.status_code == 200
    doc = public.json()
    assert doc["status"] == "healthy" and doc["auth"] is True
    assert doc["corpus"] == SAMPLE_CORPUS.name and "search_process" not in doc
    assert doc["backend"] == "bm25" and doc["corpus_size"] == 1000  # eval's identity keys stay
    assert not [v for v in doc.values() if isinstance(v, str) and "/" + SAMPLE_CORPUS.parent.name in v]
    wrong = httpx.get(f"{token_server.url}/health", headers=_bearer("y" * 40)).json()
    assert wrong == {**doc, "uptime_s": wrong["uptime_s"]}
    full = httpx.get(f"{token_server.url}/health", headers=_bearer(TOKEN)).json()
    assert full["corpus"] == str(SAMPLE_CORPUS) and isinstance(full["search_process"], int)
    assert {k for k in full if k not in doc} == HIDDEN_HEALTH_KEYS  # pids, traffic and cache counters


def test_one_tokens_cache_tells_nothing_of_anothers_queries(token_server) -> None:
    """Security review 3 N10: token B repeating what token A asked is searched again, not a hit."""
    url, other = token_server.url, "b" * 32

    def counters() -> tuple[int, int]:
        doc = httpx.get(f"{url}/health", headers=_bearer(TOKEN)).json()
        return doc["cache"]["hits"], doc["queries_searched"]

    query = {"queries": [f"tenant probe {time.time()}"], "topk": 2}
    assert httpx.post(f"{url}/retrieve", json=query, headers=_bearer(TOKEN)).status_code == 200
    hits, searched = counters()
    assert httpx.post(f"{url}/retrieve", json=query, headers=_bearer(other)).status_code == 200
    assert counters() == (hits, searched + 1)  # B's own miss
    assert httpx.post(f"{url}/retrieve", json=query, headers=_bearer(TOKEN)).status_code == 200
    assert counters() == (hits + 1, searched + 1)  # A's own hit


def test_a_token_file_others_can_read_refuses_to_start(tmp_path) -> None:
    loose = _token_file(tmp_path, mode=0o640)
    result = _serve(["--auth-token-file", str(loose), "--port", str(free_port())])
    assert result.returncode != 0
    assert "--auth-token-file" in result.stderr and f"chmod 600 {loose}" in result.stderr, result.stderr
    short = _token_file(tmp_path, text="short\n")
    result = _serve(["--auth-token-file", str(short), "--port", str(free_port())])
    assert (
        result.returncode != 0 and "--auth-token-file" in result.stderr and "16 characters" in result.stderr
    )


def test_a_non_loopback_bind_without_a_token_refuses_to_start() -> None:
    result = _serve(["--host", "0.0.0.0", "--port", str(free_port())])  # exits before it binds
    assert result.returncode != 0
    assert "--auth-token-file" in result.stderr and "--insecure-no-auth" in result.stderr, result.stderr


def test_serve_auth_rules(tmp_path, caplog) -> None:
    def args(host: str, token_file: Path | None = None, insecure: bool = False) -> argparse.Namespace:
        return argparse.Namespace(host=host, auth_token_file=token_file, insecure_no_auth=insecure)

    assert serve_auth(args("127.0.0.1")) is None and serve_auth(args("localhost")) is None
    assert serve_auth(args("10.1.2.3", _token_file(tmp_path))) == [TOKEN]
    assert serve_auth(args("0.0.0.0", insecure=True)) is None
    assert "without authentication (--insecure-no-auth)" in caplog.text
    with pytest.raises(SystemExit, match="--host 10.1.2.3 .*--auth-token-file"):
        serve_auth(args("10.1.2.3"))
    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost")] == [True] * 5
    assert [is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "node7.cluster")] == [False] * 4


def test_public_health_cuts_paths_and_drops_pids() -> None:
    doc = {
        "corpus": "/data/wiki18/wiki-18.jsonl",
        "encoder": "/home/alice/models/e5-base-v2",
        "search_process": 4242,
        "index_placement": "cpu (--gpu auto/off: the index stays on CPU)",
        "prewarm": "failed: [Errno 2] No such file or directory: '/scratch/alice/e5.index'",
        "cache": {"enabled": True, "hits": 10043},
        "nested": {"enabled": True, "note": "see /tmp/x/y.log"},
        "corpus_size": 21015324,
    }
    assert public_health(doc) == {
        "corpus": "wiki-18.jsonl",
        "encoder": "e5-base-v2",
        "index_placement": "cpu (--gpu auto/off: the index stays on CPU)",
        "prewarm": "failed: [Errno 2] No such file or directory: 'e5.index'",
        "nested": {"enabled": True, "note": "see y.log"},
        "corpus_size": 21015324,
    }


class _Stub(Retriever):
    backend = "stub"

    def __init__(self) -> None:
        self.corpus = Corpus(os.path.abspath(SAMPLE_CORPUS))

    def search_rows(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        rows = np.zeros((len(queries), topk), dtype=np.int64)
        return rows, np.ones_like(rows, dtype=np.float32)

    def describe(self) -> dict:
        return {"index_type": "stub", "nprobe": None, "search_process": 99}


@pytest.mark.parametrize(
    ("loopback", "tokens", "headers", "full"),
    [
        (True, None, {}, True),  # a loopback server without auth: local users can read `ps` anyway
        (False, None, {}, False),  # --insecure-no-auth on another address
        (True, [TOKEN], {}, False),
        (False, [TOKEN], _bearer(TOKEN), True),
    ],
    ids=["loopback-no-auth", "insecure-no-auth", "token-missing", "token-valid"],
)
def test_who_sees_the_full_health(loopback: bool, tokens, headers: dict, full: bool) -> None:
    app = create_app(_Stub(), auth_tokens=tokens, loopback=loopback)

    async def run() -> dict:
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client,
        ):
            return (await client.get("/health", headers=headers)).json()

    doc = asyncio.run(run())
    assert doc["corpus"] == (str(SAMPLE_CORPUS) if full else SAMPLE_CORPUS.name)
    assert ("search_process" in doc) is full
