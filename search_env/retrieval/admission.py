"""Admission control of the retrieval server: what is refused before or instead of a search.

`RequestGuard` (Host on loopback, no Origin, JSON content type, bearer token) and `JsonBodyGuard`
(body size and read deadline) run before any handler; `RefusalThrottle` holds 4xx answers past a
rate per address; `check_request` bounds query length and queries x topk. Every refusal is a 4xx
`{"error": ..., "field": ...}` naming the limit's flag (`limits.Limits`). Connection-level limits:
`connections.py`. Mechanisms: docs/retrieval.md ("Limits and authentication").
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Awaitable, Callable

from search_env.retrieval.auth import token_matches
from search_env.retrieval.limits import RETRY_AFTER_S, Limits

DRAIN_BYTES = 64 * 1024 * 1024
DRAIN_TIMEOUT_S = 10.0
"""A refused request's body is read and discarded within these bounds before the answer."""
REFUSAL_BURST_S = 2.0
"""seconds' worth of --max-refusal-rate answered without delay after a quiet spell."""
MAX_TRACKED_ADDRESSES = 65536
"""client addresses whose refusal count is kept; past it, the one refused least recently is forgotten."""


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP address, `[IPv6]` or `localhost`; a bind address or a Host header's
    name) is this machine's loopback, reachable from this machine only."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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


def check_request(
    limits: Limits, queries: list[str], topk: int, field: str, topk_field: str, one: bool = False
) -> None:
    """Refused (422) naming `field` (and the query's index unless `one`) and the flag, for a query
    over --max-query-chars or queries x topk over --max-hits."""
    for i, query in enumerate(queries):
        if len(query) > limits.max_query_chars:
            where = field if one else f"{field}.{i}"
            raise Refused(
                422,
                field,
                f"{where}: {len(query)} characters exceed --max-query-chars {limits.max_query_chars}; "
                "send shorter queries",
            )
    hits = len(queries) * topk
    if hits > limits.max_hits:
        raise Refused(
            422,
            field,
            f"{field}: {len(queries)} queries x {topk_field} {topk} = {hits} hits exceed --max-hits "
            f"{limits.max_hits}; send fewer queries per request or a smaller {topk_field}",
        )


def error_body(message: str, field: str | None, **extra: object) -> bytes:
    """The server's error format, `{"error": message, "field": field, ...}` (ASCII JSON: a message
    quoting client text with a lone surrogate still encodes)."""
    return json.dumps({"error": message, "field": field, **extra}).encode()


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
        drain_bytes: int = DRAIN_BYTES,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
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
        drain_bytes: int = DRAIN_BYTES,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        body_timeout_s: float = Limits.body_timeout_s,
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
