"""The fair-share micro-batcher: concurrent requests' queries, queued per client, searched in shared
batches in one worker thread, with answers from the query cache. Mechanisms and measurements:
docs/retrieval.md ("Micro-batching", "Query cache").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from search_env.retrieval.admission import Overloaded
from search_env.retrieval.cache import QueryCache
from search_env.retrieval.hits_json import EncodedHits, Hit, encode_hits
from search_env.retrieval.limits import RETRY_AFTER_S, Limits

log = logging.getLogger(__name__)

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
ACTIVE_WINDOW_S = 1.0
"""a client that sent a request or had queries queued within this many seconds counts as active."""


class BackendFailure(RuntimeError):
    """The backend raised while searching one request's queries alone; that request gets HTTP 500."""


@dataclass(eq=False)
class _Job:
    """One request: its queries, topk, future, client key, per query the answer found so far (its
    hits as JSON; None = search), the indices to search (`todo`, in order) and how many of them are in a batch (`taken`)."""

    queries: list[str]
    topk: int
    future: asyncio.Future = field(repr=False)
    answers: list[EncodedHits | None] = field(repr=False)
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
    """Collects concurrent `submit` calls into batches, answered in one worker thread: each query
    from `cache` (per client) when it holds it, the rest by `search_fn` (one call per topk asked).
    Cached queries queue, count against the bounds and share batches like searched ones; a batch's
    time, cache look-ups included, can shrink the shared batch (only searched queries grow it).

    search_fn(queries, topk) -> per query a list of hits (called once per topk asked in a batch);
    each job receives its own slice, cut to its own topk (a top-k list is a prefix of a top-K list
    for K >= k, ties aside), encoded as JSON once (`hits_json.encode_hits`: what is cached and what
    answers are joined from). When a batch's search raises, each of its requests is searched alone,
    so only a request that fails alone gets the error.

    Fairness: each request carries a client key (a token, an IP address). With one client active, a
    batch takes its requests first come first served, whole, up to `max_batch` queries (the first one
    always). When several clients were active within `ACTIVE_WINDOW_S`, a batch holds at most
    `shared_batch()` queries, a number adapted so that a batch searches in about `shared_batch_s()`.
    The client with the largest backlog waits while others have queued queries, unless it was served
    least of late (queries taken into batches, halving every `USAGE_HALF_LIFE_S`: so no client
    starves). The others each get an equal share, then what is left goes to the smallest backlogs
    first; each client's queries in arrival order (a request may be split over batches). So a light
    client's request waits about one short batch behind a heavy client's backlog.
    max_queued: most queries waiting for a batch; max_queued_per_client: most of one client's
    waiting for a batch or their answer (`submit`'s `keep`). A
    request that would pass either while others (of that client) wait is refused with `Overloaded`
    naming the flag (past the per-client bound after waiting up to `RETRY_AFTER_S` for room; None =
    no bound; a request alone in the queue is always taken). A request whose
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
        fair_batch_ms: float = Limits.fair_batch_ms,
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
        self._held: dict[Hashable, int] = {}
        """Per client, its queries submitted and not yet released (queued, searched or being answered)."""
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

    async def submit(
        self, queries: list[str], topk: int, client: Hashable = None, keep: bool = False
    ) -> list[EncodedHits]:
        """Per query its hits (at most `topk`) as JSON; `client`: who sent it (fair shares; None = one client).
        Raises `Overloaded` (429) past a queue bound; cancelling it drops the unsearched queries.
        The queries count against --max-queued-per-client until answered, or with `keep` until the
        caller's `release` (its answer built: so a client's answers waiting to be built are bounded)."""
        if self._wakeup is None:
            raise RuntimeError("MicroBatcher.start() was not awaited")
        self._seen[client] = time.monotonic()
        answers: list[EncodedHits | None] = [None] * len(queries)
        todo = list(range(len(queries)))  # cached ones too: every query counts against the bounds
        job = _Job(queries, topk, asyncio.get_running_loop().create_future(), answers, client, todo)
        if self._client_full(client, job.pending):  # hold it a while: a client that ignores
            await self._room_for(client, job.pending)  # Retry-After gets one refusal a second
            if self._client_full(client, job.pending):
                raise Overloaded(
                    f"{self._held[client]} queries of this client wait for a search or their answer and "
                    f"this request's {job.pending} would pass --max-queued-per-client "
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
        self._held[client] = self._held.get(client, 0) + len(queries)
        self._wakeup.set()
        try:
            hits = await job.future
        except BaseException:
            self._withdraw(job)
            self.release(client, len(queries))
            raise
        if not keep:
            self.release(client, len(queries))
        return hits

    def release(self, client: Hashable, queries: int) -> None:
        """`client`'s `queries` of a `submit(..., keep=True)` no longer count against its bound."""
        left = self._held[client] - queries
        if left:
            self._held[client] = left
        else:
            del self._held[client]
        if client in self._waiting:
            self._wake(client)

    async def _room_for(self, client: Hashable, queries: int) -> None:
        """Wait up to `RETRY_AFTER_S` until `queries` more of `client` fit --max-queued-per-client;
        waiting requests are woken in arrival order as the client's queries are answered."""
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
        free = (self.max_queued_per_client or 0) - self._held.get(client, 0)
        for queries, future in self._waiting.get(client, ()):
            if future.done():
                continue
            if queries > free and client in self._held:
                break
            future.set_result(None)
            free -= queries

    def _client_full(self, client: Hashable, queries: int) -> bool:
        """Whether `queries` more of `client` would pass --max-queued-per-client while some are held."""
        mine = self._held.get(client, 0)
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
        """Note a batch that searched `queries` (cache hits and repeats of a query in the batch not
        counted) in `seconds`; after a `shared` one, adapt `shared_batch` to it. A batch of cheap
        look-ups never grows it: a client of repeated or cached queries would otherwise grow it to
        `max_batch`, and the next client's first shared batch would search that many."""
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

    def _look_up_and_search(self, batch: list[_Slice]) -> tuple[list[list[tuple[int, int]]], list[list[Hit]]]:
        """In the worker thread: `batch`'s answers from the cache (keyed by each job's client), then a
        search of the rest, one call per topk asked (a text asked at several topk in the batch is
        searched once, at the largest): so a client asking topk 100 does not make every other
        client's queries of the batch search at 100. Per slice, (query index, position in the hits)
        for each query searched, and the hits by position. Each searched (query, topk) is encoded
        once and cached. Identical texts of one client in the batch share one position (counted as
        hits)."""
        topk: list[int] = []  # per position, the largest topk asked of it
        searched: list[str] = []
        position: dict[tuple[Hashable, str], int] = {}
        positions: list[list[tuple[int, int]]] = []
        stats = self.cache.stats
        for job, indices in batch:
            where: list[tuple[int, int]] = []
            for i in indices:
                query, key = job.queries[i], (job.client, job.queries[i])
                job.answers[i] = self.cache.get(query, job.topk, job.client)  # a hit is counted there
                if job.answers[i] is not None:
                    continue
                if self.cache.enabled and key in position:
                    stats.hits += 1
                else:
                    stats.misses += 1
                    position[key] = len(searched)
                    searched.append(query)
                    topk.append(0)
                where.append((i, position[key]))
                topk[position[key]] = max(topk[position[key]], job.topk)
            positions.append(where)
        hits: list[list[Hit]] = [[] for _ in searched]
        for k in sorted(set(topk)):
            group = [pos for pos, asked in enumerate(topk) if asked == k]
            for pos, found in zip(group, self.search_fn([searched[pos] for pos in group], k), strict=True):
                hits[pos] = found
        self.stats.searched += len(searched)
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(searched))
        encoded: dict[tuple[int, int], EncodedHits] = {}
        for (job, _), where in zip(batch, positions, strict=True):
            for i, pos in where:
                if (pos, job.topk) not in encoded:
                    encoded[pos, job.topk] = encode_hits(hits[pos][: job.topk])
                    self.cache.put(job.queries[i], job.topk, encoded[pos, job.topk], job.client)
                job.answers[i] = encoded[pos, job.topk]
        return positions, hits

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
        """Look up and search `batch` in the worker thread (`_look_up_and_search`) and answer its jobs
        whose queries all have answers. When that raises, a batch of several slices is done again
        slice by slice; a slice that fails alone gets its job `BackendFailure` (and the job's queued
        queries are dropped) (`retry`: this is such a second try; it logs one line instead of a
        traceback; `shared`: taken while several clients were active, so its time, cache look-ups
        included, adapts `shared_batch`)."""
        self.busy = True
        started = time.perf_counter()
        try:
            _, hits = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._look_up_and_search, batch
            )
        except Exception as err:
            failure = f"{type(err).__name__}: {err}"
            queries = sum(len(indices) for _, indices in batch)
            if retry:
                log.error("retrieval request of %d queries failed alone: %s", queries, failure)
            else:
                log.exception("retrieval batch of %d queries failed", queries)
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
            self._timed(len(hits), time.perf_counter() - started, shared)
        self.stats.batches += 1
        for job, _ in batch:
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
