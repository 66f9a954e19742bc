"""How answers leave the retrieval server: joined from their queries' JSON bytes (`hits_json`) in a
bounded pool of threads, one at a time per client and only while that client's answers in flight (built, not yet handed to its
sockets) are under --max-answer-mb-per-client, then sent in chunks under uvicorn's flow control (a
client that stops reading is cut off by the write deadline, `connections.py`). Mechanisms:
docs/security.md ("Connections").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from starlette.responses import Response

ANSWER_THREADS = 2
"""Threads that join answers (joining holds the GIL: more would only queue)."""
CHUNK_BYTES = 64 * 1024
"""An answer is written in pieces of this size; uvicorn waits for the socket between them."""


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
    built only while its answers in flight hold fewer bytes, so it holds at most that plus one."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.executor = ThreadPoolExecutor(max_workers=ANSWER_THREADS, thread_name_prefix="retrieval-answer")
        self.clients: dict[Hashable, _Client] = {}

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
                loop = asyncio.get_running_loop()
                content = await loop.run_in_executor(self.executor, build)
                state.bytes += len(content)
        except BaseException:
            self._release(client, state, 0)
            raise
        return PacedResponse(content, lambda: self._release(client, state, len(content)))

    def _release(self, client: Hashable, state: _Client, size: int) -> None:
        state.bytes -= size
        state.users -= 1
        state.freed.set()
        if not state.users:
            self.clients.pop(client, None)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
