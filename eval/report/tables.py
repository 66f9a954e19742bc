"""The paper's tables (Table 1, Tables 3-5) as tidy frames and Markdown, and the checkpoint
selection rules they report (:func:`select_checkpoints`, paper §5.3; docs/evaluation.md, "python
-m eval select"). ``python -m eval select`` and ``python -m eval report`` both select with it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pandas as pd

from eval.results import AVG_ALL, AVG_HELDOUT, IN_DISTRIBUTION, JUDGE, benchmark_label
from eval.stats import rank_groups
from reward_fns import PRIMARY, SHAPES, metric_named, metric_names
from search_env.protocol import PRESETS, TRAIN_PRESET

MATCHED = "matched"
OWN = "own"
VAL_RULES = {MATCHED: "val_matched", OWN: "val_own"}
"""The validation-chosen rule of each test-chosen rule (same candidate steps)."""
FLOOR = "untrained (step 0)"
AVERAGES = (AVG_ALL, AVG_HELDOUT)
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
    :attr:`eval.results.Results.scores` frames.

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
    wide = cell_values(scores, selections, floors, "em")[list(AVERAGES)].reset_index()
    extra = selections[["run", "rule", "step", "last_step", "short"]]
    frame = wide.merge(extra, on=["run", "rule", "step"], how="left")  # the floor (step 0) gets no match
    frame["short"] = frame["short"].astype("boolean").fillna(False).astype(bool)
    frame["last_step"] = frame["last_step"].astype("Int64")
    for avg in AVERAGES:
        ci = cis[(cis["benchmark"] == avg) & (cis["metric"] == "em")][["run", "step", "lo", "hi"]]
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


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _fmt(value: float) -> str:
    return "–" if pd.isna(value) else f"{value:.3f}"


STUDY_FLOOR_EM: dict[str, float] = {
    "bamboogle": 0.072,
    "nq": 0.100,
    "triviaqa": 0.202,
    "popqa": 0.124,
    "hotpotqa": 0.083,
    "2wikimultihopqa": 0.046,
    "musique": 0.018,
}
"""The study's untrained Qwen3.5-0.8B, EM per benchmark (``docs/report/RESULTS_m4.md`` §4.1, M4.5
``qwen35_terse`` = the training prompt, full suite, greedy, its evaluation loop; mean 0.092)."""
STUDY_FLOOR = "study's untrained floor (RESULTS_m4 §4.1; the study's number)"


def study_floor(avg: str, suite: Sequence[str]) -> float | None:
    """The study's floor for one average (mean of ``STUDY_FLOOR_EM`` over its benchmarks), or None
    when ``suite`` is not the study's seven benchmarks (a different suite is not comparable)."""
    if set(suite) != set(STUDY_FLOOR_EM):
        return None
    names = [b for b in STUDY_FLOOR_EM if avg == AVG_ALL or b not in IN_DISTRIBUTION]
    return sum(STUDY_FLOOR_EM[b] for b in names) / len(names)


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


STAGE_MARKS = {"full": "", "confirmed": "ᶜ", "screened": "ˢ"}
"""How a number's stage is marked in tables (eval.runner): unmarked = every row of the suite."""


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
        rows.append([STUDY_FLOOR, *["–" for _ in seeds], _fmt(reference), "–", *(["–"] if judged else [])])
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
    profile = done.groupby(["shape", "searches"], as_index=False).agg(n=("em", "size"), em=("em", "mean"))
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
