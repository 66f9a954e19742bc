"""Answers joined from each query's JSON bytes: every endpoint's body is byte for byte `json.dumps` of
the answer, and a request answered from the cache gets the very bytes its uncached answer had."""

import asyncio
import json

import httpx
import numpy as np
import pytest

from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.backend import Retriever
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.hits_json import batch_search_body, encode_hits, retrieve_body, search_body
from search_env.retrieval.limits import Limits
from search_env.retrieval.server import create_app, lookup_hits

SCORES = np.array([0.1 + 0.2, -0.25, 1e-7, 3.4e38, 7.0, 0.3333333333], dtype=np.float32)
"""Scores whose float32 -> float -> JSON text is not trivial."""


def _json(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


def _expected(path: str, hits: list[list[tuple[dict, float]]], scores: bool) -> bytes:
    """What one `json.dumps` writes for the answer of `path` (the server's answers before the cache
    held JSON bytes)."""
    docs = [[doc for doc, _ in one] for one in hits]
    values = [[score for _, score in one] for one in hits]
    if path == "/retrieve":
        result = [[{"document": d, "score": s} for d, s in one] for one in hits] if scores else docs
        return _json({"result": result})
    if path == "/search":
        return _json([docs[0], values[0]] if scores else docs[0])
    return _json([docs, values] if scores else docs)


def test_bodies_are_json_dumps_of_the_hits() -> None:
    odd = {"id": "u\u2014", "contents": 'Zoë "quoted"\n\\ naïve \U0001f600', "extra": [1, None, {"a": True}]}
    per_query = [[(odd, 0.30000001192092896), ({"id": "2", "contents": "x"}, -0.25)], [], [(odd, 1e-07)]]
    encoded = [encode_hits(hits) for hits in per_query]
    for scores in (True, False):
        assert retrieve_body(encoded, scores) == _expected("/retrieve", per_query, scores)
        assert batch_search_body(encoded, scores) == _expected("/batch_search", per_query, scores)
        for one, hits in zip(encoded, per_query, strict=True):
            assert search_body(one, scores) == _expected("/search", [hits], scores)


class _Varied(Retriever):
    """Rows q, q+1, ... for the q-th distinct query, with `SCORES`."""

    backend = "stub"

    def __init__(self) -> None:
        self.corpus = Corpus(SAMPLE_CORPUS)

    def search_rows(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        first = np.array([sum(map(ord, q)) % 900 for q in queries], dtype=np.int64)[:, None]
        rows = first + np.arange(topk, dtype=np.int64)
        return rows, np.resize(SCORES, rows.shape).astype(np.float32)

    def describe(self) -> dict:
        return {"index_type": "stub", "nprobe": None}


REQUESTS = [
    ("/retrieve", {"queries": ["who wrote Zoë?", "capital of France"], "topk": 6, "return_scores": True}),
    ("/retrieve", {"queries": ["who wrote Zoë?", "capital of France"], "topk": 6}),
    ("/retrieve", {"queries": ["capital of France"], "topk": 3, "return_scores": True}),
    ("/search", {"query": "who wrote Zoë?", "top_n": 4, "return_score": True}),
    ("/search", {"query": "who wrote Zoë?", "top_n": 4}),
    ("/batch_search", {"query": ["capital of France", "who wrote Zoë?"], "top_n": 5, "return_score": True}),
    ("/batch_search", {"query": ["capital of France", "who wrote Zoë?"], "top_n": 5}),
]


@pytest.mark.parametrize(("path", "body"), REQUESTS)
def test_a_cached_answer_has_the_bytes_of_the_uncached_one(path: str, body: dict) -> None:
    retriever = _Varied()
    app = create_app(retriever, Limits())
    queries = body.get("queries") or body["query"]
    queries = [queries] if isinstance(queries, str) else queries
    topk = body.get("topk") or body["top_n"]
    scores = body.get("return_scores", body.get("return_score", False))
    expected = _expected(path, lookup_hits(retriever, queries, topk), scores)

    async def run() -> list:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client,
        ):
            answers = [await client.post(path, json=body) for _ in range(2)]
            return [*answers, (await client.get("/health")).json()["cache"]]

    first, second, cache = asyncio.run(asyncio.wait_for(run(), 30))
    assert first.status_code == second.status_code == 200
    assert (cache["misses"], cache["hits"]) == (len(queries), len(queries))  # searched, then cached
    assert first.content == second.content == expected
