"""BM25 backend (bm25s) over a wiki-18 style corpus: the CPU default and the demo retriever.

Documents are the full `contents` (title line + text), lower-cased, split on `\\w\\w+`, English stop
words removed, no stemming; BM25 defaults of bm25s (Lucene variant, k1=1.5, b=0.75). Passages sharing
no term with the query score 0 and are not returned, so a query can get fewer than topk hits.

Building holds every passage's token ids in memory (fine for the 1,000-row demo and for ~1M rows; the
full 21M wiki-18 needs tens of GB); `save`/`load` keep a built index on disk (loaded memory-mapped).
"""

from __future__ import annotations

import logging
from pathlib import Path

import bm25s
import numpy as np
from bm25s.tokenization import Tokenizer

from search_env.retrieval.backend import Retriever
from search_env.retrieval.corpus import Corpus

log = logging.getLogger(__name__)

STOPWORDS = "en"


class BM25Retriever(Retriever):
    """BM25 over `corpus`; build with `BM25Retriever.build(corpus)` or `BM25Retriever.load(dir, corpus)`."""

    backend = "bm25"

    def __init__(self, corpus: Corpus, model: bm25s.BM25) -> None:
        n_docs = int(model.scores["num_docs"])
        if n_docs != len(corpus):
            raise ValueError(
                f"bm25 index holds {n_docs} documents but the corpus {corpus.path} has "
                f"{len(corpus)} rows; rebuild the index for this corpus"
            )
        self.corpus = corpus
        self.model = model

    @classmethod
    def build(cls, corpus: Corpus, show_progress: bool = False) -> BM25Retriever:
        tokenizer = Tokenizer(stopwords=STOPWORDS)
        ids = tokenizer.tokenize(
            corpus.iter_contents(),
            length=len(corpus),
            update_vocab=True,
            return_as="ids",
            show_progress=show_progress,
        )
        model = bm25s.BM25()
        model.index((ids, tokenizer.get_vocab_dict()), show_progress=show_progress)
        log.info("bm25: indexed %d passages, %d terms", len(corpus), len(tokenizer.get_vocab_dict()))
        return cls(corpus, model)

    @classmethod
    def load(cls, index_dir: str | Path, corpus: Corpus) -> BM25Retriever:
        return cls(corpus, bm25s.BM25.load(str(index_dir), mmap=True, show_progress=False))

    def save(self, index_dir: str | Path) -> None:
        self.model.save(str(index_dir), show_progress=False)

    def search_rows(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(topk, len(self.corpus))
        tokens = self._tokenize_queries(queries)
        docs, scores = self.model.retrieve(tokens, k=k, show_progress=False, return_as="tuple")
        rows = np.asarray(docs, dtype=np.int64).reshape(len(queries), k)
        scores = np.asarray(scores, dtype=np.float32).reshape(len(queries), k)
        rows = np.where(scores > 0, rows, -1)
        if k < topk:
            pad = topk - k
            rows = np.pad(rows, ((0, 0), (0, pad)), constant_values=-1)
            scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=0.0)
        return rows, scores

    def _tokenize_queries(self, queries: list[str]) -> list[list[str]]:
        """Queries as token strings (same rules as the corpus; stateless, so serving does not grow a
        vocabulary); words unknown to the index score nothing."""
        return bm25s.tokenize(list(queries), stopwords=STOPWORDS, return_ids=False, show_progress=False)

    def describe(self) -> dict:
        return {"index_type": "bm25s", "nprobe": None}
