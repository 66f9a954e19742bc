"""``python -m study list --gpu-hours``: each cell's training steps and checkpoint evaluations, priced
at the stated per-step and per-rollout costs (the study file's ``cost``, or the command line's)."""

from __future__ import annotations

from eval.run.checkpoints import get_dotted
from study.spec import Cell, Study, recipe_tree


def checkpoints(cap: int, save_freq: int | None) -> int:
    """Checkpoints a run of ``cap`` steps writes: every ``save_freq`` steps and the last one."""
    if not save_freq or save_freq < 1:
        return 1
    return cap // save_freq + (1 if cap % save_freq else 0)


def cost_table(study: Study, cells: list[Cell], step_s: float | None, rollout_s: float | None) -> str:
    """A table per cell (steps, checkpoints, rollouts, GPU-hours) and the total; step 0 counted once per
    base model (its rows are shared by every cell that starts from it)."""
    cost = study.spec.cost
    step_s = cost.step_seconds if step_s is None else step_s
    rollout_s = cost.rollout_seconds if rollout_s is None else rollout_s
    rows = []
    bases: set[str] = set()
    total = [0, 0, 0, 0.0, 0.0]
    for c in cells:
        cfg = recipe_tree(c.recipe)
        ckpts = checkpoints(c.cap, get_dotted(cfg, "trainer.save_freq"))
        base = str(c.axes.get("model", get_dotted(cfg, "actor_rollout_ref.model.path")))
        evals = ckpts + (0 if base in bases else 1)
        bases.add(base)
        rollouts = evals * cost.suite_rows
        train_h = c.cap * step_s * cost.gpus / 3600
        eval_h = rollouts * rollout_s / 3600
        rows.append(
            f"| {c.name} | {c.cap} | {evals} | {rollouts:,} | {train_h:,.1f} | {eval_h:,.1f} | {train_h + eval_h:,.1f} |"
        )
        for i, v in enumerate((c.cap, evals, rollouts, train_h, eval_h)):
            total[i] += v
    head = [
        f"Stated costs: {step_s:g} GPU-s per training step x {cost.gpus} GPU(s), {rollout_s:g} GPU-s per evaluation "
        f"rollout, {cost.suite_rows:,} rows per evaluation (the full plan; `--plan sequential` rolls out a fraction, "
        "docs/evaluation.md).",
        "",
        "| cell | steps | evaluations (step 0 once per base model) | eval rollouts | train GPU-h | eval GPU-h | GPU-h |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    foot = (
        f"| total | {total[0]} | {total[1]} | {total[2]:,} | {total[3]:,.1f} | {total[4]:,.1f} | "
        f"{total[3] + total[4]:,.1f} |"
    )
    return "\n".join([*head, *rows, foot])
