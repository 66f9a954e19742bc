"""``python -m eval plan``: the rows per benchmark a sequential plan confirms for a precision, from
the study's sizes, a suite's, or an earlier results folder's sizes and EM levels (docs/evaluation.md,
"Sequential plan")."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from eval.report.results import load_results
from eval.run import sequential as seq
from eval.run.suite import load_suite
from reward_fns import PRIMARY
from search_env.benchmarks import STUDY_FLOOR, STUDY_SIZES, canonical_benchmark
from search_env.markdown import markdown_table


def levels_from_results(root: Path) -> tuple[dict[str, int], dict[str, float]]:
    """Benchmark sizes (the suite recorded in each run.json) and the mean per-benchmark EM of every
    complete checkpoint under a results folder."""
    res = load_results(root)
    frame = res.scores[res.scores["benchmark"].isin(res.suite)]
    p = frame.groupby("benchmark")[PRIMARY].mean().to_dict()
    sizes: dict[str, int] = {}
    for run in res.runs.values():
        recorded = json.loads((run.path / "run.json").read_text()).get("eval", {}).get("benchmarks") or {}
        sizes.update({canonical_benchmark(b): int(n) for b, n in recorded.items()})
    missing = sorted(set(p) - set(sizes))
    if missing:
        raise ValueError(f"{root}: run.json records no size for {missing}; pass --suite instead")
    return {b: sizes[b] for b in p}, p


def plan_table(halfwidth: float, sizes: Mapping[str, int], p: Mapping[str, float]) -> str:
    """Markdown: rows per benchmark for ``halfwidth``, the total and its share of the full suite."""
    n = seq.rows_for_halfwidth(halfwidth, p, sizes)
    total, full = sum(n.values()), sum(sizes.values())
    rows = [(b, n[b], sizes[b], f"{p[b]:.3f}") for b in sizes]
    rows.append(("**total**", f"**{total}**", full, f"share of full-suite rows: **{total / full:.1%}**"))
    table = markdown_table(("benchmark", "rows", "of", "EM used"), rows)
    return f"95 % half-width {halfwidth} (macro EM) against the full-suite value:\n\n{table}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m eval plan --halfwidth H [--suite S | --results OUT]``."""
    parser = argparse.ArgumentParser(prog="python -m eval plan", description=main.__doc__)
    parser.add_argument("--halfwidth", type=float, default=seq.HALFWIDTH, help="95 %% half-width, macro EM")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--suite", help="a suite (sizes from its files); EM levels: the study's floor")
    src.add_argument("--results", type=Path, help="a results folder: its suite and per-benchmark EMs")
    parser.add_argument("--em", type=float, help="one EM level for every benchmark instead")
    args = parser.parse_args(argv)
    try:
        if args.results is not None:
            sizes, p = levels_from_results(args.results)
        elif args.suite is not None:
            sizes = load_suite(args.suite).sizes()
            p = {b: STUDY_FLOOR.get(b, sum(STUDY_FLOOR.values()) / len(STUDY_FLOOR)) for b in sizes}
        else:
            sizes, p = dict(STUDY_SIZES), dict(STUDY_FLOOR)
        if args.em is not None:
            p = dict.fromkeys(sizes, args.em)
        print(plan_table(args.halfwidth, sizes, p))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
