"""Async client of the retrieval server's `POST /retrieve` (Search-R1 shape).

One `RetrievalClient` is shared by all rollouts of a worker: one pooled `httpx.AsyncClient` over a
list of server URLs (replicas) used round-robin, a failed replica skipped until its `GET /health`
answers. Transport errors, timeouts, HTTP 408/429/5xx and malformed answers are retried with
jittered backoff for at most `retry_budget_s` seconds, then `RetrievalError` names the last errors;
other 4xx answers raise at once (401, a missing or refused bearer token, names
`retriever.auth_token_file`). Failover, retry and auth rules: docs/retrieval.md, "Python API".
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import time

import httpx

from search_env.protocol import TOPK
from search_env.retrieval.auth import bearer_headers
from search_env.retrieval.corpus import Passage, split_contents

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
DOWN_STATUS = frozenset({500, 502, 503, 504})
"""Answers that mark a replica down like a transport error (our server answers 500 to searches
and 503 to /health when its search process died); 408 and 429 only mean busy."""
HEALTH_TIMEOUT_S = 2.0
"""Per probe of a down replica's `GET /health` (capped at the client's `timeout`)."""


class RetrievalError(RuntimeError):
    """Retrieval failed: every try failed (message lists the last errors with their URL) or the
    server rejected the request (4xx, message carries the server's explanation)."""


def unauthorized_fix(auth_token_file: str | os.PathLike[str] | None) -> str:
    """What to do about an HTTP 401: the server wants a bearer token (none was sent) or refused the
    one read from ``auth_token_file``. Never the token itself."""
    if not auth_token_file:
        return (
            "the server requires a bearer token and none was sent: set retriever.auth_token_file (the "
            "search tool's auth_token_file, --retriever-auth-token-file, --auth-token-file) to the "
            "server's token file"
        )
    return (
        f"the server refused the token in {auth_token_file}: retriever.auth_token_file must name a file "
        "holding one of the tokens of the server's --auth-token-file"
    )


def _normalize_urls(urls: str | list[str]) -> list[str]:
    items = [urls] if isinstance(urls, str) else list(urls)
    cleaned = [u.strip().rstrip("/") for u in items if isinstance(u, str) and u.strip()]
    if not cleaned:
        raise ValueError(
            "RetrievalClient: `urls` is empty; pass a server base URL such as http://127.0.0.1:8000"
        )
    for url in cleaned:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"RetrievalClient: url {url!r} must start with http:// or https://")
    return cleaned


def parse_retrieve_response(payload: object, n_queries: int) -> list[list[Passage]]:
    """Turn a `/retrieve` JSON body into passages; accepts items with and without scores
    (`{"document": {...}, "score": s}` or a bare `{"id", "contents"}`). ValueError on any other shape."""
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise ValueError("response has no `result` list")
    result = payload["result"]
    if len(result) != n_queries:
        raise ValueError(f"response has {len(result)} result lists for {n_queries} queries")
    passages: list[list[Passage]] = []
    for hits in result:
        if not isinstance(hits, list):
            raise ValueError("a per-query result is not a list")
        parsed = []
        for item in hits:
            doc = item.get("document", item) if isinstance(item, dict) else None
            if not isinstance(doc, dict) or "contents" not in doc or "id" not in doc:
                raise ValueError(f"result item {item!r:.200} has no document id/contents")
            contents = str(doc["contents"])
            title, text = split_contents(contents)
            score = item.get("score") if "document" in item else None
            parsed.append(
                Passage(
                    id=str(doc["id"]),
                    title=title,
                    text=text,
                    score=None if score is None else float(score),
                    contents=contents,
                )
            )
        passages.append(parsed)
    return passages


class RetrievalClient:
    """Async client for one or more retrieval servers (replicas of one index).

    urls: base URL(s) like `http://127.0.0.1:8000` (the client posts to `<url>/retrieve`).
    timeout: seconds per HTTP attempt (connect + read), > 0.
    retry_budget_s: seconds, >= 0, from the start of a call after which no new try starts (the
    first try always runs; 0 = no retries). A call therefore ends within about
    `retry_budget_s + timeout + HEALTH_TIMEOUT_S` seconds.
    max_retries: extra tries after the first, or None (default) for as many as the budget allows.
    backoff: base delay in seconds; the wait before retry r (r = 1, 2, ...) is
    `min(backoff * 2**(r-1), max_backoff)` times a uniform jitter in [0.5, 1.5), cut to the budget
    left. backoff 0 needs `max_retries` (a budget alone would retry in a tight loop).
    health_interval_s: seconds, > 0, between two `/health` probes of a replica marked down.
    auth_token_file: the servers' bearer-token file (search_env.retrieval.auth), read once here and
    sent with every request; None = no token. AuthFileError (naming the file) when it is unusable.
    """

    def __init__(
        self,
        urls: str | list[str],
        timeout: float = 30.0,
        max_retries: int | None = None,
        backoff: float = 0.5,
        retry_budget_s: float = 60.0,
        max_backoff: float = 5.0,
        health_interval_s: float = 5.0,
        auth_token_file: str | os.PathLike[str] | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"RetrievalClient: timeout must be > 0 seconds, got {timeout}")
        if max_retries is not None and max_retries < 0:
            raise ValueError(f"RetrievalClient: max_retries must be >= 0 or None, got {max_retries}")
        if backoff < 0 or max_backoff < 0:
            raise ValueError(
                f"RetrievalClient: backoff and max_backoff must be >= 0 seconds, got {backoff}, {max_backoff}"
            )
        if backoff == 0 and max_retries is None and retry_budget_s > 0:
            raise ValueError(
                "RetrievalClient: backoff 0 needs max_retries (else the budget retries in a tight loop)"
            )
        if retry_budget_s < 0:
            raise ValueError(f"RetrievalClient: retry_budget_s must be >= 0 seconds, got {retry_budget_s}")
        if health_interval_s <= 0:
            raise ValueError(
                f"RetrievalClient: health_interval_s must be > 0 seconds, got {health_interval_s}"
            )
        self.urls = _normalize_urls(urls)
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.retry_budget_s = retry_budget_s
        self.health_interval_s = health_interval_s
        self.auth_token_file = str(auth_token_file) if auth_token_file else None
        self._headers = bearer_headers(self.auth_token_file)
        self._next_url = itertools.cycle(range(len(self.urls)))
        self._down: dict[int, float] = {}  # replica index -> clock time of its last check
        self._http: httpx.AsyncClient | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._rng = random.Random()

    @property
    def down(self) -> list[str]:
        """URLs currently marked down (skipped by round robin while another replica is up)."""
        return [self.urls[i] for i in sorted(self._down)]

    def _client(self) -> httpx.AsyncClient:
        """The pooled HTTP client of the running event loop (a pool cannot be shared across loops)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http.is_closed or self._http_loop is not loop:
            self._http_loop = loop
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout),
                headers=self._headers,
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            )
        return self._http

    def _mark_down(self, index: int, why: str) -> None:
        if index not in self._down:
            log.warning(
                "retriever %s marked down (%s); tried only while no other replica is up, until "
                "GET /health answers (probed every %.0f s)",
                self.urls[index],
                why,
                self.health_interval_s,
            )
        self._down[index] = time.monotonic()

    def _mark_up(self, index: int) -> None:
        if self._down.pop(index, None) is not None:
            log.warning("retriever %s answers again; back in the round robin", self.urls[index])

    async def _probe(self, index: int) -> None:
        """Take a down replica back when its `/health` answers 200 (any failure keeps it down)."""
        try:
            response = await self._client().get(
                f"{self.urls[index]}/health", timeout=min(self.timeout, HEALTH_TIMEOUT_S)
            )
        except httpx.HTTPError:
            return
        if response.status_code == 200:
            self._mark_up(index)

    async def _pick(self) -> int:
        """The next replica: probe the down ones that are due (only while another is up, so a
        lone server is never probed), then the next up one round-robin, else the next of all."""
        if len(self._down) < len(self.urls):
            now = time.monotonic()
            due = [i for i, checked in self._down.items() if now - checked >= self.health_interval_s]
            for index in due:
                self._down[index] = now  # concurrent calls do not probe it again
            if due:
                await asyncio.gather(*(self._probe(i) for i in due))
        for _ in range(len(self.urls)):
            index = next(self._next_url)
            if index not in self._down:
                return index
        return next(self._next_url)

    async def retrieve(self, queries: list[str], topk: int = TOPK) -> list[list[Passage]]:
        """Top-`topk` passages for each query, in query order (fewer when the backend finds fewer,
        e.g. BM25 with no matching term). Raises RetrievalError once the retry budget (or
        `max_retries`) is spent, or at once on a 4xx answer (401: the token, see
        :func:`unauthorized_fix`)."""
        if not queries:
            return []
        body = {"queries": list(queries), "topk": int(topk), "return_scores": True}
        errors: list[str] = []
        start = time.monotonic()
        for tries in itertools.count(1):
            index = await self._pick()
            url = self.urls[index]
            try:
                response = await self._client().post(f"{url}/retrieve", json=body)
            except httpx.HTTPError as err:
                errors.append(f"{url}: {type(err).__name__}: {err}")
                self._mark_down(index, type(err).__name__)
            else:
                if response.status_code in RETRYABLE_STATUS:
                    errors.append(f"{url}: HTTP {response.status_code}: {response.text[:200]}")
                    if response.status_code in DOWN_STATUS:
                        self._mark_down(index, f"HTTP {response.status_code}")
                elif response.status_code == 401:
                    # a missing or wrong token does not fix itself: no retry, the replica stays up
                    raise RetrievalError(
                        f"{url}/retrieve answered HTTP 401: {unauthorized_fix(self.auth_token_file)} "
                        f"(server: {response.text[:200]})"
                    )
                elif response.status_code >= 400:
                    raise RetrievalError(
                        f"{url}/retrieve rejected the request: HTTP {response.status_code}: {response.text[:500]}"
                    )
                else:
                    try:
                        passages = parse_retrieve_response(response.json(), len(queries))
                    except ValueError as err:  # json.JSONDecodeError is a ValueError
                        errors.append(f"{url}: malformed response: {err}")
                    else:
                        self._mark_up(index)
                        return passages
            left = self.retry_budget_s - (time.monotonic() - start)
            if left <= 0 or (self.max_retries is not None and tries > self.max_retries):
                break
            delay = min(self.backoff * 2 ** (tries - 1), self.max_backoff) * self._rng.uniform(0.5, 1.5)
            await asyncio.sleep(min(delay, left))
        raise RetrievalError(
            f"retrieval failed after {tries} tries in {time.monotonic() - start:.1f} s "
            f"(retry_budget_s={self.retry_budget_s:g}): " + "; ".join(errors[-3:])
        )

    async def aclose(self) -> None:
        """Close the pooled connections; the client may be used again afterwards (a new pool opens)."""
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> RetrievalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
