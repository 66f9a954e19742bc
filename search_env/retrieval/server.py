"""Retrieval HTTP server (FastAPI): Search-R1 `/retrieve`, FlashRAG/ReSearch `/search` + `/batch_search`,
`/health`; binds 127.0.0.1 unless told otherwise.

Concurrent requests are micro-batched (one batching task, up to `max_batch` queries, waiting at most
`max_wait_ms` for more) into one backend search run in a worker thread, so the event loop keeps
accepting requests; repeated queries are answered from an LRU cache (`cache.QueryCache`). Invalid
fields are a 422 naming the field, oversized bodies a 413 sent after the body was drained (bounded).
Mechanisms and measurements: docs/retrieval.md ("HTTP API", "Micro-batching", "Query cache").
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr, field_validator

from search_env.retrieval.backend import Retriever
from search_env.retrieval.cache import Hit, QueryCache
from search_env.retrieval.prewarm import Prewarm

log = logging.getLogger(__name__)

MAX_QUERIES = 4096
MAX_TOPK = 100
DEFAULT_TOPK = 5
DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_WAIT_MS = 2.0
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_CACHE_ENTRIES = 65536
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
DEFAULT_DRAIN_BYTES = 64 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT_S = 10.0
DEFAULT_STATS_INTERVAL_S = 60.0


def _check_query_strings(queries: list[str]) -> list[str]:
    for i, query in enumerate(queries):
        if not query.strip():
            raise ValueError(f"query {i} is empty or whitespace; every query must hold text")
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


class BackendFailure(RuntimeError):
    """The backend raised while searching a batch; every request of that batch gets HTTP 500."""


@dataclass
class _Job:
    """One request: its queries, topk, future, and per query the answer found so far (None = search)."""

    queries: list[str]
    topk: int
    future: asyncio.Future = field(repr=False)
    answers: list[list[Hit] | None] = field(repr=False)

    @property
    def pending(self) -> int:
        return sum(answer is None for answer in self.answers)


@dataclass
class BatchStats:
    """Counters shown by `/health`: batches run, queries answered (`served`), queries encoded and
    searched (`searched`), largest batch (queries searched in one backend call)."""

    batches: int = 0
    served: int = 0
    searched: int = 0
    max_batch_seen: int = 0


class MicroBatcher:
    """Collects concurrent `submit` calls into batches for `search_fn`, run in one worker thread, and
    answers repeated (query, topk) pairs from `cache` (see the module docstring).

    search_fn(queries, topk) -> per query a list of hits; each job receives its own slice, cut to its
    own topk (a top-k list is a prefix of a top-K list for K >= k, ties aside).
    """

    def __init__(
        self,
        search_fn: Callable[[list[str], int], list[list[Hit]]],
        max_batch: int,
        max_wait_ms: float,
        cache: QueryCache | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 query, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self.search_fn = search_fn
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000.0
        self.cache = cache if cache is not None else QueryCache(0, 1)
        self.stats = BatchStats()
        self.busy = False
        """Whether a batch is being searched now (the index pre-warm gives way meanwhile)."""
        self._jobs: deque[_Job] = deque()
        self._queued_queries = 0
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieval-batch")

    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="retrieval-micro-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def submit(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if self._wakeup is None:
            raise RuntimeError("MicroBatcher.start() was not awaited")
        answers = [self.cache.get(query, topk) for query in queries]
        cached = sum(answer is not None for answer in answers)
        self.cache.stats.hits += cached
        if cached == len(queries):
            self.stats.served += len(queries)
            return answers  # type: ignore[return-value]  # every entry is set
        job = _Job(queries, topk, asyncio.get_running_loop().create_future(), answers)
        self._jobs.append(job)
        self._queued_queries += job.pending
        self._wakeup.set()
        return await job.future

    def _take_batch(self) -> list[_Job]:
        batch = [self._jobs.popleft()]
        size = batch[0].pending
        while self._jobs and size + self._jobs[0].pending <= self.max_batch:
            job = self._jobs.popleft()
            batch.append(job)
            size += job.pending
        self._queued_queries -= size
        return batch

    def _plan(self, batch: list[_Job]) -> tuple[list[str], int, list[list[int | None]]]:
        """The texts to search for `batch`, the topk to search them with (the largest topk of a job
        with a query to search; 0 when none) and, per job and query, its position in that list (None =
        answered). Looks the unanswered queries up in the cache again; with the cache on, identical
        texts share one position (counted as hits)."""
        topk = 0
        searched: list[str] = []
        position: dict[str, int] = {}
        plan: list[list[int | None]] = []
        stats = self.cache.stats
        for job in batch:
            where: list[int | None] = []
            for i, query in enumerate(job.queries):
                if job.answers[i] is None and self.cache.enabled:
                    job.answers[i] = self.cache.get(query, job.topk)
                    if job.answers[i] is not None:
                        stats.hits += 1
                if job.answers[i] is not None:
                    where.append(None)
                    continue
                if self.cache.enabled and query in position:
                    stats.hits += 1
                else:
                    stats.misses += 1
                    position[query] = len(searched)
                    searched.append(query)
                where.append(position[query])
                topk = max(topk, job.topk)
            plan.append(where)
        return searched, topk, plan

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._jobs:
                continue
            if self.max_wait_s > 0 and self._queued_queries < self.max_batch:
                await asyncio.sleep(self.max_wait_s)
            batch = [job for job in self._take_batch() if not job.future.cancelled()]
            if self._jobs:
                self._wakeup.set()
            if not batch:
                continue
            searched, topk, plan = self._plan(batch)
            hits: list[list[Hit]] = []
            if searched:
                self.busy = True
                try:
                    hits = await loop.run_in_executor(self._executor, self.search_fn, searched, topk)
                except Exception as err:  # every waiting request must get the error
                    log.exception("retrieval batch of %d queries failed", len(searched))
                    for job in batch:
                        if not job.future.done():
                            job.future.set_exception(BackendFailure(f"{type(err).__name__}: {err}"))
                    continue
                finally:
                    self.busy = False
                self.stats.batches += 1
                self.stats.searched += len(searched)
                self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(searched))
            for job, where in zip(batch, plan, strict=True):
                for i, pos in enumerate(where):
                    if pos is not None:
                        job.answers[i] = hits[pos][: job.topk]
                        self.cache.put(job.queries[i], job.topk, job.answers[i])
                self.stats.served += len(job.queries)
                if not job.future.done():
                    job.future.set_result(job.answers)

    def describe(self) -> dict:
        """Batching and cache facts for `GET /health`."""
        return {
            "max_batch": self.max_batch,
            "max_wait_ms": self.max_wait_s * 1000.0,
            "batches": self.stats.batches,
            "queries_served": self.stats.served,
            "queries_searched": self.stats.searched,
            "largest_batch": self.stats.max_batch_seen,
            "cache": self.cache.describe(),
        }


async def log_stats_every(batcher: MicroBatcher, interval_s: float) -> None:
    """Log, every `interval_s` seconds in which queries were answered, that interval's queries, cache
    hit rate and batches, plus the cache's size (runs until cancelled)."""
    last = (batcher.stats.served, batcher.cache.stats.hits, batcher.cache.stats.misses, batcher.stats.batches)
    while True:
        await asyncio.sleep(interval_s)
        now = (
            batcher.stats.served,
            batcher.cache.stats.hits,
            batcher.cache.stats.misses,
            batcher.stats.batches,
        )
        served, hits, misses, batches = (b - a for a, b in zip(last, now, strict=True))
        last = now
        if not served:
            continue
        log.info(
            "last %g s: %d queries (%.1f/s), cache hits %d / misses %d (hit rate %.1f%%), %d batches "
            "(mean %.1f queries searched), cache %d entries / %.1f MiB",
            interval_s,
            served,
            served / interval_s,
            hits,
            misses,
            100.0 * hits / max(1, hits + misses),
            batches,
            misses / max(1, batches),
            len(batcher.cache),
            batcher.cache.bytes / 2**20,
        )


def lookup_hits(retriever: Retriever, queries: list[str], topk: int) -> list[list[Hit]]:
    """Search, then read each hit's corpus row (runs in the batch worker thread)."""
    corpus = retriever.corpus
    return [
        [(corpus.row(row), score) for row, score in per_query]
        for per_query in retriever.search_hits(queries, topk)
    ]


def _json(payload: object, status: int = 200) -> Response:
    return Response(
        content=json.dumps(payload, ensure_ascii=False), status_code=status, media_type="application/json"
    )


def _describe_validation_error(err: RequestValidationError) -> str:
    parts = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item.get("loc", ()) if p != "body") or "body"
        if item.get("type") == "json_invalid":
            loc = f"body (char {loc})"
        parts.append(f"{loc}: {item.get('msg', 'invalid')}")
    return "; ".join(parts)


class JsonBodyGuard:
    """ASGI middleware for POST bodies: answer 413 JSON when a body exceeds `max_bytes`, and read every
    body as JSON whatever Content-Type the client sent (e.g. `curl -d` sends form encoding).

    An oversized body (by its Content-Length, or by counting streamed chunks; at most `max_bytes` are
    buffered) is read to its end and discarded before the 413 is sent: clients such as urllib,
    requests and httpx write the whole body before they read the answer, and closing on them mid-body
    would give them a connection reset instead of the 413. Draining is bounded: at most `drain_bytes`
    in all and `drain_timeout_s` seconds; past either bound (or when Content-Length already exceeds
    `drain_bytes`) the 413 is sent at once with `Connection: close`. A client that sent
    `Expect: 100-continue` has not sent its body yet, so it gets the 413 at once and sends nothing.
    """

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        max_bytes: int,
        drain_bytes: int = DEFAULT_DRAIN_BYTES,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = drain_bytes
        self.drain_timeout_s = drain_timeout_s

    async def _drain(self, receive: Callable[[], Awaitable[dict]], received: int) -> bool:
        """Read and discard the rest of a body of which `received` bytes were read; True when its end
        was reached within the byte and time bounds (False also when the client went away)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        while received <= self.drain_bytes:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return False
            if message["type"] != "http.request":
                return False
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False

    async def _reject(self, send: Callable[[dict], Awaitable[None]], size: str, close: bool) -> None:
        body = json.dumps(
            {
                "error": f"body: request body of {size} bytes exceeds the limit of "
                f"{self.max_bytes} bytes; send fewer or shorter queries per request",
                "field": "body",
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        scope = {
            **scope,
            "headers": [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            + [(b"content-type", b"application/json")],
        }
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            waiting = headers.get(b"expect", b"").lower() == b"100-continue"
            drained = not waiting and int(declared) <= self.drain_bytes and await self._drain(receive, 0)
            await self._reject(send, declared.decode(), close=not drained)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)  # client went away; let the app see it
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                drained = not message.get("more_body", False) or await self._drain(receive, size)
                await self._reject(send, f"more than {self.max_bytes}", close=not drained)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        buffered = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return buffered
            return await receive()

        await self.app(scope, replay, send)


def create_app(
    retriever: Retriever,
    default_topk: int = DEFAULT_TOPK,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    cache_entries: int = DEFAULT_CACHE_ENTRIES,
    cache_bytes: int = DEFAULT_CACHE_BYTES,
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S,
    prewarm: Prewarm | None = None,
) -> FastAPI:
    """The FastAPI app serving `retriever`. max_batch: queries per backend call (1 disables
    micro-batching); max_wait_ms: how long a non-full batch waits for more requests; cache_entries /
    cache_bytes: bounds of the query cache (0 entries = off); stats_interval_s: how often the
    traffic and cache hit rate are logged (0 = never); prewarm: the index pre-warm already started
    (shown by `/health`, stopped on shutdown)."""
    if not 1 <= default_topk <= MAX_TOPK:
        raise ValueError(f"default topk must be in 1..{MAX_TOPK}, got {default_topk}")
    if stats_interval_s < 0:
        raise ValueError(f"stats interval must be >= 0 s (0 = off), got {stats_interval_s}")
    batcher = MicroBatcher(
        lambda qs, k: lookup_hits(retriever, qs, k),
        max_batch,
        max_wait_ms,
        QueryCache(cache_entries, cache_bytes),
    )

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
            if prewarm is not None:
                prewarm.stop()
            retriever.close()

    app = FastAPI(title="rlvr-search retrieval server", lifespan=lifespan)
    app.add_middleware(JsonBodyGuard, max_bytes=max_body_bytes)
    app.state.batcher = batcher
    if prewarm is not None:
        prewarm.busy = lambda: batcher.busy
    app.state.started = time.time()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> Response:
        detail = [{k: v for k, v in item.items() if k in ("type", "loc", "msg")} for item in err.errors()]
        return _json({"error": _describe_validation_error(err), "detail": detail}, status=422)

    @app.exception_handler(BackendFailure)
    async def _backend_failure(_: Request, err: BackendFailure) -> Response:
        return _json({"error": f"retrieval backend failed: {err}"}, status=500)

    @app.get("/health")
    async def health() -> Response:
        if not retriever.healthy():
            return _json({"status": "unhealthy", "error": "the retrieval backend cannot search"}, status=503)
        return _json(
            {
                "status": "healthy",
                "backend": retriever.backend,
                "corpus": str(retriever.corpus.path),
                "corpus_size": len(retriever.corpus),
                **retriever.describe(),
                **(prewarm.describe() if prewarm is not None else {}),
                "default_topk": default_topk,
                **batcher.describe(),
                "uptime_s": round(time.time() - app.state.started, 3),
            }
        )

    @app.post("/retrieve")
    async def retrieve(body: RetrieveRequest) -> Response:
        hits = await batcher.submit(body.queries, body.topk or default_topk)
        if body.return_scores:
            result = [[{"document": doc, "score": score} for doc, score in per_query] for per_query in hits]
        else:  # Search-R1 returns the bare documents when scores are not asked for
            result = [[doc for doc, _ in per_query] for per_query in hits]
        return _json({"result": result})

    @app.post("/search")
    async def search(body: SearchRequest) -> Response:
        (per_query,) = await batcher.submit([body.query], body.top_n)
        docs = [doc for doc, _ in per_query]
        return _json([docs, [score for _, score in per_query]] if body.return_score else docs)

    @app.post("/batch_search")
    async def batch_search(body: BatchSearchRequest) -> Response:
        hits = await batcher.submit(body.query, body.top_n)
        docs = [[doc for doc, _ in per_query] for per_query in hits]
        if body.return_score:
            return _json([docs, [[score for _, score in per_query] for per_query in hits]])
        return _json(docs)

    return app


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Run `app` with uvicorn until interrupted (SIGINT/SIGTERM)."""
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("retrieval server binds %s: it is reachable from other machines and has no auth", host)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
