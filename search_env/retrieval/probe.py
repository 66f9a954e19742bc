"""The one start-up check of a retrieval server: wait for ``GET /health``, then one real search.

``/health`` never searches, so a backend that fails on queries (an untrained index, a broken
encoder) passes it; :func:`probe` also sends one ``POST /retrieve`` and checks its answer.
Used by the training launcher, the evaluation runner, :func:`search_env.retrieval.process.spawn_server` and
``python -m search_env probe URL``. With ``auth_token_file`` (the server's bearer-token file,
search_env.retrieval.auth) every request carries the token; a 401 names the setting to fix.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

import httpx

from search_env.retrieval.auth import AuthFileError, bearer_headers
from search_env.retrieval.client import unauthorized_fix

PROBE_QUERY = "who wrote the first american novel"
"""The query of the test search (any plain question: a dense index always has neighbours)."""


class ProbeError(RuntimeError):
    """A retrieval server failed its check; the message is one line saying why."""


class _Process(Protocol):
    returncode: int | None

    def poll(self) -> int | None: ...


def _base(url: str) -> str:
    return url.rstrip("/")


TokenFile = str | os.PathLike[str] | None
"""A bearer-token file (None = send no token)."""


def wait_healthy(
    url: str,
    timeout_s: float,
    process: _Process | None = None,
    poll_s: float = 0.2,
    auth_token_file: TokenFile = None,
) -> dict[str, Any]:
    """Poll ``url``/health until it answers 200 and return its JSON (with the token, the full one).
    TimeoutError after ``timeout_s`` seconds (one try when 0); RuntimeError at once when ``process``
    (the server's) exits first; AuthFileError when ``auth_token_file`` is unusable."""
    headers = bearer_headers(auth_token_file)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"retrieval server exited with code {process.returncode} before {_base(url)} was healthy"
            )
        try:
            response = httpx.get(f"{_base(url)}/health", headers=headers, timeout=2.0)
            if response.status_code == 200:
                doc = response.json()
                return doc if isinstance(doc, dict) else {}
            last = f"GET /health answered HTTP {response.status_code}"
        except (httpx.HTTPError, ValueError) as err:
            last = f"{type(err).__name__}"
        if time.monotonic() + poll_s > deadline:
            raise TimeoutError(
                f"retrieval server at {_base(url)} not healthy after {timeout_s:.0f} s ({last})"
            )
        time.sleep(poll_s)


def search_once(
    url: str, require_hits: bool = False, timeout_s: float = 120.0, auth_token_file: TokenFile = None
) -> None:
    """One real ``POST /retrieve`` (one query, top 1); ProbeError unless it answers one result list
    (and, with ``require_hits``, at least one passage). A 401 or an unusable ``auth_token_file`` is
    a ProbeError naming ``retriever.auth_token_file``."""
    target = f"POST {_base(url)}/retrieve"
    try:
        headers = bearer_headers(auth_token_file)
    except AuthFileError as err:
        raise ProbeError(f"retriever.auth_token_file: {err}") from None
    try:
        answer = httpx.post(
            f"{_base(url)}/retrieve",
            json={"queries": [PROBE_QUERY], "topk": 1},
            headers=headers,
            timeout=timeout_s,
        )
    except httpx.HTTPError as err:
        raise ProbeError(f"{target} failed: {type(err).__name__}: {err}") from None
    if answer.status_code == 401:
        raise ProbeError(f"{target} answered HTTP 401: {unauthorized_fix(auth_token_file)}")
    if answer.status_code != 200:
        text = answer.text.replace("\n", " ")[:600]
        raise ProbeError(f"{target} answered HTTP {answer.status_code}: {text}")
    try:
        result = answer.json().get("result")
    except (ValueError, AttributeError):
        result = None
    if not (isinstance(result, list) and len(result) == 1 and isinstance(result[0], list)):
        raise ProbeError(f"{target} answered without one result list per query: {answer.text[:300]}")
    if require_hits and not result[0]:
        raise ProbeError(f"{target} returned no passage for a plain query (empty or broken index?)")


def probe(
    url: str,
    health_timeout_s: float = 0.0,
    require_hits: bool = False,
    search_timeout_s: float = 120.0,
    process: _Process | None = None,
    auth_token_file: TokenFile = None,
) -> dict[str, Any]:
    """:func:`wait_healthy` (up to ``health_timeout_s``), then :func:`search_once`, both with
    ``auth_token_file``'s token; returns the ``/health`` JSON. ProbeError (one line) on any failure."""
    try:
        health = wait_healthy(url, health_timeout_s, process, auth_token_file=auth_token_file)
    except AuthFileError as err:
        raise ProbeError(f"retriever.auth_token_file: {err}") from None
    except (TimeoutError, RuntimeError) as err:
        raise ProbeError(str(err)) from None
    search_once(url, require_hits, search_timeout_s, auth_token_file)
    return health
