"""`bench/eval_plan.py --measure`: both evaluation plans on the same real CPU checkpoints.

A synthetic suite shaped like the paper's (a larger test region of the study world: five benchmarks
of unequal sizes, one under 150 rows, over 4,000 rows), runs trained with the sparse micro study's
settings (``recipes/micro_sparse.yaml``, a checkpoint every 2 steps), then ``launch/eval.sh`` with
``PLAN=full`` and ``PLAN=sequential`` into two results folders (``--replay``: the full plan only, and
the sequential plan's decisions replayed on those same rows with ``eval.run.sequential``, so a large suite costs
one evaluation; its rollouts are counted, its wall time is not). Prints rollouts (rows rolled out,
step 0's shared rows counted once), wall time, each run's selected checkpoint under both plans and
the full-suite macro EM gap of the sequential choice. Everything lives under ``--work`` and is
resumed there (trained runs and evaluated rows are reused).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from eval.report.results import load_results
from eval.report.select import selection_document
from eval.run import sequential as seq
from eval.run.store import RowStore
from eval.run.suite import Suite, load_suite
from eval.schema import row_key
from search_env.checkpoint_layout import TRACKER, step_dir_name
from search_env.paths import REPO_ROOT

SEEDS = (42, 43, 44)
STEPS = 4
SHAPE = "f1_only"
TRAIN_TIMEOUT_S = 3600
EVAL_TIMEOUT_S = 5400


def build_suite(work: Path, people: int) -> Path:
    """The measurement world (seeds 5/6) with ``people`` in its test region (1,100: 4,107 test rows in
    five benchmarks, one of 87; 100: the demo's region); returns its folder."""
    from search_demo import study_world, world

    out = work / f"world_p{people}"
    if not (out / "world.json").is_file():
        study_world.write_study_world(
            5,
            6,
            out,
            test_size=world.RegionSize(
                countries=max(6, people // 55),
                cities=max(24, people // 9),
                people=people,
                companies=min(100, max(40, people // 11)),
            ),
            unseen_test_size=world.RegionSize(countries=2, cities=5, people=25, companies=8),
        )
    return out


def _run(cmd: list[str], log: Path, timeout: int, env: dict[str, str]) -> float:
    """Run ``cmd`` in its own process group (output to ``log``); the whole group is stopped after
    ``timeout`` seconds. Returns the wall time in seconds; RuntimeError naming the log on failure."""
    started = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            rc = proc.wait(timeout=60)
    if rc:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}; see {log}")
    return time.perf_counter() - started


def train(work: Path, seed: int, steps: int, port: int) -> Path:
    """One sparse micro-study run (``SHAPE``, ``seed``, ``steps``, a checkpoint every 2 steps)."""
    run_dir = work / "runs" / f"{SHAPE}_s{seed}"
    latest = run_dir / "checkpoints" / TRACKER
    if latest.is_file() and latest.read_text().strip() == str(steps):
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["bash", "launch/run.sh", "recipes/micro_sparse.yaml", f"shape={SHAPE}", f"seed={seed}"]
    cmd += [f"trainer.total_training_steps={steps}", "trainer.save_freq=2", f"retriever.port={port}"]
    _run(cmd, run_dir / "measure_train.log", TRAIN_TIMEOUT_S, {**os.environ, "RLVR_RUN_DIR": str(run_dir)})
    return run_dir


def rollouts(out: Path) -> int:
    """Rows rolled out into a results folder: every run's trained steps, plus step 0's shared rows once."""
    count = sum(
        1
        for f in out.glob(f"*/{step_dir_name('*')}/rows.jsonl")
        if f.parent.name != step_dir_name(0)
        for _ in open(f)
    )
    return count + sum(1 for f in out.glob(".step0/*/rows.jsonl") for _ in open(f))


def evaluate(work: Path, world: Path, run_dir: Path, plan: str, port: int, extra: list[str]) -> float:
    """``launch/eval.sh`` of one run under ``plan`` (a BM25 retriever over the world's corpus); its wall time."""
    env = {
        **os.environ,
        "SUITE": str(world / "test"),
        "CORPUS": str(world / "corpus.jsonl"),
        "OUT": str(work / f"eval_{plan}_{world.name}"),
        "PLAN": plan,
        "LIMIT": "",
        "BACKEND": "hf",
        "RETRIEVER_PORT": str(port),
    }
    cmd = ["bash", "launch/eval.sh", str(run_dir / "checkpoints"), "--run-name", run_dir.name, *extra]
    return _run(cmd, work / f"eval_{plan}_{world.name}_{run_dir.name}.log", EVAL_TIMEOUT_S, env)


def replay(
    out_full: Path, suite: Suite, run: str, steps: list[int], args: argparse.Namespace
) -> tuple[int, float, int, int]:
    """The sequential plan on the full plan's rows of one run: (chosen step, its confirmed macro EM,
    rollouts for the trained checkpoints, confirm rows, which step 0 takes once per sweep)."""
    em = {}
    for step in steps:
        rows = RowStore(out_full / run / step_dir_name(step) / "rows.jsonl").rows()
        em[step] = {row_key(r): float(r["em"]) for r in rows}

    def scores(step: int, n: dict[str, int]) -> dict[str, np.ndarray]:
        return {b: np.array([em[step][q.key] for q in suite.ranked[b][: n[b]]]) for b in n}

    sizes = suite.sizes()
    screen_n = {b: min(args.screen_rows, n) for b, n in sizes.items()}
    screened = {s: scores(s, screen_n) for s in steps}
    decision = seq.decide(
        screened, {"own": steps, "matched": [s for s in steps if s <= args.steps]}, args.delta
    )
    n_conf = seq.confirm_rows(decision, screened, sizes, screen_n, args.halfwidth)
    confirmed = {s: seq.macro(scores(s, n_conf)) for s in decision.confirm}
    chosen = max(confirmed, key=lambda s: (confirmed[s], -s))
    extra = sum(n_conf.values()) - sum(screen_n.values())
    rollouts = len(steps) * sum(screen_n.values()) + len(confirmed) * extra
    return chosen, confirmed[chosen], rollouts, sum(n_conf.values())


def measure(args: argparse.Namespace) -> str:
    """Train (or reuse) the runs, evaluate them by both plans, and the comparison table and last line."""
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    world = build_suite(work, args.test_people)
    sizes = {p.stem: sum(1 for _ in open(p)) for p in sorted((world / "test").glob("*.jsonl"))}
    print(f"suite {world / 'test'}: {sizes} ({sum(sizes.values())} rows)", flush=True)
    runs = [train(work, seed, args.steps, 18600) for seed in SEEDS]
    wall = {"full": 0.0} if args.replay else {"full": 0.0, "sequential": 0.0}
    extra = ["--max-in-flight", str(args.max_in_flight)] if args.max_in_flight else []
    for run_dir in runs:
        for plan in wall:
            wall[plan] += evaluate(work, world, run_dir, plan, 18610, extra)
    outs = {plan: work / f"eval_{plan}_{world.name}" for plan in ("full", "sequential")}
    full = load_results(outs["full"])
    chosen = {"full": selection_document(outs["full"], matched_horizon=args.steps)["runs"]}
    if args.replay:
        suite = load_suite(world / "test")
        chosen["sequential"], n_seq = {}, 0
        for run_dir in runs:
            steps = sorted(
                {int(s) for s in full.scores.loc[full.scores["run"] == run_dir.name, "step"] if s > 0}
            )
            step, score, rolls, n_conf = replay(outs["full"], suite, run_dir.name, steps, args)
            chosen["sequential"][run_dir.name] = {"own": {"step": step, "score": score}}
            n_seq += rolls
        n_seq += n_conf  # step 0, once per sweep
    else:
        chosen["sequential"] = selection_document(outs["sequential"], matched_horizon=args.steps)["runs"]
        n_seq = rollouts(outs["sequential"])
    macro = full.scores[full.scores["benchmark"] == "avg_all"].set_index(["run", "step"])["em"]
    lines = [
        "| run | full: step (EM) | sequential: step (EM on its rows) | full-suite EM of the sequential choice - best |"
    ]
    lines.append("|---|---|---|---|")
    worst = 0.0
    for run_dir in runs:
        name = run_dir.name
        f, s = chosen["full"][name]["own"], chosen["sequential"][name]["own"]
        gap = float(macro[(name, s["step"])] - macro[(name, f["step"])])
        worst = min(worst, gap)
        lines.append(
            f"| {name} | {f['step']} ({f['score']:.3f}) | {s['step']} ({s['score']:.3f}) | {gap:+.3f} |"
        )
    n_full = rollouts(outs["full"])
    wall_seq = wall.get("sequential", math.nan)
    lines += [
        "",
        f"rollouts: full {n_full}, sequential {n_seq}{' (replayed)' if args.replay else ''} (ratio "
        f"{n_seq / n_full:.3f}); wall time of the evaluations: full {wall['full']:.0f} s, sequential "
        f"{wall_seq:.0f} s (ratio {wall_seq / wall['full']:.3f})",
        f"eval_plan_measure: rollout_ratio={n_seq / n_full:.3f} wall_ratio={wall_seq / wall['full']:.3f} "
        f"worst_gap={worst:+.3f} runs={len(runs)} suite_rows={sum(sizes.values())} replay={int(args.replay)}",
    ]
    return "\n".join(lines)
