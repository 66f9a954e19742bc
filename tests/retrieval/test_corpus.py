"""Corpus: title/text split, memory-mapped row access, the cached byte-offset table."""

import json
import os

import numpy as np
import pytest

from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.corpus import OFFSETS_SUFFIX, Corpus, Passage, scan_line_offsets, split_contents


@pytest.mark.parametrize(
    ("contents", "title", "text"),
    [
        ('"Evan Morris"\nEvan Morris Evan L. Morris', "Evan Morris", "Evan Morris Evan L. Morris"),
        ('"A "quoted" title"\nbody', 'A "quoted" title', "body"),  # only the outer pair goes
        ("Plain title\nline 1\nline 2", "Plain title", "line 1\nline 2"),
        ('"Only title"', "Only title", ""),
        ('""\nno title', "", "no title"),
        ('"unbalanced\ntext', '"unbalanced', "text"),
        ("", "", ""),
    ],
)
def test_split_contents(contents: str, title: str, text: str) -> None:
    assert split_contents(contents) == (title, text)


def test_demo_corpus_rows_match_the_file() -> None:
    corpus = Corpus(SAMPLE_CORPUS)
    lines = SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()
    assert len(corpus) == len(lines) == 1000
    for i in (0, 1, 500, 999):
        assert corpus.row(i) == json.loads(lines[i])
    first = corpus.passage(0, score=0.5)
    assert first == Passage(
        id="0", title="Evan Morris", text=first.text, score=0.5, contents=json.loads(lines[0])["contents"]
    )
    assert first.text.startswith("Evan Morris Evan L. Morris (January 26, 1977")
    assert not (SAMPLE_CORPUS.parent / (SAMPLE_CORPUS.name + OFFSETS_SUFFIX)).exists()  # small: not cached


def test_negative_and_out_of_range_rows_raise() -> None:
    corpus = Corpus(SAMPLE_CORPUS)
    for bad in (-1, 1000):
        with pytest.raises(IndexError, match="out of range"):
            corpus.row(bad)


def test_scan_skips_empty_lines_and_handles_missing_final_newline() -> None:
    data = b'{"a":1}\n\n{"b":2}\r\n\r\n{"c":3}'
    offsets = scan_line_offsets(data)
    assert offsets.tolist() == [0, 9, 20, len(data)]
    assert [json.loads(data[offsets[i] : offsets[i + 1]]) for i in range(3)] == [{"a": 1}, {"b": 2}, {"c": 3}]
    assert scan_line_offsets(b"\n\n").tolist() == [2]


def test_offsets_cache_is_written_reused_and_rebuilt_when_stale(tmp_path) -> None:
    path = tmp_path / "c.jsonl"
    rows = [{"id": str(i), "contents": f'"T{i}"\ntext {i}'} for i in range(50)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = Corpus(path, cache_offsets=True)
    cache = tmp_path / ("c.jsonl" + OFFSETS_SUFFIX)
    assert cache.is_file() and len(corpus) == 50
    assert np.array_equal(np.load(cache), corpus.offsets)
    assert Corpus(path, cache_offsets=True).passage(49).title == "T49"

    with path.open("a") as handle:  # corpus grows -> size mismatch -> rebuilt
        handle.write(json.dumps({"id": "50", "contents": '"T50"\nnew'}) + "\n")
    os.utime(cache, (path.stat().st_mtime + 10,) * 2)  # even if the cache looks newer
    grown = Corpus(path, cache_offsets=True)
    assert len(grown) == 51 and grown.passage(50).text == "new"


def test_iter_contents_streams_in_order(tmp_path) -> None:
    corpus = Corpus(SAMPLE_CORPUS)
    assert list(corpus.iter_contents(10, 13)) == [corpus.contents(i) for i in (10, 11, 12)]
    assert len(list(corpus.iter_contents(995))) == 5


@pytest.mark.parametrize(
    ("name", "content", "error", "match"),
    [
        ("missing.jsonl", None, FileNotFoundError, "no such file"),
        ("wiki.jsonl.gz", b"\x1f\x8b", ValueError, "gunzip"),
        ("empty.jsonl", b"", ValueError, "empty"),
        ("blank.jsonl", b"\n\n", ValueError, "no rows"),
    ],
)
def test_bad_corpus_files_raise_clear_errors(tmp_path, name, content, error, match) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error, match=match):
        Corpus(path)


def test_malformed_row_names_the_row(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "0", "contents": "\\"A\\"\\nok"}\n{"id": "1"}\n')
    corpus = Corpus(path)
    assert corpus.passage(0).title == "A"
    with pytest.raises(ValueError, match="row 1"):
        corpus.row(1)
