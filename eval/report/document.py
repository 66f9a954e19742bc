"""Regenerate the paper's tables, figures and statistics from raw evaluation results.

    python -m eval report --results OUT --logs LOGS... --out REPORT

Reads ``OUT/<run>/{run.json, global_step_<N>/{summary.json, rows.jsonl}}`` and verl file-logger
JSONL training logs; writes Markdown + CSV tables, PNG figures and ``REPORT/index.md`` (see
docs/report.md). CPU only; bad input exits with status 2 and a message naming the file and the fix.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from eval.report import figures
from eval.report.results import (
    AVG_ALL,
    AVG_HELDOUT,
    JUDGE,
    Results,
    ResultsError,
    benchmark_label,
    check_disjoint,
    load_results,
    load_rows,
    load_training_logs,
)
from eval.report.select import (
    MATCHED,
    MATCHED_HORIZON,
    OWN,
    VAL_RULES,
    floor_checkpoints,
    horizon_arg,
    resolve_matched_horizon,
    select_checkpoints,
    stage_caption,
)
from eval.report.tables import (
    FLOOR,
    format_ranking,
    frame_markdown,
    limits_preset_of,
    order_shapes,
    per_benchmark_table,
    preset_caption,
    rule_label,
    search_profile,
    seed_rankings,
    study_floor,
    table1,
    table1_markdown,
)
from eval.stats import (
    AGREEMENT,
    AGREEMENT_MEASURES,
    RankingTest,
    agreement,
    bootstrap_agreement,
    bootstrap_macro,
    percentile_interval,
    ranking_test,
    stream_seed,
)
from reward_fns import PRIMARY, metric_names, registered
from search_env.benchmarks import IN_DISTRIBUTION, is_multi_hop
from search_env.markdown import markdown_table
from search_env.safe_fs import write_atomic

AVERAGE_TEXT = {
    AVG_ALL: "unweighted mean over all {n} benchmarks, the training set's included (the paper's Avg over its 7)",
    AVG_HELDOUT: "unweighted mean over the {h} held-out benchmarks (excluded as the training set's: {trained})",
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m eval report``."""
    parser = argparse.ArgumentParser(
        prog="python -m eval report", description="Regenerate the study's tables, figures and statistics."
    )
    parser.add_argument("--results", required=True, type=Path, help="eval output folder OUT (OUT/<run>/...)")
    parser.add_argument(
        "--logs",
        nargs="*",
        default=[],
        help="verl file-logger JSONL files or folders; RUN=PATH binds a file to a run",
    )
    parser.add_argument("--out", required=True, type=Path, help="report folder to write")
    parser.add_argument(
        "--matched-horizon",
        type=horizon_arg,
        default=MATCHED_HORIZON,
        help="common step cap (paper: 180); auto = the smallest run horizon (a scaled-down study)",
    )
    parser.add_argument(
        "--val-results",
        type=Path,
        help="validation-suite results of the same runs: adds checkpoints chosen on validation, scored on test",
    )
    parser.add_argument(
        "--select-on",
        choices=["all", "heldout"],
        default="all",
        help="average used to pick the best checkpoint (default: all, the paper's Avg)",
    )
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples per cell (0: none)")
    parser.add_argument("--ci-level", type=float, default=0.95, help="confidence level of the intervals")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap random seed")
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window of training curves")
    parser.add_argument(
        "--no-figures",
        action="store_true",
        help="write the tables, statistics and index only: no PNG is drawn (each is still listed)",
    )
    return parser


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
                last, verdict = _last_per_seed(test), _verdict(test)
                lines += [
                    f"- k = {k} shapes ({', '.join(test.shapes)}), s = {s} seeds with every shape "
                    f"({', '.join(map(str, test.seeds))})"
                    + (
                        f"; seeds lacking a shape, left out: {', '.join(map(str, test.incomplete_seeds))}"
                        if test.incomplete_seeds
                        else ""
                    ),
                    f"- strictly last per seed: {last}",
                    f"- {verdict[0].upper()}{verdict[1:]}.",
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


@dataclass
class Report:
    """What the section writers share: the parsed arguments, the loaded inputs, the selected
    checkpoints (``matched`` is the matched horizon in steps), and the files and notes so far,
    both in output order (``index.md`` lists them as they were added)."""

    args: argparse.Namespace
    results: Results
    logs: pd.DataFrame
    criterion: str
    matched: int
    selections: pd.DataFrame
    floors: pd.DataFrame
    shapes: list[str]
    seeds: list[int]
    cis: pd.DataFrame
    loaded: dict[tuple[str, int], Cell]
    t1: pd.DataFrame
    caption: str
    avg_text: dict[str, str]
    notes: list[str]
    files: list[tuple[str, str]] = field(default_factory=list)

    @property
    def draw(self) -> bool:
        """Whether figures are drawn (not `--no-figures`)."""
        return not self.args.no_figures

    @property
    def out(self) -> Path:
        """The report folder (``--out``)."""
        return self.args.out

    def emit(self, name: str, text: str, sentence: str) -> None:
        """Write ``text`` to ``out/name`` and list the file in the index with ``sentence``."""
        _write(self.out / name, text)
        self.listed(name, sentence)

    def listed(self, name: str, sentence: str) -> None:
        """List a file already written under ``out`` (a figure) in the index with ``sentence``."""
        self.files.append((name, sentence))


def _floor_notes(scores: pd.DataFrame, floors: pd.DataFrame) -> list[str]:
    """A note for every seed whose runs' step-0 Avg (all) EM differ by more than 1e-9 (the floor
    row shows one run's)."""
    notes = []
    zero = scores[(scores["step"] == 0) & (scores["benchmark"] == AVG_ALL)]
    for seed, group in zero.groupby("seed"):
        if group[PRIMARY].max() - group[PRIMARY].min() > 1e-9:
            notes.append(
                f"seed {seed}: step-0 EM differs across runs ({group[PRIMARY].min():.4f}-{group[PRIMARY].max():.4f});"
                f" the floor row uses run {floors.set_index('seed').loc[seed, 'run']}."
            )
    return notes


def load_report(args: argparse.Namespace) -> Report:
    """Load the results and training logs named by ``args`` (:func:`build_parser`), select the
    checkpoints and bootstrap their CIs. Raises ResultsError on unusable input, including a
    result tree without any evaluated trained checkpoint (step >= 1)."""
    results = load_results(args.results)
    logs = load_training_logs(args.logs, results.runs)
    criterion = AVG_ALL if args.select_on == "all" else AVG_HELDOUT
    try:
        m = resolve_matched_horizon(args.matched_horizon, (r.known_horizon for r in results.evaluated_runs()))
    except ValueError as err:
        raise ResultsError(f"{args.results}: {err}") from err
    scores, suite = results.scores, results.suite
    selections, sel_notes = select_checkpoints(scores, m, criterion)
    if selections.empty:
        raise ResultsError(
            f"{args.results}: no trained checkpoint (step >= 1) evaluated. Fix: evaluate checkpoints first"
        )
    floors = floor_checkpoints(scores)
    cells = pd.concat([selections[["run", "step"]], floors.assign(step=0)[["run", "step"]]])
    cis, loaded, ci_notes = bootstrap_cells(results, cells, args.bootstrap, args.seed, args.ci_level)
    n_all, n_held = len(suite), len([b for b in suite if b not in IN_DISTRIBUTION])
    trained = " and ".join(benchmark_label(b) for b in suite if b in IN_DISTRIBUTION) or "none of this suite"
    return Report(
        args=args,
        results=results,
        logs=logs,
        criterion=criterion,
        matched=m,
        selections=selections,
        floors=floors,
        shapes=order_shapes(selections["shape"].unique()),
        seeds=sorted(selections["seed"].unique()),
        cis=cis,
        loaded=loaded,
        t1=table1(scores, selections, floors, cis, criterion),
        caption=preset_caption([limits_preset_of(r.path) for r in results.runs.values()]),
        avg_text={k: v.format(n=n_all, h=n_held, trained=trained) for k, v in AVERAGE_TEXT.items()},
        notes=[*results.notes, *sel_notes, *_floor_notes(scores, floors), *ci_notes],
    )


def emit_table1(r: Report) -> None:
    """``table1.md`` (per rule and average: the shape x seed table and per-seed rankings) and
    ``table1.csv``."""
    parts = [
        "# Table 1: average EM per reward shape x seed",
        "",
        f"- **Avg (all)** = {r.avg_text[AVG_ALL]}; **Avg (held-out)** = {r.avg_text[AVG_HELDOUT]}.",
        f"- Checkpoint: best trained checkpoint (step >= 1) by {benchmark_label(r.criterion)} EM; ties -> "
        "earliest step. Both averages are read at that same checkpoint.",
        f"- A cell reads `value [{r.args.ci_level:.0%} bootstrap CI] @step`; † = the run's last evaluated step "
        f"is below {r.matched}. The floor row is step 0 (the untrained model).",
        r.caption,
        *([stages] if (stages := stage_caption(r.results.stages.values())) else []),
        "- The study's floor row (when the suite is the study's 7 benchmarks) is the study's own number for"
        " untrained Qwen3.5-0.8B under its evaluation loop; compare it with our floor under `study_eval`.",
        "",
    ]
    for rule in (MATCHED, OWN):
        for avg in (AVG_ALL, AVG_HELDOUT):
            reference = study_floor(avg, r.results.suite)
            parts += [
                f"## {rule_label(rule, r.matched)}: {benchmark_label(avg)}",
                "",
                table1_markdown(r.t1, rule, avg, r.shapes, r.seeds, reference, r.results.stages),
            ]
            rankings = seed_rankings(r.t1, rule, f"{avg}_em")
            parts += [f"- seed {s}: {format_ranking(g)}" for s, g in rankings.items()]
            parts.append("")
    r.emit(
        "table1.md",
        "\n".join(parts),
        "Table 1: average EM per reward shape x seed at the matched and own horizons,"
        " both averages, with CIs, the untrained floor and per-seed rankings.",
    )
    r.emit("table1.csv", r.t1.to_csv(index=False), "Table 1 as tidy CSV (one row per rule x row x seed).")


def emit_per_benchmark_tables(r: Report) -> None:
    """Tables 3-5 (EM, F1, ACC per benchmark at Table 1's checkpoints; one per registered metric,
    named and titled by its registry entry), Markdown and CSV each."""
    for metric in registered():
        stem, title = metric.table, metric.title
        frame = per_benchmark_table(r.results.scores, r.selections, r.floors, metric.name, r.results.suite)
        text = (
            f"# {title} per benchmark\n\n(ID) = in-distribution (training set); the other "
            f"benchmarks are held out. Averages: Avg (all) = {r.avg_text[AVG_ALL]}; Avg (held-out) = "
            f"{r.avg_text[AVG_HELDOUT]}. Same checkpoints as Table 1.\n{r.caption}\n\n"
            + frame_markdown(frame)
        )
        r.emit(
            f"{stem}.md",
            text,
            f"{title} per benchmark for every cell, with both macro averages.",
        )
        r.emit(f"{stem}.csv", frame.to_csv(index=False), f"{title} per benchmark as CSV.")


def agreement_frame(r: Report) -> pd.DataFrame:
    """Per benchmark, the judge against EM over Table 1's checkpoints (selected cells and floors,
    each (run, step) once) whose summaries carry a judge: the 2x2 counts (eval.run.summary.AGREEMENT),
    unparsed verdicts, and each :data:`eval.stats.AGREEMENT_MEASURES` with its bootstrap CI."""
    cells = pd.concat([r.selections[["run", "step"]], r.floors.assign(step=0)[["run", "step"]]])
    keys = sorted({(str(run), int(step)) for run, step in cells.itertuples(index=False)})
    records = []
    for bench in r.results.suite:
        counts = dict.fromkeys(AGREEMENT, 0)
        unparsed = 0
        for key in keys:
            summary = r.results.summaries.get(key) or {}
            entry = (summary.get("benchmarks") or {}).get(bench) or {}
            for name, value in (entry.get("judge_agreement") or {}).items():
                counts[name] += int(value)
            unparsed += int(entry.get("judge_unparsed") or 0)
        four = [counts[k] for k in AGREEMENT]
        point = agreement(*four)
        cis = bootstrap_agreement(four, max(r.args.bootstrap, 1), [r.args.seed, 42], r.args.ci_level)
        record = {"benchmark": benchmark_label(bench), "rows": sum(four), **counts, "unparsed": unparsed}
        for name in AGREEMENT_MEASURES:
            record[name], (record[f"{name}_lo"], record[f"{name}_hi"]) = point[name], cis[name]
        records.append(record)
    return pd.DataFrame.from_records(records)


def emit_judge(r: Report) -> None:
    """With an LLM judge in the results only: ``table_judge`` (the judge's score per benchmark at
    Table 1's checkpoints) and ``judge_agreement`` (per benchmark: the share of EM failures the judge
    accepts, of EM passes it rejects, Cohen's kappa, each with its CI), Markdown and CSV each."""
    scores = r.results.scores
    if JUDGE not in scores.columns:
        return
    judges = sorted(
        {json.dumps(s.get("judge"), sort_keys=True) for s in r.results.summaries.values() if s.get("judge")}
    )
    who = ", ".join(judges)
    frame = per_benchmark_table(scores, r.selections, r.floors, JUDGE, r.results.suite)
    text = (
        f"# LLM judge per benchmark\n\nThe share of rows the judge ({who}) accepts as correct; an "
        "unparsed verdict counts as not correct. Same checkpoints as Table 1; a cell without a judged "
        f"summary is empty.\n{r.caption}\n\n" + frame_markdown(frame)
    )
    r.emit("table_judge.md", text, "The LLM judge's score per benchmark for every cell, with both averages.")
    r.emit("table_judge.csv", frame.to_csv(index=False), "The LLM judge per benchmark as CSV.")
    agree = agreement_frame(r)
    level = f"{r.args.ci_level:.0%}"

    def cell(rec: pd.Series, name: str) -> str:
        if pd.isna(rec[name]):
            return "–"
        ci = "" if pd.isna(rec[f"{name}_lo"]) else f" [{rec[f'{name}_lo']:.3f}, {rec[f'{name}_hi']:.3f}]"
        return f"{rec[name]:.3f}{ci}"

    rows = [
        [
            rec["benchmark"],
            str(rec["rows"]),
            *(cell(rec, m) for m in AGREEMENT_MEASURES),
            str(rec["unparsed"]),
        ]
        for _, rec in agree.iterrows()
    ]
    header = [
        "benchmark",
        "rows",
        "EM failures the judge accepts",
        "EM passes the judge rejects",
        "Cohen's kappa",
        "unparsed",
    ]
    text = "\n".join(
        [
            "# The judge against exact match",
            "",
            f"Judge: {who}. Rows: every row of Table 1's checkpoints (selected cells and step 0) that the "
            f"judge scored, pooled per benchmark. A value reads `estimate [{level} bootstrap CI]` (rows "
            "resampled); – = undefined (no EM failures, no EM passes, or a constant rater). Unparsed "
            'verdicts count as the judge rejecting. docs/evaluation.md, "Reading the agreement section".',
            "",
            markdown_table(header, rows),
            "",
        ]
    )
    r.emit(
        "judge_agreement.md",
        text,
        "Per benchmark: the judge against EM (accepted EM failures, rejected EM passes, kappa) with CIs.",
    )
    r.emit("judge_agreement.csv", agree.to_csv(index=False), "The judge-EM agreement per benchmark as CSV.")


def emit_statistics(r: Report) -> None:
    """``statistics.md``, ``ranking_test.csv`` and ``seed_range.csv``."""
    text, tests, seed_ranges = statistics_markdown(r.t1, r.shapes, r.criterion, r.matched)
    r.emit(
        "statistics.md",
        text,
        "Exact last-place ranking probabilities (as fractions), seed ranges and "
        "per-seed rankings for both horizons and both averages.",
    )
    r.emit("ranking_test.csv", tests.to_csv(index=False), "The ranking-test results as CSV.")
    r.emit(
        "seed_range.csv",
        seed_ranges.to_csv(index=False),
        "Seed range (max - min) per shape, rule and average.",
    )


def emit_bootstrap_ci(r: Report) -> None:
    """``bootstrap_ci.csv`` when any CI was computed; a note when ``--bootstrap 0`` disabled them."""
    args = r.args
    if args.bootstrap <= 0:
        r.notes.append("bootstrap disabled (--bootstrap 0): no confidence intervals.")
    elif len(r.cis):
        cis = r.cis.assign(benchmark=r.cis["benchmark"].map(benchmark_label))
        r.emit(
            "bootstrap_ci.csv",
            cis.to_csv(index=False),
            f"{args.ci_level:.0%} bootstrap CIs ({args.bootstrap} resamples of questions within each benchmark, "
            f"seed {args.seed}) for every selected checkpoint, benchmark, average and metric.",
        )


def emit_checkpoints(r: Report) -> None:
    """``checkpoints.csv``: every loaded checkpoint's scores, benchmarks by their display label."""
    scores = r.results.scores
    r.emit(
        "checkpoints.csv",
        scores.assign(benchmark=scores["benchmark"].map(benchmark_label)).to_csv(index=False),
        "Every evaluated checkpoint's per-benchmark and average scores (the trajectories' data).",
    )


def emit_trajectories(r: Report) -> None:
    """``fig_trajectories_seed<S>.png``: average EM vs step, one figure per seed."""
    for seed in sorted(r.results.scores["seed"].unique()):
        name = f"fig_trajectories_seed{seed}.png"
        if r.draw:
            figures.plot_trajectories(r.results.scores, int(seed), r.shapes, r.matched, r.out / name)
        r.listed(name, f"Average EM vs training step at seed {seed}, one line per shape (paper Figs 2-4).")


def emit_training_figures(r: Report) -> None:
    """``fig_dynamics_seed<S>.png`` and ``fig_health_seed<S>.png`` per seed of the training logs;
    a note without logs and for every panel whose metric is not logged."""
    if r.logs.empty:
        r.notes.append("no training logs given (--logs): training-dynamics figures not drawn.")
    for seed in sorted(r.logs["seed"].unique()):
        for kind, panels, title in (
            ("dynamics", figures.DYNAMICS_PANELS, "Training dynamics"),
            ("health", figures.HEALTH_PANELS, "Training health"),
        ):
            name = f"fig_{kind}_seed{seed}.png"
            if r.draw:
                figures.plot_training(r.logs, int(seed), r.shapes, panels, r.args.smooth, title, r.out / name)
            missing = figures.missing_panels(r.logs, int(seed), panels)
            if missing:
                r.notes.append(f"{name}: not in the logs, panel left empty: {'; '.join(missing)}.")
            paper = "Figs 5-8" if kind == "dynamics" else "Fig 11"
            r.listed(name, f"{title} per step at seed {seed}, one line per shape (paper {paper}).")


def emit_zero_variance(r: Report) -> None:
    """``fig_zero_variance.png`` and ``zero_variance.{md,csv}``: the fraction of GRPO groups whose
    rollouts all got the same reward, per shape x seed (mean over all steps and over each half of
    the run; a run with one logged step has no first half, NaN). Nothing without training logs; a
    note when the logs lack the metric."""
    if r.logs.empty:
        return
    sub = r.logs[r.logs["metric"] == figures.ZERO_VARIANCE]
    if sub.empty:
        r.notes.append(f"{figures.ZERO_VARIANCE} not in the training logs: no zero-variance figure.")
        return
    records = []
    for (shape, seed, run), g in sub.groupby(["shape", "seed", "run"]):
        g = g.sort_values("step")
        half = len(g) // 2
        records.append(
            {
                "shape": shape,
                "seed": int(seed),
                "run": run,
                "steps": len(g),
                "mean": g["value"].mean(),
                "first_half": g["value"].iloc[:half].mean() if half else np.nan,
                "second_half": g["value"].iloc[half:].mean(),
            }
        )
    order = {s: i for i, s in enumerate(r.shapes)}
    frame = pd.DataFrame(records).sort_values(
        ["shape", "seed"], key=lambda c: c.map(order) if c.name == "shape" else c
    )
    per_shape = frame.groupby("shape", sort=False)[["mean", "first_half", "second_half"]].mean().reset_index()
    if r.draw:
        figures.plot_zero_variance(r.logs, r.shapes, r.args.smooth, r.out / "fig_zero_variance.png")
    r.listed(
        "fig_zero_variance.png",
        "Zero-variance GRPO group fraction per step and its mean, per reward shape, all seeds.",
    )
    text = (
        f"# Zero-variance GRPO groups per reward shape\n\n`{figures.ZERO_VARIANCE}`: fraction of a step's "
        "GRPO groups in which every rollout got the same reward (no advantage, no gradient from that "
        "prompt). Mean over the logged steps, and over the first and second half of each run.\n\n"
        "## Per shape (mean over seeds)\n\n"
        + frame_markdown(per_shape)
        + "\n## Per run\n\n"
        + frame_markdown(frame)
    )
    r.emit(
        "zero_variance.md",
        text,
        "Zero-variance group fraction per shape and run (whole run, first and second half).",
    )
    r.emit("zero_variance.csv", frame.to_csv(index=False), "The same as CSV.")


def validation_cells(test: Results, val: Results, matched: int) -> pd.DataFrame:
    """Checkpoints chosen by validation Avg (all) EM (the ``val_matched`` / ``val_own`` rules of
    :func:`eval.report.select.select_checkpoints`, as ``python -m eval select`` reports them) next to the
    test-chosen ones: ``rule, shape, seed, run, val_step, val_em, test_em, test_step,
    test_pick_em`` (EM fractions on the validation / test suite), runs in name order. Raises
    ResultsError when a run's validation rows share a question with its test rows."""
    check_disjoint(test, val)
    picks, _ = select_checkpoints(test.scores, matched, AVG_ALL, PRIMARY, val.scores)
    by_rule = picks.set_index(["run", "rule"])
    records = []
    for run, shape, seed in picks[["run", "shape", "seed"]].drop_duplicates().itertuples(index=False):
        for test_rule in (MATCHED, OWN):
            rule = VAL_RULES[test_rule]
            if (run, rule) not in by_rule.index:
                continue
            pick, test_pick = by_rule.loc[(run, rule)], by_rule.loc[(run, test_rule)]
            records.append(
                {
                    "rule": rule,
                    "shape": shape,
                    "seed": seed,
                    "run": run,
                    "val_step": int(pick["step"]),
                    "val_em": pick["val_value"],
                    "test_em": pick["value"],
                    "test_step": int(test_pick["step"]),
                    "test_pick_em": test_pick["value"],
                }
            )
    columns = ["rule", "shape", "seed", "run", "val_step", "val_em", "test_em", "test_step", "test_pick_em"]
    return pd.DataFrame(records, columns=columns)


def validation_markdown(
    frame: pd.DataFrame,
    test_root: Path,
    val_root: Path,
    matched: int,
    shapes: Sequence[str],
    seeds: Sequence[int],
) -> str:
    """``table1_val.md`` from a :func:`validation_cells` frame: per rule, a shape x seed table of
    ``test EM @validation-chosen step (test-chosen: EM @step)`` with the mean over seeds and the
    ranking test on the validation-chosen cells (omitted when not computable)."""
    lines = [
        "# Table 1 (validation-selected): average EM per reward shape x seed",
        "",
        f"- Checkpoint chosen by macro EM on the validation split ({val_root}), reported on the test split"
        f" ({test_root}); ties -> earliest step. Matched horizon = step <= {matched}.",
        "- A cell reads `test EM @validation-chosen step (test-chosen: EM @step)`; the gap is the optimism of"
        " choosing the checkpoint on the test split itself.",
        "",
    ]
    for rule, label in (
        (VAL_RULES[MATCHED], f"matched horizon (step <= {matched})"),
        (VAL_RULES[OWN], "own horizon"),
    ):
        sub = frame[frame["rule"] == rule]
        if sub.empty:
            continue
        rows, table = [], {}
        for shape in shapes:
            cells = []
            for seed in seeds:
                hit = sub[(sub["shape"] == shape) & (sub["seed"] == seed)]
                if hit.empty:
                    cells.append("–")
                    continue
                c = hit.iloc[0]
                table.setdefault(int(seed), {})[shape] = c["test_em"]
                cells.append(
                    f"{c['test_em']:.3f} @{c['val_step']} (test-chosen: {c['test_pick_em']:.3f} @{c['test_step']})"
                )
            rows.append([shape, *cells, f"{sub[sub['shape'] == shape]['test_em'].mean():.3f}"])
        lines += [f"## {label}", "", markdown_table(["reward", *[f"seed {s}" for s in seeds], "mean"], rows)]
        test = ranking_test(table, shapes)
        if test.p_given_shape is not None:
            lines += [
                f"- strictly last per seed: {_last_per_seed(test)}; {_verdict(test)} "
                f"(P = {test.p_given_shape} for a pre-specified shape, {test.p_any_shape} for any).",
                "",
            ]
    return "\n".join(lines)


def emit_validation(r: Report) -> None:
    """``table1_val.{md,csv}`` when ``--val-results`` is given (see :func:`validation_cells`)."""
    if r.args.val_results is None:
        return
    val = load_results(r.args.val_results)
    frame = validation_cells(r.results, val, r.matched)
    text = validation_markdown(frame, r.results.root, val.root, r.matched, r.shapes, r.seeds)
    r.emit(
        "table1_val.md",
        text.replace("\n\n", f"\n\n{r.caption}\n", 1),
        "Table 1 with checkpoints chosen on the independent validation split and scored on the test"
        " split, next to the test-chosen cells (the optimism of choosing on test).",
    )
    r.emit("table1_val.csv", frame.to_csv(index=False), "The validation-selected cells as tidy CSV.")


def emit_search_profile(r: Report) -> None:
    """Fig 13 (``fig13_search_profile.png``, ``search_profile.csv``, ``search_aborts.csv``) from the
    rows of the matched-horizon checkpoints on the multi-hop benchmarks, or on every benchmark
    (with a note) when the suite has none of them; a note instead when no such rows were loaded."""
    suite = r.results.suite
    matched = r.selections[r.selections["rule"] == MATCHED]
    pooled = [
        r.loaded[(run, step)].rows.assign(shape=shape)
        for run, step, shape in zip(matched["run"], matched["step"], matched["shape"], strict=True)
        if (run, step) in r.loaded
    ]
    multi = [b for b in suite if is_multi_hop(b)]
    if not multi:
        multi = list(suite)
        r.notes.append(
            "no multi-hop benchmark of the paper's suite: the search profile pools every benchmark "
            f"({', '.join(benchmark_label(b) for b in suite)})."
        )
    rows = pd.concat(pooled, ignore_index=True) if pooled else pd.DataFrame()
    if not (len(rows) and multi):
        r.notes.append(
            "search profile not drawn: no rows.jsonl for the matched-horizon checkpoints or no multi-hop "
            "benchmark in the suite."
        )
        return
    profile, aborts = search_profile(rows[rows["benchmark"].isin(multi)])
    if r.draw:
        figures.plot_search_profile(profile, aborts, r.shapes, r.out / "fig13_search_profile.png")
    r.listed(
        "fig13_search_profile.png",
        f"Search-count profile, completed-rollout EM and abort rate per "
        f"shape on {', '.join(benchmark_label(b) for b in multi)} (paper Fig 13).",
    )
    r.emit(
        "search_profile.csv", profile.to_csv(index=False), "Fig 13 data: completed rollouts per search count."
    )
    r.emit(
        "search_aborts.csv",
        aborts.to_csv(index=False),
        "Fig 13 data: abort rate and termination reasons per shape.",
    )


def emit_index(r: Report) -> None:
    """``index.md``: what was read, every file written with its sentence, then the notes."""
    suite = r.results.suite
    index = [
        "# Report",
        "",
        f"Generated by `python -m eval report` from `{r.args.results}`"
        f" ({len(r.results.runs)} runs, shapes {', '.join(r.shapes)}, seeds {', '.join(map(str, r.seeds))};"
        f" benchmarks {', '.join(benchmark_label(b) for b in suite)}).",
        "",
        markdown_table(["file", "what it shows"], [[f"[{n}]({n})", s] for n, s in r.files]),
    ]
    index += ["## Notes", ""] + ([f"- {n}" for n in r.notes] or ["- none"])
    _write(r.out / "index.md", "\n".join(index) + "\n")


def write_report(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Write every output under ``args.out``; returns (relative file, one-sentence description) of
    each, ``index.md`` excluded. Raises ResultsError on unusable input."""
    args.out.mkdir(parents=True, exist_ok=True)
    r = load_report(args)
    emit_table1(r)
    emit_per_benchmark_tables(r)
    emit_judge(r)
    emit_statistics(r)
    emit_bootstrap_ci(r)
    emit_checkpoints(r)
    emit_trajectories(r)
    emit_training_figures(r)
    emit_zero_variance(r)
    emit_validation(r)
    emit_search_profile(r)
    emit_index(r)
    return r.files


def _last_per_seed(test: RankingTest) -> str:
    """``seed 42: em_only; seed 43: tie for last; ...`` of a ranking test."""
    return "; ".join(f"seed {sd}: {test.last_by_seed[sd] or 'tie for last'}" for sd in test.seeds)


def _verdict(test: RankingTest) -> str:
    """Whether one shape is strictly last at every complete seed (lower case, no full stop)."""
    if test.last_everywhere:
        return f"**{test.last_everywhere[0]}** is strictly last at every one of the {len(test.seeds)} seeds"
    return "no shape is strictly last at every seed"


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` as UTF-8, creating missing parent folders; atomic and durable (a
    killed report leaves each file old or new, never torn)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m eval report`` (``argv`` excludes the ``report`` sub-command)."""
    args = build_parser().parse_args(argv)
    try:
        files = write_report(args)
    except ResultsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(files) + 1} files to {args.out} (start at {args.out / 'index.md'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
