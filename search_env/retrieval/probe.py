"""The one start-up check of retrieval servers: wait for ``GET /health``, then one real search.

``/health`` never searches, so a backend that fails on queries (an untrained index, a broken
encoder) passes it; :func:`probe` also sends one ``POST /retrieve`` and checks its answer, and
:func:`check_retrievers` does both for every server of a run and checks they serve one index.
Used by the training and evaluation launchers, the evaluation runner,
:func:`search_env.retrieval.process.spawn_server` and ``python -m search_env.retrieval probe URL``. With ``auth_token_file`` (the server's bearer-token file,
search_env.retrieval.auth) every request carries the token; a 401 names the setting to fix.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, Protocol

import httpx

from search_env.retrieval.auth import AuthFileError, bearer_headers
from search_env.retrieval.client import unauthorized_fix

IDENTITY_KEYS = ("backend", "index_type", "nprobe", "corpus_size")
"""The ``GET /health`` facts that change what a search returns (recorded with every evaluation result)."""
PROBE_QUERY = "who wrote the first american novel"
"""The query of the test search (any plain question: a dense index always has neighbours)."""


class ProbeError(RuntimeError):
    """A retrieval server failed its check; the message is one line saying why. ``stage``: the
    check that failed (``health``, ``identity`` or ``search``)."""

    def __init__(self, message: str, stage: str = "search") -> None:
        super().__init__(message)
        self.stage = stage


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


def check_retrievers(
    urls: Sequence[str],
    timeout: float = 5.0,
    search_timeout: float = 120.0,
    auth_token_file: TokenFile = None,
    *,
    process: _Process | None = None,
    require_hits: bool = False,
) -> dict[str, Any]:
    """Every server of ``urls`` answers ``GET /health`` within ``timeout`` seconds (the first one
    watched through ``process``, a server this caller started), all report one identity, and each
    answers one real search (:func:`search_once`, with ``require_hits``); a backend that fails on
    queries would turn every rollout's search into "search failed" text.

    Returns the servers' identity (:data:`IDENTITY_KEYS` from ``/health``, those they report).
    ProbeError (``stage`` health, identity or search) naming the server, else; one for no URL."""
    if not urls:
        raise ProbeError(
            "no retrieval server: pass --retriever-url http://127.0.0.1:8000 (start one with "
            "`python -m search_env.retrieval serve --backend bm25 --port 8000`), or use launch/eval.sh, which starts one",
            "health",
        )
    identity: dict[str, Any] | None = None
    for i, url in enumerate(urls):
        try:
            health = wait_healthy(url, timeout, process if i == 0 else None, auth_token_file=auth_token_file)
        except AuthFileError as err:
            raise ProbeError(f"retriever.auth_token_file: {err}", "health") from None
        except (TimeoutError, RuntimeError) as err:
            raise ProbeError(
                f"retrieval server {url} is not reachable ({err}); start it or fix its URL", "health"
            ) from None
        found = {k: health[k] for k in IDENTITY_KEYS if k in health}
        if identity is not None and found != identity:
            raise ProbeError(
                f"retrieval servers disagree: {urls[0]} serves {identity} but {url} serves {found}; "
                "use servers of one index",
                "identity",
            )
        identity = found
    for url in urls:
        try:
            search_once(url, require_hits, search_timeout, auth_token_file)
        except ProbeError as err:
            raise ProbeError(f"retrieval server {url} failed its test search: {err}") from None
    return identity or {}
