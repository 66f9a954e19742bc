"""Async client of the retrieval server's `POST /retrieve` (Search-R1 shape).

One `RetrievalClient` is shared by all rollouts of a worker: it holds one pooled `httpx.AsyncClient`,
walks a list of server URLs round-robin (one step per attempt, so a retry goes to the next server),
retries transport errors, timeouts, HTTP 429 and 5xx with jittered exponential backoff, and raises
`RetrievalError` once the tries are spent or at once for a 4xx answer (a bad request does not get
better by repeating it).
"""

from __future__ import annotations

import asyncio
import itertools
import random

import httpx

from search_env.retrieval.corpus import Passage, split_contents

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RetrievalError(RuntimeError):
    """Retrieval failed: every try failed (message lists the last error per URL) or the server
    rejected the request (4xx, message carries the server's explanation)."""


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
    """Async client for one or more retrieval servers.

    urls: base URL(s) like `http://127.0.0.1:8000` (the client posts to `<url>/retrieve`).
    timeout: seconds per HTTP attempt (connect + read). max_retries: extra attempts after the first
    (so at most 1 + max_retries requests). backoff: base delay in seconds; the wait before retry r
    (r = 1, 2, ...) is `backoff * 2**(r-1)` times a uniform jitter in [0.5, 1.5).
    """

    def __init__(
        self, urls: str | list[str], timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.5
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"RetrievalClient: timeout must be > 0 seconds, got {timeout}")
        if max_retries < 0:
            raise ValueError(f"RetrievalClient: max_retries must be >= 0, got {max_retries}")
        if backoff < 0:
            raise ValueError(f"RetrievalClient: backoff must be >= 0 seconds, got {backoff}")
        self.urls = _normalize_urls(urls)
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self._next_url = itertools.cycle(range(len(self.urls)))
        self._http: httpx.AsyncClient | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._rng = random.Random()

    def _client(self) -> httpx.AsyncClient:
        """The pooled HTTP client of the running event loop (a pool cannot be shared across loops)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http.is_closed or self._http_loop is not loop:
            self._http_loop = loop
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            )
        return self._http

    async def retrieve(self, queries: list[str], topk: int = 5) -> list[list[Passage]]:
        """Top-`topk` passages for each query, in query order (fewer when the backend finds fewer,
        e.g. BM25 with no matching term). Raises RetrievalError after the last failed try."""
        if not queries:
            return []
        body = {"queries": list(queries), "topk": int(topk), "return_scores": True}
        errors: list[str] = []
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1) * self._rng.uniform(0.5, 1.5))
            url = self.urls[next(self._next_url)]
            try:
                response = await self._client().post(f"{url}/retrieve", json=body)
            except httpx.HTTPError as err:
                errors.append(f"{url}: {type(err).__name__}: {err}")
                continue
            if response.status_code in RETRYABLE_STATUS:
                errors.append(f"{url}: HTTP {response.status_code}: {response.text[:200]}")
                continue
            if response.status_code >= 400:
                raise RetrievalError(
                    f"{url}/retrieve rejected the request: HTTP {response.status_code}: {response.text[:500]}"
                )
            try:
                return parse_retrieve_response(response.json(), len(queries))
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                errors.append(f"{url}: malformed response: {err}")
        raise RetrievalError(
            f"retrieval failed after {self.max_retries + 1} tries: " + "; ".join(errors[-3:])
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
