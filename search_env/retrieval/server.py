"""Retrieval HTTP server (FastAPI): Search-R1 `/retrieve`, FlashRAG/ReSearch `/search` + `/batch_search`,
`/health`; binds 127.0.0.1 unless told otherwise (then a bearer token file is required).

Concurrent requests are micro-batched into one backend search run in a worker thread (a batch whose
search raises is searched again request by request); repeated queries come from an LRU cache
(`cache.QueryCache`). `RequestGuard` (Host on loopback, no Origin, JSON content type, bearer token)
and `JsonBodyGuard` (body size and read deadline) run before any handler; every limit is a `serve`
flag and every refusal a 4xx `{"error": ..., "field": ...}` naming it.
Mechanisms, limits and measurements: docs/retrieval.md ("HTTP API", "Limits", "Micro-batching").
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from search_env.retrieval.auth import token_matches
from search_env.retrieval.backend import Retriever
from search_env.retrieval.cache import Hit, QueryCache
from search_env.retrieval.heap import freeze_heap
from search_env.retrieval.prewarm import Prewarm

log = logging.getLogger(__name__)

MAX_QUERIES = 4096
MAX_TOPK = 100
DEFAULT_TOPK = 5
DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_WAIT_MS = 2.0
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
"""1 MiB: a Search-R1 batch of 512 short queries is ~0.5 MB, 256 queries of --max-query-chars 4,096
chars fit, the search tool and eval send one query per request; a bigger body is refused (413) by
its Content-Length before it is parsed."""
DEFAULT_CACHE_ENTRIES = 65536
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
DEFAULT_DRAIN_BYTES = 64 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT_S = 10.0
DEFAULT_STATS_INTERVAL_S = 60.0
DEFAULT_MAX_QUERY_CHARS = 4096
DEFAULT_MAX_HITS = 8192
"""queries x topk per request: a Search-R1 batch (512 queries x topk 3) and a 512-query topk-5
request fit; an answer holds at most this many passages (wiki-18 rows: ~0.7 KB each with JSON, so
~6 MB; docs/retrieval.md "Limits and authentication")."""
DEFAULT_MAX_QUEUED_QUERIES = 16384
DEFAULT_MAX_QUEUED_PER_CLIENT = 1024
"""queries one client may have waiting: one training node's 512 concurrent one-query rollouts pass twice."""
DEFAULT_FAIR_BATCH_MS = 5.0
"""while several clients are active, the search time one batch aims at (ms), at least
`FIXED_COST_FACTOR` x the quickest batch's, so a request waits about one such batch behind another
client's backlog (docs/retrieval.md "Micro-batching"); a lone client still gets full --max-batch
batches."""
FIXED_COST_FACTOR = 1.5
"""a shared batch may take this many times the quickest recent batch (the search's fixed cost, e.g. a
GPU flat index's full scan), so batching keeps at least 2/3 of its throughput."""
QUICKEST_RISE = 1.01
"""the quickest recent batch time rises by this factor per batch searched (so it follows a slowdown)."""
USAGE_HALF_LIFE_S = 1.0
"""half-life of a client's recent usage (queries taken into batches), by which batches are shared."""
SHARED_GROWTH = 1.25
"""after a shared batch searched within --fair-batch-ms, the next may hold this factor more queries
(at least one more); after a slower one, 1/this factor as many (at least one)."""
DEFAULT_MAX_REFUSAL_RATE = 10.0
"""4xx answers per second to one client address before further ones are held (`RefusalThrottle`)."""
REFUSAL_BURST_S = 2.0
"""seconds' worth of --max-refusal-rate answered without delay after a quiet spell."""
MAX_TRACKED_ADDRESSES = 65536
"""client addresses whose refusal count is kept; past it, the one refused least recently is forgotten."""
ACTIVE_WINDOW_S = 1.0
"""a client that sent a request or had queries queued within this many seconds counts as active."""
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_BODY_TIMEOUT_S = 10.0
RETRY_AFTER_S = 1
"""`Retry-After` of a 429 (seconds); a request past --max-queued-per-client waits this long for room
before its 429, so a client that retries at once is not answered in a busy loop."""
HIDDEN_HEALTH_KEYS = frozenset({"search_process"})
"""`/health` keys shown only to callers the server trusts (process ids)."""
PATH_NAME_KEYS = frozenset({"corpus", "encoder"})
"""`/health` keys cut to their last path component for other callers."""
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/(?:[^\s/'\"]+/)*([^\s/'\"]*)")


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP address, `[IPv6]` or `localhost`; a bind address or a Host header's
    name) is this machine's loopback, reachable from this machine only."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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


class Refused(Exception):
    """A request the server will not serve: HTTP `status`, the body `field` it concerns (None: the
    request as a whole), a message naming the limit or flag, and extra response headers."""

    def __init__(
        self, status: int, field: str | None, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.field = field
        self.message = message
        self.headers = headers or {}


class Overloaded(Refused):
    """429: the queue of queries waiting for a search is full (the client retries after `Retry-After`)."""

    def __init__(self, message: str) -> None:
        super().__init__(429, None, message, {"Retry-After": str(RETRY_AFTER_S)})


@dataclass(frozen=True)
class Limits:
    """Per-request limits checked after the body parsed: characters per query and queries x topk."""

    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS
    max_hits: int = DEFAULT_MAX_HITS

    def __post_init__(self) -> None:
        if self.max_query_chars < 1 or self.max_hits < 1:
            raise ValueError(
                f"--max-query-chars and --max-hits must be >= 1, got {self.max_query_chars}, {self.max_hits}"
            )

    def check(self, queries: list[str], topk: int, field: str, topk_field: str, one: bool = False) -> None:
        """Refused (422) naming `field` (and the query's index unless `one`) and the flag."""
        for i, query in enumerate(queries):
            if len(query) > self.max_query_chars:
                where = field if one else f"{field}.{i}"
                raise Refused(
                    422,
                    field,
                    f"{where}: {len(query)} characters exceed --max-query-chars {self.max_query_chars}; "
                    "send shorter queries",
                )
        hits = len(queries) * topk
        if hits > self.max_hits:
            raise Refused(
                422,
                field,
                f"{field}: {len(queries)} queries x {topk_field} {topk} = {hits} hits exceed --max-hits "
                f"{self.max_hits}; send fewer queries per request or a smaller {topk_field}",
            )


class BackendFailure(RuntimeError):
    """The backend raised while searching one request's queries alone; that request gets HTTP 500."""


@dataclass(eq=False)
class _Job:
    """One request: its queries, topk, future, client key, per query the answer found so far (None =
    search), the indices to search (`todo`, in order) and how many of them are in a batch (`taken`)."""

    queries: list[str]
    topk: int
    future: asyncio.Future = field(repr=False)
    answers: list[list[Hit] | None] = field(repr=False)
    client: Hashable = None
    todo: list[int] = field(default_factory=list, repr=False)
    taken: int = 0

    @property
    def pending(self) -> int:
        """Queries not yet in a batch."""
        return len(self.todo) - self.taken


_Slice = tuple[_Job, list[int]]
"""Part of a batch: a job and the indices of its queries searched in that batch."""


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
    own topk (a top-k list is a prefix of a top-K list for K >= k, ties aside). When a batch's search
    raises, each of its requests is searched alone, so only a request that fails alone gets the error.

    Fairness: each request carries a client key (a token, an IP address). With one client active, a
    batch takes its requests first come first served, whole, up to `max_batch` queries (the first one
    always). When several clients were active within `ACTIVE_WINDOW_S`, a batch holds at most
    `shared_batch()` queries, a number adapted so that a batch searches in about `shared_batch_s()`.
    The client with the largest backlog waits while others have queued queries, unless it was served
    least of late (queries taken into batches, halving every `USAGE_HALF_LIFE_S`: so no client
    starves). The others each get an equal share, then what is left goes to the smallest backlogs
    first; each client's queries in arrival order (a request may be split over batches). So a light
    client's request waits about one short batch behind a heavy client's backlog.
    max_queued: most queries waiting for a search; max_queued_per_client: most of one client's. A
    request that would pass either while others (of that client) wait is refused with `Overloaded`
    naming the flag (past the per-client bound after waiting up to `RETRY_AFTER_S` for room) (None = no bound; a request alone in the queue is always taken). A request whose
    `submit` is cancelled (its client went away) leaves the queue with its queries not yet searched.
    """

    def __init__(
        self,
        search_fn: Callable[[list[str], int], list[list[Hit]]],
        max_batch: int,
        max_wait_ms: float,
        cache: QueryCache | None = None,
        max_queued: int | None = None,
        max_queued_per_client: int | None = None,
        fair_batch_ms: float = DEFAULT_FAIR_BATCH_MS,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 query, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if max_queued is not None and max_queued < 1:
            raise ValueError(f"--max-queued-queries must be >= 1, got {max_queued}")
        if max_queued_per_client is not None and max_queued_per_client < 1:
            raise ValueError(f"--max-queued-per-client must be >= 1, got {max_queued_per_client}")
        if not fair_batch_ms > 0:
            raise ValueError(f"--fair-batch-ms must be > 0 ms, got {fair_batch_ms}")
        self.max_queued = max_queued
        self.max_queued_per_client = max_queued_per_client
        self.fair_batch_s = fair_batch_ms / 1000.0
        self._shared = 1
        """Queries of the next batch while several clients are active (`shared_batch`)."""
        self._quickest_s: float | None = None
        """The quickest recent batch's search time (a minimum rising by `QUICKEST_RISE` per batch)."""
        self.search_fn = search_fn
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000.0
        self.cache = cache if cache is not None else QueryCache(0, 1)
        self.stats = BatchStats()
        self.busy = False
        """Whether a batch is being searched now (the index pre-warm gives way meanwhile)."""
        self._queues: dict[Hashable, deque[_Job]] = {}
        """Per client with queued queries, its requests in arrival order; dict order = turn order."""
        self._client_queued: dict[Hashable, int] = {}
        self._seen: dict[Hashable, float] = {}
        """Per recently active client, when it last sent a request or had queries queued (monotonic s)."""
        self._usage: dict[Hashable, tuple[float, float]] = {}
        """Per recently active client, (queries taken into batches, decayed; when it was last updated)."""
        self._queued_queries = 0
        self._waiting: dict[Hashable, deque[tuple[int, asyncio.Future]]] = {}
        """Per client, its requests waiting for room under --max-queued-per-client: (queries, future)."""
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

    async def submit(self, queries: list[str], topk: int, client: Hashable = None) -> list[list[Hit]]:
        """Per query its hits (at most `topk`); `client`: who sent it (fair shares; None = one client).
        Raises `Overloaded` (429) past a queue bound; cancelling it drops the unsearched queries."""
        if self._wakeup is None:
            raise RuntimeError("MicroBatcher.start() was not awaited")
        answers = [self.cache.get(query, topk) for query in queries]
        self._seen[client] = time.monotonic()
        if all(answer is not None for answer in answers):
            self.stats.served += len(queries)
            return answers  # type: ignore[return-value]  # every entry is set
        todo = [i for i, answer in enumerate(answers) if answer is None]
        job = _Job(queries, topk, asyncio.get_running_loop().create_future(), answers, client, todo)
        if self._client_full(client, job.pending):  # hold it a while: a client that ignores
            await self._room_for(client, job.pending)  # Retry-After gets one refusal a second
            if self._client_full(client, job.pending):
                raise Overloaded(
                    f"{self._client_queued[client]} queries of this client wait for a search and this "
                    f"request's {job.pending} would pass --max-queued-per-client "
                    f"{self.max_queued_per_client}; retry after {RETRY_AFTER_S} s"
                )
        queued = self._queued_queries
        if self.max_queued is not None and queued and queued + job.pending > self.max_queued:
            raise Overloaded(
                f"{queued} queries wait for a search and this request's {job.pending} would pass "
                f"--max-queued-queries {self.max_queued}; retry after {RETRY_AFTER_S} s"
            )
        self._queues.setdefault(client, deque()).append(job)
        self._count(client, job.pending)
        self._wakeup.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            self._withdraw(job)
            raise

    async def _room_for(self, client: Hashable, queries: int) -> None:
        """Wait up to `RETRY_AFTER_S` until `queries` more of `client` fit --max-queued-per-client;
        waiting requests are woken in arrival order as batches take the client's queries."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETRY_AFTER_S
        while self._client_full(client, queries) and loop.time() < deadline:
            waiter = (queries, loop.create_future())
            waiting = self._waiting.setdefault(client, deque())
            waiting.append(waiter)
            try:
                await asyncio.wait_for(waiter[1], deadline - loop.time())
            except TimeoutError:
                pass
            finally:
                if waiter in waiting:
                    waiting.remove(waiter)
                if not waiting:
                    self._waiting.pop(client, None)

    def _wake(self, client: Hashable) -> None:
        """Wake the waiting requests of `client` that now fit its bound, in arrival order."""
        free = (self.max_queued_per_client or 0) - self._client_queued.get(client, 0)
        for queries, future in self._waiting.get(client, ()):
            if future.done():
                continue
            if queries > free and client in self._client_queued:
                break
            future.set_result(None)
            free -= queries

    def _client_full(self, client: Hashable, queries: int) -> bool:
        """Whether `queries` more of `client` would pass --max-queued-per-client while some wait."""
        mine = self._client_queued.get(client, 0)
        bound = self.max_queued_per_client
        return bound is not None and mine > 0 and mine + queries > bound

    def _count(self, client: Hashable, queries: int) -> None:
        """Add `queries` (may be negative) to the queued counts of `client` and of all."""
        self._queued_queries += queries
        left = self._client_queued.get(client, 0) + queries
        if left:
            self._client_queued[client] = left
        else:
            self._client_queued.pop(client, None)
        if queries < 0 and client in self._waiting:
            self._wake(client)

    def _withdraw(self, job: _Job) -> None:
        """Take `job`'s queries not yet in a batch out of the queue (its answer is no longer wanted)."""
        queue = self._queues.get(job.client)
        if queue is None or job not in queue:
            return
        queue.remove(job)
        if not queue:
            del self._queues[job.client]
        self._count(job.client, -job.pending)
        job.taken = len(job.todo)

    def _active_clients(self, now: float) -> int:
        """Clients active within `ACTIVE_WINDOW_S` of `now` (older ones are forgotten)."""
        for client in self._queues:
            self._seen[client] = now
        for client in [c for c, t in self._seen.items() if now - t > ACTIVE_WINDOW_S]:
            del self._seen[client]
            self._usage.pop(client, None)
        return len(self._seen)

    def usage(self, client: Hashable, now: float) -> float:
        """`client`'s queries taken into batches, each weighted by 1/2 per `USAGE_HALF_LIFE_S` since."""
        value, at = self._usage.get(client, (0.0, now))
        return value * 0.5 ** ((now - at) / USAGE_HALF_LIFE_S)

    def _charge(self, client: Hashable, queries: int, now: float) -> None:
        self._usage[client] = (self.usage(client, now) + queries, now)

    def shared_batch(self) -> int:
        """Most queries in a batch while several clients are active, 1..`max_batch`: grown after each
        such batch searched within `shared_batch_s()`, shrunk after a slower one (`SHARED_GROWTH`)."""
        return self._shared

    def shared_batch_s(self) -> float:
        """The search time a shared batch aims at: `fair_batch_ms`, or `FIXED_COST_FACTOR` x the
        quickest recent batch if that is longer."""
        quickest = self._quickest_s or 0.0
        return max(self.fair_batch_s, FIXED_COST_FACTOR * quickest)

    def _timed(self, queries: int, seconds: float, shared: bool) -> None:
        """Note a batch of `queries` that searched in `seconds`; after a `shared` one, adapt
        `shared_batch` to it."""
        quickest = self._quickest_s
        self._quickest_s = seconds if quickest is None else min(quickest * QUICKEST_RISE, seconds)
        if not shared:
            return
        if seconds > self.shared_batch_s():
            self._shared = max(1, int(self._shared / SHARED_GROWTH))
        elif queries >= self._shared:  # a batch short of work says nothing about a full one
            self._shared = min(self.max_batch, max(self._shared + 1, int(self._shared * SHARED_GROWTH)))

    def _take_batch(self) -> tuple[list[_Slice], bool]:
        """The next batch (see the class docstring) and whether it is shared by several active
        clients; jobs whose future is done (cancelled) are dropped."""
        for job in [j for queue in self._queues.values() for j in queue if j.future.done()]:
            self._withdraw(job)
        if not self._queues:
            return [], False
        now = time.monotonic()
        if self._active_clients(now) <= 1:
            return self._take_in_order(now), False
        size = self.shared_batch()
        order = sorted(self._queues, key=self._client_queued.__getitem__)  # smallest backlog first
        if order[-1] != min(order, key=lambda c: self.usage(c, now)):
            order.pop()  # the largest backlog waits, unless its client was served least of late
        share = max(1, size // len(order))
        slices: dict[Hashable, list[_Slice]] = {}
        for client in order:  # each its equal share, then what is left to the least used
            size -= self._take_from(client, min(share, size), slices, now)
        for client in order:
            size -= self._take_from(client, size, slices, now)
        return [part for client in order for part in slices.get(client, [])], True

    def _take_from(
        self, client: Hashable, most: int, slices: dict[Hashable, list[_Slice]], now: float
    ) -> int:
        """Move up to `most` of `client`'s queued queries, in arrival order, into `slices[client]`;
        how many were taken."""
        queue, taken = self._queues.get(client), 0
        while queue and taken < most:
            job = queue[0]
            n = min(most - taken, job.pending)
            slices.setdefault(client, []).append((job, job.todo[job.taken : job.taken + n]))
            job.taken += n
            taken += n
            if not job.pending:
                queue.popleft()
        if taken:
            self._count(client, -taken)
            self._charge(client, taken, now)
        if queue is not None and not queue:
            del self._queues[client]
        return taken

    def _take_in_order(self, now: float) -> list[_Slice]:
        """One client's batch: whole requests in arrival order up to `max_batch` queries (the first
        one always)."""
        client, queue = next(iter(self._queues.items()))
        batch: list[_Slice] = []
        size = 0
        while queue and (not batch or size + queue[0].pending <= self.max_batch):
            job = queue.popleft()
            batch.append((job, job.todo[job.taken :]))
            size += job.pending
            job.taken = len(job.todo)
        self._count(client, -size)
        self._charge(client, size, now)
        if not queue:
            del self._queues[client]
        return batch

    def _queries_to_search(self, batch: list[_Slice]) -> tuple[list[str], int, list[list[tuple[int, int]]]]:
        """The texts to search for `batch`, the topk to search them with (the largest topk of a slice
        with a query to search; 0 when none) and, per slice, (query index, position in that list) for
        each query to search. Looks the slice's queries up in the cache again; with the cache on,
        identical texts share one position (counted as hits)."""
        topk = 0
        searched: list[str] = []
        position: dict[str, int] = {}
        positions: list[list[tuple[int, int]]] = []
        stats = self.cache.stats
        for job, indices in batch:
            where: list[tuple[int, int]] = []
            for i in indices:
                query = job.queries[i]
                if self.cache.enabled:
                    job.answers[i] = self.cache.get(query, job.topk)  # a hit is counted there
                    if job.answers[i] is not None:
                        continue
                if self.cache.enabled and query in position:
                    stats.hits += 1
                else:
                    stats.misses += 1
                    position[query] = len(searched)
                    searched.append(query)
                where.append((i, position[query]))
                topk = max(topk, job.topk)
            positions.append(where)
        return searched, topk, positions

    async def _run(self) -> None:
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._queues:
                continue
            if self.max_wait_s > 0 and self._queued_queries < self.max_batch:
                await asyncio.sleep(self.max_wait_s)
            batch, shared = self._take_batch()
            if self._queues:
                self._wakeup.set()
            if batch:
                await self._answer(batch, shared=shared)

    async def _answer(self, batch: list[_Slice], retry: bool = False, shared: bool = False) -> None:
        """Search `batch` in one backend call and answer its jobs whose queries all have answers. When
        the call raises, a batch of several slices is searched again slice by slice; a slice that fails
        alone gets its job `BackendFailure` (and the job's queued queries are dropped) (`retry`: this
        is such a second search; it logs one line instead of a traceback; `shared`: taken while several
        clients were active, so its search time adapts `shared_batch`)."""
        searched, topk, positions = self._queries_to_search(batch)
        hits: list[list[Hit]] = []
        if searched:
            self.busy = True
            started = time.perf_counter()
            try:
                hits = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self.search_fn, searched, topk
                )
            except Exception as err:
                failure = f"{type(err).__name__}: {err}"
                if retry:
                    log.error("retrieval request of %d queries failed alone: %s", len(searched), failure)
                else:
                    log.exception("retrieval batch of %d queries failed", len(searched))
                if len(batch) > 1:
                    for part in batch:  # only the request(s) that fail alone get the error
                        if not part[0].future.done():
                            await self._answer([part], retry=True)
                elif not batch[0][0].future.done():
                    self._withdraw(batch[0][0])
                    batch[0][0].future.set_exception(BackendFailure(failure))
                return
            finally:
                self.busy = False
            if not retry:
                self._timed(sum(len(i) for _, i in batch), time.perf_counter() - started, shared)
            self.stats.batches += 1
            self.stats.searched += len(searched)
            self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(searched))
        for (job, _), where in zip(batch, positions, strict=True):
            for i, pos in where:
                job.answers[i] = hits[pos][: job.topk]
                self.cache.put(job.queries[i], job.topk, job.answers[i])
            if job.pending or any(answer is None for answer in job.answers):
                continue  # the rest of its queries are in a later batch
            self.stats.served += len(job.queries)
            if not job.future.done():
                job.future.set_result(job.answers)

    def describe(self) -> dict:
        """Batching and cache facts for `GET /health`."""
        return {
            "max_batch": self.max_batch,
            "max_queued_queries": self.max_queued,
            "max_queued_per_client": self.max_queued_per_client,
            "fair_batch_ms": self.fair_batch_s * 1000.0,
            "shared_batch_ms": round(self.shared_batch_s() * 1000.0, 3),
            "shared_batch": self.shared_batch(),
            "queued_queries": self._queued_queries,
            "clients_queued": len(self._queues),
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
) -> list[list[Hit]]:
    """`batcher.submit`, cancelled (its queries not yet searched leave the queue) when the client
    disconnects first: uvicorn does not cancel a handler whose client went away, it only answers
    `http.disconnect` to the next `receive()` once the body has been read."""
    search = asyncio.ensure_future(batcher.submit(queries, topk, client))

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
        raise Refused(499, None, "the client disconnected before its answer was ready")
    return search.result()


def lookup_hits(retriever: Retriever, queries: list[str], topk: int) -> list[list[Hit]]:
    """Search, then read each hit's corpus row (runs in the batch worker thread)."""
    corpus = retriever.corpus
    return [
        [(corpus.row(row), score) for row, score in per_query]
        for per_query in retriever.search_hits(queries, topk)
    ]


def encode_json(payload: object) -> bytes:
    """`payload` as UTF-8 JSON (run in a thread for answers, whose size is bounded by --max-hits)."""
    return json.dumps(payload, ensure_ascii=False).encode("utf-8")


async def _json_answer(build: Callable[[], object]) -> Response:
    """200 JSON of `build()`, built and serialised off the event loop (so `/health` and other
    requests are not held up by a large answer)."""
    content = await asyncio.to_thread(lambda: encode_json(build()))
    return Response(content=content, media_type="application/json")


def error_body(message: str, field: str | None, **extra: object) -> bytes:
    """The server's error format, `{"error": message, "field": field, ...}` (ASCII JSON: a message
    quoting client text with a lone surrogate still encodes)."""
    return json.dumps({"error": message, "field": field, **extra}).encode()


def _error(
    status: int, message: str, field: str | None, headers: dict[str, str] | None = None, **extra: object
) -> Response:
    return Response(
        content=error_body(message, field, **extra),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


async def send_error(
    send: Callable[[dict], Awaitable[None]],
    status: int,
    field: str | None,
    message: str,
    close: bool = False,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """Send an error response from ASGI middleware (`close`: with `Connection: close`)."""
    body = error_body(message, field)
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


async def drain(
    receive: Callable[[], Awaitable[dict]], received: int, max_bytes: int, timeout_s: float
) -> bool:
    """Read and discard the rest of a body of which `received` bytes were read; True when its end
    was reached within `max_bytes` in all and `timeout_s` seconds (False also when the client left)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while received <= max_bytes:
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


def _header(scope: dict, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or []:
        if key == name:
            return value
    return None


def host_name(host: bytes) -> str:
    """The name of a Host header value without its port, lower-cased (`[::1]:8000` -> `[::1]`)."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[: text.find("]") + 1] if "]" in text else text
    return text.split(":", 1)[0]


class RequestGuard:
    """ASGI middleware: refuses a request from its headers alone, before its body is read.

    - `loopback_hosts_only` (set when bound to loopback): a Host header that is not `localhost` or a
      loopback address such as 127.0.0.1 or [::1] (any port), or none, gets 421, so a web page
      reached through DNS rebinding cannot talk to the server;
    - an `Origin` header (browsers send it on cross-site requests) gets 403;
    - with `tokens`: a POST without `Authorization: Bearer <one of tokens>` gets 401 with
      `WWW-Authenticate: Bearer` (compared in constant time, `auth.token_matches`);
    - a POST whose Content-Type is present and not `application/json` (parameters such as charset
      allowed) gets 415 (form and text/plain are what a web page may send without a preflight).

    The refused request's body is read and discarded within `drain_bytes` and `drain_timeout_s`
    (clients write the whole body before reading the answer), else the answer closes the connection.
    """

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        tokens: list[str] | None = None,
        loopback_hosts_only: bool = False,
        drain_bytes: int = DEFAULT_DRAIN_BYTES,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.loopback_hosts_only = loopback_hosts_only
        self.drain_bytes = drain_bytes
        self.drain_timeout_s = drain_timeout_s

    def refusal(self, scope: dict) -> Refused | None:
        """Why the request is refused (status, message, headers), or None."""
        host = _header(scope, b"host")
        if self.loopback_hosts_only and (host is None or not is_loopback(host_name(host))):
            shown = "none" if host is None else repr(host.decode("latin-1")[:100])
            return Refused(
                421,
                None,
                f"Host header {shown} is not a loopback name (localhost, 127.0.0.1, [::1], ...): "
                "a server bound to loopback answers local clients only",
            )
        if _header(scope, b"origin") is not None:
            return Refused(
                403,
                None,
                "requests carrying an Origin header (sent by web browsers) are refused; call the server "
                "from a program, not a web page",
            )
        if scope.get("method") != "POST":
            return None
        given = _header(scope, b"authorization")
        if self.tokens is not None and not token_matches(
            None if given is None else given.decode("latin-1"), self.tokens
        ):
            return Refused(
                401,
                None,
                f"{'missing' if given is None else 'wrong'} bearer token: this server was started with "
                "--auth-token-file; send `Authorization: Bearer <token>` (retriever.auth_token_file)",
                {"WWW-Authenticate": "Bearer"},
            )
        content_type = _header(scope, b"content-type")
        media = None if content_type is None else content_type.decode("latin-1").split(";", 1)[0].strip()
        if media is not None and media.lower() != "application/json":
            return Refused(
                415,
                None,
                f"Content-Type {media!r} is refused; send JSON with `Content-Type: application/json` "
                "(e.g. curl -H 'Content-Type: application/json')",
            )
        return None

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
    ) -> None:
        refused = self.refusal(scope) if scope["type"] == "http" else None
        if refused is None:
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length") or b"0"
        waiting = (_header(scope, b"expect") or b"").lower() == b"100-continue"
        drained = (
            not waiting
            and declared.isdigit()
            and int(declared) <= self.drain_bytes
            and await drain(receive, 0, self.drain_bytes, self.drain_timeout_s)
        )
        headers = tuple((k.lower().encode(), v.encode()) for k, v in refused.headers.items())
        await send_error(
            send, refused.status, refused.field, refused.message, close=not drained, headers=headers
        )


class JsonBodyGuard:
    """ASGI middleware for POST bodies: answer 413 JSON when a body exceeds `max_bytes`, 408 JSON (and
    close the connection) when the whole body has not arrived `body_timeout_s` seconds after its
    request started being read, and hand the app a body without Content-Type as JSON.

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
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        if body_timeout_s <= 0:
            raise ValueError(f"--body-timeout-s must be > 0 seconds, got {body_timeout_s}")
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = drain_bytes
        self.drain_timeout_s = drain_timeout_s
        self.body_timeout_s = body_timeout_s

    async def _reject(self, send: Callable[[dict], Awaitable[None]], size: str, close: bool) -> None:
        message = (
            f"body: request body of {size} bytes exceeds the limit of {self.max_bytes} bytes "
            "(--max-body-bytes); send fewer or shorter queries per request"
        )
        await send_error(send, 413, "body", message, close=close)

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if b"content-type" not in headers:  # read as JSON (FastAPI would otherwise see raw bytes)
            scope = {
                **scope,
                "headers": [*(scope.get("headers") or []), (b"content-type", b"application/json")],
            }
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            waiting = headers.get(b"expect", b"").lower() == b"100-continue"
            drained = (
                not waiting
                and int(declared) <= self.drain_bytes
                and await drain(receive, 0, self.drain_bytes, self.drain_timeout_s)
            )
            await self._reject(send, declared.decode(), close=not drained)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                await send_error(
                    send,
                    408,
                    "body",
                    f"body: not complete within --body-timeout-s {self.body_timeout_s:g} s ({size} bytes "
                    "arrived); send the whole body at once",
                    close=True,
                )
                return
            if message["type"] != "http.request":
                await self.app(scope, receive, send)  # client went away; let the app see it
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                drained = not message.get("more_body", False) or await drain(
                    receive, size, self.drain_bytes, self.drain_timeout_s
                )
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


class RefusalThrottle:
    """ASGI middleware: past `rate` 4xx answers per second to one client address (a burst of
    `REFUSAL_BURST_S` x `rate` allowed after a quiet spell), each further 4xx answer to that address is
    held before it is sent, up to `RETRY_AFTER_S` (a token bucket that may run into debt). A client that
    repeats refused requests in a loop is slowed to about `rate` per second plus one per connection
    and second, instead of taking the event loop from others; only refusals are slowed (`rate` 0: off).
    """

    def __init__(self, app: Callable[..., Awaitable[None]], rate: float) -> None:
        if rate < 0:
            raise ValueError(f"--max-refusal-rate must be >= 0 answers/s (0 = off), got {rate}")
        self.app = app
        self.rate = rate
        self.burst = max(1.0, REFUSAL_BURST_S * rate)
        self._allowance: dict[str, tuple[float, float]] = {}
        """Per address, (refusals it may still get at once, may be negative; when that was computed), in
        order of last refusal; at most `MAX_TRACKED_ADDRESSES`."""

    def delay(self, address: str, now: float) -> float:
        """Seconds to hold one more refusal to `address` at `now` (monotonic s); counts it."""
        left, at = self._allowance.get(address, (self.burst, now))
        left = min(self.burst, left + (now - at) * self.rate) - 1.0
        left = max(left, -self.rate * RETRY_AFTER_S)
        self._allowance.pop(address, None)  # re-inserted last: the dict is in order of last refusal
        if len(self._allowance) >= MAX_TRACKED_ADDRESSES:
            del self._allowance[next(iter(self._allowance))]
        self._allowance[address] = (left, now)
        return 0.0 if left >= 0 else min(RETRY_AFTER_S, -left / self.rate)

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http" or not self.rate:
            await self.app(scope, receive, send)
            return
        peer = scope.get("client")
        address = peer[0] if peer else ""

        async def send_after_delay(message: dict) -> None:
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500:
                held = self.delay(address, time.monotonic())
                if held > 0:
                    await asyncio.sleep(held)
            await send(message)

        await self.app(scope, receive, send_after_delay)


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
    limits: Limits | None = None,
    max_queued_queries: int | None = DEFAULT_MAX_QUEUED_QUERIES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    auth_tokens: list[str] | None = None,
    loopback: bool = True,
    max_queued_per_client: int | None = DEFAULT_MAX_QUEUED_PER_CLIENT,
    fair_batch_ms: float = DEFAULT_FAIR_BATCH_MS,
    max_refusal_rate: float = DEFAULT_MAX_REFUSAL_RATE,
) -> FastAPI:
    """The FastAPI app serving `retriever`. max_batch: queries per backend call (1 disables
    micro-batching); max_wait_ms: how long a non-full batch waits for more requests; cache_entries /
    cache_bytes: bounds of the query cache (0 entries = off); stats_interval_s: how often the
    traffic and cache hit rate are logged (0 = never); prewarm: the index pre-warm already started
    (shown by `/health`, stopped on shutdown). limits: characters per query and queries x topk;
    max_queued_queries: the 429 bound (None = none); max_queued_per_client: the same per client (a
    token of `auth_tokens`, else a peer IP address); fair_batch_ms: most estimated search time of a
    batch while several clients are active (`MicroBatcher`); max_refusal_rate: 4xx answers per second
    to one address before further ones are held (`RefusalThrottle`; 0 = never); body_timeout_s: the 408 deadline; auth_tokens:
    bearer tokens every POST must carry (None = no auth); loopback: the server binds a loopback
    address (Host header checked; without tokens `/health` is shown in full to any caller)."""
    if not 1 <= default_topk <= MAX_TOPK:
        raise ValueError(f"default topk must be in 1..{MAX_TOPK}, got {default_topk}")
    if stats_interval_s < 0:
        raise ValueError(f"stats interval must be >= 0 s (0 = off), got {stats_interval_s}")
    if auth_tokens is not None and not auth_tokens:
        raise ValueError("auth_tokens: an empty list would refuse every request; pass None for no auth")
    limits = limits or Limits()
    batcher = MicroBatcher(
        lambda qs, k: lookup_hits(retriever, qs, k),
        max_batch,
        max_wait_ms,
        QueryCache(cache_entries, cache_bytes),
        max_queued=max_queued_queries,
        max_queued_per_client=max_queued_per_client,
        fair_batch_ms=fair_batch_ms,
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
    app.add_middleware(JsonBodyGuard, max_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    app.add_middleware(RequestGuard, tokens=auth_tokens, loopback_hosts_only=loopback)
    app.add_middleware(RefusalThrottle, rate=max_refusal_rate)  # added last: runs first
    app.state.batcher = batcher
    app.state.limits = limits
    if prewarm is not None:
        prewarm.busy = lambda: batcher.busy
    app.state.started = time.time()

    def trusted(request: Request) -> bool:
        """Whether `/health` may show paths and process ids to this caller: a valid token, or any
        caller of a loopback server without auth (local users can read the same from `ps`)."""
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
            return Response(content=encode_json(unhealthy), status_code=503, media_type="application/json")
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
        return Response(content=encode_json(shown), media_type="application/json")

    async def submit(request: Request, queries: list[str], topk: int) -> list[list[Hit]]:
        return await submit_while_connected(batcher, request, queries, topk, client_key(request, auth_tokens))

    @app.post("/retrieve")
    async def retrieve(body: RetrieveRequest, request: Request) -> Response:
        topk = body.topk or default_topk
        limits.check(body.queries, topk, "queries", "topk")
        hits = await submit(request, body.queries, topk)
        if body.return_scores:
            return await _json_answer(
                lambda: {
                    "result": [[{"document": d, "score": s} for d, s in per_query] for per_query in hits]
                }
            )
        # Search-R1 returns the bare documents when scores are not asked for
        return await _json_answer(lambda: {"result": [[d for d, _ in per_query] for per_query in hits]})

    @app.post("/search")
    async def search(body: SearchRequest, request: Request) -> Response:
        limits.check([body.query], body.top_n, "query", "top_n", one=True)
        (per_query,) = await submit(request, [body.query], body.top_n)
        docs = [doc for doc, _ in per_query]
        return await _json_answer(lambda: [docs, [s for _, s in per_query]] if body.return_score else docs)

    @app.post("/batch_search")
    async def batch_search(body: BatchSearchRequest, request: Request) -> Response:
        limits.check(body.query, body.top_n, "query", "top_n")
        hits = await submit(request, body.query, body.top_n)

        def build() -> object:
            docs = [[doc for doc, _ in per_query] for per_query in hits]
            if body.return_score:
                return [docs, [[score for _, score in per_query] for per_query in hits]]
            return docs

        return await _json_answer(build)

    return app


def serve(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> None:
    """Run `app` with uvicorn until interrupted (SIGINT/SIGTERM); past `max_connections` open
    connections or requests in flight uvicorn answers 503. The heap built so far is frozen
    (`heap.freeze_heap`)."""
    freeze_heap()
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, access_log=False, limit_concurrency=max_connections
    )
