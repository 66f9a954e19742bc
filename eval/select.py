"""Checkpoint selection (SPEC §7, paper §5.3): which step of each run to report.

Rules, each over a run's complete trained checkpoints (step >= 1; step 0, the untrained model,
is reported separately as ``floor``), maximising the macro average of ``--metric`` (EM by
default) and taking the earliest step on a tie:

- ``own``: steps within the run's own horizon (``run.json`` ``horizon``; all steps if unknown);
- ``matched``: steps <= the matched horizon (180, the study's common cap; ``auto`` = the smallest
  run horizon, e.g. a scaled-down study's shortest cap) and the own horizon;
- ``val_own`` / ``val_matched``: the same step sets, but the step is chosen by its macro score
  on the validation suite (``--val-results``) and then reported on the test suite — the
  independent rule the study lacked. The validation and test rows must not share a question.

Input: result folders written by ``python -m eval run`` (``OUT/<run>/global_step_N/summary.json``).
Output: a JSON document (``--json``) and a printed table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eval.store import RowStore, read_json, write_json_atomic
from reward_fns import normalize_answer

MATCHED_HORIZON = 180
METRICS = ("em", "f1", "acc")
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


def load_results(root: Path) -> dict[str, dict[str, Any]]:
    """``{run: {"info": run.json or {}, "steps": {step: summary}}}`` for complete summaries under ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"results folder {root} does not exist; run `python -m eval run --out {root}` first")
    runs: dict[str, dict[str, Any]] = {}
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        steps = {}
        for summary_path in run_dir.glob("global_step_*/summary.json"):
            summary = read_json(summary_path)
            if summary.get("complete"):
                steps[int(summary["step"])] = summary
        if steps:
            info_path = run_dir / "run.json"
            info = read_json(info_path) if info_path.is_file() else {}
            runs[run_dir.name] = {"info": info, "steps": dict(sorted(steps.items()))}
    return runs


def best_step(scores: dict[int, float]) -> int | None:
    """The step with the highest score, the earliest on a tie; None when there is none."""
    if not scores:
        return None
    top = max(scores.values())
    return min(s for s, v in scores.items() if v == top)


def _questions(run_root: Path) -> set[str]:
    out: set[str] = set()
    for rows_path in run_root.glob("global_step_*/rows.jsonl"):
        out |= {
            normalize_answer(r.get("question", "")) for r in RowStore(rows_path).rows() if r.get("question")
        }
    return out


def check_disjoint(test_root: Path, val_root: Path, run: str) -> None:
    """Raise ValueError if the validation rows of ``run`` share a (normalised) question with its test rows."""
    shared = _questions(test_root / run) & _questions(val_root / run)
    if shared:
        example = sorted(shared)[0]
        raise ValueError(
            f"validation suite is not disjoint from the test suite for run {run}: {len(shared)} shared "
            f"question(s), e.g. {example!r}; build the validation split from rows outside the test files"
        )


def _pick(summary: dict[str, Any], step: int, metric: str) -> dict[str, Any]:
    return {
        "step": step,
        "score": summary["macro"][metric],
        "macro": summary["macro"],
        "benchmarks": summary["benchmarks"],
    }


def select_run(
    test: dict[str, Any],
    val: dict[str, Any] | None,
    metric: str = "em",
    matched_horizon: int = MATCHED_HORIZON,
) -> dict[str, Any]:
    """The four selections (and the floor) of one run; see the module docstring."""
    if metric not in METRICS:
        raise ValueError(f"--metric {metric!r} is unknown; use one of {METRICS}")
    info = test["info"]
    horizon = info.get("horizon")
    steps = test["steps"]
    trained = [s for s in steps if s >= 1]
    own = [s for s in trained if horizon is None or s <= horizon]
    matched = [s for s in own if s <= matched_horizon]
    result: dict[str, Any] = {
        "shape": info.get("shape"),
        "seed": info.get("seed"),
        "horizon": horizon,
        "steps_evaluated": sorted(steps),
        "floor": _pick(steps[0], 0, metric) if 0 in steps else None,
    }
    for name, candidates in (("own", own), ("matched", matched)):
        step = best_step({s: steps[s]["macro"][metric] for s in candidates})
        result[name] = _pick(steps[step], step, metric) if step is not None else None
        if val is None:
            continue
        val_steps = val["steps"]
        step = best_step({s: val_steps[s]["macro"][metric] for s in candidates if s in val_steps})
        if step is None:
            result[f"val_{name}"] = None
        else:
            result[f"val_{name}"] = {
                **_pick(steps[step], step, metric),
                "val_macro": val_steps[step]["macro"],
            }
    return result


def select(
    results: Path,
    val_results: Path | None = None,
    metric: str = "em",
    matched_horizon: int | str = MATCHED_HORIZON,
) -> dict[str, Any]:
    """Selections for every run under ``results`` (validation rules only where ``val_results`` has the run).
    ``matched_horizon`` may be ``"auto"``: the smallest run horizon (see :func:`resolve_matched_horizon`)."""
    test_runs = load_results(results)
    val_runs = load_results(val_results) if val_results is not None else {}
    matched_horizon = resolve_matched_horizon(
        matched_horizon, (t["info"].get("horizon") for t in test_runs.values())
    )
    runs = {}
    for run, test in test_runs.items():
        val = val_runs.get(run)
        if val is not None:
            check_disjoint(Path(results), Path(val_results), run)  # type: ignore[arg-type]
        runs[run] = select_run(test, val, metric, matched_horizon)
    return {
        "metric": metric,
        "matched_horizon": matched_horizon,
        "results": str(results),
        "val_results": str(val_results) if val_results is not None else None,
        "runs": runs,
    }


def format_table(selection: dict[str, Any]) -> str:
    """A markdown table: one line per run, ``step: score`` per rule."""
    rules = ["own", "matched", "val_own", "val_matched"]
    metric = selection["metric"].upper()
    header = ["run", "shape", "seed", "horizon", f"floor {metric}"] + [f"{r} (step: {metric})" for r in rules]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def cell(pick: dict[str, Any] | None) -> str:
        return "-" if pick is None else f"{pick['step']}: {pick['score']:.3f}"

    for run, sel in selection["runs"].items():
        floor = "-" if sel["floor"] is None else f"{sel['floor']['score']:.3f}"
        row = [run, str(sel["shape"]), str(sel["seed"]), str(sel["horizon"]), floor]
        row += [cell(sel.get(r)) for r in rules]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval select", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results", required=True, type=Path, help="test-suite results folder (eval run --out)"
    )
    parser.add_argument("--val-results", type=Path, help="validation-suite results folder of the same runs")
    parser.add_argument(
        "--metric", default="em", choices=METRICS, help="macro metric to maximise (default em)"
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
        selection = select(args.results, args.val_results, args.metric, args.matched_horizon)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not selection["runs"]:
        print(f"error: no complete summary.json under {args.results}", file=sys.stderr)
        return 2
    out = args.json or args.results / "selection.json"
    write_json_atomic(out, selection)
    print(format_table(selection))
    print(f"selection written to {out}")
    return 0
