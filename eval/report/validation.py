"""Table 1 with checkpoints chosen on the validation split (``table1_val``): the cells the
``val_*`` selection rules pick, scored on the test split, beside the test-chosen ones
(docs/report.md, "Outputs")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from eval.report.results import AVG_ALL, Results, check_disjoint
from eval.report.select import MATCHED, OWN, VAL_RULES, select_checkpoints
from eval.report.uncertainty import last_per_seed, verdict
from eval.stats import ranking_test
from reward_fns import PRIMARY
from search_env.markdown import markdown_table


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
                f"- strictly last per seed: {last_per_seed(test)}; {verdict(test)} "
                f"(P = {test.p_given_shape} for a pre-specified shape, {test.p_any_shape} for any).",
                "",
            ]
    return "\n".join(lines)
