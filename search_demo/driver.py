"""The CPU demo end to end (``make demo``): world, warm start, GRPO, before/after evaluation.

Subcommands of ``python -m search_demo``: ``assets`` builds the world (or the micro study's
``search_demo.study_world``) and the regime's warm start when missing or stale (the launcher calls
it for ``launch.build_demo_assets`` recipes); ``run`` trains with ``launch/run.sh
recipes/demo_cpu.yaml``, evaluates step 0 and the last step with ``launch/eval.sh`` on held-out
questions (optionally also on another world's) and writes ``RUN/demo_report.{md,json}``;
``evaluate`` does the evaluation and report of a trained run; ``report`` rewrites the report from the
files. What each step does: docs/training.md, "The CPU demo".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from search_demo import world as world_mod
from search_demo.study_world import ensure_study_world, study_world_stamp
from search_demo.transfer_world import ensure_transfer_world, transfer_world_stamp
from search_env.checkpoint_layout import TRACKER, by_step, step_dir_name
from search_env.markdown import markdown_table
from search_env.paths import REPO_ROOT

RECIPE = REPO_ROOT / "recipes" / "demo_cpu.yaml"
TABLE_METRICS = ("em", "f1", "searches", "abort")
REGIME_NAMES = ("dense", "sparse")
"""The keys of ``search_demo.warm_start.REGIMES`` (listed here so the command line parses without
importing torch; a test keeps the two equal)."""
TRANSFER_REGIME = "transfer"
"""The transfer world's regime (``search_demo.transfer_world``, ``search_demo.transfer_warm_start``):
its own world and warm start, so not a ``warm_start.REGIMES`` entry."""
"""Columns of the before/after table: mean EM, F1, searches per rollout, abort rate (no answer)."""


def ensure_world(seed: int, out: Path) -> Path:
    """``out`` holding the world of ``seed`` (built when missing, or of another seed/version)."""
    if _world_current(seed, None, out):
        return out
    return world_mod.write_world(world_mod.build_world(seed), out)


def _world_stamp(seed: int, unseen_seed: int | None, regime: str | None = None) -> dict[str, Any]:
    """What ``world.json`` of the world of ``seed`` holds (the study world with ``unseen_seed``; the
    transfer world for the transfer regime)."""
    if regime == TRANSFER_REGIME:
        return transfer_world_stamp(seed, unseen_seed)
    if unseen_seed is None:
        return {"seed": seed, "version": world_mod.WORLD_VERSION}
    return study_world_stamp(seed, unseen_seed)


def _world_current(seed: int, unseen_seed: int | None, out: Path, regime: str | None = None) -> bool:
    """Whether ``out`` holds the world of ``seed`` (:func:`_world_stamp`)."""
    return world_mod.stamp_matches(out, _world_stamp(seed, unseen_seed, regime))


def _ready_line(args: argparse.Namespace, model: Path, key: str) -> str:
    return f"demo assets ready: world {args.world} (seed {args.world_seed}), warm start {model} (key {key})"


def _warm_start_config(args: argparse.Namespace) -> Any:
    """The ``search_demo.warm_start.WarmStartConfig`` of ``--regime`` and ``--sft-steps``."""
    from search_demo.warm_start import REGIMES  # heavy: torch/transformers, only for assets

    cfg = REGIMES[args.regime]
    return cfg if args.sft_steps is None else replace(cfg, steps=args.sft_steps)


def _transfer_config(args: argparse.Namespace) -> Any:
    """The ``search_demo.transfer_warm_start.TransferWarmStart`` of ``--sft-steps``."""
    from search_demo.transfer_warm_start import TransferWarmStart  # heavy: torch/transformers

    cfg = TransferWarmStart()
    return cfg if args.sft_steps is None else replace(cfg, steps=args.sft_steps)


def asset_stamps(args: argparse.Namespace) -> dict[str, Any]:
    """What the world and the warm start of ``args`` (the ``assets`` subcommand's arguments) are
    stamped with once current, as JSON values: ``world`` (its ``world.json`` stamp) and
    ``warm_start`` (its cache key). Builds nothing; hashes the warm start's inputs (~0.3 s once
    torch is imported)."""
    from search_demo.warm_start import base_model, cache_key  # heavy: torch/transformers

    base = Path(args.base or base_model.SHIPPED)
    if args.regime == TRANSFER_REGIME:
        from search_demo import transfer_warm_start  # heavy: torch/transformers

        key = transfer_warm_start.cache_key(_transfer_config(args), base)
    else:
        key = cache_key(_warm_start_config(args), base)
    world = _world_stamp(args.world_seed, args.unseen_world_seed, args.regime)
    return json.loads(json.dumps({"world": world, "warm_start": key}))


def assets_ready(args: argparse.Namespace) -> str | None:
    """The ``assets`` ready line when the world and the warm start of ``args`` (the ``assets``
    subcommand's arguments) are both current, so that there is nothing to build; else None
    (:func:`asset_stamps`)."""
    from search_demo.warm_start import stamp_key  # heavy: torch/transformers

    if args.unseen_world_seed == args.world_seed or not _world_current(
        args.world_seed, args.unseen_world_seed, args.world, args.regime
    ):
        return None
    key = asset_stamps(args)["warm_start"]
    return _ready_line(args, args.warm_start, key) if stamp_key(args.warm_start) == key else None


def cmd_assets(args: argparse.Namespace) -> int:
    if args.unseen_world_seed == args.world_seed:
        print(
            f"error: --unseen-world-seed must differ from --world-seed (both {args.world_seed}): "
            "the unseen world would be the training world; pick another seed",
            file=sys.stderr,
        )
        return 2
    from search_demo.warm_start import (  # heavy: torch/transformers, only for assets
        ensure_warm_start,
        stamp_key,
    )

    if args.regime == TRANSFER_REGIME:
        if args.unseen_world_seed is None:
            print(
                "error: --regime transfer needs --unseen-world-seed (launch.assets.unseen_world_seed): "
                "its test suite holds an unseen world's questions",
                file=sys.stderr,
            )
            return 2
        from search_demo.transfer_warm_start import ensure_transfer_warm_start  # heavy: torch

        ensure_transfer_world(args.world_seed, args.unseen_world_seed, args.world)
        model = ensure_transfer_warm_start(
            args.warm_start, _transfer_config(args), base=args.base, log=lambda m: print(m, flush=True)
        )
        print(_ready_line(args, model, stamp_key(model)))
        return 0
    if args.unseen_world_seed is None:
        ensure_world(args.world_seed, args.world)
    else:  # the micro study's paper-shaped suite (search_demo.study_world)
        ensure_study_world(args.world_seed, args.unseen_world_seed, args.world)
    model = ensure_warm_start(
        args.warm_start, _warm_start_config(args), base=args.base, log=lambda m: print(m, flush=True)
    )
    print(_ready_line(args, model, stamp_key(model)))
    return 0


# ---- evaluation table ---------------------------------------------------------------------------


def _rows(step_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (step_dir / "rows.jsonl").read_text().splitlines() if line.strip()]


def step_table(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per question type (the suite's benchmarks) and ``all``: n and the ``TABLE_METRICS`` means."""
    groups: dict[str, list[dict[str, Any]]] = {"all": list(rows)}
    for row in rows:
        groups.setdefault(row["benchmark"], []).append(row)
    out = {}
    for name, items in groups.items():
        n = len(items)
        out[name] = {
            "n": n,
            "em": math.fsum(r["em"] for r in items) / n,
            "f1": math.fsum(r["f1"] for r in items) / n,
            "searches": math.fsum(r.get("searches", 0) for r in items) / n,
            "abort": math.fsum(r.get("prediction") is None for r in items) / n,
        }
    return out


def format_table(
    title: str,
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    steps: tuple[int, int],
) -> str:
    """Markdown before/after table, one line per question type."""
    header = ["questions", "n", *(f"{m} s{s}" for m in TABLE_METRICS for s in steps), "ΔEM"]
    rows = []
    for name in ["all", *sorted(k for k in before if k != "all")]:
        b, a = before[name], after.get(name, {})
        cells = [f"{v:.3f}" for m in TABLE_METRICS for v in (b[m], a.get(m, float("nan")))]
        rows.append([name, b["n"], *cells, f"{a.get('em', float('nan')) - b['em']:+.3f}"])
    return f"### {title}\n\n{markdown_table(header, rows)}".rstrip()


def step_rewards(metrics: Path) -> list[dict[str, float]]:
    """Per training step (in order, last entry per step kept): reward/mean, reward/em, searches."""
    data_by_step: dict[int, dict[str, Any]] = {}
    for line in metrics.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            data_by_step[int(row["step"])] = row["data"]
    keys = (
        "reward/mean",
        "reward/em",
        "reward/f1",
        "rollout/searches_mean",
        "rollout/abort_ratio",
        "grpo/zero_variance_group_frac",
    )
    return [
        {"step": s, **{k: float(d.get(k, float("nan"))) for k in keys}}
        for s, d in sorted(data_by_step.items())
    ]


def report(run_dir: Path) -> dict[str, Any]:
    """The demo's report from ``run_dir`` (metrics.jsonl, eval*/): printed, and written as .md/.json."""
    steps = step_rewards(run_dir / "metrics.jsonl")
    lines = [
        "## Demo: GRPO on the CPU",
        "",
        "| step | reward/mean | reward/em | searches | abort | zero-var groups |",
        "|---|---|---|---|---|---|",
    ]
    for s in steps:
        lines.append(
            f"| {s['step']} | {s['reward/mean']:.3f} | {s['reward/em']:.3f} | {s['rollout/searches_mean']:.2f} | "
            f"{s['rollout/abort_ratio']:.2f} | {s['grpo/zero_variance_group_frac']:.2f} |"
        )
    out: dict[str, Any] = {"steps": steps, "evaluations": {}}
    for eval_root in sorted(run_dir.glob("eval*")):
        step_dirs = by_step(
            p for p in eval_root.glob(f"*/{step_dir_name('*')}") if (p / "summary.json").is_file()
        )
        if len(step_dirs) < 2:
            continue
        (first_step, first), (last_step, last) = step_dirs[0], step_dirs[-1]
        before, after = step_table(_rows(first)), step_table(_rows(last))
        pair = (first_step, last_step)
        label = (
            json.loads((eval_root / "label.json").read_text())["label"]
            if (eval_root / "label.json").is_file()
            else eval_root.name
        )
        lines += ["", format_table(f"{label}: step {pair[0]} -> step {pair[1]}", before, after, pair)]
        out["evaluations"][eval_root.name] = {"label": label, "steps": pair, "before": before, "after": after}
    text = "\n".join(lines) + "\n"
    (run_dir / "demo_report.md").write_text(text)
    (run_dir / "demo_report.json").write_text(json.dumps(out, indent=2) + "\n")
    print(text, flush=True)
    return out


# ---- run ----------------------------------------------------------------------------------------


def _composed(run_dir: Path) -> dict[str, Any]:
    """The run's composed recipe (``RUN/recipe.yaml``, written by the preflight), interpolations resolved."""
    from omegaconf import OmegaConf  # heavy: omegaconf, only for run

    return OmegaConf.to_container(OmegaConf.load(run_dir / "recipe.yaml"), resolve=True)


def evaluate(
    run_dir: Path, world_dir: Path, out: Path, label: str, steps: Sequence[int], port: int, limit: int
) -> None:
    """``launch/eval.sh`` of ``steps`` of the run on ``world_dir``'s test suite (BM25 over its corpus)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "label.json").write_text(json.dumps({"label": label, "world": str(world_dir)}) + "\n")
    env = {
        **os.environ,
        "SUITE": str(world_dir / "test"),
        "LIMIT": str(limit),
        "OUT": str(out),
        "CORPUS": str(world_dir / "corpus.jsonl"),
        "RETRIEVER_PORT": str(port),
        "BACKEND": "hf",
    }
    cmd = ["bash", "launch/eval.sh", str(run_dir / "checkpoints"), "--steps", *map(str, steps)]
    print(f"+ evaluating {label}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True)


def cmd_run(args: argparse.Namespace, overrides: list[str]) -> int:
    run_dir = args.run_dir.resolve()
    os.environ.setdefault("PYTHON", sys.executable)  # launch/*.sh use this interpreter
    env = {**os.environ, "RLVR_RUN_DIR": str(run_dir)}
    train = ["bash", "launch/run.sh", str(RECIPE), f"retriever.port={args.port}", *overrides]
    print(f"+ {' '.join(train)}", flush=True)
    done = subprocess.run(train, cwd=REPO_ROOT, env=env)
    if done.returncode != 0:
        return done.returncode
    return cmd_evaluate(args)


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Steps 2-4 of ``run`` on a trained run directory."""
    os.environ.setdefault("PYTHON", sys.executable)
    run_dir = args.run_dir.resolve()
    cfg = _composed(run_dir)
    world_dir = Path(cfg["launch"]["assets"]["world"])
    world_dir = world_dir if world_dir.is_absolute() else REPO_ROOT / world_dir
    last = int((run_dir / "checkpoints" / TRACKER).read_text().strip())
    seed = cfg["launch"]["assets"]["world_seed"]
    evaluate(
        run_dir,
        world_dir,
        run_dir / "eval",
        f"held-out test questions, training world (seed {seed})",
        (0, last),
        args.port + 1,
        args.limit,
    )
    if args.also_world_seed is not None:
        other = ensure_world(args.also_world_seed, REPO_ROOT / ".demo" / f"world_s{args.also_world_seed}")
        evaluate(
            run_dir,
            other,
            run_dir / f"eval_w{args.also_world_seed}",
            f"test questions of an unseen world (seed {args.also_world_seed})",
            (0, last),
            args.port + 1,
            args.limit,
        )
    report(run_dir)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m search_demo`` command line (subcommands assets, run, evaluate, report)."""
    parser = argparse.ArgumentParser(prog="python -m search_demo", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    assets = sub.add_parser("assets", help="build the world and the warm start when missing or stale")
    assets.add_argument("--world-seed", type=int, required=True)
    assets.add_argument("--world", type=Path, required=True, help="world folder")
    assets.add_argument("--warm-start", type=Path, required=True, help="warm-start model folder")
    assets.add_argument(
        "--sft-steps", type=int, default=None, help="SFT steps (default: WarmStartConfig.steps)"
    )
    assets.add_argument(
        "--base", type=Path, default=None, help="base model folder (default: the shipped assets/demo_base)"
    )
    assets.add_argument(
        "--regime",
        choices=(*REGIME_NAMES, TRANSFER_REGIME),
        default="dense",
        help="warm start of the micro study's reward regime (search_demo.warm_start.REGIMES), or "
        "transfer: the transfer world and its warm start (search_demo.transfer_world)",
    )
    assets.add_argument(
        "--unseen-world-seed",
        type=int,
        default=None,
        help="build the paper-shaped study world (search_demo.study_world) with this unseen world",
    )
    run = sub.add_parser("run", help="train (launch/run.sh), evaluate (launch/eval.sh), print the report")
    run.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "demo_cpu")
    run.add_argument(
        "--port", type=int, default=18450, help="retriever port of training; evaluation uses port+1"
    )
    run.add_argument(
        "--limit", type=int, default=100, help="test questions per type (default 100: 200 in all)"
    )
    run.add_argument(
        "--also-world-seed", type=int, default=None, help="also evaluate on the world of this seed"
    )
    ev = sub.add_parser("evaluate", help="steps 2-4 of run (evaluate + report) on a trained run")
    ev.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "demo_cpu")
    ev.add_argument("--port", type=int, default=18450, help="evaluation retriever port - 1")
    ev.add_argument("--limit", type=int, default=100, help="test questions per type")
    ev.add_argument(
        "--also-world-seed", type=int, default=None, help="also evaluate on the world of this seed"
    )
    rep = sub.add_parser("report", help="print the report of a finished demo run")
    rep.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "demo_cpu")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.command == "assets":
        return cmd_assets(args)
    if args.command == "run":
        return cmd_run(args, rest)
    if args.command == "evaluate":
        return cmd_evaluate(args)
    report(args.run_dir)
    return 0
