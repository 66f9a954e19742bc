"""The paper's tables (Table 1, Tables 3-5) as tidy frames and Markdown, from the checkpoints
:mod:`eval.report.select` chose (paper §5.3)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from eval.report.results import AVG_ALL, AVG_HELDOUT, JUDGE, benchmark_label
from eval.report.select import MATCHED, OWN, STAGE_MARKS
from eval.stats import rank_groups
from reward_fns import PRIMARY, SHAPES, metric_names
from search_env.benchmarks import FLOOR_SOURCE, IN_DISTRIBUTION, STUDY_FLOOR
from search_env.markdown import markdown_table
from search_env.protocol import PRESETS, TRAIN_PRESET

FLOOR = "untrained (step 0)"
AVERAGES = (AVG_ALL, AVG_HELDOUT)


def order_shapes(shapes: Sequence[str]) -> list[str]:
    """The paper's shapes in its order (em_only, f1_only, f1_format), then any others sorted."""
    known = [s for s in SHAPES if s in shapes]
    return known + sorted(set(shapes) - set(known))


def rule_label(rule: str, matched_horizon: int) -> str:
    """Human label of a selection rule."""
    return (
        f"matched horizon (step <= {matched_horizon})"
        if rule == MATCHED
        else "own horizon (step <= run's cap)"
    )


def cell_values(
    scores: pd.DataFrame, selections: pd.DataFrame, floors: pd.DataFrame, metric: str
) -> pd.DataFrame:
    """Wide frame of ``metric`` per selected cell: index (rule, row, seed, run, step), one column per
    benchmark key incl. the two averages. The floor appears under both rules with row FLOOR."""
    picks = selections[["rule", "shape", "seed", "run", "step"]].rename(columns={"shape": "row"})
    floor = floors.assign(step=0, row=FLOOR)
    both = [floor.assign(rule=rule) for rule in (MATCHED, OWN)]
    picks = pd.concat([*both, picks], ignore_index=True)
    merged = picks.merge(scores[["run", "step", "benchmark", metric]], on=["run", "step"])
    wide = merged.pivot_table(
        index=["rule", "row", "seed", "run", "step"], columns="benchmark", values=metric, aggfunc="first"
    )
    wide.columns.name = None
    return wide


def table1(
    scores: pd.DataFrame,
    selections: pd.DataFrame,
    floors: pd.DataFrame,
    cis: pd.DataFrame,
    criterion: str = AVG_ALL,
) -> pd.DataFrame:
    """Table 1 (tidy): one row per (rule, row, seed) with ``step, last_step, short``, EM for both
    averages with their bootstrap CI bounds (NaN without rows.jsonl), and ``rank`` of the shape
    within (rule, seed) by the ``criterion`` average (1 = best; ties share the better rank)."""
    wide = cell_values(scores, selections, floors, PRIMARY)[list(AVERAGES)].reset_index()
    extra = selections[["run", "rule", "step", "last_step", "short"]]
    frame = wide.merge(extra, on=["run", "rule", "step"], how="left")  # the floor (step 0) gets no match
    frame["short"] = frame["short"].astype("boolean").fillna(False).astype(bool)
    frame["last_step"] = frame["last_step"].astype("Int64")
    for avg in AVERAGES:
        ci = cis[(cis["benchmark"] == avg) & (cis["metric"] == PRIMARY)][["run", "step", "lo", "hi"]]
        ci = ci.rename(columns={"lo": f"{avg}_lo", "hi": f"{avg}_hi"})
        frame = frame.merge(ci, on=["run", "step"], how="left")
    frame = frame.rename(columns={AVG_ALL: "avg_all_em", AVG_HELDOUT: "avg_heldout_em"})
    judged = JUDGE in scores.columns
    if judged:
        judge = cell_values(scores, selections, floors, JUDGE)[list(AVERAGES)].reset_index()
        judge = judge.rename(columns={AVG_ALL: "avg_all_judge", AVG_HELDOUT: "avg_heldout_judge"})
        frame = frame.merge(
            judge[["rule", "run", "step", "avg_all_judge", "avg_heldout_judge"]].drop_duplicates(),
            on=["rule", "run", "step"],
            how="left",
        )
    trained = frame["row"] != FLOOR
    key = f"{criterion}_em"
    frame["rank"] = pd.NA
    frame.loc[trained, "rank"] = (
        frame[trained].groupby(["rule", "seed"])[key].rank(method="min", ascending=False).astype(int)
    )
    columns = [
        "rule",
        "row",
        "seed",
        "run",
        "step",
        "last_step",
        "short",
        "avg_all_em",
        "avg_all_lo",
        "avg_all_hi",
        "avg_heldout_em",
        "avg_heldout_lo",
        "avg_heldout_hi",
        "rank",
        *(["avg_all_judge", "avg_heldout_judge"] if judged else []),
    ]
    return _sorted_cells(frame)[columns]


def _sorted_cells(frame: pd.DataFrame) -> pd.DataFrame:
    """Floor rows first, then matched-horizon and own-horizon cells; shapes in paper order; by seed."""
    rules = {MATCHED: 1, OWN: 2}
    shapes = {s: i for i, s in enumerate(order_shapes([r for r in frame["row"].unique() if r != FLOOR]))}
    keys = pd.DataFrame(
        {
            "floor": (frame["row"] != FLOOR).astype(int),
            "rule": frame["rule"].map(rules).fillna(0),
            "shape": frame["row"].map(shapes).fillna(-1),
            "seed": frame["seed"],
        }
    )
    order = keys.sort_values(["rule", "floor", "shape", "seed"], kind="stable").index
    return frame.loc[order].reset_index(drop=True)


def seed_rankings(t1: pd.DataFrame, rule: str, column: str) -> dict[int, list[list[tuple[str, float]]]]:
    """Per seed: shapes grouped best-first by ``column`` (ties grouped) with their values."""
    out = {}
    trained = t1[(t1["rule"] == rule) & (t1["row"] != FLOOR)]
    for seed, sub in trained.groupby("seed"):
        values = dict(zip(sub["row"], sub[column], strict=True))
        out[int(seed)] = [[(name, values[name]) for name in group] for group in rank_groups(values)]
    return out


def format_ranking(groups: list[list[tuple[str, float]]]) -> str:
    """``a (0.310) > b (0.300) = c (0.300)``."""
    return " > ".join(" = ".join(f"{name} ({value:.3f})" for name, value in group) for group in groups)


def _fmt(value: float) -> str:
    return "–" if pd.isna(value) else f"{value:.3f}"


def study_floor(avg: str, suite: Sequence[str]) -> float | None:
    """The study's floor for one average (mean of ``search_env.benchmarks.STUDY_FLOOR`` over its
    benchmarks), or None when ``suite`` is not the study's suite (a different suite is not comparable)."""
    if set(suite) != set(STUDY_FLOOR):
        return None
    names = [b for b in STUDY_FLOOR if avg == AVG_ALL or b not in IN_DISTRIBUTION]
    return sum(STUDY_FLOOR[b] for b in names) / len(names)


def limits_preset_of(run_dir: Path) -> str:
    """The rollout limits preset recorded in ``run_dir/run.json`` (``eval.limits.preset``); runs
    evaluated before presets existed used the training limits (``train``)."""
    path = run_dir / "run.json"
    doc = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    limits = (doc.get("eval") or {}).get("limits") or {}
    return str(limits.get("preset", TRAIN_PRESET.name))


def preset_caption(presets: Sequence[str]) -> str:
    """Caption line naming the rollout limits preset(s) the evaluated rows were made with."""
    named = ", ".join(
        f"`{p}` ({PRESETS[p].source})" if p in PRESETS else f"`{p}`" for p in sorted(set(presets))
    )
    return (
        f"- Rollout limits preset: {named} (`python -m eval run --limits-preset`; values in each run.json)."
    )


def table1_markdown(
    t1: pd.DataFrame,
    rule: str,
    avg: str,
    shapes: Sequence[str],
    seeds: Sequence[int],
    reference: float | None = None,
    stages: Mapping[tuple[str, int], str] | None = None,
) -> str:
    """Wide Markdown view of one (rule, average) slice: rows = floor + shapes, columns = seeds, mean,
    seed range. A cell reads ``value [CI low, high] @step``; † marks a run whose last evaluated step
    is below the matched horizon; ``stages`` ((run, step) -> stage) marks numbers that are not
    full-suite (:data:`STAGE_MARKS`). ``reference`` (the study's floor, :func:`study_floor`) adds a
    last row labelled as the study's number, with its value under "mean over seeds"."""
    sub = t1[t1["rule"] == rule]
    judged = f"{avg}_judge" in sub.columns
    header = ["reward", *[f"seed {s}" for s in seeds], "mean over seeds", "seed range"]
    header += ["judge, mean over seeds"] if judged else []
    rows = []
    for row in [FLOOR, *shapes]:
        cells, values, judge = [], [], []
        for seed in seeds:
            hit = sub[(sub["row"] == row) & (sub["seed"] == seed)]
            if hit.empty:
                cells.append("–")
                continue
            rec = hit.iloc[0]
            value = rec[f"{avg}_em"]
            values.append(value)
            if judged and not pd.isna(rec[f"{avg}_judge"]):
                judge.append(rec[f"{avg}_judge"])
            ci = "" if pd.isna(rec[f"{avg}_lo"]) else f" [{rec[f'{avg}_lo']:.3f}, {rec[f'{avg}_hi']:.3f}]"
            mark = "†" if rec["short"] else ""
            where = "" if row == FLOOR else f" @{int(rec['step'])}{mark}"
            stage = STAGE_MARKS.get(stages.get((rec["run"], int(rec["step"])), "full"), "") if stages else ""
            cells.append(f"{value:.3f}{stage}{ci}{where}")
        mean = sum(values) / len(values) if values else float("nan")
        spread = max(values) - min(values) if values else float("nan")
        rows.append([row, *cells, _fmt(mean), _fmt(spread)])
        if judged:
            rows[-1].append(_fmt(sum(judge) / len(judge)) if judge else "–")
    if reference is not None:
        rows.append([FLOOR_SOURCE, *["–" for _ in seeds], _fmt(reference), "–", *(["–"] if judged else [])])
    return markdown_table(header, rows)


def per_benchmark_table(
    scores: pd.DataFrame, selections: pd.DataFrame, floors: pd.DataFrame, metric: str, suite: Sequence[str]
) -> pd.DataFrame:
    """Tables 3-5: ``metric`` per benchmark for every selected cell and the floor, plus both averages.

    Columns: ``rule, row, seed, step`` then one column per benchmark label (MuSiQue suffixed
    ``(ID)``, in-distribution), ``Avg (all N)`` and ``Avg (held-out N)``.
    """
    if metric not in metric_names() and not (metric == JUDGE and JUDGE in scores.columns):
        raise ValueError(f"metric must be one of {metric_names()} (or {JUDGE!r} when judged), got {metric!r}")
    wide = cell_values(scores, selections, floors, metric)[[*suite, *AVERAGES]].reset_index()
    heldout = len([b for b in suite if b not in IN_DISTRIBUTION])
    names = {b: benchmark_label(b) + (" (ID)" if b in IN_DISTRIBUTION else "") for b in suite}
    names.update({AVG_ALL: f"Avg (all {len(suite)})", AVG_HELDOUT: f"Avg (held-out {heldout})"})
    wide = wide.rename(columns=names).drop(columns="run")
    floor = wide["row"] == FLOOR
    wide.loc[floor, "rule"] = "step 0"
    wide = wide[~(floor & wide.duplicated(["rule", "row", "seed"]))]
    return _sorted_cells(wide)


def frame_markdown(frame: pd.DataFrame, digits: int = 3) -> str:
    """Markdown of a frame, floats to ``digits`` decimals, NaN as an en dash."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return "–" if pd.isna(value) else f"{value:.{digits}f}"
        return str(value)

    return markdown_table(
        list(frame.columns), [[cell(v) for v in row] for row in frame.itertuples(index=False)]
    )


def search_profile(rows: pd.DataFrame, max_searches: int = 10) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Fig. 13 data from per-question rows with a ``shape`` column (caller filters benchmarks).

    A rollout is *completed* when a prediction was extracted, otherwise *aborted* (ended
    without an ``<answer>``; the same rule as ``abort_rate`` in summary.json). Returns
    (profile, aborts): profile has ``shape, searches, n, share, em`` over completed rollouts with a
    known search count, counts above ``max_searches`` folded into ``max_searches``, ``share`` = n /
    completed rollouts of the shape and ``em`` = mean EM; aborts has ``shape, n, abort_rate`` and the
    fraction of rollouts ending by each termination reason (``term_<reason>``).
    """
    completed = rows["answered"]
    done = rows[completed & (rows["searches"] >= 0)].assign(
        searches=lambda f: f["searches"].clip(upper=max_searches)
    )
    profile = done.groupby(["shape", "searches"], as_index=False).agg(
        n=(PRIMARY, "size"), **{PRIMARY: (PRIMARY, "mean")}
    )
    profile["share"] = profile["n"] / profile.groupby("shape")["n"].transform("sum")
    aborts = (
        rows.assign(aborted=~completed)
        .groupby("shape", as_index=False)
        .agg(n=("aborted", "size"), abort_rate=("aborted", "mean"))
    )
    reasons = rows[rows["termination"] != ""]
    if len(reasons):
        share = pd.crosstab(reasons["shape"], reasons["termination"], normalize="index").add_prefix("term_")
        aborts = aborts.merge(share.reset_index(), on="shape", how="left")
    return profile[["shape", "searches", "n", "share", "em"]], aborts
