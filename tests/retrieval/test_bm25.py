"""BM25 backend over the bundled wiki-18 sample: ranking, the -1 padding rule, save/load."""

import json

import numpy as np
import pytest

from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.bm25 import BM25Retriever
from search_env.retrieval.corpus import Corpus


@pytest.fixture(scope="module")
def bm25() -> BM25Retriever:
    return BM25Retriever.build(Corpus(SAMPLE_CORPUS))


def test_title_query_finds_its_passage_first(bm25: BM25Retriever) -> None:
    (hits,) = bm25.search(["Evan Morris lobbyist Genentech"], topk=5)
    assert hits[0].id == "0" and hits[0].title == "Evan Morris"
    scores = [p.score for p in hits]
    assert scores == sorted(scores, reverse=True) and all(s > 0 for s in scores)


def test_every_row_is_found_by_its_own_title(bm25: BM25Retriever) -> None:
    corpus = bm25.corpus
    rows = list(range(0, 1000, 97))
    titles_and_text = [corpus.contents(i) for i in rows]
    results = bm25.search(titles_and_text, topk=1)
    assert [hits[0].id for hits in results] == [corpus.row(i)["id"] for i in rows]


def test_queries_without_known_terms_get_no_passages(bm25: BM25Retriever) -> None:
    rows, scores = bm25.search_rows(["the of and", "qqqzzzxx"], topk=4)
    assert rows.shape == scores.shape == (2, 4)
    assert (rows == -1).all()
    assert bm25.search(["the of and", "qqqzzzxx"], topk=4) == [[], []]


def test_topk_larger_than_corpus_is_padded(tmp_path) -> None:
    path = tmp_path / "tiny.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"d{i}", "contents": f'"T{i}"\napple {"pear " * i}'}) + "\n" for i in range(3)
        )
    )
    retriever = BM25Retriever.build(Corpus(path))
    rows, scores = retriever.search_rows(["apple pear"], topk=10)
    assert rows.shape == (1, 10)
    found = rows[0][rows[0] >= 0]
    assert sorted(found.tolist()) == [0, 1, 2] and found[0] == 2  # most "pear" ranks first
    assert (rows[0][3:] == -1).all()


def test_save_and_load_give_identical_results(bm25: BM25Retriever, tmp_path) -> None:
    bm25.save(tmp_path / "bm25")
    loaded = BM25Retriever.load(tmp_path / "bm25", bm25.corpus)
    queries = ["Roche Washington", "American football player", "river in Europe"]
    a_rows, a_scores = bm25.search_rows(queries, 5)
    b_rows, b_scores = loaded.search_rows(queries, 5)
    assert np.array_equal(a_rows, b_rows) and np.allclose(a_scores, b_scores)


def test_index_of_another_corpus_is_rejected(bm25: BM25Retriever, tmp_path) -> None:
    bm25.save(tmp_path / "bm25")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "0", "contents": '"X"\ny'}) + "\n")
    with pytest.raises(ValueError, match="rebuild"):
        BM25Retriever.load(tmp_path / "bm25", Corpus(other))
