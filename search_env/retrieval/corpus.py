"""Memory-mapped wiki-18 style corpus and the `Passage` record shared by server, client and tool.

A corpus is a jsonl file with one `{"id": str, "contents": "\\"Title\\"\\ntext"}` object per line
(the Search-R1 / FlashRAG wiki-18 format). Row ``i`` of the file is row ``i`` of every index built from
it. The file is memory-mapped and addressed through a byte-offset table (one int64 per row, plus the
file size as a sentinel), so the 21M-passage wiki-18 (~14 GB) needs ~170 MB of RAM for the table and
only the pages actually read. The table of a large corpus is cached next to it as
``<corpus>.offsets.npy`` and rebuilt when the corpus is newer or its size changed.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from search_env.safe_fs import replace_durably

log = logging.getLogger(__name__)

OFFSETS_SUFFIX = ".offsets.npy"
CACHE_MIN_BYTES = 64 * 1024 * 1024
"""Corpora smaller than this (64 MiB) are scanned in memory on every open instead of being cached."""
_SCAN_CHUNK_BYTES = 64 * 1024 * 1024


@dataclass
class Passage:
    """One retrieved passage. `title` has no surrounding quotes; `score` is the backend's similarity
    (inner product for dense, BM25 score for bm25), None when the server was asked for no scores;
    `contents` is the corpus row's raw `contents` string (`"Title"\ntext`, or however the row spells
    its title line), "" when unknown."""

    id: str
    title: str
    text: str
    score: float | None = None
    contents: str = ""


def split_contents(contents: str) -> tuple[str, str]:
    """Split wiki-18 `contents` into (title, text).

    The first line is the title; one pair of surrounding double quotes is removed from it (wiki-18
    writes `"Title"`). The rest, joined by newlines, is the text. Contents without a newline are
    all title and an empty text (FlashRAG's rule: `contents.split("\\n")[0]` is the title).
    """
    title, _, text = contents.partition("\n")
    title = title.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, text


def scan_line_offsets(buffer: bytes | mmap.mmap | np.ndarray) -> np.ndarray:
    """Byte offsets of every non-empty line start in `buffer`, followed by the buffer length.

    Returns an int64 array of length rows + 1; row i spans `[off[i], off[i + 1])` (its newline and
    any following empty lines included, which JSON parsing ignores). Empty lines (`""` or `"\\r"`) are
    not rows. Scans in 64 MiB chunks with numpy: a 14 GB file takes about a minute.
    """
    data = np.frombuffer(buffer, dtype=np.uint8)
    size = data.size
    newlines = [
        np.flatnonzero(data[lo : lo + _SCAN_CHUNK_BYTES] == ord(b"\n")).astype(np.int64) + lo
        for lo in range(0, size, _SCAN_CHUNK_BYTES)
    ]
    ends = np.concatenate([*newlines, np.array([size], dtype=np.int64)])
    starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1] + 1])
    lengths = ends - starts
    is_cr_only = np.zeros_like(lengths, dtype=bool)
    single = np.flatnonzero(lengths == 1)
    is_cr_only[single] = data[starts[single]] == ord(b"\r")
    keep = (lengths > 0) & ~is_cr_only
    return np.append(starts[keep], np.int64(size))


class Corpus:
    """Random access to a jsonl corpus by row number without loading it.

    `len(corpus)` rows; `corpus.row(i)` -> dict, `corpus.contents(i)`, `corpus.passage(i, score)`;
    `iter_contents(start, stop)` streams rows in order (for index building). Thread-safe for reads.
    Raises FileNotFoundError for a missing path and ValueError for a gzip file (gunzip it first: the
    file must be seekable to be memory-mapped) or an empty corpus.
    """

    def __init__(self, path: str | os.PathLike[str], cache_offsets: bool | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"corpus: no such file {self.path} (expected a wiki-18 style jsonl)")
        if self.path.suffix == ".gz":
            raise ValueError(
                f"corpus: {self.path} is gzip-compressed; run `gunzip -k {self.path}` and pass the .jsonl"
            )
        size = self.path.stat().st_size
        if size == 0:
            raise ValueError(f"corpus: {self.path} is empty")
        with open(self.path, "rb") as handle:
            self._mmap = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        if cache_offsets is None:
            cache_offsets = size >= CACHE_MIN_BYTES
        self.offsets = self._load_offsets(cache_offsets)
        if len(self.offsets) < 2:
            raise ValueError(f"corpus: {self.path} holds no rows")

    @property
    def offsets_path(self) -> Path:
        return self.path.with_name(self.path.name + OFFSETS_SUFFIX)

    def _load_offsets(self, cache: bool) -> np.ndarray:
        cached = self.offsets_path
        size = self.path.stat().st_size
        if cache and cached.is_file() and cached.stat().st_mtime >= self.path.stat().st_mtime:
            offsets = np.load(cached, mmap_mode="r")
            if len(offsets) >= 1 and int(offsets[-1]) == size:
                return offsets
            log.warning("corpus: stale offset cache %s (size mismatch), rebuilding", cached)
        offsets = scan_line_offsets(self._mmap)
        if cache:
            try:
                tmp = cached.with_name(cached.name + f".tmp{os.getpid()}.npy")
                np.save(tmp, offsets)
                replace_durably(tmp, cached)
                log.info("corpus: cached %d row offsets in %s", len(offsets) - 1, cached)
            except OSError as err:
                log.warning(
                    "corpus: cannot cache offsets next to the corpus (%s); keeping them in memory", err
                )
        return offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def raw(self, i: int) -> bytes:
        """The jsonl line of row `i` (0 <= i < len); IndexError otherwise (negative ids are NOT wrapped)."""
        if not 0 <= i < len(self):
            raise IndexError(f"corpus row {i} out of range 0..{len(self) - 1}")
        return self._mmap[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def row(self, i: int) -> dict:
        """Row `i` as `{"id": str, "contents": str}`; ValueError naming the row if it is malformed."""
        try:
            obj = json.loads(self.raw(i))
            return {"id": str(obj["id"]), "contents": str(obj["contents"])}
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(
                f'corpus {self.path} row {i}: expected {{"id", "contents"}} json ({err})'
            ) from err

    def contents(self, i: int) -> str:
        return self.row(i)["contents"]

    def passage(self, i: int, score: float | None = None) -> Passage:
        row = self.row(i)
        title, text = split_contents(row["contents"])
        return Passage(id=row["id"], title=title, text=text, score=score, contents=row["contents"])

    def iter_contents(self, start: int = 0, stop: int | None = None) -> Iterator[str]:
        """`contents` of rows start..stop-1 in file order."""
        stop = len(self) if stop is None else min(stop, len(self))
        for i in range(start, stop):
            yield self.contents(i)

    def close(self) -> None:
        self._mmap.close()
