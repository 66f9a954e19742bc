"""A run killed as a whole (SIGKILL of launch/run.sh and of every process it started, as power loss,
the OOM killer or a scheduler would), once inside a step and once inside a checkpoint save, then
started again with the same command: it resumes from the last complete checkpoint, logs each step
once, and nothing of the killed runs holds a port or a lock.

The test runs the CPU demo three times on one run directory (10.6 min measured on 2 cores shared
with other runs, about 3 min a run; each in one of the heavy-run slots, tests/heavy_slot.py). The
fast checks (what verl 0.9.1 does under a kill, ``launch.resume``'s checkpoint choice on hand-made
checkpoints, the launcher stopping on a stray process) are in tests/launch/test_resume.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from conftest import DEMO_RUN_TIMEOUT_S, demo_cmd, demo_env, free_port, port_free

from launch import resume
from launch.resume import TRACKER, complete_torch_file, problems
from search_env.paths import REPO_ROOT

# ---- e2e: killed in a step, killed in a save, resumed ----------------------------------------------


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


@pytest.mark.timeout(3 * DEMO_RUN_TIMEOUT_S + 120)
def test_killed_in_a_step_and_in_a_save_resumes_from_the_last_complete_checkpoint(tmp_path: Path):
    run_dir, port = tmp_path.resolve() / "run", free_port()
    ckpt = run_dir / "checkpoints"
    cmd = demo_cmd(port, "trainer.total_training_steps=2", "trainer.save_freq=1")

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
