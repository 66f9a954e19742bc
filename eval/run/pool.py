"""The steady rollout pool of an evaluation: a fixed number of rollouts in flight."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

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
