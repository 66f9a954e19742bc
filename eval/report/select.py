"""``python -m eval select``: each run's selected checkpoints, as a JSON document and a table.

Reads result folders written by ``python -m eval run`` (:func:`eval.results.load_results`) and
applies the selection rules of :func:`eval.tables.select_checkpoints` (``own``, ``matched``,
``val_own``, ``val_matched``; docs/evaluation.md, "python -m eval select").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from eval.results import AVG_ALL, check_disjoint, load_results
from eval.store import write_json_atomic
from eval.tables import (
    MATCHED,
    MATCHED_HORIZON,
    OWN,
    STAGE_MARKS,
    VAL_RULES,
    horizon_arg,
    resolve_matched_horizon,
    select_checkpoints,
    stage_caption,
)
from reward_fns import PRIMARY, metric_names
from search_env.paths import repo_relative


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
    evaluated runs. Raises ValueError (:class:`eval.results.ResultsError` for bad input files) on
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
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def score(pick: dict[str, Any]) -> str:
        return f"{pick['score']:.3f}{STAGE_MARKS.get(pick.get('stage', 'full'), '')}"

    def cell(pick: dict[str, Any] | None) -> str:
        return "-" if pick is None else f"{pick['step']}: {score(pick)}"

    for run, sel in selection["runs"].items():
        floor = "-" if sel["floor"] is None else score(sel["floor"])
        row = [run, str(sel["shape"]), str(sel["seed"]), str(sel["horizon"]), floor]
        row += [cell(sel.get(r)) for r in rules]
        lines.append("| " + " | ".join(row) + " |")
    stages = [
        p.get("stage", "full")
        for sel in selection["runs"].values()
        for p in sel.values()
        if isinstance(p, dict)
    ]
    caption = stage_caption(stages)
    return "\n".join(lines + ([caption] if caption else []))


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
