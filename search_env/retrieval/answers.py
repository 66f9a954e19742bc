"""How answers leave the retrieval server: joined from their queries' JSON bytes (`hits_json`) in a
bounded pool of threads, one at a time per client and only while that client's answers in flight (built, not yet handed to its
sockets) are under --max-answer-mb-per-client and its answers of the last moments under
--max-answer-mb-per-s-per-client (a token bucket: `paced_wait`), then sent in chunks under uvicorn's
flow control (a client that stops reading is cut off by the write deadline, `connections.py`).
Mechanisms: docs/security.md ("Connections").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from starlette.responses import Response

ANSWER_THREADS = 2
"""Threads that join answers (joining holds the GIL: more would only queue)."""
CHUNK_BYTES = 64 * 1024
"""An answer is written in pieces of this size; uvicorn waits for the socket between them."""
PACED_CLIENTS_KEPT = 4096
"""Clients whose byte-rate account is kept past its settling before the settled ones are dropped."""


def paced_wait(due: float, now: float, burst_s: float) -> float:
    """Seconds a client must wait before its next answer is built under a byte-rate bound: ``due`` is
    when its answers so far are paid for at the rate (a virtual clock, advanced by size / rate per
    answer), ``burst_s`` how far ahead of ``now`` it may run (the burst, in seconds of the rate).
    0 when it is within its burst."""
    return max(0.0, due - burst_s - now)


def paid_until(due: float, now: float, size: int, rate: float) -> float:
    """The client's virtual clock after an answer of ``size`` bytes at ``rate`` bytes/s: an idle
    client (``due`` in the past) starts from ``now``, so idle time is not saved up beyond the burst."""
    return max(due, now) + size / rate


class PacedResponse(Response):
    """A 200 JSON answer sent in `CHUNK_BYTES` pieces; `done` is called once it is sent (or failed)."""

    def __init__(self, content: bytes, done: Callable[[], None]) -> None:
        super().__init__(content=content, media_type="application/json")
        self.done = done

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            body = memoryview(self.body)
            for start in range(0, len(body), CHUNK_BYTES):
                piece = bytes(body[start : start + CHUNK_BYTES])
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.done()


@dataclass
class _Client:
    """One client's answers: its turn to build one, its bytes in flight, how many are in the works."""

    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    freed: asyncio.Event = field(default_factory=asyncio.Event)
    bytes: int = 0
    users: int = 0


class AnswerBudget:
    """Builds answers per client (see the module docstring); `max_bytes`: a client's next answer is
    built only while its answers in flight hold fewer bytes, so it holds at most that plus one;
    `bytes_per_s` (0 = no bound): and only once its earlier answers are paid for at that rate, past
    a burst of `max_bytes`."""

    def __init__(self, max_bytes: int, bytes_per_s: float = 0.0) -> None:
        self.max_bytes, self.bytes_per_s = max_bytes, bytes_per_s
        self.burst_s = max_bytes / bytes_per_s if bytes_per_s else 0.0
        self.executor = ThreadPoolExecutor(max_workers=ANSWER_THREADS, thread_name_prefix="retrieval-answer")
        self.clients: dict[Hashable, _Client] = {}
        self.due: dict[Hashable, float] = {}
        """Per client, the virtual clock of :func:`paid_until` (monotonic seconds)."""

    async def answer(self, client: Hashable, build: Callable[[], bytes]) -> PacedResponse:
        """`build()` (the JSON body) as the answer, built in the pool in `client`'s turn and under its
        bound."""
        state = self.clients.setdefault(client, _Client())
        state.users += 1
        try:
            async with state.turn:
                while state.bytes >= self.max_bytes:
                    state.freed.clear()
                    await state.freed.wait()
                if self.bytes_per_s:
                    wait = paced_wait(self.due.get(client, 0.0), time.monotonic(), self.burst_s)
                    if wait:
                        await asyncio.sleep(wait)
                loop = asyncio.get_running_loop()
                content = await loop.run_in_executor(self.executor, build)
                state.bytes += len(content)
                if self.bytes_per_s:
                    self._pay(client, len(content))
        except BaseException:
            self._release(client, state, 0)
            raise
        return PacedResponse(content, lambda: self._release(client, state, len(content)))

    def _pay(self, client: Hashable, size: int) -> None:
        now = time.monotonic()
        self.due[client] = paid_until(self.due.get(client, 0.0), now, size, self.bytes_per_s)
        if len(self.due) > PACED_CLIENTS_KEPT:  # settled accounts say nothing: drop them
            self.due = {c: due for c, due in self.due.items() if due > now}

    def _release(self, client: Hashable, state: _Client, size: int) -> None:
        state.bytes -= size
        state.users -= 1
        state.freed.set()
        if not state.users:
            self.clients.pop(client, None)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
