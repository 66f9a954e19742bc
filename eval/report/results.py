"""Load evaluation result trees and verl training logs into tidy pandas tables.

Reads what ``python -m eval run`` writes (``OUT/<run>/run.json``, ``global_step_<N>/summary.json``
and ``rows.jsonl``; step 0 is the untrained model) and verl's file-logger JSONL (one
``{"step": N, "data": {metric: value}}`` line per step), so ``select``, ``report`` and ``study.regimes``
share one validated view. Bad input raises :class:`ResultsError` naming the file and the fix.
Formats and checks: docs/report.md ("Inputs").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from eval.schema import FULL, JUDGE, RUN_NAME, SUMMARY_SHAPE, differences, mismatch_message, read_rows
from reward_fns import SHAPES, metric_names, normalize_answer
from search_env.benchmarks import BY_KEY, IN_DISTRIBUTION, canonical_benchmark, order_benchmarks
from search_env.checkpoint_layout import step_dir_name, step_of
from search_env.jsonl import iter_jsonl

AVG_ALL = "avg_all"
AVG_HELDOUT = "avg_heldout"


def benchmark_label(key: str) -> str:
    """Display label of a canonical key; averages get their own labels."""
    if key in BY_KEY:
        return BY_KEY[key].label
    return {AVG_ALL: "Avg (all)", AVG_HELDOUT: "Avg (held-out)"}.get(key, key)


class ResultsError(ValueError):
    """An input file is missing or malformed; the message names the file and the fix."""


@dataclass(frozen=True)
class Run:
    """One training run (reward shape x seed) as described by its ``run.json``."""

    name: str
    shape: str
    seed: int
    horizon: int
    path: Path
    config: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def known_horizon(self) -> int | None:
        """The step cap from run.json, or None when it says ``"horizon": null`` (no cap)."""
        return None if self.horizon == UNKNOWN_HORIZON else self.horizon


@dataclass
class Results:
    """A loaded result tree.

    ``scores`` is tidy: one row per (run, step, benchmark) with columns ``run, shape, seed,
    horizon, step, benchmark, n, <each registered metric: em, f1, acc>, abort_rate, searches_mean``
    (and ``judge`` when an LLM judge scored some summary, :data:`JUDGE`);
    ``benchmark`` also takes the pseudo-benchmarks :data:`AVG_ALL` (unweighted mean over the suite)
    and :data:`AVG_HELDOUT` (unweighted mean over the suite without the training benchmark) for the
    metrics. ``suite`` lists the real
    benchmarks in paper order. ``notes`` says which checkpoints were skipped and why.
    ``summaries`` holds the summary.json document of every (run, step) in ``scores``, as written.
    Every run and summary was evaluated with the same settings (:func:`check_settings`).
    """

    root: Path
    runs: dict[str, Run]
    scores: pd.DataFrame
    suite: list[str]
    notes: list[str]
    summaries: dict[tuple[str, int], dict[str, Any]]
    stages: dict[tuple[str, int], str] = field(default_factory=dict)
    """Per (run, step) in ``scores``: ``full`` (every row), ``confirmed`` or ``screened`` (eval.run.runner)."""

    def rows_path(self, run: str, step: int) -> Path:
        """Path of the per-question rows of one checkpoint (may not exist)."""
        return self.runs[run].path / step_dir_name(step) / "rows.jsonl"

    def evaluated_runs(self) -> list[Run]:
        """The runs with at least one checkpoint in ``scores``, in folder-name order."""
        have = set(self.scores["run"])
        return [run for name, run in self.runs.items() if name in have]


def _read_json(path: Path, fix: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise ResultsError(f"{path}: file not found. Fix: {fix}") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ResultsError(f"{path}: not valid JSON ({err}). Fix: {fix}") from err


def _require(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path, fix: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise ResultsError(f"{path}: missing field {key!r}. Fix: {fix}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ResultsError(f"{path}: field {key!r} = {value!r} has the wrong type. Fix: {fix}")
    return value


RUN_FIX = (
    f'write run.json as {{"run": NAME, "shape": "{"|".join(SHAPES)}", "seed": INT, '
    '"horizon": STEP_CAP or null, "config": {...}} (`python -m eval run` writes it; pass --shape/--seed/'
    "--horizon there when the run's config does not say, or edit the file)"
)
SUMMARY_FIX = (
    "re-run the eval harness for this checkpoint (it rewrites summary.json from rows.jsonl); the "
    f"expected shape is {SUMMARY_SHAPE}"
)


UNKNOWN_HORIZON = 10**9
"""Horizon used when run.json says ``"horizon": null``: no cap, every evaluated step counts."""


def load_run(run_dir: Path) -> Run:
    """Read and validate ``run_dir/run.json`` (``run``, ``shape``, ``seed`` required; ``horizon``
    may be null, meaning no cap)."""
    path = run_dir / "run.json"
    if not path.exists():
        raise ResultsError(f"{path}: missing, but {run_dir} holds global_step_* checkpoints. Fix: {RUN_FIX}")
    meta = _read_json(path, RUN_FIX)
    if not isinstance(meta, dict):
        raise ResultsError(f"{path}: expected a JSON object. Fix: {RUN_FIX}")
    name = _require(meta, "run", str, path, RUN_FIX)
    shape = _require(meta, "shape", str, path, RUN_FIX)
    seed = _require(meta, "seed", int, path, RUN_FIX)
    horizon = meta.get("horizon")
    if horizon is None:  # unknown cap: every evaluated checkpoint counts
        horizon = UNKNOWN_HORIZON
    elif not isinstance(horizon, int) or isinstance(horizon, bool):
        raise ResultsError(f"{path}: field 'horizon' = {horizon!r} has the wrong type. Fix: {RUN_FIX}")
    elif horizon < 0:
        raise ResultsError(f"{path}: horizon {horizon} must be >= 0 (the run's step cap). Fix: {RUN_FIX}")
    config = meta.get("config") or {}
    return Run(name, shape, seed, horizon, run_dir, config if isinstance(config, dict) else {})


def _as_fraction(value: Any, where: str, path: Path, fix: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ResultsError(
            f"{path}: {where} = {value!r} is not a number in [0, 1]. Fix: {fix or SUMMARY_FIX}"
        )
    return float(value)


def load_summary(path: Path, step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Validate one ``summary.json``: returns (the document, one record per benchmark).

    The ``macro`` field, when present, must equal the unweighted mean of the per-benchmark values
    (to 1e-6); a mismatch means the file was edited or written by another convention.
    """
    summary = _read_json(path, SUMMARY_FIX)
    if not isinstance(summary, dict):
        raise ResultsError(f"{path}: expected a JSON object. Fix: {SUMMARY_FIX}")
    benchmarks = _require(summary, "benchmarks", dict, path, SUMMARY_FIX)
    if not benchmarks:
        raise ResultsError(f"{path}: 'benchmarks' is empty. Fix: {SUMMARY_FIX}")
    if "step" in summary and summary["step"] != step:
        raise ResultsError(
            f"{path}: 'step' is {summary['step']!r} but the folder is {step_dir_name(step)}. "
            f"Fix: move the file to {step_dir_name(summary['step'])} or {SUMMARY_FIX}"
        )
    records = []
    for name, entry in benchmarks.items():
        if not isinstance(entry, dict):
            raise ResultsError(f"{path}: benchmarks.{name} must be an object. Fix: {SUMMARY_FIX}")
        record: dict[str, Any] = {"benchmark": canonical_benchmark(name), "step": step}
        for metric in metric_names():
            record[metric] = _as_fraction(
                _require(entry, metric, (int, float), path, SUMMARY_FIX), f"benchmarks.{name}.{metric}", path
            )
        n = entry.get("n")
        record["n"] = float(n) if isinstance(n, int) and not isinstance(n, bool) else math.nan
        abort = entry.get("abort_rate")
        record["abort_rate"] = (
            _as_fraction(abort, f"benchmarks.{name}.abort_rate", path) if abort is not None else math.nan
        )
        searches = entry.get("searches_mean")
        record["searches_mean"] = float(searches) if isinstance(searches, (int, float)) else math.nan
        if entry.get(JUDGE) is not None:
            record[JUDGE] = _as_fraction(entry[JUDGE], f"benchmarks.{name}.{JUDGE}", path)
        records.append(record)
    macro = summary.get("macro")
    if isinstance(macro, dict):
        for metric in metric_names():
            if isinstance(macro.get(metric), (int, float)):
                mean = float(np.mean([r[metric] for r in records]))
                if abs(mean - macro[metric]) > 1e-6:
                    raise ResultsError(
                        f"{path}: macro.{metric} = {macro[metric]} but the unweighted mean of the "
                        f"{len(records)} benchmarks is {mean:.6f}. Fix: {SUMMARY_FIX}"
                    )
    return summary, records


def _step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    found = [(s, p) for p in run_dir.iterdir() if p.is_dir() and (s := step_of(p.name)) is not None]
    return sorted(found)


def _scored(frame: pd.DataFrame) -> list[str]:
    """The registered metrics, then the judge's score when ``frame`` has it."""
    return [*metric_names(), *([JUDGE] if JUDGE in frame.columns else [])]


def _with_averages(frame: pd.DataFrame, suite: Sequence[str]) -> pd.DataFrame:
    """Append the AVG_ALL / AVG_HELDOUT pseudo-benchmark rows for every (run, step)."""
    keys = ["run", "shape", "seed", "horizon", "step"]
    heldout = [b for b in suite if b not in IN_DISTRIBUTION]
    parts = [frame]
    for name, members in ((AVG_ALL, list(suite)), (AVG_HELDOUT, heldout)):
        sub = frame[frame["benchmark"].isin(members)]
        avg = sub.groupby(keys, as_index=False)[_scored(frame)].mean()
        avg["benchmark"] = name
        avg["n"] = sub.groupby(keys)["n"].sum().to_numpy()
        parts.append(avg)
    return pd.concat(parts, ignore_index=True)


SETTINGS_FIX = (
    "evaluate every run with the same settings, or keep each setting's results in its own results "
    "folder (`python -m eval run --out`)"
)


def run_settings(run_dir: Path) -> dict[str, Any]:
    """The evaluation settings recorded in ``run_dir/run.json`` (``eval``; empty when absent)."""
    path = run_dir / "run.json"
    doc = json.loads(path.read_text()) if path.is_file() else {}
    found = doc.get("eval") if isinstance(doc, dict) else None
    return found if isinstance(found, dict) else {}


def check_settings(reference: tuple[Path, dict[str, Any]], other: tuple[Path, dict[str, Any]]) -> None:
    """ResultsError naming every setting two result sets differ in, with both values."""
    diffs = differences(reference[1], other[1])
    if diffs:
        raise ResultsError(mismatch_message(str(reference[0]), str(other[0]), diffs, SETTINGS_FIX))


def load_results(root: Path | str) -> Results:
    """Load every run under ``root``: folders holding ``run.json`` or evaluated ``global_step_*``
    folders (with summary.json or rows.jsonl; others, such as merged-weight caches, are ignored).

    Refused (ResultsError naming the setting and both values): runs or summaries evaluated with
    other settings than the first run (:func:`eval.schema.differences`). Skipped, with a note:
    checkpoint folders without ``summary.json`` (not evaluated yet),
    summaries marked ``"complete": false``, and checkpoints lacking a benchmark of the suite (the
    suite is the union of benchmarks over all complete checkpoints; a partial checkpoint's average
    would not be comparable).
    """
    root = Path(root)
    if not root.is_dir():
        raise ResultsError(
            f"{root}: results folder not found. Fix: pass --results OUT, the eval harness's output"
        )
    runs: dict[str, Run] = {}
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    summaries: dict[tuple[str, int], dict[str, Any]] = {}
    stages: dict[tuple[str, int], str] = {}
    reference: tuple[Path, dict[str, Any]] | None = None
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        steps = _step_dirs(run_dir)
        evaluated = any((d / "summary.json").exists() or (d / "rows.jsonl").exists() for _, d in steps)
        if not (run_dir / "run.json").exists() and not evaluated:
            if steps:
                notes.append(
                    f"{run_dir}: global_step_* folders without evaluation files (e.g. merged weights) - ignored."
                )
            continue
        run = load_run(run_dir)
        if run.name in runs:
            raise ResultsError(
                f"{run_dir / 'run.json'}: run name {run.name!r} also used by {runs[run.name].path}. "
                "Fix: give every run a unique 'run' name"
            )
        runs[run.name] = run
        settings = run_settings(run_dir)
        reference = reference or (run_dir / "run.json", settings)
        check_settings(reference, (run_dir / "run.json", settings))
        if run.horizon == UNKNOWN_HORIZON:
            notes.append(
                f"{run_dir / 'run.json'}: horizon is null - the own-horizon rule uses every evaluated step."
            )
        for step, step_dir in steps:
            summary_path = step_dir / "summary.json"
            if not summary_path.exists():
                notes.append(f"{step_dir}: no summary.json (not evaluated yet) - skipped.")
                continue
            summary, recs = load_summary(summary_path, step)
            if summary.get("complete", True) is False:
                notes.append(f"{summary_path}: marked incomplete - skipped.")
                continue
            recorded = summary.get("eval")
            if isinstance(recorded, dict):
                check_settings((run_dir / "run.json", settings), (summary_path, recorded))
            summaries[(run.name, step)] = summary
            stages[(run.name, step)] = str((recorded or {}).get("stage", FULL))
            for rec in recs:
                rec.update(run=run.name, shape=run.shape, seed=run.seed, horizon=run.horizon)
            records.extend(recs)
    if not records:
        raise ResultsError(
            f"{root}: no complete checkpoint found (expected OUT/<run>/global_step_<N>/summary.json). "
            "Fix: run the eval harness first, or point --results at its output folder"
        )
    frame = pd.DataFrame.from_records(records)
    suite = order_benchmarks(frame["benchmark"])
    counts = frame.groupby(["run", "step"])["benchmark"].nunique()
    partial = counts[counts < len(suite)]
    for run, step in partial.index:
        have = set(frame[(frame["run"] == run) & (frame["step"] == step)]["benchmark"])
        missing = ", ".join(benchmark_label(b) for b in suite if b not in have)
        notes.append(f"{runs[run].path / step_dir_name(step)}: lacks {missing} - skipped from every table.")
        del summaries[(run, step)]
        del stages[(run, step)]
    if len(partial):
        keep = ~frame.set_index(["run", "step"]).index.isin(partial.index)
        frame = frame[keep]
    columns = [
        "run",
        "shape",
        "seed",
        "horizon",
        "step",
        "benchmark",
        "n",
        *metric_names(),
        "abort_rate",
        "searches_mean",
        *([JUDGE] if JUDGE in frame.columns else []),
    ]
    scores = _with_averages(frame[columns], suite)[columns]
    scores = scores.sort_values(["seed", "shape", "run", "step"], kind="stable").reset_index(drop=True)
    return Results(root, runs, scores, suite, notes, summaries, stages)


def _questions(run_dir: Path) -> set[str]:
    """Normalised questions of every ``global_step_*/rows.jsonl`` under ``run_dir``."""
    out: set[str] = set()
    for rows_path in run_dir.glob(f"{step_dir_name('*')}/rows.jsonl"):
        out |= {normalize_answer(r.get("question", "")) for r in read_rows(rows_path) if r.get("question")}
    return out


def check_disjoint(test: Results, val: Results) -> None:
    """Raise ResultsError if a run evaluated in both ``test`` and ``val`` shares a question
    (compared after answer normalisation: case, punctuation, articles) between the two."""
    in_val = {run.name for run in val.evaluated_runs()}
    for run in test.evaluated_runs():
        if run.name not in in_val:
            continue
        shared = _questions(run.path) & _questions(val.runs[run.name].path)
        if shared:
            example = sorted(shared)[0]
            raise ResultsError(
                f"validation suite is not disjoint from the test suite for run {run.name}: {len(shared)} "
                f"shared question(s), e.g. {example!r}; build the validation split from rows outside the "
                "test files"
            )


ROW_FIX = (
    f"each line must be a JSON object with benchmark, {', '.join(metric_names())} (and searches, termination, "
    "prediction for the search profile); re-run the eval harness for this checkpoint"
)


def load_rows(path: Path) -> pd.DataFrame:
    """Per-question rows of one checkpoint as a DataFrame.

    Columns: ``benchmark`` (canonical), ``id``, each registered metric (``em``, ``f1``, ``acc``: floats in [0, 1]),
    ``searches`` (int, -1 when absent), ``termination`` (str, "" when absent), ``answered`` (bool:
    a prediction was extracted). A question appearing twice keeps its first line, as
    :func:`eval.schema.read_rows` does (the runner never writes a key twice). Blank lines are ignored; any other malformed line raises naming ``file:line``.
    """
    records = []
    for lineno, row in iter_jsonl(path, ROW_FIX, ResultsError):
        where = Path(f"{path}:{lineno}")
        bench = _require(row, "benchmark", str, where, ROW_FIX)
        rec = {"benchmark": canonical_benchmark(bench), "id": str(row.get("id", f"line{lineno}"))}
        for metric in metric_names():
            rec[metric] = _as_fraction(
                _require(row, metric, (int, float), where, ROW_FIX), metric, where, ROW_FIX
            )
        searches = row.get("searches")
        rec["searches"] = searches if isinstance(searches, int) and not isinstance(searches, bool) else -1
        rec["termination"] = str(row.get("termination") or "")
        prediction = row.get("prediction")
        rec["answered"] = isinstance(prediction, str)
        records.append(rec)
    frame = pd.DataFrame.from_records(
        records, columns=["benchmark", "id", *metric_names(), "searches", "termination", "answered"]
    )
    return frame.drop_duplicates(["benchmark", "id"], keep="first").reset_index(drop=True)


LOG_FIX = (
    "pass verl file-logger JSONL (trainer.logger includes 'file'; one line "
    '{"step": N, "data": {metric: value}} per step)'
)


def load_training_log(path: Path) -> pd.DataFrame:
    """One verl file-logger JSONL as a tidy frame ``step, metric, value``.

    Non-numeric values are dropped. When a step appears more than once (a resumed run appending to
    the same file) the last value logged for each (step, metric) wins.
    """
    records = []
    for lineno, entry in iter_jsonl(path, LOG_FIX, ResultsError):
        if not isinstance(entry, dict) or not isinstance(entry.get("data"), dict):
            raise ResultsError(f"{path}:{lineno}: no 'data' object. Fix: {LOG_FIX}")
        step = entry.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ResultsError(f"{path}:{lineno}: 'step' = {step!r} is not an integer. Fix: {LOG_FIX}")
        for metric, value in entry["data"].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                records.append((step, metric, float(value)))
    frame = pd.DataFrame.from_records(records, columns=["step", "metric", "value"])
    return (
        frame.drop_duplicates(["step", "metric"], keep="last")
        .sort_values(["metric", "step"])
        .reset_index(drop=True)
    )


RUN_DIR_LOG = "metrics.jsonl"
"""``launch/run.sh`` writes a run's training log to ``runs/<run>/metrics.jsonl``."""


def _log_run_name(path: Path) -> str:
    """The run a log file names: its folder for ``<run>/metrics.jsonl``, else its stem."""
    return path.parent.name if path.name == RUN_DIR_LOG else path.stem


def _expand_log_args(specs: Sequence[str]) -> list[tuple[str | None, Path]]:
    """``RUN=PATH`` binds a file to a run; a bare file names its run (``_log_run_name``); a folder adds
    every ``<run>/metrics.jsonl`` below it, or, when it holds none, its own ``*.jsonl`` files."""
    found: list[tuple[str | None, Path]] = []
    for spec in specs:
        name, sep, target = spec.partition("=")
        bound, path = (name, Path(target)) if sep and not Path(spec).exists() else (None, Path(spec))
        if path.is_dir():
            logs = sorted(path.rglob(RUN_DIR_LOG)) or sorted(path.glob("*.jsonl"))
            found.extend((bound, p) for p in logs)
        elif path.is_file():
            found.append((bound, path))
        else:
            raise ResultsError(
                f"{path}: training log not found. Fix: pass existing files or folders to --logs"
            )
    return found


def load_training_logs(specs: Sequence[str], runs: dict[str, Run]) -> pd.DataFrame:
    """Load training logs and attach each to a run: tidy ``run, shape, seed, step, metric, value``.

    A log belongs to the run named by ``RUN=PATH``, else to the run named by the file
    (``runs/<run>/metrics.jsonl`` from launch/run.sh, or verl's default ``<experiment_name>.jsonl``), else to ``<shape>_s<seed>`` parsed from the
    stem (the recipe naming). Anything else raises naming the file.
    """
    frames = []
    for bound, path in _expand_log_args(specs):
        name = bound or _log_run_name(path)
        if name in runs:
            run = runs[name]
            shape, seed = run.shape, run.seed
        elif bound is None and (m := RUN_NAME.fullmatch(name)):
            shape, seed = m.group("shape"), int(m.group("seed"))
        else:
            raise ResultsError(
                f"{path}: cannot tell which run this log belongs to (known runs: {sorted(runs)}). "
                "Fix: name it <run>/metrics.jsonl, <run>.jsonl or <shape>_s<seed>.jsonl, or pass it as RUN=PATH"
            )
        frame = load_training_log(path)
        frames.append(frame.assign(run=name, shape=shape, seed=seed))
    columns = ["run", "shape", "seed", "step", "metric", "value"]
    if not frames:
        return pd.DataFrame(columns=columns)
    logs = pd.concat(frames, ignore_index=True)[columns]
    return logs.drop_duplicates(["run", "step", "metric"], keep="last").reset_index(drop=True)
