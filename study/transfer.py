"""The transfer world's study report (``report.transfer`` in a study file; docs/micro_transfer.md):
per test type and reward shape, EM and form-normalised EM ("in X" read as "X") at step 0 and at the
matched horizon, searches per question at both, and the transfer checks of the study's plan. Read
from the raw ``rows.jsonl`` files only, so it regenerates byte for byte.

The checks (docs/micro_transfer.md, "The study"):

- gain: on every asserted held-out type, EM(end) - EM(step 0), averaged over each shape's seeds, is
  at least :data:`MIN_GAIN` with a seed-bootstrap 95 % CI above 0; the selection type's end EM is
  also above its chance rate;
- headroom: the deepest held-out type and the selection type end at least :data:`MIN_HEADROOM` below
  their A2 ceiling (the scripted teacher's solve rate, :data:`A2_CEILING`);
- resolution: for every pair of shapes, the paired seed-bootstrap 95 % CI of the end-point gap in
  held-out EM (the asserted types' mean) has a half-width of at most :data:`MAX_HALF_WIDTH`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from eval.report.results import Results, benchmark_label
from eval.report.select import floor_checkpoints
from eval.report.tables import order_shapes
from eval.stats import ci_text, mean, seed_ci
from reward_fns import PRIMARY
from reward_fns.metrics import form_normalised_em
from search_env.jsonl import iter_jsonl
from search_env.markdown import markdown_table

ASSERTED = {
    "xfer_single_hop": "H1",
    "xfer_new_pair": "H2",
    "xfer_new_triple": "H3",
    "xfer_selection": "H4",
    "xfer_unseen_world": "H5",
}
"""The held-out types the checks assert (``search_demo.transfer_world.HELD_OUT``)."""
DEEPEST = "xfer_new_triple"
SELECTION = "xfer_selection"
SELECTION_CHANCE = 1 / 3
"""One of three named options, picked at random."""
A2_CEILING = 1.0
"""The scripted teacher's solve rate on every type of the shipped world (A2, docs/micro_transfer.md)."""
MIN_GAIN = 0.10
MIN_HEADROOM = 0.15
MAX_HALF_WIDTH = 0.05
HELD_OUT_MEAN = "held-out mean"
"""The pseudo-type: the mean over the asserted types, per cell."""
ROW_FIX = "re-run the evaluation of this checkpoint (eval.run writes rows.jsonl)"
COLUMNS = [PRIMARY, "form", "searches"]
"""Per type: the primary metric (EM), form-normalised EM and searches per question."""


def checkpoint_types(rows_path: Path) -> dict[str, dict[str, float]]:
    """Per benchmark of one checkpoint's ``rows.jsonl``: mean ``em``, ``form`` (form-normalised EM)
    and ``searches`` (per question; a row without a count counts 0)."""
    acc: dict[str, list[tuple[float, float, float]]] = {}
    for _, row in iter_jsonl(rows_path, ROW_FIX, ValueError):
        prediction = row.get("prediction")
        form = form_normalised_em(prediction if isinstance(prediction, str) else None, row["golds"])
        acc.setdefault(row["benchmark"], []).append(
            (float(row[PRIMARY]), form, float(row.get("searches") or 0))
        )
    return {b: dict(zip(COLUMNS, map(mean, zip(*v, strict=True)), strict=True)) for b, v in acc.items()}


def transfer_frame(results: Results, runs: Sequence[str], matched: int) -> pd.DataFrame:
    """One row per (run, benchmark) of ``runs`` evaluated at step ``matched``: shape, seed, and
    ``COLUMNS`` at step 0 (``*_0``: the seed's step-0 checkpoint, whichever run holds it) and at
    ``matched``; plus the pseudo-benchmark :data:`HELD_OUT_MEAN` (the mean over :data:`ASSERTED`)."""
    floor = {
        int(seed): checkpoint_types(results.rows_path(run, 0))
        for seed, run in floor_checkpoints(results.scores).itertuples(index=False)
    }
    records = []
    for name in runs:
        run = results.runs[name]
        end_path = results.rows_path(name, matched)
        if run.seed not in floor or not end_path.is_file():
            continue
        start, end = floor[run.seed], checkpoint_types(end_path)
        for bench in sorted(set(start) & set(end)):
            records.append(
                {
                    "run": name,
                    "shape": run.shape,
                    "seed": run.seed,
                    "benchmark": bench,
                    **{f"{c}_0": start[bench][c] for c in COLUMNS},
                    **{c: end[bench][c] for c in COLUMNS},
                }
            )
    frame = pd.DataFrame.from_records(
        records, columns=["run", "shape", "seed", "benchmark", *[f"{c}_0" for c in COLUMNS], *COLUMNS]
    )
    held = frame[frame["benchmark"].isin(ASSERTED)]
    if not held.empty:
        mean = held.groupby(["run", "shape", "seed"], as_index=False)[
            [f"{c}_0" for c in COLUMNS] + COLUMNS
        ].mean()
        frame = pd.concat([frame, mean.assign(benchmark=HELD_OUT_MEAN)], ignore_index=True)
    frame["gain"] = frame[PRIMARY] - frame[f"{PRIMARY}_0"]
    return frame


def _label(bench: str) -> str:
    return HELD_OUT_MEAN if bench == HELD_OUT_MEAN else benchmark_label(bench)


def profile_table(frame: pd.DataFrame, n_boot: int) -> str:
    """Per type and shape (seeds pooled): EM, form-normalised EM and searches, step 0 -> end, and the
    EM gain with its seed-bootstrap 95 % CI."""
    header = [
        "type",
        "shape",
        "seeds",
        "EM 0 -> end",
        "form 0 -> end",
        "searches 0 -> end",
        "EM gain",
        "95 % CI",
    ]
    rows = []
    benches = [b for b in dict.fromkeys(frame["benchmark"]) if b != HELD_OUT_MEAN] + [HELD_OUT_MEAN]
    for bench in benches:
        part = frame[frame["benchmark"] == bench]
        for shape in order_shapes(part["shape"].unique()):
            cells = part[part["shape"] == shape].sort_values("seed")
            m = cells[[f"{c}_0" for c in COLUMNS] + COLUMNS + ["gain"]].mean()
            ci = seed_ci(cells["gain"].tolist(), n_boot, f"transfer:gain:{bench}:{shape}")
            rows.append(
                [
                    _label(bench),
                    shape,
                    str(len(cells)),
                    f"{m[f'{PRIMARY}_0']:.3f} -> {m[PRIMARY]:.3f}",
                    f"{m['form_0']:.3f} -> {m['form']:.3f}",
                    f"{m['searches_0']:.2f} -> {m['searches']:.2f}",
                    f"{m['gain']:+.3f}",
                    ci_text(ci),
                ]
            )
    return markdown_table(header, rows)


def check_lines(frame: pd.DataFrame, n_boot: int) -> list[str]:
    """The checks of the module docstring, one line each with its numbers and verdict."""
    lines = []
    shapes = order_shapes(frame["shape"].unique())
    for bench, tag in ASSERTED.items():
        for shape in shapes:
            cells = frame[(frame["benchmark"] == bench) & (frame["shape"] == shape)]
            if cells.empty:
                lines.append(f"- gain, {tag} {_label(bench)}, {shape}: no cells.")
                continue
            gain = float(cells["gain"].mean())
            ci = seed_ci(cells["gain"].tolist(), n_boot, f"transfer:gain:{bench}:{shape}")
            ok = gain >= MIN_GAIN and ci[0] > 0
            said = f"gain {gain:+.3f}, 95 % CI {ci_text(ci)}"
            if bench == SELECTION:
                end = float(cells[PRIMARY].mean())
                ok = ok and end > SELECTION_CHANCE
                said += f", end EM {end:.3f} against chance {SELECTION_CHANCE:.3f}"
            lines.append(
                f"- gain, {tag} {_label(bench)}, {shape} ({len(cells)} seeds): {said}: {_verdict(ok)}."
            )
    for bench in (DEEPEST, SELECTION):
        for shape in shapes:
            cells = frame[(frame["benchmark"] == bench) & (frame["shape"] == shape)]
            if cells.empty:
                continue
            end = float(cells[PRIMARY].mean())
            ok = end <= A2_CEILING - MIN_HEADROOM
            lines.append(
                f"- headroom, {_label(bench)}, {shape}: end EM {end:.3f}, A2 ceiling {A2_CEILING:.2f}: "
                f"{_verdict(ok)}."
            )
    held = frame[frame["benchmark"] == HELD_OUT_MEAN]
    for better, worse in itertools.combinations(shapes, 2):
        a = held[held["shape"] == better].set_index("seed")[PRIMARY]
        b = held[held["shape"] == worse].set_index("seed")[PRIMARY]
        diffs = (a - b).dropna()
        if len(diffs) < 2:
            lines.append(f"- resolution, {better} - {worse}: {len(diffs)} paired seeds, too few.")
            continue
        ci = seed_ci(diffs.tolist(), n_boot, f"transfer:resolution:{better}:{worse}")
        half = (ci[1] - ci[0]) / 2
        lines.append(
            f"- resolution, {better} - {worse} ({len(diffs)} paired seeds): end held-out EM gap "
            f"{float(diffs.mean()):+.3f}, 95 % CI {ci_text(ci)}, half-width {half:.3f}: "
            f"{_verdict(half <= MAX_HALF_WIDTH)}."
        )
    return lines


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def transfer_markdown(frame: pd.DataFrame, matched: int, n_boot: int) -> str:
    """``transfer.md``: the type profile table and the checks."""
    return (
        "\n".join(
            [
                "# Transfer by type",
                "",
                f"Step 0 against the checkpoint at the matched horizon (step {matched}), seeds pooled. `form`: EM "
                "after dropping one leading 'in'/'by' (the answer's form told apart from its content); "
                "`searches`: per question. CIs: percentile intervals of "
                f"{n_boot} resamples of the seeds. Definitions: docs/micro_transfer.md.",
                "",
                profile_table(frame, n_boot).rstrip("\n"),
                "",
                "## Checks",
                "",
                f"Thresholds: gain >= {MIN_GAIN:.2f} with CI above 0 on H1-H5 (H4 also above chance); the deepest "
                f"and the selection type >= {MIN_HEADROOM:.2f} below the A2 ceiling; the paired CI half-width "
                f"of every shape pair's end-point gap <= {MAX_HALF_WIDTH:.2f}.",
                "",
                *check_lines(frame, n_boot),
            ]
        )
        + "\n"
    )
