"""Two reward regimes side by side: ``python -m study.regimes`` (the micro study's regime report).

Reads the raw exports of the dense micro study (``--dense``) and the sparse one (``--sparse``, with
its group-size tree, e.g. ``g10/``) and writes ``cells.csv`` (one row per cell), ``table1.md``,
``group_size.md``, ``fig_zero_variance_gain.png`` and ``index.md`` (each claim with its numbers).
Every number comes from the raw files and every CI's generator is seeded by what it describes, so
the folder regenerates byte for byte, figures aside (``tests/study/test_regimes.py``).

Mechanism: docs/micro_study/regimes.md ("The regimes report").
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pandas as pd

from eval.report import figures
from eval.report.results import AVG_ALL, AVG_HELDOUT, Results, ResultsError, load_results, load_training_logs
from eval.report.select import resolve_matched_horizon, select_checkpoints
from eval.report.tables import order_shapes
from eval.run.checkpoints import get_dotted
from eval.stats import RankingTest, binomial_tail, ci_text, ranking_test, seed_ci
from reward_fns import PRIMARY
from search_env.markdown import markdown_table

ZERO_VAR = "grpo/zero_variance_group_frac"
EM_ZERO_VAR = "grpo/em_zero_variance_group_frac"
PARTIAL = "reward/partial_credit_frac"
CLIP = "rollout/length_clip_ratio"
LENGTH = "rollout/model_tokens_mean"
REWARD = "reward/mean"


@dataclass(frozen=True)
class Claims:
    """What the study file states before the runs: the shape predicted last (the paper's C2) and the
    shape pair of the gain gap (``better - worse``)."""

    last: str
    better: str
    worse: str
    meaning: str  # what a positive gap says, e.g. "F1 learns more"


@dataclass
class Tree:
    """One results tree: a regime's main study, or its group-size runs."""

    regime: str
    results: Results
    logs: pd.DataFrame


def load_tree(regime: str, root: Path, logs: Path | None = None) -> Tree:
    """``root/test`` results with the training logs under ``logs`` (default ``root/logs``)."""
    results = load_results(root / "test")
    log_root = logs or root / "logs"
    frame = load_training_logs([str(log_root)], results.runs) if log_root.exists() else pd.DataFrame()
    return Tree(regime, results, frame)


def _group_size(results: Results, run: str) -> int:
    n = get_dotted(results.runs[run].config, "actor_rollout_ref.rollout.n")
    return int(n) if n is not None else 5


def _log_mean(logs: pd.DataFrame, run: str, metric: str, lo: int, hi: int) -> float:
    if logs.empty:
        return math.nan
    sel = logs[(logs["run"] == run) & (logs["metric"] == metric) & logs["step"].between(lo, hi)]
    return float(sel["value"].mean()) if len(sel) else math.nan


def _reward_em_corr(results: Results, logs: pd.DataFrame, run: str, window: int = 3) -> float:
    """Pearson r over a run's trained checkpoints between test EM (Avg all) and the training
    reward averaged over the ``window`` steps up to the checkpoint (paper §6.5); NaN under 3 points."""
    sc = results.scores
    em = sc[(sc["run"] == run) & (sc["benchmark"] == AVG_ALL) & (sc["step"] >= 1)].set_index("step")[PRIMARY]
    pairs = [(_log_mean(logs, run, REWARD, s - window + 1, s), float(v)) for s, v in em.items()]
    pairs = [p for p in pairs if not math.isnan(p[0])]
    if len(pairs) < 3:
        return math.nan
    x, y = np.array(pairs).T
    if x.std() == 0 or y.std() == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def _first_checkpoint(scores: pd.DataFrame, run: str) -> tuple[int, float]:
    """(step, test EM Avg all) of a run's first trained checkpoint: how fast it starts, which a
    best-by-horizon table hides when every shape reaches the same ceiling."""
    em = scores[(scores["run"] == run) & (scores["benchmark"] == AVG_ALL) & (scores["step"] >= 1)]
    if em.empty:
        return -1, math.nan
    row = em.loc[em["step"].idxmin()]
    return int(row["step"]), float(row[PRIMARY])


def cells(tree: Tree, matched: int) -> pd.DataFrame:
    """One row per trained run of ``tree`` at the ``matched`` horizon (columns: docs/micro_study/regimes.md,
    "The regimes report")."""
    sc = tree.results.scores
    sel, _ = select_checkpoints(sc, matched, AVG_ALL)
    sel = sel[sel["rule"] == "matched"]
    floor = sc[sc["step"] == 0].groupby(["seed", "benchmark"])[PRIMARY].first()
    rows = []
    for _, c in sel.iterrows():
        run, seed, step = c["run"], int(c["seed"]), int(c["step"])
        at = sc[(sc["run"] == run) & (sc["step"] == step)].set_index("benchmark")[PRIMARY]
        f_all = floor.get((seed, AVG_ALL), math.nan)
        f_held = floor.get((seed, AVG_HELDOUT), math.nan)
        length_early = _log_mean(tree.logs, run, LENGTH, 1, 3)
        first = _first_checkpoint(sc, run)
        length_late = _log_mean(tree.logs, run, LENGTH, matched - 2, matched)
        rows.append(
            {
                "regime": tree.regime,
                "group": _group_size(tree.results, run),
                "shape": c["shape"],
                "seed": seed,
                "run": run,
                "step": step,
                "floor_em": f_all,
                "best_em": float(at[AVG_ALL]),
                "gain": float(at[AVG_ALL]) - f_all,
                "floor_heldout_em": f_held,
                "best_heldout_em": float(at[AVG_HELDOUT]),
                "gain_heldout": float(at[AVG_HELDOUT]) - f_held,
                "zero_var": _log_mean(tree.logs, run, ZERO_VAR, 1, matched),
                "em_zero_var": _log_mean(tree.logs, run, EM_ZERO_VAR, 1, matched),
                "partial_credit_step1": _log_mean(tree.logs, run, PARTIAL, 1, 1),
                "clip_ratio": _log_mean(tree.logs, run, CLIP, 1, matched),
                "length_early": length_early,
                "length_late": length_late,
                "reward_em_r": _reward_em_corr(tree.results, tree.logs, run),
                "first_step": first[0],
                "first_em": first[1],
            }
        )
    return pd.DataFrame(rows)


def ranking(frame: pd.DataFrame) -> RankingTest:
    """The last-place test on best EM (Avg all) at the matched horizon, by seed."""
    table: dict[int, dict[str, float]] = {}
    for _, r in frame.iterrows():
        table.setdefault(int(r["seed"]), {})[r["shape"]] = float(r["best_em"])
    return ranking_test(table, order_shapes(frame["shape"].unique()))


def num_text(x: float | None, digits: int = 3) -> str:
    """A table number to ``digits`` decimals; '-' for None or NaN."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _p(p: Fraction | None) -> str:
    return "-" if p is None else f"{p} = {float(p):.4f}"


def ranking_markdown(regime: str, test: RankingTest, last: str) -> list[str]:
    """The ranking test's lines: the pre-stated direction (``last``), then the conservative alternatives."""
    k, s = len(test.shapes), len(test.seeds)
    if s == 0:
        return [f"- {regime}: no seed has every shape evaluated; no test."]
    hits = sum(1 for sd in test.seeds if test.last_by_seed[sd] == last)
    lasts = "; ".join(f"{sd}: {test.last_by_seed[sd] or 'tie'}" for sd in test.seeds)
    return [
        f"- **{regime}** ({k} shapes x {s} seeds; last per seed — {lasts}): {last} strictly last at "
        f"**{hits} of {s}** seeds.",
        f"  - Stated in advance (C2: {last} last at every seed): exact P = {_p(test.p_given_shape)}; "
        f"{'reached' if hits == s else 'not reached'}.",
        f"  - Conservative (post hoc: any shape last at every seed): P = {_p(test.p_any_shape)}; "
        f"{'reached by ' + test.last_everywhere[0] if test.last_everywhere else 'not reached'}.",
        f"  - Conservative (binomial: {last} last at >= {hits} of {s} seeds by chance): "
        f"P = {_p(binomial_tail(k, s, hits)) if hits else '1'}.",
    ]


def gain_ci(frame: pd.DataFrame, shape: str, n_boot: int) -> tuple[float, float]:
    """``seed_ci`` of ``shape``'s gains in ``frame`` (one regime), keyed by regime and shape."""
    regime = "/".join(sorted(frame["regime"].unique()))
    return seed_ci(list(frame[frame["shape"] == shape]["gain"]), n_boot, f"gain/{regime}/{shape}")


def paired_gap(frame: pd.DataFrame, better: str, worse: str) -> list[float]:
    """Per seed holding both shapes: gain of ``better`` minus gain of ``worse`` (seed order)."""
    gains = frame.pivot_table(index="seed", columns="shape", values="gain")
    if better not in gains or worse not in gains:
        return []
    return [float(v) for v in (gains[better] - gains[worse]).dropna().sort_index()]


def regime_table_markdown(frame: pd.DataFrame, n_boot: int) -> str:
    """Per shape: mean best EM (both averages) at the matched horizon, gain with its seed CI,
    seed values."""
    rows = []
    for shape in order_shapes(frame["shape"].unique()):
        sub = frame[frame["shape"] == shape].sort_values("seed")
        rows.append(
            [
                shape,
                str(len(sub)),
                num_text(sub["floor_em"].mean()),
                num_text(sub["best_em"].mean()),
                num_text(sub["gain"].mean()),
                ci_text(gain_ci(frame, shape, n_boot)),
                num_text(sub["best_heldout_em"].mean()),
                num_text(sub["gain_heldout"].mean()),
                num_text(sub["first_em"].mean()),
                ", ".join(f"{int(r.seed)}: {r.best_em:.3f}" for r in sub.itertuples()),
            ]
        )
    header = [
        "shape",
        "seeds",
        "step-0 EM",
        "best EM (all)",
        "gain",
        "gain 95% CI (seeds)",
        "best EM (held-out)",
        "gain (held-out)",
        "EM at the first checkpoint",
        "per seed (all)",
    ]
    return markdown_table(header, rows)


def group_gaps(
    frame: pd.DataFrame, seeds: Sequence[int], n_boot: int, claims: Claims
) -> dict[int, tuple[float, tuple[float, float]]]:
    """Per group size: mean paired gain gap better - worse over ``seeds`` and its seed CI."""
    out = {}
    for group in sorted(frame["group"].unique()):
        sub = frame[(frame["group"] == group) & frame["seed"].isin(seeds)]
        gaps = paired_gap(sub, claims.better, claims.worse)
        mean = float(np.mean(gaps)) if gaps else math.nan
        key = f"gap/{'/'.join(sorted(sub['regime'].unique()))}/G{int(group)}/seeds{list(seeds)}"
        out[int(group)] = (mean, seed_ci(gaps, n_boot, key))
    return out


def gap_verdict(gaps: dict[int, tuple[float, tuple[float, float]]], small: int, large: int) -> str:
    """Whether G = ``large`` closes the G = ``small`` gain gap: only a gap whose CI excludes 0 can be closed."""
    mean_s, (low_s, high_s) = gaps[small]
    mean_l = gaps[large][0]
    if math.isnan(mean_s) or math.isnan(mean_l):
        return "not measured"
    if math.isnan(low_s) or low_s <= 0 <= high_s:
        return f"no gap at G = {small} to close: its CI covers 0"
    return f"G = {large} narrows it" if abs(mean_l) < abs(mean_s) else f"G = {large} does not narrow it"


def group_size_markdown(frame: pd.DataFrame, seeds: Sequence[int], n_boot: int, claims: Claims) -> str:
    """The gap pair's shapes x G on ``seeds``: mean gain, zero-variance fractions; then the paired
    gain gap better - worse per G with its seed CI."""
    rows = []
    for (shape, group), sub in frame[frame["seed"].isin(seeds)].groupby(["shape", "group"]):
        rows.append(
            [
                shape,
                str(int(group)),
                str(len(sub)),
                num_text(sub["best_em"].mean()),
                num_text(sub["gain"].mean()),
                num_text(sub["first_em"].mean()),
                num_text(sub["zero_var"].mean()),
                num_text(sub["em_zero_var"].mean()),
            ]
        )
    header = [
        "shape",
        "G",
        "seeds",
        "best EM (all)",
        "gain",
        "EM at the first checkpoint",
        "zero-var (own reward)",
        "zero-var (under EM)",
    ]
    gaps = group_gaps(frame, seeds, n_boot, claims)
    gap_rows = [[str(g), num_text(m), ci_text(ci)] for g, (m, ci) in gaps.items()]
    return (
        markdown_table(header, rows)
        + f"\n\nGain gap {claims.better} - {claims.worse}, paired by seed (positive: {claims.meaning}):\n\n"
        + markdown_table(["G", "mean gap", "95% CI (seeds)"], gap_rows)
    )


def _column_mean(frame: pd.DataFrame, col: str, **where: object) -> float:
    sub = frame
    for k, v in where.items():
        sub = sub[sub[k] == v]
    return float(sub[col].mean()) if len(sub) else math.nan


def _spearman(x: pd.Series, y: pd.Series) -> float:
    ok = x.notna() & y.notna()
    if ok.sum() < 3:
        return math.nan
    return float(x[ok].rank().corr(y[ok].rank()))


def group_levels(frame: pd.DataFrame) -> tuple[int, int | None]:
    """(the main study's group size, the group-size tree's or None): the smallest G and the other."""
    groups = sorted(int(g) for g in frame["group"].unique())
    return groups[0], (groups[-1] if len(groups) > 1 else None)


def conclusion(frame: pd.DataFrame, tests: dict[str, RankingTest], n_boot: int, claims: Claims) -> list[str]:
    """The claims stated in the study file, each with this data's numbers (95 % seed CIs of mean
    gains) and whether it holds in each regime."""
    lines = []
    small, large = group_levels(frame)
    main = frame[frame["group"] == small]
    for regime, test in tests.items():
        sub = main[main["regime"] == regime]
        means = {s: _column_mean(sub, "gain", shape=s) for s in order_shapes(sub["shape"].unique())}
        hits = sum(1 for sd in test.seeds if test.last_by_seed[sd] == claims.last)
        order = " > ".join(
            f"{s} {sub[sub['shape'] == s]['best_em'].mean():.3f}"
            for s in sorted(means, key=lambda s: -sub[sub["shape"] == s]["best_em"].mean())
        )
        held = hits == len(test.seeds) and len(test.seeds) > 0
        gains = ", ".join(f"{s} {means[s]:+.3f} {ci_text(gain_ci(sub, s, n_boot))}" for s in means)
        gap = paired_gap(sub, claims.better, claims.last)
        lines.append(
            f"- **C2 (EM-only last), {regime}:** {'holds' if held else 'does not hold'} — mean best EM {order}; "
            f"{claims.last} last at {hits} of {len(test.seeds)} seeds (exact P {_p(test.p_given_shape)}); "
            f"mean gain (95% seed CI) {gains}; {claims.better} - {claims.last} paired by seed "
            f"{num_text(float(np.mean(gap)) if gap else math.nan)} {ci_text(seed_ci(gap, n_boot, f'gap/{regime}'))}; "
            "EM at the first checkpoint (how fast a shape starts) "
            + ", ".join(f"{s} {_column_mean(sub, 'first_em', shape=s):.3f}" for s in means)
            + "."
        )
        zv = {s: _column_mean(sub, "zero_var", shape=s) for s in means}
        r = _spearman(sub["zero_var"], sub["gain"])
        most_tied = max(zv, key=lambda s: zv[s]) if zv else "-"
        least_gain = min(means, key=lambda s: means[s]) if means else "-"
        mech = most_tied == claims.last and least_gain == claims.last and r < 0
        lines.append(
            f"- **§6.3 (sparse EM ties groups at zero and so learns less), {regime}:** "
            f"{'holds' if mech else 'does not hold'} — zero-variance fraction "
            + ", ".join(f"{s} {zv[s]:.3f}" for s in zv)
            + f"; most tied: {most_tied}, least gain: {least_gain}; Spearman(zero-var, gain) over "
            f"{len(sub)} cells = {num_text(r, 2)}; partial credit at step 1 (wrong rollouts with 0 < F1 < 1): "
            f"{num_text(sub['partial_credit_step1'].mean())}."
        )
        early, late = sub["length_early"].mean(), sub["length_late"].mean()
        lines.append(
            f"- **§6.4 (responses compress; the length-clip ratio stays low), {regime}:** "
            f"{'holds' if late < early else 'does not hold'} — policy tokens per rollout {num_text(early, 1)} "
            f"(steps 1-3) -> {num_text(late, 1)} (last 3 matched steps); length-clip ratio "
            + ", ".join(f"{s} {_column_mean(sub, 'clip_ratio', shape=s):.3f}" for s in means)
            + "."
        )
        rs = sub["reward_em_r"]
        lines.append(
            f"- **§6.5 (training reward tracks held-out EM), {regime}:** mean Pearson r over checkpoints "
            f"{num_text(rs.mean(), 2)} (cells with r > 0: {int((rs > 0).sum())} of {int(rs.notna().sum())}); "
            + ", ".join(f"{s} {_column_mean(sub, 'reward_em_r', shape=s):.2f}" for s in means)
            + "."
        )
    g10 = frame[frame["group"] == large] if large is not None else frame.iloc[:0]
    if len(g10):
        seeds = sorted(int(sd) for sd in g10["seed"].unique())
        sp = frame[(frame["regime"] == g10["regime"].iloc[0]) & frame["seed"].isin(seeds)]
        gaps = group_gaps(sp, seeds, n_boot, claims)
        zv = {g: _column_mean(sp[sp["group"] == g], "zero_var", shape=claims.worse) for g in (small, large)}
        lines.append(
            f"- **Group size (§7), {g10['regime'].iloc[0]}, seeds {', '.join(map(str, seeds))}:** gain gap "
            f"{claims.better} - {claims.worse} (paired by seed, 95% CI) {gaps[small][0]:+.3f} {ci_text(gaps[small][1])} "
            f"at G = {small} and {gaps[large][0]:+.3f} {ci_text(gaps[large][1])} at G = {large} "
            f"({gap_verdict(gaps, small, large)}); {claims.worse}'s zero-variance "
            f"fraction {zv[small]:.3f} -> {zv[large]:.3f}; EM at the first checkpoint, G = {small} -> {large}: "
            + ", ".join(
                f"{s} {_column_mean(sp[sp['group'] == small], 'first_em', shape=s):.3f} -> "
                f"{_column_mean(sp[sp['group'] == large], 'first_em', shape=s):.3f}"
                for s in (claims.worse, claims.better)
            )
            + "."
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m study.regimes", description=__doc__.split("\n\n")[0])
    p.add_argument("--dense", type=Path, help="the dense study's raw export (test/, logs/)")
    p.add_argument(
        "--sparse",
        type=Path,
        required=True,
        help="the sparse study's raw results (test/, logs/, and trees such as g10/)",
    )
    p.add_argument(
        "--sparse-logs",
        type=Path,
        help="folder of every sparse cell's <cell>/metrics.jsonl, e.g. the runs folder (default: SPARSE/logs and SPARSE/g10/logs)",
    )
    p.add_argument("--out", type=Path, required=True, help="folder to write")
    p.add_argument("--no-figures", action="store_true", help="write the tables only: no PNG is drawn")
    p.add_argument(
        "--last-place", required=True, help="the shape stated in advance to rank last (C2: em_only)"
    )
    p.add_argument(
        "--gap", nargs=2, required=True, metavar=("BETTER", "WORSE"), help="the shapes of the paired gain gap"
    )
    p.add_argument("--gap-meaning", help="what a positive gap says (default: BETTER learns more)")
    p.add_argument(
        "--bootstrap", type=int, default=1000, help="resamples of the seeds for each 95%% CI (0: no CIs)"
    )
    return p


def write_regimes(args: argparse.Namespace) -> list[Path]:
    """Write the report (docs/micro_study/regimes.md) to ``args.out``; returns the files written."""
    trees = []
    if args.dense is not None:
        trees.append(load_tree("dense", args.dense))
    trees.append(load_tree("sparse", args.sparse, args.sparse_logs))
    for sub in sorted(
        p for p in args.sparse.iterdir() if (p / "test").is_dir()
    ):  # e.g. the group-size tree g10/
        trees.append(load_tree("sparse", sub, args.sparse_logs))  # a runs folder holds every cell's log
    matched = {}
    for t in trees:
        horizons = [r.known_horizon for r in t.results.runs.values()]
        matched.setdefault(t.regime, resolve_matched_horizon("auto", horizons))
    frame = pd.concat([cells(t, matched[t.regime]) for t in trees], ignore_index=True)
    if frame.empty:
        raise ResultsError(f"{args.sparse}: no trained checkpoint evaluated. Fix: run the study first")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "cells.csv", index=False, float_format="%.6f")
    claims = Claims(args.last_place, *args.gap, args.gap_meaning or f"{args.gap[0]} learns more")
    small, large = group_levels(frame)
    main = frame[frame["group"] == small]
    tests = {r: ranking(main[main["regime"] == r]) for r in main["regime"].unique()}
    t1 = []
    for regime, test in tests.items():
        sub = main[main["regime"] == regime]
        t1 += [
            f"## {regime} regime (matched horizon {matched[regime]})",
            "",
            regime_table_markdown(sub, args.bootstrap),
            "",
        ]
        t1 += ranking_markdown(regime, test, claims.last) + [""]
    (out / "table1.md").write_text("# Table 1 per regime\n\n" + "\n".join(t1), encoding="utf-8")
    g10_frame = frame[frame["group"] == large] if large is not None else frame.iloc[:0]
    gs = ""
    if len(g10_frame):
        seeds = sorted(int(sd) for sd in g10_frame["seed"].unique())
        sp = frame[
            (frame["regime"] == g10_frame["regime"].iloc[0])
            & frame["shape"].isin([claims.worse, claims.better])
        ]
        gs = group_size_markdown(sp, seeds, args.bootstrap, claims)
        (out / "group_size.md").write_text(
            f"# Group size (seeds {', '.join(map(str, seeds))})\n\n{gs}\n", encoding="utf-8"
        )
    fig = out / "fig_zero_variance_gain.png"
    if not args.no_figures:
        figures.plot_zero_variance_gain(frame, fig)
    index = [
        "# The micro study's two reward regimes side by side",
        "",
        "Generated by `python -m study.regimes` from the raw results (see docs/micro_study/regimes.md).",
        "",
        "## Conclusion",
        "",
        *conclusion(frame, tests, args.bootstrap, claims),
        "",
        "\n".join(t1),
        *(["## Group size", "", gs, ""] if gs else []),
        "## Zero-variance fraction against gain",
        "",
        f"![zero-variance vs gain]({fig.name})",
        "",
        f"Filled: G = {small}; hollow: G = {large}; circles: dense, squares: sparse. Per-cell numbers: `cells.csv`.",
        "",
    ]
    (out / "index.md").write_text("\n".join(index), encoding="utf-8")
    return sorted(p for p in out.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.bootstrap < 0:
        print(
            f"error: --bootstrap {args.bootstrap}: must be >= 0. Fix: pass a count of resamples (0: no CIs)"
        )
        return 2
    try:
        written = write_regimes(args)
    except ResultsError as err:
        print(f"error: {err}")
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
