"""The backend interface: dense (encoder + faiss) and bm25 behind one `search(queries, topk)`.

A backend implements `search_rows(queries, topk) -> (rows, scores)`: two (n_queries, topk) arrays of
corpus row numbers (int64, -1 = no hit) and scores (float32, higher is better), best first. Everything
else (passages, the server's JSON) is derived here, and a -1 row never becomes a passage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from search_env.retrieval.corpus import Corpus, Passage


def hits_per_query(rows: np.ndarray, scores: np.ndarray) -> list[list[tuple[int, float]]]:
    """(row, score) pairs per query with every negative row (faiss's "no result") dropped."""
    return [
        [(int(r), float(s)) for r, s in zip(row_line, score_line, strict=True) if r >= 0]
        for row_line, score_line in zip(rows, scores, strict=True)
    ]


class Retriever(ABC):
    """A search backend over `corpus`. `search_rows` is called from one worker thread at a time."""

    backend: str
    corpus: Corpus

    @abstractmethod
    def search_rows(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, scores), each shaped (len(queries), topk); rows -1 where fewer hits exist."""

    @abstractmethod
    def describe(self) -> dict:
        """Facts for `GET /health`: at least `index_type` and `nprobe` (None when not applicable)."""

    def healthy(self) -> bool:
        """False when the backend can no longer search (`GET /health` then answers 503)."""
        return True

    def close(self) -> None:
        """Release what the backend holds beyond memory (the server calls it on shutdown)."""
        return None

    def search_hits(self, queries: list[str], topk: int) -> list[list[tuple[int, float]]]:
        rows, scores = self.search_rows(queries, topk)
        return hits_per_query(rows, scores)

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        """Top-`topk` passages per query, best first, with scores."""
        return [
            [self.corpus.passage(row, score) for row, score in hits]
            for hits in self.search_hits(queries, topk)
        ]
