"""Run a retriever's encode + index search in a child process, so it never competes for the server's GIL.

`ProcessRetriever` builds the real retriever in a spawned child (it loads the encoder and maps the
index; the parent imports neither torch nor faiss) and sends it each batch's query strings; only row
numbers and scores come back, and the parent reads the passages from its own mapped corpus. If the
child dies, every later search raises `SearchProcessDied` and `/health` answers 503, so clients with
several retriever URLs move on. Mechanism: docs/retrieval.md (*Search process*).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from search_env.retrieval.backend import Retriever
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.heap import freeze_heap

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_retriever: Retriever | None = None
"""The child's retriever (set by `_build` in the child process only)."""
_build_error: BaseException | None = None
"""What building it raised; re-raised by `_describe`, so the parent gets the real error."""


class SearchProcessDied(RuntimeError):
    """The child process running the searches exited."""


def _die_with_parent() -> None:
    """Linux: have the kernel SIGTERM this process when the server process dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _build(factory: Callable[..., Retriever], args: tuple, log_level: int) -> None:
    global _retriever, _build_error
    _die_with_parent()
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    try:
        _retriever = factory(*args)
    except BaseException as err:  # an initializer that raises would only break the pool, message lost
        _build_error = err
    freeze_heap()


def _describe() -> tuple[str, int, dict]:
    if _build_error is not None:
        raise _build_error
    assert _retriever is not None
    return _retriever.backend, len(_retriever.corpus), _retriever.describe()


def _search_rows(queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
    assert _retriever is not None
    return _retriever.search_rows(queries, topk)


class ProcessRetriever(Retriever):
    """A `Retriever` whose `search_rows` runs in a child process built by `factory(*args)` (picklable;
    it must return a retriever over the corpus at `corpus_path`). Construction blocks until the child
    has built its retriever and raises what the child raised (e.g. a missing index file)."""

    def __init__(self, factory: Callable[..., Retriever], args: tuple, corpus_path: str) -> None:
        self.corpus = Corpus(corpus_path)
        self._pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_build,
            initargs=(factory, args, logging.getLogger().getEffectiveLevel()),
        )
        try:
            self.backend, size, self._facts = self._pool.submit(_describe).result()
        except BaseException:
            self._pool.shutdown(wait=False, cancel_futures=True)
            raise
        if size != len(self.corpus):
            self.close()
            raise ValueError(
                f"search process serves {size} rows but corpus {corpus_path} has {len(self.corpus)}"
            )
        self.pid = next(iter(self._pool._processes))  # the one worker (read for /health)

    def healthy(self) -> bool:
        process = (self._pool._processes or {}).get(self.pid)  # None once the pool is shut down
        return process is not None and process.is_alive()

    def search_rows(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        try:
            return self._pool.submit(_search_rows, queries, topk).result()
        except BrokenProcessPool as err:
            raise SearchProcessDied(f"the search process (pid {self.pid}) exited") from err

    def describe(self) -> dict:
        return {**self._facts, "search_process": self.pid}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
