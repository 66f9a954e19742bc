"""The report's uncertainty: bootstrap confidence intervals of each selected checkpoint, and the
ranking test with the seed ranges over the seeds (``bootstrap_ci.csv``, ``statistics.md``: docs/report.md,
"Outputs")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from eval.report.results import AVG_ALL, AVG_HELDOUT, Results, benchmark_label, load_rows
from eval.report.select import MATCHED, OWN
from eval.report.tables import FLOOR, format_ranking, frame_markdown, order_shapes, rule_label, seed_rankings
from eval.stats import RankingTest, bootstrap_macro, percentile_interval, ranking_test, stream_seed
from reward_fns import PRIMARY, metric_names
from search_env.benchmarks import IN_DISTRIBUTION


@dataclass
class Cell:
    """Rows of one selected checkpoint, loaded once for the bootstrap and the search profile."""

    run: str
    step: int
    rows: pd.DataFrame


def bootstrap_cells(
    results: Results, cells: pd.DataFrame, n_boot: int, seed: int, level: float
) -> tuple[pd.DataFrame, dict[tuple[str, int], Cell], list[str]]:
    """Bootstrap CIs for every (run, step) in ``cells``: tidy ``run, step, benchmark, metric, n,
    estimate, lo, hi`` (benchmark includes the two averages). Cells without rows.jsonl, or whose rows
    lack a benchmark, get no CI and a note; rows disagreeing with summary.json get a note."""
    suite = results.suite
    subsets = {AVG_ALL: suite, AVG_HELDOUT: [b for b in suite if b not in IN_DISTRIBUTION]}
    records, loaded, notes = [], {}, []
    names = list(metric_names())
    primary = names.index(PRIMARY)
    for run, step in sorted(set(zip(cells["run"], cells["step"], strict=True))):
        path = results.rows_path(run, int(step))
        if not path.exists():
            notes.append(f"{path}: missing - no confidence interval or search profile for this checkpoint.")
            continue
        rows = load_rows(path)
        loaded[(run, int(step))] = Cell(run, int(step), rows)
        groups = {b: rows.loc[rows["benchmark"] == b, names].to_numpy() for b in suite}
        empty = [benchmark_label(b) for b, g in groups.items() if len(g) == 0]
        if empty:
            notes.append(
                f"{path}: no rows for {', '.join(empty)} - no confidence interval for this checkpoint."
            )
            continue
        point = {b: g.mean(axis=0) for b, g in groups.items()}
        point.update(
            {name: np.mean([point[b] for b in members], axis=0) for name, members in subsets.items()}
        )
        summary = results.scores[(results.scores["run"] == run) & (results.scores["step"] == step)]
        in_summary = summary.set_index("benchmark")[PRIMARY]
        off = [benchmark_label(b) for b in suite if abs(in_summary.get(b, np.nan) - point[b][primary]) > 1e-6]
        if off:
            notes.append(
                f"{path}: {PRIMARY.upper()} from rows differs from summary.json on {', '.join(off)}."
            )
        draws = (
            bootstrap_macro(groups, subsets, n_boot, stream_seed(seed, run, int(step))) if n_boot > 0 else {}
        )
        for bench, est in point.items():
            lo, hi = percentile_interval(draws[bench], level) if draws else (np.full(len(names), np.nan),) * 2
            n = len(rows) if bench in subsets else len(groups[bench])
            for i, metric in enumerate(names):
                records.append((run, int(step), bench, metric, n, float(est[i]), float(lo[i]), float(hi[i])))
    columns = ["run", "step", "benchmark", "metric", "n", "estimate", "lo", "hi"]
    return pd.DataFrame(records, columns=columns), loaded, notes


def statistics_markdown(
    t1: pd.DataFrame, shapes: Sequence[str], criterion: str, matched: int
) -> tuple[str, pd.DataFrame, pd.DataFrame]:
    """statistics.md body, the ranking-test frame (one row per rule x average) and the seed-range
    frame (one row per rule x average x shape)."""
    lines = ["# Statistics", ""]
    tests, ranges = [], []
    for rule in (MATCHED, OWN):
        lines += [f"## {rule_label(rule, matched)}", ""]
        for avg in (AVG_ALL, AVG_HELDOUT):
            col = f"{avg}_em"
            sub = t1[(t1["rule"] == rule) & (t1["row"] != FLOOR)]
            table = {int(s): dict(zip(g["row"], g[col], strict=True)) for s, g in sub.groupby("seed")}
            test = ranking_test(table, shapes)
            picked = " (the selection average)" if avg == criterion else " (at the same checkpoints)"
            lines += [f"### Average: {benchmark_label(avg)}{picked}", ""]
            if test.p_given_shape is None:
                lines += [
                    f"Ranking test not computable: {len(shapes)} shape(s), {len(test.seeds)} complete seed(s).",
                    "",
                ]
            else:
                k, s = len(test.shapes), len(test.seeds)
                last, said = last_per_seed(test), verdict(test)
                lines += [
                    f"- k = {k} shapes ({', '.join(test.shapes)}), s = {s} seeds with every shape "
                    f"({', '.join(map(str, test.seeds))})"
                    + (
                        f"; seeds lacking a shape, left out: {', '.join(map(str, test.incomplete_seeds))}"
                        if test.incomplete_seeds
                        else ""
                    ),
                    f"- strictly last per seed: {last}",
                    f"- {said[0].upper()}{said[1:]}.",
                    f"- P(a pre-specified shape is last at all {s} seeds | exchangeable) = (1/{k})^{s} = "
                    f"**{test.p_given_shape}** ≈ {float(test.p_given_shape):.4f}",
                    f"- P(some shape is last at all {s} seeds | exchangeable) = {k}·(1/{k})^{s} = "
                    f"**{test.p_any_shape}** ≈ {float(test.p_any_shape):.4f} (post-hoc, direction not pre-registered)",
                    "",
                ]
            tests.append(
                {
                    "rule": rule,
                    "average": avg,
                    "k": len(test.shapes),
                    "seeds": len(test.seeds),
                    "last_everywhere": ";".join(test.last_everywhere),
                    "p_given_shape": str(test.p_given_shape),
                    "p_any_shape": str(test.p_any_shape),
                }
            )
            rng = (
                sub.groupby("row")[col]
                .agg(["min", "max", "mean", "count"])
                .reindex(order_shapes(list(shapes)))
            )
            rng["range"] = rng["max"] - rng["min"]
            ranges.append(
                rng.reset_index()
                .rename(columns={"row": "shape", "count": "seeds"})
                .assign(rule=rule, average=avg)
            )
            lines += [
                "Seed range per shape (max - min over seeds):",
                "",
                frame_markdown(rng.reset_index().rename(columns={"row": "reward", "count": "seeds"})),
                "",
            ]
            rankings = seed_rankings(t1, rule, col)
            lines += ["Per-seed ranking (best first):", ""]
            lines += [f"- seed {sd}: {format_ranking(groups)}" for sd, groups in rankings.items()]
            lines.append("")
    seed_ranges = pd.concat(ranges, ignore_index=True)
    columns = ["rule", "average", "shape", "seeds", "min", "max", "mean", "range"]
    return "\n".join(lines), pd.DataFrame(tests), seed_ranges[columns]


def last_per_seed(test: RankingTest) -> str:
    """``seed 42: em_only; seed 43: tie for last; ...`` of a ranking test."""
    return "; ".join(f"seed {sd}: {test.last_by_seed[sd] or 'tie for last'}" for sd in test.seeds)


def verdict(test: RankingTest) -> str:
    """Whether one shape is strictly last at every complete seed (lower case, no full stop)."""
    if test.last_everywhere:
        return f"**{test.last_everywhere[0]}** is strictly last at every one of the {len(test.seeds)} seeds"
    return "no shape is strictly last at every seed"
