"""Query cache: LRU order, both bounds (entries and bytes), the byte estimate against tracemalloc, and
the micro-batcher answering repeats from the cache or from one search per batch."""

import asyncio
import gc
import json
import tracemalloc

import pytest

from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.batcher import MicroBatcher
from search_env.retrieval.cache import QueryCache, entry_bytes
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.hits_json import EncodedHits, Hit, encode_hits


def _decoded(hits: EncodedHits) -> list[Hit]:
    return [(hit["document"], hit["score"]) for hit in json.loads(hits.scored)]


def _hits(corpus: Corpus, first: int, k: int) -> list:
    return [(corpus.row((first + j) % len(corpus)), float(k - j)) for j in range(k)]


def test_lru_evicts_least_recently_used_first() -> None:
    cache = QueryCache(max_entries=3, max_bytes=10**9)
    for q in ("a", "b", "c"):
        cache.put(q, 5, encode_hits([({"id": q, "contents": q}, 1.0)]))
    assert cache.get("a", 5) is not None  # "a" is now the most recent; "b" the least
    cache.put("d", 5, encode_hits([]))
    assert [cache.get(q, 5) is not None for q in ("a", "b", "c", "d")] == [True, False, True, True]
    assert len(cache) == 3 and cache.stats.evictions == 1
    assert cache.get("a", 4) is None  # topk is part of the key


def test_replacing_an_entry_keeps_the_byte_count_exact() -> None:
    cache = QueryCache(max_entries=10, max_bytes=10**9)
    small, large = [({"id": "1", "contents": "x"}, 1.0)], [({"id": "1", "contents": "x" * 5000}, 1.0)]
    cache.put("q", 1, encode_hits(small))
    small_bytes = cache.bytes
    cache.put("q", 1, encode_hits(large))
    assert len(cache) == 1 and cache.bytes == small_bytes + 4999
    cache.put("q", 1, encode_hits(small))
    assert cache.bytes == small_bytes == entry_bytes("None\x001:q", encode_hits(small))


def test_cached_answers_come_back_equal_and_are_never_scanned_by_the_garbage_collector() -> None:
    corpus = Corpus(SAMPLE_CORPUS)
    cache = QueryCache(max_entries=100, max_bytes=10**9)
    hits = _hits(corpus, 3, 5) + [({"id": "u", "contents": "Zoë \u2014 naïve"}, -0.25)]
    cache.put("query", 6, encode_hits(hits))
    cached = cache.get("query", 6)
    assert cached == encode_hits(hits) and _decoded(cached) == hits
    assert cached.scored is cache.get("query", 6).scored  # the stored bytes themselves: no parse
    assert not any(gc.is_tracked(part) for entry in cache._entries.items() for part in (entry[0], *entry[1]))


def test_byte_bound_holds_and_oversized_answers_are_not_cached() -> None:
    corpus = Corpus(SAMPLE_CORPUS)
    bound = 200_000
    cache = QueryCache(max_entries=10**6, max_bytes=bound)
    for i in range(500):
        cache.put(f"query {i}", 5, encode_hits(_hits(corpus, 5 * i, 5)))
        assert cache.bytes <= bound
    assert 0 < len(cache) < 500 and cache.stats.evictions == 500 - len(cache)
    assert cache.get("query 499", 5) is not None and cache.get("query 0", 5) is None
    huge = [({"id": "h", "contents": "y" * (bound + 1)}, 1.0)]
    cache.put("huge", 1, encode_hits(huge))
    assert cache.get("huge", 1) is None and cache.bytes <= bound


@pytest.mark.slow
def test_estimated_bytes_cover_the_real_allocation() -> None:
    """tracemalloc: the memory the cached answers really hold is at most the estimate (and not far
    below it, or the bound would waste most of its budget)."""
    corpus = Corpus(SAMPLE_CORPUS)
    cache = QueryCache(max_entries=10**6, max_bytes=10**9)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(2000):
            cache.put(
                f"who wrote book number {i}?", 1 + i % 10, encode_hits(_hits(corpus, 7 * i, 1 + i % 10))
            )
        gc.collect()
        real = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert real <= cache.bytes <= 1.6 * real


def test_disabled_cache_keeps_nothing() -> None:
    cache = QueryCache(max_entries=0, max_bytes=1)
    cache.put("q", 5, encode_hits([]))
    assert not cache.enabled and len(cache) == 0 and cache.get("q", 5) is None
    with pytest.raises(ValueError, match="cache size"):
        QueryCache(max_entries=-1, max_bytes=1)


def _recording_search(calls: list):
    def search(queries: list[str], topk: int) -> list:
        calls.append((list(queries), topk))
        return [[({"id": f"{q}/{j}", "contents": q}, float(-j)) for j in range(topk)] for q in queries]

    return search


def _run(batcher: MicroBatcher, coroutine_fn):
    async def main():
        await batcher.start()
        try:
            return await coroutine_fn()
        finally:
            await batcher.stop()

    return asyncio.run(main())


def test_identical_queries_in_one_batch_are_searched_once() -> None:
    calls: list = []
    batcher = MicroBatcher(_recording_search(calls), 256, 20, QueryCache(100, 10**7))

    async def group():  # a GRPO group: 5 rollouts send the same first search at once
        first = await asyncio.gather(*(batcher.submit(["capital of France"], 3) for _ in range(5)))
        again = await batcher.submit(["capital of France"], 3)  # answered at once from the cache
        return first, again

    first, again = _run(batcher, group)
    assert calls == [(["capital of France"], 3)]
    assert all(answer == first[0] for answer in first) and again == first[0]
    assert [doc["id"] for doc, _ in _decoded(first[0][0])] == [
        "capital of France/0",
        "capital of France/1",
        "capital of France/2",
    ]
    stats = batcher.cache.stats
    assert (stats.hits, stats.misses) == (5, 1) and batcher.stats.served == 6 and batcher.stats.searched == 1


def test_partial_hits_search_only_the_misses_with_the_right_topk() -> None:
    calls: list = []
    batcher = MicroBatcher(_recording_search(calls), 256, 20, QueryCache(100, 10**7))

    async def mixed():
        await batcher.submit(["known"], 2)
        calls.clear()
        return await asyncio.gather(
            batcher.submit(["known", "new"], 2),  # one hit, one miss
            batcher.submit(["new"], 4),  # same text, larger topk, same batch: one search at topk 4
        )

    both, new4 = _run(batcher, mixed)
    assert calls == [(["new"], 4)]
    assert [len(_decoded(hits)) for hits in both] == [2, 2] and len(_decoded(new4[0])) == 4
    assert _decoded(new4[0])[:2] == _decoded(both[1])
    assert batcher.cache.get("new", 2) == both[1] and batcher.cache.get("new", 4) == new4[0]


def test_without_cache_every_query_is_searched() -> None:
    calls: list = []
    batcher = MicroBatcher(_recording_search(calls), 256, 20, QueryCache(0, 1))

    async def group():
        return await asyncio.gather(*(batcher.submit(["same"], 2) for _ in range(5)))

    answers = _run(batcher, group)
    assert calls == [(["same"] * 5, 2)] and all(a == answers[0] for a in answers)
    assert batcher.cache.stats.hits == 0 and batcher.cache.stats.misses == 5


def test_hit_rate_is_logged_per_interval(caplog) -> None:
    from search_env.retrieval.batcher import log_stats_every

    calls: list = []
    batcher = MicroBatcher(_recording_search(calls), 256, 5, QueryCache(100, 10**7))

    async def traffic():
        logger = asyncio.create_task(log_stats_every(batcher, 0.2))
        await asyncio.gather(*(batcher.submit(["same"], 1) for _ in range(4)), batcher.submit(["other"], 1))
        await asyncio.sleep(0.3)  # one interval with traffic
        logger.cancel()

    with caplog.at_level("INFO", logger="search_env.retrieval.batcher"):
        _run(batcher, traffic)
    (line,) = [r.getMessage() for r in caplog.records if "cache hits" in r.getMessage()]
    assert "5 queries" in line and "cache hits 3 / misses 2 (hit rate 60.0%)" in line
    assert "1 batches" in line and "cache 2 entries" in line


def test_a_batch_searches_each_topk_asked_apart_and_a_text_once_at_its_largest() -> None:
    """A batch holding one client's topk-100 queries and another's topk-5 ones: one search per topk,
    so the topk-5 queries are not searched (and their passages read) at 100; a client's text asked
    at two topk in the batch is searched once, at the larger."""
    from search_env.retrieval.batcher import _Job

    calls: list = []
    batcher = MicroBatcher(_recording_search(calls), 256, 0, QueryCache(100, 10**7))
    loop = asyncio.new_event_loop()

    def job(queries: list[str], topk: int, client: str) -> _Job:
        return _Job(
            queries, topk, loop.create_future(), [None] * len(queries), client, list(range(len(queries)))
        )

    wide, narrow, again = job(["wide", "shared"], 100, "a"), job(["narrow"], 5, "b"), job(["shared"], 7, "a")
    batcher._look_up_and_search([(j, j.todo) for j in (wide, narrow, again)])
    loop.close()
    assert sorted(calls) == [(["narrow"], 5), (["wide", "shared"], 100)]
    assert [len(_decoded(h)) for h in wide.answers] == [100, 100] and len(_decoded(narrow.answers[0])) == 5
    assert _decoded(again.answers[0]) == _decoded(wide.answers[1])[:7]
