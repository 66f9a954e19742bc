"""The CPU demo end to end: `bash launch/run.sh recipes/demo_cpu.yaml` trains for real with verl
(GRPO, Ray, FSDP2, the search agent loop against a live BM25 retriever), logs the study's
metrics every step, checkpoints every step under the checkpoint policy, and its checkpoints go
through `launch/eval.sh`, the demo's report and `python -m eval report`. Killing and resuming a run
is tested in tests/e2e/test_run_killed.py. Heavy: one trainer start-up (~1.5 min on 2 cores) and three
steps, in one of the heavy-run slots (tests/heavy_slot.py)."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
from conftest import (
    DEMO_RUN_TIMEOUT_S,
    demo_cmd,
    demo_env,
    demo_eval,
    free_port,
    logged_steps,
    port_free,
)

from search_env.paths import REPO_ROOT
from search_env.rollout_record import TERMINATIONS
from search_env.rollout_stats import group_metrics, group_of


def _run_demo(run_dir: Path, port: int, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        demo_cmd(port, *overrides),
        cwd=REPO_ROOT,
        env=demo_env(run_dir),
        capture_output=True,
        text=True,
        timeout=DEMO_RUN_TIMEOUT_S,
    )


def _check_metrics_plausible(step: int, logged: dict, dump: Path) -> None:
    """Fractions in [0, 1], terminations summing to 1, GRPO group stats equal to the dumped rewards'."""
    for name in (
        "rollout/abort_ratio",
        "rollout/length_clip_ratio",
        "grpo/zero_variance_group_frac",
        "reward/mean",
        "reward/em",
        "reward/f1",
        "reward/acc",
        *(f"rollout/termination/{t}" for t in TERMINATIONS),
    ):
        assert 0.0 <= logged[name] <= 1.0, (step, name, logged[name])
    assert sum(logged[f"rollout/termination/{t}"] for t in TERMINATIONS) == pytest.approx(1.0)
    assert logged["rollout/model_tokens_mean"] > 0 and logged["rollout/retrieved_tokens_mean"] >= 0
    assert logged["response_length/clip_ratio"] == logged["rollout/length_clip_ratio"]
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    scores, groups = [r["score"] for r in rows], [group_of(r["uid"]) for r in rows]
    assert logged["reward/mean"] == pytest.approx(sum(scores) / len(scores))
    recomputed = group_metrics(scores, groups)
    for name in ("grpo/zero_variance_group_frac", "grpo/group_reward_std_mean", "grpo/groups"):
        assert logged[name] == pytest.approx(recomputed[name]), (step, name)


def _ray_leftovers(stderr: str) -> list[str]:
    """The private Ray temp dir launch/run.sh named in ``stderr`` if it still exists, and every
    process still using it (this run's only: other runs may be going on beside it)."""
    found = re.search(r"private Ray instance, temp dir (/tmp/rlvr_ray\.\w+)", stderr)
    assert found, "run.sh did not name its private Ray temp dir"
    temp = found.group(1)
    left = [temp] if Path(temp).exists() else []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if temp in cmdline:
            left.append(f"pid {proc.name}: {cmdline[:120]}")
    return left


@pytest.mark.timeout(DEMO_RUN_TIMEOUT_S + 300)
def test_demo_trains_checkpoints_and_evaluates(tmp_path):
    run_dir, port = tmp_path / "demo", free_port()
    run = _run_demo(
        run_dir,
        port,
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
    )
    assert run.returncode == 0, run.stderr[-4000:]
    ckpt = run_dir / "checkpoints"
    assert f"checkpoint: {ckpt}/global_step_3/actor" in run.stderr
    assert (ckpt / "global_step_3" / "actor" / "model_world_size_1_rank_0.pt").is_file()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    _assert_checkpoint_policy(ckpt, latest=3)  # steps 1, 2: weights only; step 3: + optimizer and extra
    steps = logged_steps(run_dir)
    assert sorted(steps) == [1, 2, 3]
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3], "each step's metrics must appear exactly once"
    assert all(math.isfinite(s["actor/grad_norm"]) for s in steps.values())
    for s in steps.values():  # the warm start searches and answers; GRPO gets a signal
        assert s["rollout/searches_mean"] >= 0.5, "the warm-started model does not call the search tool"
        assert s["rollout/termination/answer"] >= 0.5 and s["rollout/abort_ratio"] <= 0.5, (
            "it does not answer"
        )
        assert s["reward/mean"] > 0 and s["grpo/zero_variance_group_frac"] < 1, "rewards tied in every group"
    assert any(s["actor/grad_norm"] > 0 for s in steps.values()), "no learning signal (all groups tied)"
    assert "demo assets ready" in run.stderr
    assert "Training from scratch" in run.stderr
    for step, logged_step in steps.items():
        _check_metrics_plausible(step, logged_step, run_dir / "rollouts" / f"{step}.jsonl")
    assert "rollout/searches_mean" in run.stderr, "the console logger does not print the study's metrics"
    assert port_free(port), "the retriever outlived the run"
    assert not _ray_leftovers(run.stderr), "Ray processes or temp dirs outlived the run"
    _evaluate_demo_checkpoint(ckpt, run_dir / "eval")
    _demo_report(run_dir)
    _report(run_dir / "eval", run_dir / "metrics.jsonl", tmp_path / "report")


def _assert_checkpoint_policy(ckpt: Path, latest: int) -> None:
    """search_env.checkpoint_policy: every checkpoint keeps its weights, only the latest keeps the
    optimizer and extra state a resume needs."""
    for step_dir in sorted(ckpt.glob("global_step_*")):
        actor, is_latest = step_dir / "actor", step_dir.name == f"global_step_{latest}"
        assert any(actor.glob("model_world_size_*_rank_*.pt")) or any(
            (actor / "huggingface").glob("*.safetensors")
        )
        assert bool(list(actor.glob("optim_world_size_*_rank_*.pt"))) == is_latest, step_dir
        assert bool(list(actor.glob("extra_state_world_size_*_rank_*.pt"))) == is_latest, step_dir


def _evaluate_demo_checkpoint(ckpt: Path, out: Path) -> None:
    """`launch/eval.sh` on the demo's own (FSDP-sharded) checkpoints: step 1 (pruned to its weights by
    the checkpoint policy) and step 3 (the latest, complete); 4 held-out world questions per type."""
    done = demo_eval(ckpt, out, "--steps", "1", "3", limit=4)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for step in (1, 3):
        (summary_path,) = out.glob(f"*/global_step_{step}/summary.json")
        summary = json.loads(summary_path.read_text())
        assert summary["complete"] and summary["step"] == step
        rows = [json.loads(line) for line in (summary_path.parent / "rows.jsonl").read_text().splitlines()]
        assert set(summary["benchmarks"]) == {"single_hop", "two_hop"} and len(rows) == 8
        assert all(b["n"] == 4 for b in summary["benchmarks"].values())
    assert "macro" in done.stdout  # the per-benchmark table


def _demo_report(run_dir: Path) -> None:
    """`python -m search_demo report`: per-step rewards and the before/after table, written."""
    from search_demo.driver import main as demo_main

    assert demo_main(["report", "--run-dir", str(run_dir)]) == 0
    table = (run_dir / "demo_report.md").read_text()
    assert "| 3 |" in table and "step 1 -> step 3" in table
    for row in ("| all | 8 |", "| single_hop | 4 |", "| two_hop | 4 |"):
        assert row in table, row


def _report(results: Path, metrics: Path, out: Path) -> None:
    """`python -m eval report` on the demo's evaluation and training log writes the whole report."""
    from eval.__main__ import main as eval_main

    assert (
        eval_main(
            [
                "report",
                "--results",
                str(results),
                "--logs",
                f"demo_cpu={metrics}",
                "--out",
                str(out),
                "--bootstrap",
                "50",
            ]
        )
        == 0
    )
    index = (out / "index.md").read_text()
    for name in (
        "table1.md",
        "table3_em.csv",
        "statistics.md",
        "fig_dynamics_seed42.png",
        "fig_health_seed42.png",
    ):
        assert name in index and (out / name).stat().st_size > 0, name
