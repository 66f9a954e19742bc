"""The start-up check of the retrieval servers an evaluation uses, and what identifies them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

IDENTITY_KEYS = ("backend", "index_type", "nprobe", "corpus_size")
"""The ``GET /health`` facts that change what a search returns (recorded with every result)."""


def check_retrievers(
    urls: Sequence[str], timeout: float = 5.0, search_timeout: float = 120.0
) -> dict[str, Any]:
    """Raise RuntimeError unless every retrieval server answers ``GET /health`` with 200 and one
    real ``POST /retrieve`` with one result list (``/health`` never searches: a backend that fails
    on queries would otherwise turn every row into "search failed" text).

    Returns the servers' identity (:data:`IDENTITY_KEYS` from ``/health``, those it reports);
    RuntimeError when two servers report different ones (their rows would not be comparable)."""
    if not urls:
        raise RuntimeError(
            "no retrieval server: pass --retriever-url http://127.0.0.1:8000 (start one with "
            "`python -m search_env serve --backend bm25 --port 8000`), or use launch/eval.sh, which starts one"
        )
    identity: dict[str, Any] | None = None
    for url in urls:
        try:
            health = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout)
            status = health.status_code
        except httpx.HTTPError as err:
            raise RuntimeError(
                f"retrieval server {url} is not reachable ({type(err).__name__}); start it "
                "or fix --retriever-url"
            ) from None
        if status != 200:
            raise RuntimeError(f"retrieval server {url}/health answered HTTP {status}")
        found = _identity(health)
        if identity is not None and found != identity:
            raise RuntimeError(
                f"retrieval servers disagree: {urls[0]} serves {identity} but {url} serves {found}; "
                "evaluate with servers of one index"
            )
        identity = found
        try:
            answer = httpx.post(
                f"{url.rstrip('/')}/retrieve",
                json={"queries": ["who wrote the first american novel"], "topk": 1},
                timeout=search_timeout,
            )
        except httpx.HTTPError as err:
            raise RuntimeError(
                f"retrieval server {url} failed its test search ({type(err).__name__})"
            ) from None
        try:
            result = answer.json().get("result") if answer.status_code == 200 else None
        except (ValueError, AttributeError):
            result = None
        if not (isinstance(result, list) and len(result) == 1 and isinstance(result[0], list)):
            raise RuntimeError(
                f"retrieval server {url} failed its test search: POST /retrieve answered HTTP "
                f"{answer.status_code}: {answer.text[:300]}"
            )
    return identity or {}


def _identity(health: httpx.Response) -> dict[str, Any]:
    try:
        doc = health.json()
    except ValueError:
        return {}
    return {k: doc[k] for k in IDENTITY_KEYS if isinstance(doc, dict) and k in doc}
