"""The sequential evaluation plan against full evaluation, side by side (docs/evaluation.md).

Default, ``simulate``: the study's scale without a model. Seven benchmarks of the real sizes, 9 runs
of 19-32 checkpoints (one every 10 steps), per-question outcomes drawn around learning curves shaped
like the study's (floor 0.092, best about 0.35, plateau jitter, some late declines), questions
correlated across a run's checkpoints. Each simulated study is evaluated both ways with the real plan
code (``eval.run.sequential.decide``, ``rows_for_halfwidth``; step 0 keyed by ``eval.run.settings.step0_key``) and
prints the rollouts of each, how often the sequential choice is within 0.01 of the best checkpoint's
full-suite macro EM, and the selection effect of each plan's reported number. Last line:

    eval_plan: rollout_fraction=F within_delta=K/N step0_evals=S

``--measure``: real CPU runs (:mod:`bench.eval_plan_measure`).

    .venv/bin/python -m bench.eval_plan [--studies 200] [--seed 0] [--screen-rows 200]
                                        [--delta 0.01] [--halfwidth 0.01]
    .venv/bin/python -m bench.eval_plan --measure [--steps 4] [--test-people 1100] [--replay] [--work DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eval.run import sequential as seq
from eval.run.settings import step0_key
from search_env.benchmarks import STUDY_FLOOR, STUDY_SIZES

CHECKPOINTS = (19, 24, 32)
"""Checkpoints per run by seed (caps 180/230/312 at one save every 10 steps, plus the last)."""
SAVE_EVERY = 10
MATCHED = 180
KEEP = 0.8
"""Chance that a question's latent difficulty carries over from one checkpoint to another (the rest
is drawn afresh): two checkpoints at EM 0.35 then disagree on about 15 % of questions."""


@dataclass
class Run:
    """One simulated run: per-checkpoint full-suite scores and the prefix outcomes the plan reads."""

    steps: list[int]
    truth: np.ndarray  # (K, B) expected EM per benchmark
    outcomes: dict[str, np.ndarray]  # benchmark -> (K, N_b) 0/1 in subsample order


def simulate_run(rng: np.random.Generator, k: int) -> Run:
    """Learning curve (rise, plateau jitter, sometimes a late decline) and 0/1 outcomes per question."""
    best = rng.uniform(0.32, 0.38)
    floor = np.array([STUDY_FLOOR[b] for b in STUDY_SIZES])
    trained = np.array([seq.STUDY_TRAINED[b] for b in STUDY_SIZES])
    top = trained * best / trained.mean()
    t = np.arange(1, k + 1)
    curve = 1 - np.exp(-t / rng.uniform(2, 8)) + rng.normal(0, 0.03, k)
    if rng.random() < 0.3:  # a late decline (the study saw some runs fall off)
        start = rng.integers(k // 2, k)
        curve -= rng.uniform(0.05, 0.3) * np.clip((t - start) / k, 0, None)
    truth = floor + np.clip(curve, 0, 1.05)[:, None] * (top - floor)
    outcomes = {}
    for j, (bench, size) in enumerate(STUDY_SIZES.items()):
        latent = rng.random(size, dtype=np.float32)
        w = rng.random((k, size), dtype=np.float32)
        value = np.where(w < KEEP, latent, (w - KEEP) / (1 - KEEP))
        outcomes[bench] = (value < truth[:, j : j + 1]).astype(np.float32)
    return Run([int(s) * SAVE_EVERY for s in t], truth, outcomes)


def full_values(run: Run) -> np.ndarray:
    """Full-suite macro EM of every checkpoint."""
    return np.mean([o.mean(axis=1) for o in run.outcomes.values()], axis=0)


def sequential(run: Run, screen_rows: int, delta: float, halfwidth: float) -> tuple[int, int, dict[str, int]]:
    """(selected checkpoint index, rollouts for the trained checkpoints, confirm rows) of the plan."""
    n_screen = {b: min(screen_rows, size) for b, size in STUDY_SIZES.items()}
    screened = {s: {b: run.outcomes[b][i, : n_screen[b]] for b in n_screen} for i, s in enumerate(run.steps)}
    rules = {"own": run.steps, "matched": [s for s in run.steps if s <= MATCHED]}
    decision = seq.decide(screened, rules, delta)
    n_conf = seq.confirm_rows(decision, screened, STUDY_SIZES, n_screen, halfwidth)
    kept = decision.confirm
    confirmed = {
        s: np.mean([run.outcomes[b][run.steps.index(s), : n_conf[b]].mean() for b in n_conf]) for s in kept
    }
    own = max(kept, key=lambda s: (confirmed[s], -s))
    rollouts = len(run.steps) * sum(n_screen.values()) + len(kept) * (
        sum(n_conf.values()) - sum(n_screen.values())
    )
    return run.steps.index(own), rollouts, n_conf


def simulate(args: argparse.Namespace) -> str:
    rng = np.random.default_rng(args.seed)
    suite_rows = sum(STUDY_SIZES.values())
    full_rollouts = seq_rollouts = 0
    within = total = 0
    effect = {"full": [], "sequential": []}
    step0_evals = 0
    started = time.perf_counter()
    settings = {
        "suite_fingerprint": "study",
        "limits": {"preset": "train"},
        "backend": "vllm",
        "plan": "sequential",
    }
    for _ in range(args.studies):
        confirm_rows = 0
        for k in CHECKPOINTS * 3:
            run = simulate_run(rng, k)
            values = full_values(run)
            truth = run.truth.mean(axis=1)
            chosen, rollouts, n_conf = sequential(run, args.screen_rows, args.delta, args.halfwidth)
            confirm_rows = sum(n_conf.values())
            full_rollouts += (k + 1) * suite_rows  # every checkpoint and step 0, once per run
            seq_rollouts += rollouts
            within += values[chosen] >= values.max() - 0.01
            total += 1
            reported = np.mean([run.outcomes[b][chosen, : n_conf[b]].mean() for b in n_conf])
            effect["sequential"].append(reported - truth[chosen])
            effect["full"].append(values.max() - truth[int(values.argmax())])
        # step 0: one evaluation per distinct key; the 9 runs share the base model and settings
        step0_evals = len({step0_key("base-model", settings) for _ in range(len(CHECKPOINTS) * 3)})
        seq_rollouts += confirm_rows * step0_evals
    fraction = seq_rollouts / full_rollouts
    print(f"{args.studies} simulated studies x 9 runs ({time.perf_counter() - started:.1f} s)")
    print(
        "| plan | rollouts per study | ratio | selected within 0.01 of the best | selection effect (mean, 95th pct) |"
    )
    print("|---|---|---|---|---|")
    for name, rolls, hits in (("full", full_rollouts, total), ("sequential", seq_rollouts, within)):
        e = np.asarray(effect[name])
        print(
            f"| {name} | {rolls / args.studies:,.0f} | {rolls / full_rollouts:.3f} | {hits}/{total} "
            f"| {e.mean():+.4f}, {np.percentile(e, 95):+.4f} |"
        )
    return (
        f"eval_plan: rollout_fraction={fraction:.3f} within_delta={within}/{total} step0_evals={step0_evals}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--studies", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--screen-rows", type=int, default=seq.SCREEN_ROWS)
    parser.add_argument("--delta", type=float, default=seq.DELTA)
    parser.add_argument("--halfwidth", type=float, default=seq.HALFWIDTH)
    parser.add_argument("--measure", action="store_true", help="real CPU runs instead of the simulation")
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/eval_plan_measure"), help="--measure: work folder"
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="--measure: training steps per run (a checkpoint every 2)"
    )
    parser.add_argument(
        "--test-people", type=int, default=1100, help="--measure: test region size (1100: a 4,107-row suite)"
    )
    parser.add_argument("--max-in-flight", type=int, help="--measure: eval run's --max-in-flight")
    parser.add_argument(
        "--replay", action="store_true", help="--measure: sequential plan replayed on the full plan's rows"
    )
    args = parser.parse_args(argv)
    if args.measure:
        from bench.eval_plan_measure import measure

        print(measure(args))
    else:
        print(simulate(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
