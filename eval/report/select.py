"""Checkpoint selection (paper §5.3): the rules ``own``, ``matched``, ``val_own`` and ``val_matched``
(:func:`select_checkpoints`, which ``python -m eval report`` tabulates), and ``python -m eval select``:
each run's selected checkpoints as a JSON document and a table (docs/evaluation.md, "python -m eval
select"). Reads result folders written by ``python -m eval run`` (:func:`eval.report.results.load_results`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from eval.report.results import AVG_ALL, check_disjoint, load_results
from eval.schema import write_json_atomic
from reward_fns import PRIMARY, metric_named, metric_names
from search_env.markdown import markdown_table
from search_env.paths import repo_relative

MATCHED = "matched"
OWN = "own"
VAL_RULES = {MATCHED: "val_matched", OWN: "val_own"}
"""The validation-chosen rule of each test-chosen rule (same candidate steps)."""
MATCHED_HORIZON = 180
"""The study's common step cap."""
AUTO = "auto"


def horizon_arg(text: str) -> int | str:
    """argparse type of ``--matched-horizon``: a positive step count or ``auto``."""
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive step count or 'auto', got {text!r}")
    return value


def resolve_matched_horizon(value: int | str, horizons: Iterable[int | None]) -> int:
    """The matched horizon in steps: ``value`` itself, or for ``auto`` the smallest known run
    horizon (``None`` = uncapped runs are ignored). Raises ValueError when ``auto`` finds no horizon."""
    if value != AUTO:
        return int(value)
    known = [int(h) for h in horizons if h is not None]
    if not known:
        raise ValueError(
            "--matched-horizon auto needs runs with a known horizon (run.json 'horizon'); pass a number"
        )
    return min(known)


def _best_step(values: pd.Series, higher_is_better: bool = True) -> int:
    """The step (index of ``values``) with the best value (the highest, or the lowest when not
    ``higher_is_better``), the earliest on a tie."""
    ordered = values.sort_index()  # idxmax/idxmin return the first (earliest) extreme
    return int(ordered.idxmax() if higher_is_better else ordered.idxmin())


def select_checkpoints(
    scores: pd.DataFrame,
    matched_horizon: int = MATCHED_HORIZON,
    criterion: str = AVG_ALL,
    metric: str = PRIMARY,
    val_scores: pd.DataFrame | None = None,
) -> tuple[pd.DataFrame, list[str]]:
    """Best checkpoint per run and rule, by ``metric`` (a registered metric: em, f1 or acc, a
    fraction in [0, 1]; best = highest unless the registry says lower is better) of the
    ``criterion`` average (AVG_ALL or AVG_HELDOUT); ``scores`` and ``val_scores`` are
    :attr:`eval.report.results.Results.scores` frames.

    Returns (frame, notes); the frame has one row per (run, rule) with ``run, shape, seed, rule,
    cap, step, last_step, short, value, val_value``: ``cap`` (steps) is ``min(matched_horizon,
    horizon)`` for the matched rule and ``horizon`` for the own rule (checkpoints beyond a run's
    horizon are never selected); ``last_step`` is the run's last evaluated trained step within its
    horizon, ``short`` is True when it is below ``matched_horizon`` (a run that ended early, or
    whose later checkpoints are not evaluated); ``value`` is the chosen step's score on ``scores``.
    With ``val_scores``, each rule also gets a ``val_matched`` / ``val_own`` row: the candidate
    step present in ``val_scores`` (same run name) with the best validation score, which is
    ``val_value`` (NaN on the test-chosen rows). A rule with no candidate step gets no row and a note.
    Only a run's checkpoints with the most rows are candidates (under the sequential plan, those it
    confirmed), so every comparison is on the same questions.
    """
    if metric not in metric_names():
        raise ValueError(f"--metric {metric!r} is unknown; use one of {metric_names()}")
    higher = metric_named(metric).higher_is_better
    crit = scores[(scores["benchmark"] == criterion) & (scores["step"] >= 1)]
    val = None
    if val_scores is not None:
        val = val_scores[val_scores["benchmark"] == criterion].set_index(["run", "step"])[metric]
    name = metric.upper()
    rows, notes = [], []
    for run, sub in crit.groupby("run", sort=True):
        most = sub["n"].max()
        if pd.notna(most) and (sub["n"] < most).any():  # a sequential plan: its confirmed checkpoints
            dropped = sorted(int(s) for s in sub.loc[sub["n"] < most, "step"])
            notes.append(
                f"run {run}: steps {dropped} were only screened (fewer rows); chosen among the "
                f"{int((sub['n'] == most).sum())} confirmed on {int(most)} rows."
            )
            sub = sub[sub["n"] == most]
        first = sub.iloc[0]
        horizon = int(first["horizon"])
        within, beyond = sub[sub["step"] <= horizon], sub[sub["step"] > horizon]
        if len(beyond):
            best = beyond.loc[beyond[metric].idxmax() if higher else beyond[metric].idxmin()]
            notes.append(
                f"run {run}: {len(beyond)} checkpoint(s) beyond its horizon {horizon} ignored by both rules "
                f"(best of them: step {int(best['step'])}, {name} {best[metric]:.3f})."
            )
        for rule, cap in ((MATCHED, min(matched_horizon, horizon)), (OWN, horizon)):
            eligible = within[within["step"] <= cap].set_index("step")[metric]
            if eligible.empty:
                notes.append(f"run {run}: no evaluated trained checkpoint with step <= {cap} ({rule} rule).")
                continue
            last_step = int(within["step"].max())
            cell = {
                "run": run,
                "shape": first["shape"],
                "seed": int(first["seed"]),
                "cap": cap,
                "last_step": last_step,
                "short": last_step < matched_horizon,
            }
            step = _best_step(eligible, higher)
            rows.append({**cell, "rule": rule, "step": step, "value": float(eligible[step])})
            if val is None:
                continue
            on_val = val[val.index.get_level_values("run") == run].droplevel("run")
            on_val = on_val[on_val.index.isin(eligible.index)]
            if on_val.empty:
                notes.append(
                    f"run {run}: no validation checkpoint with step <= {cap} ({VAL_RULES[rule]} rule)."
                )
                continue
            step = _best_step(on_val, higher)
            rows.append(
                {
                    **cell,
                    "rule": VAL_RULES[rule],
                    "step": step,
                    "value": float(eligible[step]),
                    "val_value": float(on_val[step]),
                }
            )
    columns = ["run", "shape", "seed", "rule", "cap", "step", "last_step", "short", "value", "val_value"]
    return pd.DataFrame(rows, columns=columns), notes


def floor_checkpoints(scores: pd.DataFrame) -> pd.DataFrame:
    """Step-0 (untrained) checkpoint per seed: ``seed, run`` — the first run (by name) with step 0."""
    zero = scores[scores["step"] == 0][["seed", "run"]].drop_duplicates().sort_values(["seed", "run"])
    return zero.drop_duplicates("seed").reset_index(drop=True)


STAGE_MARKS = {"full": "", "confirmed": "ᶜ", "screened": "ˢ"}
"""How a number's stage is marked in tables (eval.run.runner): unmarked = every row of the suite."""


def stage_caption(stages: Iterable[str]) -> str | None:
    """Caption line explaining the stage marks present, or None when every number is full-suite."""
    present = sorted(set(stages) - {"full"})
    if not present:
        return None
    said = {
        "confirmed": "ᶜ = confirmed on a nested subsample (`plan.json`: rows, target half-width against the "
        "full-suite value); the checkpoint was chosen on the same rows, which overstates its expected EM "
        "by about 0.004 (bench/eval_plan.py's simulation; docs/evaluation.md)",
        "screened": "ˢ = screened only (a few hundred rows per benchmark): read it as a ranking, not a score",
    }
    return "- " + "; ".join(said.get(s, f"{s} = stage {s}") for s in present) + "."


def _pick(summary: dict[str, Any], step: int, metric: str) -> dict[str, Any]:
    """One selected checkpoint as the JSON document reports it: its summary.json's macro ``metric``
    (``score``, a fraction in [0, 1]), its ``macro`` and its per-benchmark ``benchmarks``."""
    return {
        "step": step,
        "stage": (summary.get("eval") or {}).get("stage", "full"),
        "score": summary["macro"][metric],
        "macro": summary["macro"],
        "benchmarks": summary["benchmarks"],
    }


def selection_document(
    results: Path,
    val_results: Path | None = None,
    metric: str = PRIMARY,
    matched_horizon: int | str = MATCHED_HORIZON,
) -> dict[str, Any]:
    """The selection document of every run under ``results``: its floor and its pick under each rule
    (validation rules only where ``val_results`` has the run). ``matched_horizon`` (steps) may be ``"auto"``: the smallest known horizon of the
    evaluated runs. Raises ValueError (:class:`eval.report.results.ResultsError` for bad input files) on
    an unknown metric, unreadable results, or validation rows sharing a question with test rows."""
    if metric not in metric_names():
        raise ValueError(f"--metric {metric!r} is unknown; use one of {metric_names()}")
    test = load_results(results)
    val = load_results(val_results) if val_results is not None else None
    if val is not None:
        check_disjoint(test, val)
    matched = resolve_matched_horizon(matched_horizon, (r.known_horizon for r in test.evaluated_runs()))
    picks, _ = select_checkpoints(test.scores, matched, AVG_ALL, metric, None if val is None else val.scores)
    chosen = {(p.run, p.rule): int(p.step) for p in picks.itertuples()}
    in_val = set() if val is None else {r.name for r in val.evaluated_runs()}
    runs: dict[str, Any] = {}
    for run in test.evaluated_runs():
        steps = sorted(int(s) for s in test.scores.loc[test.scores["run"] == run.name, "step"].unique())
        summaries = {s: test.summaries[(run.name, s)] for s in steps}
        entry: dict[str, Any] = {
            "shape": run.shape,
            "seed": run.seed,
            "horizon": run.known_horizon,
            "steps_evaluated": steps,
            "floor": _pick(summaries[0], 0, metric) if 0 in summaries else None,
        }
        for rule in (OWN, MATCHED):
            step = chosen.get((run.name, rule))
            entry[rule] = None if step is None else _pick(summaries[step], step, metric)
            if val is None or run.name not in in_val:
                continue
            step = chosen.get((run.name, VAL_RULES[rule]))
            entry[VAL_RULES[rule]] = (
                None
                if step is None
                else {
                    **_pick(summaries[step], step, metric),
                    "val_macro": val.summaries[(run.name, step)]["macro"],
                }
            )
        runs[run.name] = entry
    return {
        "metric": metric,
        "matched_horizon": matched,
        "results": repo_relative(results),
        "val_results": repo_relative(val_results) if val_results is not None else None,
        "runs": runs,
    }


def format_selection(selection: dict[str, Any]) -> str:
    """A markdown table of a :func:`selection_document`: one line per run, ``step: score`` per rule
    (scores to 3 decimals, marked by stage as in Table 1; ``-`` where a rule chose nothing)."""
    rules = [OWN, MATCHED, VAL_RULES[OWN], VAL_RULES[MATCHED]]
    metric = selection["metric"].upper()
    header = ["run", "shape", "seed", "horizon", f"floor {metric}"] + [f"{r} (step: {metric})" for r in rules]
    rows = []

    def score(pick: dict[str, Any]) -> str:
        return f"{pick['score']:.3f}{STAGE_MARKS.get(pick.get('stage', 'full'), '')}"

    def cell(pick: dict[str, Any] | None) -> str:
        return "-" if pick is None else f"{pick['step']}: {score(pick)}"

    for run, sel in selection["runs"].items():
        floor = "-" if sel["floor"] is None else score(sel["floor"])
        row = [run, str(sel["shape"]), str(sel["seed"]), str(sel["horizon"]), floor]
        rows.append(row + [cell(sel.get(r)) for r in rules])
    stages = [
        p.get("stage", "full")
        for sel in selection["runs"].values()
        for p in sel.values()
        if isinstance(p, dict)
    ]
    caption = stage_caption(stages)
    return (markdown_table(header, rows) + (caption or "")).rstrip()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m eval select`` (``argv`` excludes the ``select`` sub-command);
    returns 2 with a message on stderr when the input is unusable."""
    parser = argparse.ArgumentParser(prog="python -m eval select", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results", required=True, type=Path, help="test-suite results folder (eval run --out)"
    )
    parser.add_argument("--val-results", type=Path, help="validation-suite results folder of the same runs")
    parser.add_argument(
        "--metric",
        default=PRIMARY,
        choices=metric_names(),
        help=f"macro metric to maximise (default {PRIMARY})",
    )
    parser.add_argument(
        "--matched-horizon",
        type=horizon_arg,
        default=MATCHED_HORIZON,
        help="common step cap (default 180); auto = the smallest run horizon",
    )
    parser.add_argument("--json", type=Path, help="selection JSON path (default RESULTS/selection.json)")
    args = parser.parse_args(argv)
    try:
        selection = selection_document(args.results, args.val_results, args.metric, args.matched_horizon)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.json or args.results / "selection.json"
    write_json_atomic(out, selection)
    print(format_selection(selection))
    print(f"selection written to {out}")
    return 0
