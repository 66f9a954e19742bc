"""``python -m study report``: the paper-style report of each results tree the study produced, the
regimes report when the file asks for it, and ``study.md`` (every cell's numbers by axis level and the
tests stated in the file). Everything is read from raw files, so it regenerates byte for byte.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from eval.report.document import main as eval_report
from eval.report.results import SETTINGS_FIX, ResultsError, load_results, load_training_logs, run_settings
from eval.report.select import resolve_matched_horizon
from eval.report.tables import order_shapes
from eval.schema import differences, mismatch_message
from eval.stats import seed_ci
from search_env.markdown import markdown_table
from search_env.paths import repo_path
from search_env.safe_fs import write_atomic
from study import regimes, transfer
from study.hypotheses import METRICS, Gap, LastPlace, axis_column, gap_lines, last_place_lines, parse_tests
from study.spec import Cell, Study, axis_value
from study.store import Layout, raw_complete, reuse_root, tree_root

EVICTED = "training/filter_groups/evicted_samples"
SURPLUS = "training/filter_groups/discarded_surplus_samples"
GROUPS = "grpo/groups"
AXIS_SETTINGS = {"top_k": "top-k", "retriever": "retriever"}
"""Evaluation settings that differ between cells by design when the study varies that axis."""


@dataclass(frozen=True)
class Source:
    """Where one cell's raw results live: ``root/{test,val}/<cell>`` and its training log."""

    root: Path
    log: Path
    reused: bool


def rel(path: Path) -> str:
    """``path`` relative to the working directory when below it (reports quote it)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def sources(study: Study, where: Layout) -> dict[str, Source]:
    """Each cell's raw results: a ``reuse`` export, the study's export, or its results folder; cells
    with none are left out (not run yet)."""
    out = {}
    for cell in study.cells:
        for export in study.spec.reuse:
            root = reuse_root(repo_path(export), cell)
            if root is not None:
                out[cell.name] = Source(root, root / "logs" / cell.name / "metrics.jsonl", True)
                break
        else:
            if where.export is not None and raw_complete(tree_root(where.export, cell.tree), cell):
                root = tree_root(where.export, cell.tree)
                out[cell.name] = Source(root, root / "logs" / cell.name / "metrics.jsonl", False)
            elif (where.results_of(cell) / "test" / cell.name).is_dir():
                out[cell.name] = Source(
                    where.results_of(cell), where.runs / cell.name / "metrics.jsonl", False
                )
    return out


def _log_steps(logs: pd.DataFrame, run: str, metric: str, matched: int) -> pd.Series:
    sel = logs[(logs["run"] == run) & (logs["metric"] == metric) & logs["step"].between(1, matched)]
    return sel.set_index("step")["value"]


def sampling_columns(logs: pd.DataFrame, run: str, group: int, matched: int) -> tuple[float, float]:
    """(tied-group fraction of the generated groups, rollouts generated per step), means over steps
    1..``matched``. With dynamic sampling, verl's ``evicted_samples`` and ``discarded_surplus_samples``
    count groups (uids), not rollouts: the evicted groups are the tied ones (refilled, never trained on),
    the surplus ones finished untied after the batch was full (docs/studies.md)."""
    if logs.empty:
        return math.nan, math.nan
    groups = _log_steps(logs, run, GROUPS, matched)
    if groups.empty:
        return math.nan, math.nan
    zero = _log_steps(logs, run, regimes.ZERO_VAR, matched).reindex(groups.index).fillna(0.0)
    evicted = _log_steps(logs, run, EVICTED, matched).reindex(groups.index).fillna(0.0)
    surplus = _log_steps(logs, run, SURPLUS, matched).reindex(groups.index).fillna(0.0)
    generated = groups + evicted + surplus
    ties = (evicted + zero * groups) / generated
    return float(ties.mean()), float((generated * group).mean())


def cells_frame(study: Study, where: Layout, matched: int) -> pd.DataFrame:
    """One row per evaluated cell: the regimes report's columns plus tree, axis values, ties and
    rollouts per step (``study_cells.csv``)."""
    found = sources(study, where)
    by_root: dict[Path, list[Cell]] = {}
    for cell in study.cells:
        if cell.name in found:
            by_root.setdefault(found[cell.name].root, []).append(cell)
    axes = sorted({a for c in study.cells for a in c.axes} - {"shape", "seed"})
    check_comparable(by_root, {AXIS_SETTINGS[a] for a in axes if a in AXIS_SETTINGS})
    frames = []
    for root, cells in by_root.items():
        results = load_results(root / "test")
        names = [c.name for c in cells]
        bound = [f"{n}={found[n].log}" for n in names if found[n].log.is_file()]
        log_frame = load_training_logs(bound, results.runs) if bound else pd.DataFrame()
        frame = regimes.cells(regimes.Tree(study.name, results, log_frame), matched)
        frame = frame[frame["run"].isin(names)].copy()
        for cell in cells:
            at = frame["run"] == cell.name
            frame.loc[at, "tree"] = cell.tree
            frame.loc[at, "shape"] = cell.shape
            for axis in axes:
                frame.loc[at, f"axis:{axis}"] = str(axis_value(cell, axis))
            group = int(axis_value(cell, "group_size") or 5)
            ties, rollouts = sampling_columns(log_frame, cell.name, group, matched)
            frame.loc[at, "ties"] = ties
            frame.loc[at, "rollouts_per_step"] = rollouts
        frames.append(frame)
    if not frames:
        raise ResultsError(
            f"{study.path.name}: no cell has results yet. Fix: python -m study run {rel(study.path)}"
        )
    order = {c.name: i for i, c in enumerate(study.cells)}
    frame = pd.concat(frames, ignore_index=True)
    return frame.sort_values("run", key=lambda s: s.map(order)).reset_index(drop=True)


def check_comparable(by_root: dict[Path, list[Cell]], varied: set[str]) -> None:
    """ResultsError unless every results folder (own and reused) was evaluated with the same settings,
    but for those an axis of the study varies (``varied``)."""
    reference: tuple[str, dict] | None = None
    for root, cells in by_root.items():
        where = root / "test" / cells[0].name / "run.json"
        settings = run_settings(where.parent)
        if reference is None:
            reference = (rel(where), settings)
            continue
        diffs = [d for d in differences(reference[1], settings) if d[0] not in varied]
        if diffs:
            raise ResultsError(mismatch_message(reference[0], rel(where), diffs, SETTINGS_FIX))


def _order(column: str, value: object, rank: dict[str, int]) -> tuple[float, str]:
    """Sort key of a level: shapes in the report's order, numbers by value, other text by name."""
    if column == "shape":
        return float(rank.get(str(value), len(rank))), ""
    try:
        return float(str(value)), ""
    except ValueError:
        return math.inf, str(value)


def levels_markdown(frame: pd.DataFrame, n_boot: int, compare: str) -> str:
    """One row per setting of the study's axes (seeds pooled): mean (seed 95 % CI) of each metric of
    ``METRICS``. Rows that differ only in the ``compare`` axis stand next to each other."""
    axes = [c for c in frame.columns if c.startswith("axis:")]
    col = axis_column(compare)
    keys = [c for c in ["shape", *axes] if c != col] + [col]
    rank = {s: i for i, s in enumerate(order_shapes(frame["shape"].unique()))}
    rows = []
    for key, sub in frame.groupby(keys, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        name = "/".join(str(k) for k in key)
        sub = sub.sort_values("seed")
        row = [str(k) for k in key] + [str(len(sub))]
        for metric in METRICS:
            values = [float(v) for v in sub[metric]]
            low, high = seed_ci(values, n_boot, f"level/{name}/{metric}")
            mean = float(np.nanmean(values)) if not all(math.isnan(v) for v in values) else math.nan
            ci = "" if math.isnan(low) else f" [{low:.3f}, {high:.3f}]"
            row.append(regimes.num_text(mean) + ci)
        rows.append((tuple(_order(c, k, rank) for c, k in zip(keys, key, strict=True)), row))
    header = [c.removeprefix("axis:") for c in keys] + ["seeds", *METRICS]
    return markdown_table(header, [r for _, r in sorted(rows, key=lambda x: x[0])])


def study_markdown(study: Study, frame: pd.DataFrame, matched: int, n_boot: int) -> str:
    """``study.md``: the cells by level, then each stated test with its numbers."""
    tests = parse_tests(study.spec.tests, {a for c in study.cells for a in c.axes})
    lines = [
        f"# Study {study.name}",
        "",
        f"Generated by `python -m study report {rel(study.path)}` from the raw results. Matched horizon: "
        f"step {matched}; 95 % CIs are percentile intervals of {n_boot} resamples of the seeds.",
        "",
        "## Metrics by setting (seeds pooled)",
        "",
        levels_markdown(frame, n_boot, study.spec.report.compare).rstrip("\n"),
        "",
        "Metrics: " + "; ".join(f"`{k}` = {v}" for k, v in METRICS.items()) + ".",
        "",
        "## Tests stated in the study file",
        "",
    ]
    for test in tests:
        if isinstance(test, LastPlace):
            lines += last_place_lines(frame, test)
        elif isinstance(test, Gap):
            lines += gap_lines(frame, test, n_boot)
    if not tests:
        lines.append("- none stated.")
    return "\n".join(lines) + "\n"


def _report_args(root: Path, logs: list[str], n_boot: int, horizon: str) -> list[str]:
    args = [
        "--results",
        rel(root / "test"),
        "--logs",
        *logs,
        "--matched-horizon",
        horizon,
        "--bootstrap",
        str(n_boot),
    ]
    if (root / "val").is_dir():
        args += ["--val-results", rel(root / "val")]
    return args


def write_study_report(study: Study, where: Layout, out: Path | None = None, draw: bool = True) -> list[Path]:
    """Write every report of the study under ``out`` (default ``EXPORT/report``, else
    ``results/<name>/report``); ``draw`` False: tables only, no PNG drawn (each still listed)."""
    no_figures = [] if draw else ["--no-figures"]
    spec = study.spec.report
    default = (where.export / "report") if where.export else where.results / "report"
    out = out or default
    record = (
        where.export is not None and out.resolve() == default.resolve()
    )  # report_args*.txt beside the export
    out.mkdir(parents=True, exist_ok=True)
    found = sources(study, where)
    written: list[Path] = []
    for tree in study.trees:
        own = [c for c in study.cells if c.tree == tree and c.name in found and not found[c.name].reused]
        if not own:
            continue
        roots = {found[c.name].root for c in own}
        if len(roots) != 1:
            raise ResultsError(
                f"tree {tree or 'main'}: cells in {sorted(map(str, roots))}. Fix: export the study"
            )
        root = roots.pop()
        exported = where.export is not None and root == tree_root(where.export, tree)
        logs = [rel(root / "logs")] if exported else [rel(found[c.name].log) for c in own]
        args = _report_args(root, logs, spec.bootstrap, spec.matched_horizon)
        if record:
            write_atomic(
                where.export / f"report_args{'_' + tree if tree else ''}.txt", shlex.join(args) + "\n"
            )
        target = out / tree if tree else out
        if eval_report([*args, "--out", rel(target), *no_figures]) != 0:
            raise ResultsError(
                f"tree {tree or 'main'}: `python -m eval report {' '.join(args)}` failed (above)"
            )
        written.append(target / "index.md")
    tests = parse_tests(study.spec.tests, {a for c in study.cells for a in c.axes})
    if spec.regimes is not None and where.export is not None:
        last = next((t.shape for t in tests if isinstance(t, LastPlace)), None)
        gap = next((t for t in tests if isinstance(t, Gap) and t.axis == "shape"), None)
        if last is None or gap is None:
            raise ResultsError(
                "report.regimes: needs a {last_place: SHAPE} and a shape gap test in tests. Fix: state them"
            )
        args = [
            "--dense", rel(repo_path(spec.regimes.dense) / "raw"), "--sparse", rel(where.export / "raw"),
            "--bootstrap", str(spec.bootstrap), "--last-place", last, "--gap", str(gap.better), str(gap.worse),
        ]  # fmt: skip
        if gap.labelled:
            args += ["--gap-meaning", gap.label]
        if record:
            write_atomic(where.export / "report_args_regimes.txt", shlex.join(args) + "\n")
        if regimes.main([*args, "--out", rel(out / "regimes"), *no_figures]) != 0:
            raise ResultsError(f"`python -m study.regimes {' '.join(args)}` failed (above)")
        written.append(out / "regimes" / "index.md")
    horizons = [c.cap for c in study.cells if c.name in found]
    matched = resolve_matched_horizon(spec.matched_horizon, horizons)
    frame = cells_frame(study, where, matched)
    frame.to_csv(out / "study_cells.csv", index=False, float_format="%.6f")
    (out / "study.md").write_text(study_markdown(study, frame, matched, spec.bootstrap), encoding="utf-8")
    written += [out / "study_cells.csv", out / "study.md"]
    if spec.transfer:
        written += write_transfer_report(study, found, matched, spec.bootstrap, out)
    return written


def write_transfer_report(
    study: Study, found: dict[str, Source], matched: int, n_boot: int, out: Path
) -> list[Path]:
    """``transfer.md`` and ``transfer_types.csv`` (``study.transfer``) over the cells of ``found``."""
    by_root: dict[Path, list[str]] = {}
    for cell in study.cells:
        if cell.name in found:
            by_root.setdefault(found[cell.name].root, []).append(cell.name)
    frames = [
        transfer.transfer_frame(load_results(root / "test"), names, matched)
        for root, names in by_root.items()
    ]
    frame = pd.concat(frames, ignore_index=True)
    if frame.empty:
        raise ResultsError(
            f"report.transfer: no cell has rows at step 0 and at the matched horizon (step {matched}). "
            f"Fix: python -m study run {rel(study.path)}"
        )
    frame.to_csv(out / "transfer_types.csv", index=False, float_format="%.6f")
    (out / "transfer.md").write_text(transfer.transfer_markdown(frame, matched, n_boot), encoding="utf-8")
    return [out / "transfer_types.csv", out / "transfer.md"]
