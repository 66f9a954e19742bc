"""The real search before a run starts: ``python -m search_env.retrieval probe`` sends one search
(a server healthy on /health whose searches fail is refused, with one line saying why), and
:func:`search_env.retrieval.probe.check_retrievers` (what the eval runner checks before it starts)
refuses such a server too (``broken_retriever``: tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from search_env.paths import REPO_ROOT


def _probe(url: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "search_env.retrieval", "probe", url, "--timeout", "2", *flags],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_probe_sends_one_real_search(retrieval_server_url: str, broken_retriever: str):
    assert _probe(retrieval_server_url, "--require-hits").returncode == 0
    failed = _probe(broken_retriever)
    assert failed.returncode == 1 and "HTTP 500" in failed.stderr and "index is not trained" in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1, "one line saying why"
    gone = _probe("http://127.0.0.1:9")
    assert gone.returncode == 1 and "not healthy" in gone.stderr


def test_eval_runner_refuses_a_retriever_that_cannot_search(broken_retriever: str):
    from search_env.retrieval.probe import check_retrievers

    with pytest.raises(RuntimeError, match="failed its test search.*HTTP 500"):
        check_retrievers([broken_retriever])
