"""LRU cache of recent answers: (client, query text, topk) -> the passages and scores the backend
returned, as the JSON bytes the answers are joined from (`hits_json.EncodedHits`).

GRPO sends every question to a group of rollouts at once, and their first searches are often the same
string; the server answers repeats from here instead of encoding and searching them again. The cache
is bounded twice: at most `max_entries` answers and at most `max_bytes` bytes (`entry_bytes`); the
least recently used answers are evicted first. Each answer is held as one string key and two bytes
values (its JSON and where each document and score is in it), objects the garbage collector never
scans: a full cache of parsed hits was ~8 tracked objects per answer, and a full collection over
65,536 answers paused the server ~100 ms. A hit is handed out as those bytes, never parsed. An answer
larger than `max_bytes` on its own is not cached. Keys are the exact query text (no normalisation) and
the requested topk: a different topk is a different key, because a top-3 list is not always the prefix
of a top-5 list when scores tie. Each client (a bearer token, else an IP address: the `tenant`) has
its own answers, so no client can tell from the cache what another asked; the bounds are shared.

Not thread-safe: the server uses it from its batch worker thread only.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from search_env.retrieval.hits_json import EncodedHits

ENTRY_OVERHEAD_BYTES = 200
"""Fixed cost of one cached answer beyond its key and bytes: the OrderedDict node and slot, the value
tuple (~160 measured on CPython 3.11, with margin; the test suite checks the estimate against tracemalloc)."""


def entry_bytes(key: str, hits: EncodedHits) -> int:
    """Bytes held by one cached answer stored as `key` -> `hits`."""
    return ENTRY_OVERHEAD_BYTES + sys.getsizeof(key) + sys.getsizeof(hits.scored) + sys.getsizeof(hits.cuts)


def _key(query: str, topk: int, tenant: Hashable) -> str:
    return f"{tenant!r}\x00{topk}:{query}"


@dataclass
class CacheStats:
    """Counters since start: `hits` (queries answered from the cache or from an identical query in the
    same batch), `misses` (queries encoded and searched), `evictions` (answers dropped for space)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0


class QueryCache:
    """LRU of (tenant, query, topk) -> encoded hits, bounded by `max_entries` answers and `max_bytes` bytes.

    max_entries 0 disables the cache: `get` always misses and `put` keeps nothing.
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0:
            raise ValueError(f"cache size must be >= 0 entries (0 = off), got {max_entries}")
        if max_bytes < 1:
            raise ValueError(f"cache memory bound must be >= 1 byte, got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[str, tuple[bytes, bytes, int]] = OrderedDict()
        """`_key(query, topk, tenant)` -> (`EncodedHits.scored`, `EncodedHits.cuts`, `entry_bytes`)."""

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, query: str, topk: int, tenant: Hashable = None) -> EncodedHits | None:
        """`tenant`'s cached hits (most recent use refreshed, counted in `stats.hits`), or None. A miss
        is not counted: the caller counts a query as missed once it is searched (see `CacheStats`)."""
        key = _key(query, topk, tenant)
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return EncodedHits(entry[0], entry[1])

    def put(self, query: str, topk: int, hits: EncodedHits, tenant: Hashable = None) -> None:
        """Store `hits` for (tenant, query, topk), evicting least recently used answers until both
        bounds hold."""
        if not self.enabled:
            return
        key = _key(query, topk, tenant)
        size = entry_bytes(key, hits)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[2]
        self._entries[key] = (hits.scored, hits.cuts, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped
            self.stats.evictions += 1

    def describe(self) -> dict:
        """Facts for `GET /health`."""
        asked = self.stats.hits + self.stats.misses
        return {
            "enabled": self.enabled,
            "size": len(self._entries),
            "max_entries": self.max_entries,
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "hits": self.stats.hits,
            "misses": self.stats.misses,
            "hit_rate": round(self.stats.hits / asked, 4) if asked else None,
            "evictions": self.stats.evictions,
        }
