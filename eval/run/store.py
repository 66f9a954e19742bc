"""Durable result files: append-only JSONL rows and atomically replaced JSON documents.

``rows.jsonl`` survives a SIGKILL at any instant: every batch of rows is written, flushed and
fsynced before the next batch starts; a torn last line (a crash mid-write) is cut off before
anything is appended again; duplicate keys (same benchmark, id and sample) keep their first row.
JSON documents (``summary.json``, ``run.json``) are written to a temporary file in the same
directory and renamed over the target, so readers see the old or the new file, never half.
Several processes (one per GPU) may share one results folder: each checkpoint folder has its own
``flock`` (:func:`try_lock`), so they evaluate different checkpoints and never write the same
``rows.jsonl``.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eval.schema import RowKey, intact_rows, read_rows, row_key
from search_env.safe_fs import fsync_dir, open_lock


class RowStore:
    """The ``rows.jsonl`` of one checkpoint: read what is done, append new rows durably.

    Not safe for two writers at once: the runner holds the checkpoint folder's lock
    (:func:`try_lock` / :func:`exclusive_lock`) while it writes.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._done: set[RowKey] | None = None

    def rows(self) -> list[dict[str, Any]]:
        """Complete rows in file order, first occurrence of each :func:`row_key` only."""
        return read_rows(self.path)

    def done_keys(self) -> set[RowKey]:
        return {row_key(r) for r in self.rows()}

    def repair(self) -> int:
        """Cut a torn or corrupt tail off the file; returns the number of bytes removed."""
        if not self.path.exists():
            return 0
        _, good = intact_rows(self.path)
        size = self.path.stat().st_size
        if good < size:
            with open(self.path, "r+b") as f:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())
        return size - good

    def recover(self) -> set[RowKey]:
        """:meth:`repair` the file and return the keys it stores; appends then reuse them."""
        self.repair()
        self._done = self.done_keys()
        return set(self._done)

    def append(self, rows: Iterable[dict[str, Any]]) -> int:
        """Append rows (skipping keys already stored), then flush and fsync; returns rows written.

        Unless :meth:`recover` ran, the first call runs it; later calls reuse the stored keys,
        so this store object must be the file's only writer.
        """
        if self._done is None:
            self.recover()
        done = self._done
        lines = []
        for row in rows:
            key = row_key(row)
            if key in done:
                continue
            done.add(key)
            lines.append(json.dumps(row, ensure_ascii=False) + "\n")
        if not lines:
            return 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
        if created:
            fsync_dir(self.path.parent)
        return len(lines)


def _flock(f: Any, wait: bool) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


@contextmanager
def try_lock(folder: Path) -> Iterator[bool]:
    """Try an exclusive ``flock`` on ``folder/.lock`` (opened by ``safe_fs.open_lock``: never
    truncated, a symlink refused) without waiting; yields whether it is held.

    The lock is per open file, so it also excludes another holder in the same process, and the
    kernel drops it when its holder dies (a SIGKILLed evaluation leaves no stale lock).
    """
    folder.mkdir(parents=True, exist_ok=True)
    with os.fdopen(open_lock(folder / ".lock"), "r+b") as f:
        held = _flock(f, wait=False)
        try:
            yield held
        finally:
            if held:
                fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def exclusive_lock(folder: Path, wait: bool = False) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder/.lock``: wait for it (``wait``), or fail at once
    with a RuntimeError when another process holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    with os.fdopen(open_lock(folder / ".lock"), "r+b") as f:
        if not _flock(f, wait):
            raise RuntimeError(
                f"{folder} is being written by another `python -m eval run`; wait for it or use another --out"
            )
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


FLUSH_ROWS = 64
FLUSH_S = 2.0
"""rows.jsonl gets the finished prefix (one write + fsync) every FLUSH_ROWS rows or FLUSH_S seconds."""


class InOrderWriter:
    """Appends finished rows to a :class:`RowStore` in item order, as the longest finished prefix.

    ``add(i, row)`` takes row ``i`` whenever it finishes; rows ``0..k`` go to the store (one append
    + fsync) once all are finished and ``flush_rows`` of them are waiting or ``flush_s`` seconds
    have passed since the last write; ``flush()`` writes the finished prefix now. Rows after a gap
    stay in memory until the gap fills, so the file is always a prefix of the uninterrupted one.
    ``add(i, None)`` marks row ``i`` finished but held back: it fills its place in the order and is
    never written.
    """

    def __init__(
        self,
        store: RowStore,
        flush_rows: int = FLUSH_ROWS,
        flush_s: float = FLUSH_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.flush_rows, self.flush_s, self.clock = store, flush_rows, flush_s, clock
        self._finished: dict[int, dict[str, Any] | None] = {}
        self._next = 0  # index of the first row not yet written
        self._last_write = clock()
        self.written = 0

    def _prefix_end(self) -> int:
        end = self._next
        while end in self._finished:
            end += 1
        return end

    def add(self, index: int, row: dict[str, Any] | None) -> None:
        self._finished[index] = row
        waiting = self._prefix_end() - self._next
        if waiting and (waiting >= self.flush_rows or self.clock() - self._last_write >= self.flush_s):
            self.flush()

    def flush(self) -> int:
        """Write the finished prefix now (held-back rows skipped); returns the rows written."""
        end = self._prefix_end()
        rows = [row for i in range(self._next, end) if (row := self._finished.pop(i)) is not None]
        self._next = end
        self._last_write = self.clock()
        if rows:
            self.written += self.store.append(rows)
        return len(rows)
