"""The steady rollout pool and the in-order, append-only row writer of an evaluation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from eval.run.store import RowStore

FLUSH_ROWS = 64
FLUSH_S = 2.0
"""rows.jsonl gets the finished prefix (one write + fsync) every FLUSH_ROWS rows or FLUSH_S seconds."""

X = TypeVar("X")
R = TypeVar("R")


async def rollout_pool(
    items: Sequence[X], rollout: Callable[[X], Awaitable[R]], size: int
) -> AsyncIterator[tuple[int, R]]:
    """Yield ``(index, result)`` of ``rollout(item)`` for every item, in completion order, keeping
    ``min(size, items left)`` rollouts in flight: as soon as some finish, as many new ones start,
    before their results are handed on. Results finishing together come in index order. When a
    rollout raises, or the consumer stops early, the others are cancelled and the error propagates.
    """
    if size < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {size}")
    upcoming = iter(enumerate(items))
    running: dict[asyncio.Future[R], int] = {}

    def top_up() -> None:
        while len(running) < size and (nxt := next(upcoming, None)) is not None:
            running[asyncio.ensure_future(rollout(nxt[1]))] = nxt[0]

    top_up()
    try:
        while running:
            finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            done = sorted((running.pop(f), f) for f in finished)
            top_up()
            for index, future in done:
                yield index, future.result()
    finally:
        for future in running:
            future.cancel()
        await asyncio.gather(*running, return_exceptions=True)


class InOrderWriter:
    """Appends finished rows to a :class:`RowStore` in item order, as the longest finished prefix.

    ``add(i, row)`` takes row ``i`` whenever it finishes; rows ``0..k`` go to the store (one append
    + fsync) once all are finished and ``flush_rows`` of them are waiting or ``flush_s`` seconds
    have passed since the last write; ``flush()`` writes the finished prefix now. Rows after a gap
    stay in memory until the gap fills, so the file is always a prefix of the uninterrupted one.
    ``add(i, None)`` marks row ``i`` finished but held back: it fills its place in the order and is
    never written.
    """

    def __init__(
        self,
        store: RowStore,
        flush_rows: int = FLUSH_ROWS,
        flush_s: float = FLUSH_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.flush_rows, self.flush_s, self.clock = store, flush_rows, flush_s, clock
        self._finished: dict[int, dict[str, Any] | None] = {}
        self._next = 0  # index of the first row not yet written
        self._last_write = clock()
        self.written = 0

    def _prefix_end(self) -> int:
        end = self._next
        while end in self._finished:
            end += 1
        return end

    def add(self, index: int, row: dict[str, Any] | None) -> None:
        self._finished[index] = row
        waiting = self._prefix_end() - self._next
        if waiting and (waiting >= self.flush_rows or self.clock() - self._last_write >= self.flush_s):
            self.flush()

    def flush(self) -> int:
        """Write the finished prefix now (held-back rows skipped); returns the rows written."""
        end = self._prefix_end()
        rows = [row for i in range(self._next, end) if (row := self._finished.pop(i)) is not None]
        self._next = end
        self._last_write = self.clock()
        if rows:
            self.written += self.store.append(rows)
        return len(rows)
