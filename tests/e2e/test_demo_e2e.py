"""The CPU demo end to end, as a user's run meets it: `bash launch/run.sh recipes/demo_cpu.yaml` trains
for real with verl (GRPO, Ray, FSDP2, the search agent loop against a live BM25 retriever), is
killed as a whole (SIGKILL of launch/run.sh and of every process it started, as power loss, the OOM
killer or a scheduler would) once inside a step and once inside a checkpoint save, and is started
again with the same command each time. It resumes from the last complete checkpoint, logs the
study's metrics once per step, leaves no process, port, lock or Ray temp dir behind, keeps the
checkpoint policy, and its checkpoints go through `launch/eval.sh`, the demo's report and
`python -m eval report`.

One test, three starts of the demo on one run directory (the 2-step run from scratch killed in step
2, the resume killed in step 2's save, the resume that finishes), each in one of the heavy-run slots
(tests/heavy_slot.py): a trainer start-up is most of a CPU run's cost (~1.5 min on 2 cores), so the
demo's own checks ride on the runs the kill needs. The fast checks (what verl 0.9.1 does under a
kill, ``launch.resume``'s checkpoint choice on hand-made checkpoints, the launcher stopping on a stray
process) are in tests/launch/test_resume.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from conftest import DEMO_RUN_TIMEOUT_S, demo_cmd, demo_env, demo_eval, free_port, logged_steps, port_free

from launch import resume
from launch.resume import TRACKER, complete_torch_file, problems
from search_env.paths import REPO_ROOT
from search_env.rollout_record import TERMINATIONS
from search_env.rollout_stats import group_metrics, group_of

# ---- the demo killed in a step, killed in a save, resumed, evaluated ------------------------------


def _logged(run_dir: Path) -> list[int]:
    """The steps of ``run_dir/metrics.jsonl``, one per complete line, in file order."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("\n")]


def _listening(procs: list[psutil.Process]) -> set[int]:
    """TCP ports ``procs`` listen on."""
    ports = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            ports |= {c.laddr.port for c in proc.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    return ports


def _kill_as_a_whole(
    run_dir: Path, cmd: list[str], log: Path, ready: Callable[[], bool], what: str
) -> set[int]:
    """Start ``cmd`` in its own session, wait until ``ready()`` (at most DEMO_RUN_TIMEOUT_S), then
    SIGKILL it and every process it started: its descendants, found before the kill (run.sh puts
    the trainer in a process group of its own; Ray starts daemons), and whatever carries the run's
    environment marker. Asserts all are gone within 30 s; returns the TCP ports they listened on."""
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=demo_env(run_dir),
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    victims: dict[int, psutil.Process] = {}
    ports: set[int] = set()
    try:
        deadline = time.monotonic() + DEMO_RUN_TIMEOUT_S
        while not ready():
            assert proc.poll() is None, (
                f"run ended (rc {proc.returncode}) before {what}: {log.read_text()[-4000:]}"
            )
            assert time.monotonic() < deadline, f"not {what} within {DEMO_RUN_TIMEOUT_S} s"
            time.sleep(0.2)
        assert proc.poll() is None, f"run ended (rc {proc.returncode}) while {what}"
    finally:
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(proc.pid)
            victims |= {p.pid: p for p in [top, *top.children(recursive=True)]}
        for _ in range(5):  # a parent not yet killed may start a child meanwhile
            found = {p.pid: p for p in resume.marked(run_dir) if p.pid not in victims}
            victims |= found
            ports |= _listening(list(victims.values()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for victim in victims.values():
                with contextlib.suppress(psutil.Error):
                    victim.kill()
            time.sleep(0.2)
            if not found and not resume.marked(run_dir):
                break
        proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    while (left := [p for p in victims.values() if resume.alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"still running after SIGKILL: {[resume.describe(p) for p in left]}"
    return ports


def _still_listening(run_dir: Path, ports: set[int], wait_s: float = 30.0) -> set[int]:
    """Those of ``ports`` still listened on after ``wait_s`` seconds by a socket of the killed run:
    one no live process holds (a killed process's sockets can close a few seconds after it left
    /proc on a loaded or sandboxed machine) or one held by a process of ``run_dir``. Ports that
    other programs bound meanwhile do not count."""
    ours = {p.pid for p in resume.marked(run_dir)}
    deadline = time.monotonic() + wait_s
    while True:
        held = {
            c.laddr.port
            for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in ports and (c.pid is None or c.pid in ours)
        }
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


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


@pytest.mark.timeout(3 * DEMO_RUN_TIMEOUT_S + 420)
def test_demo_killed_in_a_step_and_in_a_save_resumes_checkpoints_and_evaluates(tmp_path: Path):
    run_dir, port = tmp_path.resolve() / "run", free_port()
    ckpt = run_dir / "checkpoints"
    cmd = demo_cmd(
        port,
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
        "trainer.total_training_steps=2",
        "trainer.save_freq=1",
    )

    # 1. Killed inside step 2 (its rollouts; step 1 saved and logged).
    def in_step_2() -> bool:
        if 1 not in _logged(run_dir):
            return False
        time.sleep(2)  # step 2 takes far longer on CPU
        return True

    ports = _kill_as_a_whole(run_dir, cmd, tmp_path / "kill1.err", in_step_2, "inside step 2")
    assert port in ports, f"the retriever was not among the killed processes: {ports}"
    assert not _still_listening(run_dir, ports), "a port of the killed run is still held"
    assert (ckpt / TRACKER).read_text() == "1" and not (ckpt / "global_step_2").exists()
    assert _logged(run_dir) == [1]
    ray_tmps = [Path((run_dir / ".ray_tmp").read_text().strip())]  # left: nothing ran cleanup
    first = (tmp_path / "kill1.err").read_text()
    assert "demo assets ready" in first and "Training from scratch" in first, first[-4000:]

    # 2. Killed inside the save of step 2: a FIFO in place of the actor's extra-state shard stops the
    #    save after the model and optimizer shards, before verl names the checkpoint.
    actor2 = ckpt / "global_step_2" / "actor"
    actor2.mkdir(parents=True)
    os.mkfifo(actor2 / "extra_state_world_size_1_rank_0.pt")
    optim2 = actor2 / "optim_world_size_1_rank_0.pt"

    def in_save_2() -> bool:
        return complete_torch_file(optim2)

    ports = _kill_as_a_whole(run_dir, cmd, tmp_path / "kill2.err", in_save_2, "inside the save of step 2")
    killed = (tmp_path / "kill2.err").read_text()
    assert "resume: resuming from global_step_1" in killed, killed[-4000:]
    assert re.search(r"Resuming from \S+/global_step_1\b", killed), killed[-4000:]
    assert not _still_listening(run_dir, ports), "a port of the killed run is still held"
    assert (ckpt / TRACKER).read_text() == "1" and _logged(run_dir) == [1]
    assert f"removed {ray_tmps[0]}, the Ray temp dir of an earlier run that was killed" in killed
    ray_tmps.append(Path((run_dir / ".ray_tmp").read_text().strip()))
    assert (
        complete_torch_file(actor2 / "model_world_size_1_rank_0.pt")
        and not (ckpt / "global_step_2" / "data.pt").exists()
    )
    # What kills inside torch.save and inside verl's tracker write (open "w" truncates first) leave:
    (actor2 / "extra_state_world_size_1_rank_0.pt").unlink()
    (actor2 / "extra_state_world_size_1_rank_0.pt").write_bytes(optim2.read_bytes()[:100])
    (ckpt / TRACKER).write_text("")

    # 3. The same command again.
    done = subprocess.run(
        cmd, cwd=REPO_ROOT, env=demo_env(run_dir), capture_output=True, text=True, timeout=DEMO_RUN_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (
        "resume: latest_checkpointed_iteration.txt holds '', not a step (a kill while it was written); "
        "resuming from global_step_1, the newest complete checkpoint" in done.stderr
    ), done.stderr[-4000:]
    assert re.search(r"Resuming from \S+/global_step_1\b", done.stderr), done.stderr[-4000:]
    assert _logged(run_dir) == [1, 2], "each step's metrics must appear exactly once"
    assert (ckpt / TRACKER).read_text() == "2" and problems(ckpt / "global_step_2") == []
    assert not list((ckpt / "global_step_1" / "actor").glob("optim_*")), "the checkpoint policy did not run"
    assert port_free(port)
    assert not [d for d in ray_tmps if d.exists()] and not (run_dir / ".ray_tmp").exists()
    assert not _ray_leftovers(done.stderr), "Ray processes or temp dirs outlived the run"

    # 4. What the demo promises of the finished run: its checkpoints, metrics, evaluation and reports.
    assert f"checkpoint: {ckpt}/global_step_2/actor" in done.stderr
    _assert_checkpoint_policy(ckpt, latest=2)  # step 1: weights only; step 2: + optimizer and extra
    steps = logged_steps(run_dir)
    assert all(math.isfinite(s["actor/grad_norm"]) for s in steps.values())
    for s in steps.values():  # the warm start searches and answers; GRPO gets a signal
        assert s["rollout/searches_mean"] >= 0.5, "the warm-started model does not call the search tool"
        assert s["rollout/termination/answer"] >= 0.5 and s["rollout/abort_ratio"] <= 0.5, (
            "it does not answer"
        )
        assert s["reward/mean"] > 0 and s["grpo/zero_variance_group_frac"] < 1, "rewards tied in every group"
    assert any(s["actor/grad_norm"] > 0 for s in steps.values()), "no learning signal (all groups tied)"
    for step, logged_step in steps.items():  # step 1's rollouts dumped by the first run, step 2's by this
        _check_metrics_plausible(step, logged_step, run_dir / "rollouts" / f"{step}.jsonl")
    assert "rollout/searches_mean" in done.stderr, "the console logger does not print the study's metrics"
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
    the checkpoint policy) and step 2 (the latest, complete); 4 held-out world questions per type."""
    done = demo_eval(ckpt, out, "--steps", "1", "2", limit=4)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    for step in (1, 2):
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
    assert "| 2 |" in table and "step 1 -> step 2" in table
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
