"""Retrieval HTTP server (FastAPI): Search-R1 `/retrieve`, FlashRAG/ReSearch `/search` + `/batch_search`,
`/health`; binds 127.0.0.1 unless told otherwise (then a bearer token file is required).

The app ties the parts together: admission (`admission.py`: guards, throttle, request limits), the
fair-share micro-batcher with the query cache (`batcher.py`), answers built and sent under per-client
bounds (`answers.py`), and uvicorn's h11 protocol with connection limits (`connections.py`); every
number is a field of `limits.Limits`, every refusal a 4xx `{"error": ..., "field": ...}` naming its
flag. Mechanisms, limits and measurements: docs/retrieval.md ("HTTP API", "Limits", "Micro-batching").
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Hashable
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from search_env.retrieval.admission import (
    JsonBodyGuard,
    RefusalThrottle,
    Refused,
    RequestGuard,
    check_request,
    error_body,
)
from search_env.retrieval.answers import AnswerBudget
from search_env.retrieval.auth import token_matches
from search_env.retrieval.backend import Retriever
from search_env.retrieval.batcher import BackendFailure, MicroBatcher, log_stats_every
from search_env.retrieval.cache import QueryCache
from search_env.retrieval.connections import guarded_protocol, raise_open_files
from search_env.retrieval.heap import freeze_heap
from search_env.retrieval.hits_json import EncodedHits, Hit, batch_search_body, retrieve_body, search_body
from search_env.retrieval.limits import MAX_QUERIES, MAX_TOPK, Limits
from search_env.retrieval.prewarm import Prewarm

HIDDEN_HEALTH_KEYS = frozenset(
    {
        "search_process",
        "batches",
        "queries_served",
        "queries_searched",
        "largest_batch",
        "queued_queries",
        "clients_queued",
        "shared_batch",
        "shared_batch_ms",
        "cache",
    }
)
"""`/health` keys shown only to callers the server trusts: process ids, traffic and cache counters."""
GC_THRESHOLDS = (50_000, 20, 20)
"""The server process's garbage-collector thresholds (Python's: 2,000, 10, 10): a batch's searched
hits (up to --max-hits passages) live for milliseconds and hold no cycles; with young collections
rarer they die before one, instead of being promoted and scanned again by full collections."""
SWITCH_INTERVAL_S = 0.001
"""The GIL switch interval of the server process (Python's default: 5 ms): the event loop's thread
waits at most about this long for the GIL while an answer or batch thread holds it."""
PATH_NAME_KEYS = frozenset({"corpus", "encoder"})
"""`/health` keys cut to their last path component for other callers."""
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/(?:[^\s/'\"]+/)*([^\s/'\"]*)")


def _check_query_strings(queries: list[str]) -> list[str]:
    for i, query in enumerate(queries):
        if not query.strip():
            raise ValueError(f"query {i} is empty or whitespace; every query must hold text")
        try:
            query.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"query {i} is not valid Unicode (a lone surrogate at char {err.start}); send UTF-8 text"
            ) from None
    return queries


class RetrieveRequest(BaseModel):
    """Search-R1 `/retrieve` body. `topk` None -> the server's default topk."""

    queries: list[StrictStr] = Field(min_length=1, max_length=MAX_QUERIES)
    topk: StrictInt | None = Field(default=None, ge=1, le=MAX_TOPK)
    return_scores: StrictBool = False

    _nonempty = field_validator("queries")(_check_query_strings)


class SearchRequest(BaseModel):
    """FlashRAG/ReSearch `/search` body (one query)."""

    query: StrictStr = Field(min_length=1)
    top_n: StrictInt = Field(default=10, ge=1, le=MAX_TOPK)
    return_score: StrictBool = False

    @field_validator("query")
    @classmethod
    def _nonempty(cls, query: str) -> str:
        return _check_query_strings([query])[0]


class BatchSearchRequest(BaseModel):
    """FlashRAG/ReSearch `/batch_search` body (`query` is a list)."""

    query: list[StrictStr] = Field(min_length=1, max_length=MAX_QUERIES)
    top_n: StrictInt = Field(default=10, ge=1, le=MAX_TOPK)
    return_score: StrictBool = False

    _nonempty = field_validator("query")(_check_query_strings)


def client_key(request: Request, tokens: list[str] | None) -> Hashable:
    """Who sent `request`, for fair shares of the batches: the index of its bearer token when the
    server has tokens (one per user), else the peer's IP address ("" when unknown)."""
    if tokens is not None:
        header = request.headers.get("authorization")
        for i, token in enumerate(tokens):  # RequestGuard already checked that one matches
            if token_matches(header, [token]):
                return ("token", i)
    return request.client.host if request.client is not None else ""


async def submit_while_connected(
    batcher: MicroBatcher, request: Request, queries: list[str], topk: int, client: Hashable
) -> list[EncodedHits]:
    """`batcher.submit(..., keep=True)` (the caller releases the queries), cancelled (its queries not
    yet searched leave the queue) when the client disconnects first: uvicorn does not cancel a
    handler whose client went away, it only answers `http.disconnect` to the next `receive()` once
    the body has been read."""
    search = asyncio.ensure_future(batcher.submit(queries, topk, client, keep=True))

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({search, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not search.done():
            search.cancel()  # on our own cancellation too; the batcher then drops the queued queries
    if search not in done:
        with contextlib.suppress(asyncio.CancelledError, Refused):
            await search
            batcher.release(client, len(queries))  # answered as the client went away
        raise Refused(499, None, "the client disconnected before its answer was ready")
    return search.result()


def lookup_hits(retriever: Retriever, queries: list[str], topk: int) -> list[list[Hit]]:
    """Search, then read each hit's corpus row (runs in the batch worker thread)."""
    corpus = retriever.corpus
    return [
        [(corpus.row(row), score) for row, score in per_query]
        for per_query in retriever.search_hits(queries, topk)
    ]


def _json(doc: dict) -> bytes:
    return json.dumps(doc, ensure_ascii=False).encode("utf-8")


def _error(
    status: int, message: str, field: str | None, headers: dict[str, str] | None = None, **extra: object
) -> Response:
    return Response(
        content=error_body(message, field, **extra),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def _describe_validation_error(err: RequestValidationError) -> tuple[str, str]:
    """(message, field of the first error) of a validation error."""
    parts = []
    fields = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item.get("loc", ()) if p != "body") or "body"
        fields.append(loc.split(".")[0] if item.get("type") != "json_invalid" else "body")
        if item.get("type") == "json_invalid":
            loc = f"body (char {loc})"
        parts.append(f"{loc}: {item.get('msg', 'invalid')}")
    return "; ".join(parts), (fields[0] if fields else "body")


def _describe_body_error(cause: BaseException | None) -> str:
    """Why a body that is not a JSON decode error could not be parsed (FastAPI's 400 cause)."""
    if isinstance(cause, UnicodeDecodeError):
        return f"body: not valid UTF-8 (byte {cause.start}); send UTF-8 JSON"
    if isinstance(cause, RecursionError):
        return "body: JSON nested too deeply to parse; send the documented flat shape"
    return f"body: cannot be parsed as JSON ({type(cause).__name__}); send a JSON object"


def public_health(doc: dict) -> dict:
    """`/health` for a caller the server does not trust: no process ids (`HIDDEN_HEALTH_KEYS`), the
    corpus and encoder as their last path component, and every other absolute path in a text cut to
    its last component."""
    out: dict = {}
    for key, value in doc.items():
        if key in HIDDEN_HEALTH_KEYS:
            continue
        if key in PATH_NAME_KEYS and isinstance(value, str):
            value = Path(value).name
        elif isinstance(value, str):
            value = _ABSOLUTE_PATH.sub(r"\1", value)
        elif isinstance(value, dict):
            value = public_health(value)
        out[key] = value
    return out


def create_app(
    retriever: Retriever,
    limits: Limits | None = None,
    prewarm: Prewarm | None = None,
    auth_tokens: list[str] | None = None,
    loopback: bool = True,
) -> FastAPI:
    """The FastAPI app serving `retriever` under `limits` (every field a `serve` flag; `serve` reads
    its connection limits from `app.state.limits`). prewarm: the index pre-warm already started
    (shown by `/health`, stopped on shutdown); auth_tokens: bearer tokens every POST must carry (None =
    no auth); loopback: the server binds a loopback address (Host header checked; without tokens
    `/health` is shown in full to any caller)."""
    limits = limits or Limits()
    if auth_tokens is not None and not auth_tokens:
        raise ValueError("auth_tokens: an empty list would refuse every request; pass None for no auth")
    batcher = MicroBatcher(
        lambda qs, k: lookup_hits(retriever, qs, k),
        limits.max_batch,
        limits.max_wait_ms,
        QueryCache(limits.cache_size, int(limits.cache_max_mb * 2**20)),
        max_queued=limits.max_queued_queries,
        max_queued_per_client=limits.max_queued_per_client,
        fair_batch_ms=limits.fair_batch_ms,
    )
    answers = AnswerBudget(
        int(limits.max_answer_mb_per_client * 2**20), limits.max_answer_mb_per_s_per_client * 2**20
    )
    default_topk, stats_interval_s = limits.topk, limits.stats_interval_s

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await batcher.start()
        stats_task = (
            asyncio.create_task(log_stats_every(batcher, stats_interval_s)) if stats_interval_s else None
        )
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await batcher.stop()
            answers.close()
            if prewarm is not None:
                prewarm.stop()
            retriever.close()

    app = FastAPI(title="rlvr-search retrieval server", lifespan=lifespan)
    app.add_middleware(JsonBodyGuard, max_bytes=limits.max_body_bytes, body_timeout_s=limits.body_timeout_s)
    app.add_middleware(RequestGuard, tokens=auth_tokens, loopback_hosts_only=loopback)
    app.add_middleware(RefusalThrottle, rate=limits.max_refusal_rate)  # added last: runs first
    app.state.batcher = batcher
    app.state.limits = limits
    if prewarm is not None:
        prewarm.busy = lambda: batcher.busy
    app.state.started = time.time()

    def trusted(request: Request) -> bool:
        """Whether `/health` may show paths, process ids and traffic counters to this caller: a valid
        token, or any caller of a loopback server without auth (local users can read the paths from
        `ps`, and all of them share one address, so one cache, anyway)."""
        if auth_tokens is None:
            return loopback
        return token_matches(request.headers.get("authorization"), auth_tokens)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> Response:
        detail = [{k: v for k, v in item.items() if k in ("type", "loc", "msg")} for item in err.errors()]
        message, field = _describe_validation_error(err)
        return _error(422, message, field, detail=detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> Response:
        if err.status_code == 400 and err.__cause__ is not None:  # FastAPI could not parse the body
            return _error(422, _describe_body_error(err.__cause__), "body")
        return _error(err.status_code, str(err.detail), None, headers=err.headers)

    @app.exception_handler(Refused)
    async def _refused(_: Request, err: Refused) -> Response:
        return _error(err.status, err.message, err.field, headers=err.headers)

    @app.exception_handler(BackendFailure)
    async def _backend_failure(_: Request, err: BackendFailure) -> Response:
        return _error(500, f"retrieval backend failed: {err}", None)

    @app.get("/health")
    async def health(request: Request) -> Response:
        if not retriever.healthy():
            unhealthy = {"status": "unhealthy", "error": "the retrieval backend cannot search", "field": None}
            return Response(content=_json(unhealthy), status_code=503, media_type="application/json")
        doc = {
            "status": "healthy",
            "backend": retriever.backend,
            "corpus": str(retriever.corpus.path),
            "corpus_size": len(retriever.corpus),
            **retriever.describe(),
            **(prewarm.describe() if prewarm is not None else {}),
            "default_topk": default_topk,
            "max_query_chars": limits.max_query_chars,
            "max_hits": limits.max_hits,
            "auth": auth_tokens is not None,
            **batcher.describe(),
            "uptime_s": round(time.time() - app.state.started, 3),
        }
        shown = doc if trusted(request) else public_health(doc)
        return Response(content=_json(shown), media_type="application/json")

    async def answer(
        request: Request, queries: list[str], topk: int, build: Callable[[list[EncodedHits]], bytes]
    ) -> Response:
        """`build(hits)` of `queries` (the JSON body) as the answer to the client of `request`; the
        queries count against its --max-queued-per-client until the answer is built."""
        client = client_key(request, auth_tokens)
        hits = await submit_while_connected(batcher, request, queries, topk, client)
        try:
            return await answers.answer(client, lambda: build(hits))
        finally:
            batcher.release(client, len(queries))

    @app.post("/retrieve")
    async def retrieve(body: RetrieveRequest, request: Request) -> Response:
        topk = body.topk or default_topk
        check_request(limits, body.queries, topk, "queries", "topk")
        return await answer(request, body.queries, topk, lambda hits: retrieve_body(hits, body.return_scores))

    @app.post("/search")
    async def search(body: SearchRequest, request: Request) -> Response:
        check_request(limits, [body.query], body.top_n, "query", "top_n", one=True)
        return await answer(
            request, [body.query], body.top_n, lambda hits: search_body(hits[0], body.return_score)
        )

    @app.post("/batch_search")
    async def batch_search(body: BatchSearchRequest, request: Request) -> Response:
        check_request(limits, body.query, body.top_n, "query", "top_n")
        return await answer(
            request, body.query, body.top_n, lambda hits: batch_search_body(hits, body.return_score)
        )

    return app


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Run `app` with uvicorn's h11 protocol under the connection limits of `app.state.limits`
    (`connections.guarded_protocol`) until interrupted (SIGINT/SIGTERM). The heap built so far is
    frozen (`heap.freeze_heap`), young collections made rarer (`GC_THRESHOLDS`) and the GIL switch
    interval shortened (`SWITCH_INTERVAL_S`); the open-files limit raised to what the limits need
    (`connections.raise_open_files`, a warning where the hard limit is lower)."""
    if warning := raise_open_files(app.state.limits):
        logging.getLogger(__name__).warning(warning)
    freeze_heap()
    gc.set_threshold(*GC_THRESHOLDS)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, access_log=False, **uvicorn_options(app.state.limits)
    )


def uvicorn_options(limits: Limits) -> dict:
    """uvicorn's settings for `limits`: h11 (httptools builds a header value in quadratic time) with
    its own bounds and the guarded protocol."""
    return {
        "http": guarded_protocol(limits),
        "ws": "none",  # no upgrades: a connection stays with the guarded protocol until it closes
        "limit_concurrency": limits.max_connections,
        "timeout_keep_alive": limits.keep_alive_timeout_s,
        "h11_max_incomplete_event_size": limits.max_header_bytes,
    }
