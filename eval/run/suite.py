"""Evaluation suites: the questions of each benchmark, as written by ``python -m search_env.data``.

A suite (``--suite``) is a folder of ``<benchmark>.jsonl`` files, one such file, a verl parquet
file (or a folder of them) grouped by ``data_source``, or a built-in name (``test``, ``val``,
``samples``): :func:`read_suite`. Ids must be unique within a benchmark, because (benchmark, id)
keys the resumable results; ``--limit N`` picks rows by a hash of their ids, so the pick does not
depend on the file's order. The formats and built-in names: docs/evaluation.md, "SUITE".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from reward_fns.compute_score import gold_answers
from search_env.jsonl import iter_jsonl
from search_env.paths import REPO_ROOT

DEFAULT_DATA_DIR = REPO_ROOT / "data" / "parquet"
SAMPLES = REPO_ROOT / "assets" / "eval_samples"
SAMPLE_SUITE = {
    "nq": SAMPLES / "flashrag-quickstart" / "nq_test.jsonl",
    "hotpotqa": SAMPLES / "r1-searcher-evalset" / "hotpotqa_500.jsonl",
    "2wikimultihopqa": SAMPLES / "r1-searcher-evalset" / "2wiki_500.jsonl",
    "musique": SAMPLES / "r1-searcher-evalset" / "musique_500.jsonl",
    "bamboogle": SAMPLES / "r1-searcher-evalset" / "bamboogle.flashrag.jsonl",
}
"""The ``samples`` suite: real rows shipped in assets/eval_samples/ (NQ 17, HotpotQA/2Wiki/MuSiQue 500-row
samples, the full 125-row Bamboogle) for CPU demos and CI."""


def builtin_suites(data_dir: Path = DEFAULT_DATA_DIR) -> dict[str, Path | dict[str, Path]]:
    """Built-in suite names: ``test`` (the 7-benchmark suite), ``val`` (the validation split) under
    ``data_dir`` (``eval.data_dir``: where ``python -m search_env.data`` wrote them), ``samples``."""
    return {"test": data_dir / "suite", "val": data_dir / "val.parquet", "samples": SAMPLE_SUITE}


@dataclass(frozen=True)
class Question:
    """One benchmark row. ``golds`` are the gold answer strings (at least one)."""

    benchmark: str
    id: str
    question: str
    golds: tuple[str, ...]

    @property
    def key(self) -> tuple[str, str]:
        return (self.benchmark, self.id)


@dataclass(frozen=True)
class Suite:
    """A resolved suite: its folder and the rows of each benchmark in file order (after ``--limit``).

    ``ranked`` holds every row of each benchmark (before ``--limit``) in subsample order, so the
    first n rows of a benchmark are its n-row subsample (nested: rows for n are a subset of rows
    for n' > n); ``fingerprint`` is :func:`fingerprint` of those full benchmarks (content, not path).
    """

    name: str
    path: Path
    benchmarks: dict[str, list[Question]]
    ranked: dict[str, list[Question]] = field(default_factory=dict)
    fingerprint: str = ""

    @property
    def n_rows(self) -> int:
        return sum(len(rows) for rows in self.benchmarks.values())

    def prefix(self, n: int | dict[str, int]) -> list[Question]:
        """The first ``n`` rows of each benchmark in subsample order (``n`` per benchmark, or one
        number for all), benchmark by benchmark; a benchmark with fewer rows gives all of them."""
        sizes = n if isinstance(n, dict) else dict.fromkeys(self.ranked, n)
        return [q for b, qs in self.ranked.items() for q in qs[: sizes[b]]]

    def sizes(self) -> dict[str, int]:
        """Rows per benchmark of the whole suite (before ``--limit``)."""
        return {b: len(qs) for b, qs in self.ranked.items()}


def _jsonl_questions(benchmark: str, file: Path) -> list[Question]:
    """Rows of one jsonl file (FlashRAG or R1-Searcher schema, parsed by ``search_env.data``)."""
    from search_env.data import parse_row  # heavy: search_env.data imports pandas

    rows: list[Question] = []
    for line_no, obj in iter_jsonl(file, "one JSON object per line: {id, question, golden_answers}"):
        if not isinstance(obj, dict):
            raise ValueError(f"{file}:{line_no}: a row must be a JSON object (id, question, golden_answers)")
        row = parse_row(obj, f"{file}:{line_no}")
        rows.append(Question(benchmark, row.id, row.question, tuple(row.golds)))
    return rows


def _parquet_questions(file: Path) -> dict[str, list[Question]]:
    """verl rows written by ``search_env.data`` grouped by ``data_source`` (id/question from extra_info)."""
    import pandas as pd  # heavy: pandas, only for parquet suites

    frame = pd.read_parquet(file)
    for column in ("data_source", "reward_model", "extra_info"):
        if column not in frame.columns:
            raise ValueError(
                f"{file}: column {column!r} is missing; write the file with `python -m search_env.data`"
            )
    out: dict[str, list[Question]] = {}
    for i, rec in enumerate(frame.to_dict("records")):
        extra = rec["extra_info"] or {}
        if "id" not in extra or "question" not in extra:
            raise ValueError(
                f"{file} row {i}: extra_info needs 'id' and 'question' (search_env.data writes both)"
            )
        golds = gold_answers((rec["reward_model"] or {}).get("ground_truth"))
        if not golds:
            raise ValueError(f"{file} row {i}: reward_model.ground_truth holds no gold answer")
        bench = str(rec["data_source"])
        out.setdefault(bench, []).append(
            Question(bench, str(extra["id"]), str(extra["question"]), tuple(golds))
        )
    return out


def _check_unique(benchmark: str, rows: list[Question], where: Path) -> list[Question]:
    seen: set[str] = set()
    for q in rows:
        if q.id in seen:
            raise ValueError(
                f"{where}: id {q.id!r} of benchmark {benchmark} is repeated; ids key the results"
            )
        seen.add(q.id)
    if not rows:
        raise ValueError(f"{where}: no rows for benchmark {benchmark}")
    return rows


def read_suite(
    spec: str | Path, data_dir: Path = DEFAULT_DATA_DIR
) -> tuple[str, Path, dict[str, list[Question]]]:
    """(name, path, rows per benchmark) of a suite given as a built-in name, folder, jsonl or parquet file.

    A folder holds ``<benchmark>.jsonl`` files (or, with none, verl ``*.parquet`` files); a jsonl
    file is one benchmark named by its stem; a parquet file is grouped by ``data_source``.
    """
    builtins = builtin_suites(data_dir)
    target: Path | dict[str, Path]
    if str(spec) in builtins and not Path(spec).exists():
        target = builtins[str(spec)]
        name = str(spec)
        if isinstance(target, Path) and not target.exists():
            raise ValueError(
                f"--suite {spec}: {target} does not exist; write it with `python -m search_env.data "
                f"{'suite' if spec == 'test' else 'val'} --source SRC --out {data_dir}` or set eval.data_dir"
            )
    else:
        target = Path(spec)
        name = target.stem if target.is_file() else target.name
        if not target.exists():
            raise ValueError(
                f"--suite {spec!r} is neither a file, a folder nor a built-in suite ({sorted(builtins)})"
            )
    if isinstance(target, dict):
        files = target
        path = SAMPLES
    elif target.is_dir():
        files = {f.stem: f for f in sorted(target.glob("*.jsonl"))}
        path = target.resolve()
        if not files:
            parquets = sorted(target.glob("*.parquet"))
            if not parquets:
                raise ValueError(f"suite folder {target} holds no <benchmark>.jsonl or .parquet files")
            merged: dict[str, list[Question]] = {}
            for pq in parquets:
                for bench, rows in _parquet_questions(pq).items():
                    merged.setdefault(bench, []).extend(rows)
            return name, path, {b: _check_unique(b, r, target) for b, r in sorted(merged.items())}
    elif target.suffix == ".parquet":
        path = target.resolve()
        return (
            name,
            path,
            {b: _check_unique(b, r, target) for b, r in sorted(_parquet_questions(target).items())},
        )
    else:
        files = {target.stem: target}
        path = target.resolve()
    return name, path, {b: _check_unique(b, _jsonl_questions(b, f), f) for b, f in files.items()}


def ranked(rows: list[Question], seed: int = 0) -> list[Question]:
    """``rows`` in subsample order: by ``sha256("<seed>:<benchmark>:<id>")``."""
    return sorted(rows, key=lambda q: hashlib.sha256(f"{seed}:{q.benchmark}:{q.id}".encode()).hexdigest())


def subsample(rows: list[Question], limit: int | None, seed: int = 0) -> list[Question]:
    """The ``limit`` rows with the smallest seeded id hash, in their original order (all if None)."""
    if limit is None or limit >= len(rows):
        return list(rows)
    if limit <= 0:
        raise ValueError(f"--limit must be a positive number of rows per benchmark, got {limit}")
    keep = {q.key for q in ranked(rows, seed)[:limit]}
    return [q for q in rows if q.key in keep]


def fingerprint(benchmarks: dict[str, list[Question]]) -> str:
    """Content fingerprint of a suite (16 hex digits): its benchmarks' ids, questions and golds,
    independent of row order and of where the files are."""
    h = hashlib.sha256()
    for bench in sorted(benchmarks):
        for q in sorted(benchmarks[bench], key=lambda q: q.id):
            h.update("\x1f".join((bench, q.id, q.question, *q.golds)).encode() + b"\x1e")
    return h.hexdigest()[:16]


def load_suite(
    spec: str | Path,
    limit: int | None = None,
    seed: int = 0,
    benchmarks: list[str] | None = None,
    data_dir: Path = DEFAULT_DATA_DIR,
) -> Suite:
    """Resolve and load a suite, optionally restricted to ``benchmarks`` and subsampled per benchmark."""
    name, path, rows = read_suite(spec, data_dir)
    if benchmarks:
        unknown = sorted(set(benchmarks) - set(rows))
        if unknown:
            raise ValueError(f"--benchmarks {unknown} not in suite {name} (has {sorted(rows)})")
        rows = {b: rows[b] for b in benchmarks}
    return Suite(
        name=name,
        path=path,
        benchmarks={b: subsample(qs, limit, seed) for b, qs in rows.items()},
        ranked={b: ranked(qs, seed) for b, qs in rows.items()},
        fingerprint=fingerprint(rows),
    )
