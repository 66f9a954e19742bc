"""Evaluation suites: a folder of FlashRAG-format jsonl files, one per benchmark.

A row is ``{"id": str, "question": str, "golden_answers": [str, ...]}`` (extra keys are kept
and ignored); the benchmark name is the file stem (``nq.jsonl`` -> ``nq``). A suite is given
either as a path to such a folder or as the name of a folder under the suites root
(``$RLVR_SUITES_DIR``, default ``<repo>/data/suites``), e.g. ``--suite test`` or ``--suite val``
after ``python -m search_env.data`` has written them there.

``--limit N`` keeps, per benchmark, the N rows with the smallest
``sha256("<seed>:<benchmark>:<id>")``: the pick depends only on the ids, so it is the same for
the same file and unchanged when the file is reordered (rows are then used in file order).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SUITES_ROOT = REPO_ROOT / "data" / "suites"


def suites_root() -> Path:
    return Path(os.environ.get("RLVR_SUITES_DIR", DEFAULT_SUITES_ROOT))


@dataclass(frozen=True)
class Question:
    """One benchmark row. ``golds`` are the gold answer strings (at least one)."""

    benchmark: str
    id: str
    question: str
    golds: tuple[str, ...]
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.benchmark, self.id)


@dataclass(frozen=True)
class Suite:
    """A resolved suite: its folder and the rows of each benchmark in file order."""

    name: str
    path: Path
    benchmarks: dict[str, list[Question]]

    @property
    def n_rows(self) -> int:
        return sum(len(rows) for rows in self.benchmarks.values())


def resolve_suite_path(spec: str | Path) -> Path:
    """A suite folder from a path or a built-in name; raises ValueError naming what to do."""
    path = Path(spec)
    if path.is_dir():
        return path.resolve()
    named = suites_root() / str(spec)
    if named.is_dir():
        return named.resolve()
    known = sorted(p.name for p in suites_root().iterdir() if p.is_dir()) if suites_root().is_dir() else []
    raise ValueError(
        f"--suite {spec!r} is neither a folder nor a suite under {suites_root()} (known: {known or 'none'}); "
        "write one with `python -m search_env.data` or pass a folder of <benchmark>.jsonl files"
    )


def _parse_row(benchmark: str, file: Path, line_no: int, obj: Any) -> Question:
    where = f"{file}:{line_no}"
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a row must be a JSON object with id, question, golden_answers")
    for name in ("id", "question", "golden_answers"):
        if name not in obj:
            raise ValueError(
                f"{where}: field {name!r} is missing; suite rows are FlashRAG-format "
                '{"id", "question", "golden_answers": [...]} (convert with `python -m search_env.data`)'
            )
    golds = obj["golden_answers"]
    if isinstance(golds, str):
        golds = [golds]
    if not isinstance(golds, list) or not golds or not all(isinstance(g, str) for g in golds):
        raise ValueError(f"{where}: field 'golden_answers' must be a non-empty list of strings")
    if not isinstance(obj["question"], str) or not obj["question"].strip():
        raise ValueError(f"{where}: field 'question' must be a non-empty string")
    return Question(benchmark, str(obj["id"]), obj["question"], tuple(golds), obj)


def load_benchmark(file: Path) -> list[Question]:
    """Rows of one ``<benchmark>.jsonl``; ids must be unique (they key resumable results)."""
    benchmark = file.stem
    rows: list[Question] = []
    seen: set[str] = set()
    with open(file, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{line_no}: not valid JSON ({e.msg})") from None
            q = _parse_row(benchmark, file, line_no, obj)
            if q.id in seen:
                raise ValueError(f"{file}:{line_no}: field 'id' value {q.id!r} is repeated; ids must be unique")
            seen.add(q.id)
            rows.append(q)
    if not rows:
        raise ValueError(f"{file}: no rows")
    return rows


def subsample(rows: list[Question], limit: int | None, seed: int = 0) -> list[Question]:
    """The ``limit`` rows with the smallest seeded id hash, in their original order (all if None)."""
    if limit is None or limit >= len(rows):
        return list(rows)
    if limit <= 0:
        raise ValueError(f"--limit must be a positive number of rows per benchmark, got {limit}")

    def rank(q: Question) -> str:
        return hashlib.sha256(f"{seed}:{q.benchmark}:{q.id}".encode()).hexdigest()

    keep = {q.key for q in sorted(rows, key=rank)[:limit]}
    return [q for q in rows if q.key in keep]


def load_suite(
    spec: str | Path,
    limit: int | None = None,
    seed: int = 0,
    benchmarks: list[str] | None = None,
) -> Suite:
    """Resolve and load a suite, optionally restricted to ``benchmarks`` and subsampled."""
    path = resolve_suite_path(spec)
    files = {f.stem: f for f in sorted(path.glob("*.jsonl"))}
    if not files:
        raise ValueError(f"suite folder {path} holds no <benchmark>.jsonl files")
    if benchmarks:
        unknown = sorted(set(benchmarks) - set(files))
        if unknown:
            raise ValueError(f"--benchmarks {unknown} not in suite {path} (has {sorted(files)})")
        files = {name: files[name] for name in benchmarks}
    loaded = {name: subsample(load_benchmark(file), limit, seed) for name, file in files.items()}
    return Suite(name=path.name, path=path, benchmarks=loaded)
