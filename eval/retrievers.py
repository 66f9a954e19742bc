"""The start-up check of the retrieval servers an evaluation uses, and what identifies them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from search_env.retrieval.probe import ProbeError, search_once, wait_healthy

IDENTITY_KEYS = ("backend", "index_type", "nprobe", "corpus_size")
"""The ``GET /health`` facts that change what a search returns (recorded with every result)."""


def check_retrievers(
    urls: Sequence[str],
    timeout: float = 5.0,
    search_timeout: float = 120.0,
    auth_token_file: str | None = None,
) -> dict[str, Any]:
    """Raise RuntimeError unless every retrieval server answers ``GET /health`` within ``timeout``
    seconds and one real ``POST /retrieve`` (search_env.retrieval.probe: ``/health`` never searches,
    and a backend that fails on queries would turn every row into "search failed" text).

    Returns the servers' identity (:data:`IDENTITY_KEYS` from ``/health``, those it reports);
    RuntimeError when two servers report different ones (their rows would not be comparable).
    ``auth_token_file``: the servers' bearer-token file, sent with both requests (None = none)."""
    if not urls:
        raise RuntimeError(
            "no retrieval server: pass --retriever-url http://127.0.0.1:8000 (start one with "
            "`python -m search_env serve --backend bm25 --port 8000`), or use launch/eval.sh, which starts one"
        )
    identity: dict[str, Any] | None = None
    for url in urls:
        try:
            health = wait_healthy(url, timeout, auth_token_file=auth_token_file)
        except TimeoutError as err:
            raise RuntimeError(
                f"retrieval server {url} is not reachable ({err}); start it or fix --retriever-url"
            ) from None
        found = {k: health[k] for k in IDENTITY_KEYS if k in health}
        if identity is not None and found != identity:
            raise RuntimeError(
                f"retrieval servers disagree: {urls[0]} serves {identity} but {url} serves {found}; "
                "evaluate with servers of one index"
            )
        identity = found
        try:
            search_once(url, timeout_s=search_timeout, auth_token_file=auth_token_file)
        except ProbeError as err:
            raise RuntimeError(f"retrieval server {url} failed its test search: {err}") from None
    return identity or {}
