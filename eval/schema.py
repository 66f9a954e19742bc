"""The results schema: what ``python -m eval run`` writes and ``python -m eval report`` reads, in
the one module both halves import (a floor below eval/run/ and eval/report/).

A results folder holds ``<run>/run.json`` and ``<run>/global_step_<N>/{rows.jsonl, summary.json}``
(docs/report.md, "Inputs"): a run's name (:data:`RUN_NAME`), a row's identity (:func:`row_key`) and
the intact rows of a ``rows.jsonl`` (:func:`read_rows`), the JSON documents (:func:`write_json_atomic`),
the fields of ``summary.json`` (:data:`SUMMARY_SHAPE`, :data:`JUDGE`), the plans a stage records
(:data:`FULL`, :data:`SEQUENTIAL`) and the settings two results must share (:func:`differences`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from reward_fns import SHAPES, metric_names
from search_env import protocol
from search_env.safe_fs import write_atomic

RUN_NAME = re.compile(r"(?P<shape>" + "|".join(sorted(SHAPES, key=len, reverse=True)) + r")_s(?P<seed>\d+)")
"""A run named by its recipe, ``<shape>_s<seed>`` (e.g. ``f1_only_s2``): the run folder, its
training log, its results."""
FULL, SEQUENTIAL = "full", "sequential"
"""Evaluation plans: every checkpoint on every row, or screen + decide + confirm (eval.run.sequential);
a stage's rows record the first when they are the whole suite."""
JUDGE = "judge"
"""Key of the judge's score (the share of rows it judged ``correct``) in a summary's benchmarks and
macro, beside the registered metrics; present only when a judge scored the rows."""
SUMMARY_SHAPE = (
    '{"benchmarks": {name: {"n", '
    + "".join(f'"{name}", ' for name in metric_names())
    + '...}}, "macro": {...}, "step": N, "complete": true}'
)
"""The fields of ``summary.json`` every reader needs: what :func:`eval.run.summary.summarize` writes and
:func:`eval.report.results.load_summary` checks (``macro``: the unweighted mean of ``benchmarks``)."""

RowKey = tuple[str, ...]
"""(benchmark, question id) of a greedy row, (benchmark, question id, sample index) of a sampled
one: the identity of one row."""


def unit_key(question: tuple[str, str], sample: int | None) -> RowKey:
    """The key of one rollout of a question (``Question.key``): greedy (``sample`` None) or a sample."""
    return question if sample is None else (*question, str(sample))


def row_key(row: dict[str, Any]) -> RowKey:
    sample = row.get("sample")
    return unit_key((str(row["benchmark"]), str(row["id"])), None if sample is None else int(sample))


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` by temp file + fsync + rename (+ dir fsync)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def intact_rows(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Parsed complete rows of a ``rows.jsonl`` and the byte length of its intact prefix.

    A line counts only if it ends in a newline and parses as a JSON object with
    ``benchmark`` and ``id``; parsing stops at the first bad line (a torn write can only be
    the last line, since every batch is fsynced before the next one starts).
    """
    if not path.exists():
        return [], 0
    rows: list[dict[str, Any]] = []
    good = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                row = json.loads(raw)
            except json.JSONDecodeError:
                break
            if not isinstance(row, dict) or "benchmark" not in row or "id" not in row:
                break
            rows.append(row)
            good += len(raw)
    return rows, good


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The complete rows of a ``rows.jsonl`` in file order, first occurrence of each :func:`row_key` only."""
    seen: set[RowKey] = set()
    out = []
    for row in intact_rows(path)[0]:
        key = row_key(row)
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def comparable(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings two result sets must share, by human name; ``None`` = not recorded (old results).

    Rows per benchmark count only for the full plan: a sequential plan's rows grow by stage, and
    its numbers carry their stage instead. The judge is compared only when both sides used one:
    results without judge verdicts may be judged later into the same folder.
    """
    limits = dict(settings.get("limits") or {})
    preset = limits.pop("preset", protocol.TRAIN_PRESET.name)
    plan = settings.get("plan", FULL)
    return {
        "limits preset": preset,
        "rollout limits": limits or None,
        "benchmarks": sorted(settings.get("benchmarks") or {}) or None,
        "suite fingerprint": settings.get("suite_fingerprint") or None,
        "plan": plan,
        "rows per benchmark (--limit)": settings.get("benchmarks") if plan == FULL else None,
        "subsample seed": settings.get("subsample_seed", 0),
        "backend": settings.get("backend"),
        "sampling": settings.get("sampling"),
        "vLLM prefix caching": settings.get("prefix_caching"),
        "retriever": settings.get("retriever") or None,
        "top-k": settings.get("topk", protocol.TOPK),
        "judge (--judge-model, prompt version)": settings.get("judge") or None,
    }


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(setting, value in a, value in b)`` for every setting both record and that differs."""
    ca, cb = comparable(a), comparable(b)
    return [(k, ca[k], cb[k]) for k in ca if ca[k] is not None and cb[k] is not None and ca[k] != cb[k]]


def mismatch_message(where_a: str, where_b: str, diffs: list[tuple[str, Any, Any]], fix: str) -> str:
    """One error line naming each differing setting with both values, and how to proceed."""
    said = "; ".join(f"{name} is {va!r} in {where_a} but {vb!r} in {where_b}" for name, va, vb in diffs)
    return f"evaluation settings differ: {said}. Fix: {fix}"
