"""JSON-lines files: writing rows, and reading them with errors that name the file, the line and the fix."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def iter_jsonl(
    path: str | os.PathLike[str], fix: str, error: type[Exception] = ValueError
) -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, parsed value)`` for every non-blank line of ``path`` (1-based).

    A line that is not valid JSON raises ``error("{path}:{line}: not valid JSON (…). Fix: {fix}")``.
    """
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as err:
                raise error(f"{path}:{line_no}: not valid JSON ({err.msg}). Fix: {fix}") from None


def write_jsonl(rows: Iterable[Any], path: str | os.PathLike[str]) -> Path:
    """Write one JSON object per line (UTF-8, non-ASCII kept), creating the parent folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
