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
    load_results,
    load_training_logs,
)
from eval.report.select import (
    MATCHED,
    MATCHED_HORIZON,
    OWN,
    floor_checkpoints,
    horizon_arg,
    resolve_matched_horizon,
    select_checkpoints,
    stage_caption,
)
from eval.report.tables import (
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
from eval.report.uncertainty import Cell, bootstrap_cells, statistics_markdown
from eval.report.validation import validation_cells, validation_markdown
from eval.stats import (
    AGREEMENT,
    AGREEMENT_MEASURES,
    agreement,
    bootstrap_agreement,
)
from reward_fns import PRIMARY, registered
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

    def emit_table(self, stem: str, text: str, frame: pd.DataFrame, sentence: str, csv_sentence: str) -> None:
        """``stem.md`` (``text``) and ``stem.csv`` (``frame``), listed in that order."""
        self.emit(f"{stem}.md", text, sentence)
        self.emit(f"{stem}.csv", frame.to_csv(index=False), csv_sentence)

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
    r.emit_table(
        "table1",
        "\n".join(parts),
        r.t1,
        "Table 1: average EM per reward shape x seed at the matched and own horizons,"
        " both averages, with CIs, the untrained floor and per-seed rankings.",
        "Table 1 as tidy CSV (one row per rule x row x seed).",
    )


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
        r.emit_table(
            stem,
            text,
            frame,
            f"{title} per benchmark for every cell, with both macro averages.",
            f"{title} per benchmark as CSV.",
        )


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
    r.emit_table(
        "table_judge",
        text,
        frame,
        "The LLM judge's score per benchmark for every cell, with both averages.",
        "The LLM judge per benchmark as CSV.",
    )
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
    r.emit_table(
        "judge_agreement",
        text,
        agree,
        "Per benchmark: the judge against EM (accepted EM failures, rejected EM passes, kappa) with CIs.",
        "The judge-EM agreement per benchmark as CSV.",
    )


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
    r.emit_table(
        "zero_variance",
        text,
        frame,
        "Zero-variance group fraction per shape and run (whole run, first and second half).",
        "The same as CSV.",
    )


def emit_validation(r: Report) -> None:
    """``table1_val.{md,csv}`` when ``--val-results`` is given (see :func:`validation_cells`)."""
    if r.args.val_results is None:
        return
    val = load_results(r.args.val_results)
    frame = validation_cells(r.results, val, r.matched)
    text = validation_markdown(frame, r.results.root, val.root, r.matched, r.shapes, r.seeds)
    r.emit_table(
        "table1_val",
        text.replace("\n\n", f"\n\n{r.caption}\n", 1),
        frame,
        "Table 1 with checkpoints chosen on the independent validation split and scored on the test"
        " split, next to the test-chosen cells (the optimism of choosing on test).",
        "The validation-selected cells as tidy CSV.",
    )


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
