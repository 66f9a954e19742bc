"""Connection-level limits of the retrieval server, as a subclass of uvicorn's h11 protocol
(`guarded_protocol`): at most --max-connections-per-client open connections per IP address (a
connection past it held unread for --refusal-hold-s, then answered 503 and closed), a
deadline for each complete request head (--header-timeout-s; both spread: `spread_s`) and a write deadline
(--write-timeout-s). uvicorn's and h11's own limits do the rest: --max-connections
(`limit_concurrency`), --keep-alive-timeout-s (`timeout_keep_alive`), --max-header-bytes
(`h11_max_incomplete_event_size`). Mechanisms: docs/security.md ("Connections").
"""

from __future__ import annotations

import asyncio
import random
import resource

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_remote_addr

from search_env.retrieval.admission import error_body
from search_env.retrieval.limits import RETRY_AFTER_S, Limits


class ConnectionTable:
    """Open connections per client IP address, at most `per_client` each; `held`: refused
    connections not yet answered (at most `max_held`)."""

    def __init__(self, per_client: int, max_held: int = 0) -> None:
        self.per_client, self.max_held = per_client, max_held
        self.open: dict[str, int] = {}
        self.held = 0

    def hold(self) -> bool:
        """Count one more refused connection held before its answer, unless `max_held` are."""
        if self.held >= self.max_held:
            return False
        self.held += 1
        return True

    def admit(self, address: str) -> bool:
        """Count one more connection of `address`, unless it already has `per_client` open."""
        if self.open.get(address, 0) >= self.per_client:
            return False
        self.open[address] = self.open.get(address, 0) + 1
        return True

    def release(self, address: str) -> None:
        left = self.open[address] - 1
        if left:
            self.open[address] = left
        else:
            del self.open[address]


HEAD_DEADLINE_SPREAD = 0.2
"""A connection's head deadline is drawn from [1 - this, 1] x --header-timeout-s: connections opened
together (a reconnecting client's, or an abuser's thousand idle sockets) are closed over a spread of
moments, not in one event-loop tick that stalls every other client (measured: 512 idle sockets
timing out at once held good requests ~100 ms, tripling the abuse benchmark's p99)."""
REFUSAL_HOLD_SPREAD = 0.5
"""A refused connection's hold is drawn from [1 - this, 1] x --refusal-hold-s, for the same reason:
the abuse benchmark's 512 refused idle sockets, held 2 s from one burst of connects, answered in
one burst held good requests ~300 ms (p99 14x alone, every other type alone under 2x)."""


def spread_s(limit_s: float, draw: float, spread: float) -> float:
    """Seconds until a connection's deadline or end of hold for a uniform ``draw`` in [0, 1): within
    [(1 - spread) x limit_s, limit_s], never past the flag's value."""
    return limit_s * (1.0 - spread * draw)


def refusal(per_client: int) -> bytes:
    """The 503 written to a connection past --max-connections-per-client, before it is closed."""
    body = error_body(
        f"this address already has --max-connections-per-client {per_client} connections open; reuse "
        "them (keep-alive) or close some",
        None,
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: {RETRY_AFTER_S}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def head_too_large(max_header_bytes: int) -> bytes:
    """The 431 written to a connection whose request head passed --max-header-bytes (h11 stops
    reading it there), before it is closed."""
    body = error_body(
        f"the request head is over --max-header-bytes {max_header_bytes} bytes; send shorter headers",
        "headers",
    )
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


OTHER_FILES = 256
"""Open files the server needs besides its sockets (index, corpus, model files, logs, pipes)."""


def max_held(limits: Limits) -> int:
    """Refused connections held at once before their answer: --max-connections, or 0 when
    --refusal-hold-s is 0 (refused at once)."""
    return limits.max_connections if limits.refusal_hold_s > 0 else 0


def open_files_needed(limits: Limits) -> int:
    """File descriptors a server under `limits` can hold: --max-connections admitted sockets,
    :func:`max_held` held refusals and :data:`OTHER_FILES`."""
    return limits.max_connections + max_held(limits) + OTHER_FILES


def open_files_target(soft: int, hard: int, needed: int) -> int:
    """The soft RLIMIT_NOFILE to run with: `soft` when it covers `needed`, else `needed` up to the
    `hard` limit (RLIM_INFINITY: no bound)."""
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    return needed if hard == resource.RLIM_INFINITY else min(hard, needed)


def raise_open_files(limits: Limits) -> str | None:
    """Raise this process's soft open-files limit to what `limits` need (up to the hard limit); a
    warning naming the flags when the hard limit is lower (past it, asyncio stops accepting for 1 s
    at a time and every client waits), else None."""
    needed = open_files_needed(limits)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = open_files_target(soft, hard, needed)
    if target != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target != resource.RLIM_INFINITY and target < needed:
        return (
            f"open files limit {target} (hard) is below the {needed} that --max-connections "
            f"{limits.max_connections} and --refusal-hold-s need; past it the server stops accepting for "
            "1 s at a time: raise `ulimit -Hn`, or lower --max-connections"
        )
    return None


def guarded_protocol(limits: Limits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the per-address cap, the head deadline and the write deadline of
    `limits` (one `ConnectionTable` per call: pass the class to one server)."""
    hold_s = limits.refusal_hold_s
    table = ConnectionTable(limits.max_connections_per_client, max_held(limits))
    refused = refusal(limits.max_connections_per_client)
    too_large = head_too_large(limits.max_header_bytes)

    class GuardedH11Protocol(H11Protocol):
        """A connection of one server; see the module docstring."""

        address: str | None = None
        """The peer's IP address once admitted (None: refused, or not yet connected)."""
        head_timer: asyncio.TimerHandle | None = None
        write_timer: asyncio.TimerHandle | None = None
        refusal_timer: asyncio.TimerHandle | None = None
        """Set while a refused connection is held before its answer."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            peer = get_remote_addr(transport)
            address = peer[0] if peer else ""
            if not table.admit(address):
                if table.hold():  # answered later: a reopening client waits, the loop does not spin
                    transport.pause_reading()
                    hold = spread_s(hold_s, random.random(), REFUSAL_HOLD_SPREAD)
                    self.refusal_timer = self.loop.call_later(hold, self._refuse, transport)
                    return
                self._refuse(transport)
                return
            self.address = address
            super().connection_made(transport)
            self._await_head()

        def _refuse(self, transport: asyncio.Transport) -> None:
            self._release_hold()
            transport.write(refused)
            transport.close()

        def _release_hold(self) -> None:
            if self.refusal_timer is not None:
                self.refusal_timer.cancel()
                self.refusal_timer = None
                table.held -= 1

        def connection_lost(self, exc: Exception | None) -> None:
            if self.address is None:
                self._release_hold()  # a held refused connection that its client closed
                return
            table.release(self.address)
            self.address = None
            for timer in (self.head_timer, self.write_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.address is not None:
                super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.head_timer is not None and self.cycle is not None and not self.cycle.response_complete:
                self.head_timer.cancel()  # a request head is complete
                self.head_timer = None

        def send_400_response(self, msg: str) -> None:
            # uvicorn answers every h11 protocol error 400; a head past h11's bound is a 431
            if len(self.conn.trailing_data[0]) <= limits.max_header_bytes:
                super().send_400_response(msg)
                return
            self.transport.write(too_large)
            self.transport.close()

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._await_head()  # first: a pipelined request's head, handled below, cancels it
            super().on_response_complete()

        def _await_head(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            deadline = spread_s(limits.header_timeout_s, random.random(), HEAD_DEADLINE_SPREAD)
            self.head_timer = self.loop.call_later(deadline, self.transport.close)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self.write_timer is None:
                self.write_timer = self.loop.call_later(limits.write_timeout_s, self.transport.abort)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self.write_timer is not None:
                self.write_timer.cancel()
                self.write_timer = None

    return GuardedH11Protocol
