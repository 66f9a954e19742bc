"""The CPU demo end to end: `bash launch/run.sh recipes/demo_cpu.yaml` trains for real with verl
(GRPO, Ray, FSDP2, the search agent loop against a live BM25 retriever), checkpoints, and a
second invocation resumes from that checkpoint. Heavy: two trainer start-ups (~2 min each on 2
cores), serialised with other heavy runs through /tmp/rlvr_heavy.lock."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 900  # per invocation, lock wait included; the recipe's own trainer limit is 420 s


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_demo(run_dir: Path, port: int, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [
        "flock",
        "/tmp/rlvr_heavy.lock",
        "bash",
        "launch/run.sh",
        "recipes/demo_cpu.yaml",
        f"retriever.port={port}",
        *overrides,
    ]
    env = {**os.environ, "RLVR_RUN_DIR": str(run_dir), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _steps(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row["data"] for row in map(json.loads, lines)}


def _private_ray_leftovers() -> set[str]:
    """Private Ray temp dirs of launch/run.sh, and processes still using one."""
    found = {str(p) for p in Path("/tmp").glob("rlvr_ray.*")}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "/tmp/rlvr_ray." in cmdline:
            found.add(f"pid {proc.name}: {cmdline[:120]}")
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_demo_trains_checkpoints_and_resumes(tmp_path):
    run_dir, port = tmp_path / "demo", _free_port()
    before = _private_ray_leftovers()
    first = _run_demo(run_dir, port)
    assert first.returncode == 0, first.stderr[-4000:]
    ckpt = run_dir / "checkpoints"
    assert f"checkpoint: {ckpt}/global_step_2/actor" in first.stderr
    assert (ckpt / "global_step_2" / "actor" / "model_world_size_1_rank_0.pt").is_file()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    steps = _steps(run_dir)
    assert sorted(steps) == [1, 2]
    assert all(math.isfinite(s["actor/grad_norm"]) for s in steps.values())
    assert any(s["rollout/searches_mean"] > 0 for s in steps.values()), "no rollout called the search tool"
    assert any(s["actor/grad_norm"] > 0 for s in steps.values()), "no learning signal (all groups tied)"
    assert "Training from scratch" in first.stderr
    assert _port_free(port), "the retriever outlived the run"

    second = _run_demo(run_dir, port, "trainer.total_training_steps=3")
    assert second.returncode == 0, second.stderr[-4000:]
    assert re.search(r"Resuming from \S+/global_step_2", second.stderr), second.stderr[-4000:]
    assert "step:3" in second.stderr and "step:1 " not in second.stderr
    assert sorted(_steps(run_dir)) == [1, 2, 3], "metrics history lost on resume"
    assert (ckpt / "global_step_3" / "actor" / "model_world_size_1_rank_0.pt").is_file()
    assert _private_ray_leftovers() <= before, "Ray processes or temp dirs outlived the run"
