"""GRPO through verl on the CPU demo with the model-based rewards (issue #42, item 5): 2 steps with
``shape=semantic`` (E5 cosine on a tiny local encoder, loaded in verl's reward worker) and 2 steps
with ``shape=judge`` against a real judge: vLLM's CPU build serving the demo's base model
(launch/serve_judge.sh; its verdicts need not be good, the real server path is what is exercised).
Each run finishes its steps, logs the shape's reward every step (metrics.jsonl ``reward/mean``), and
the judge's verdicts land in the run's verdict cache. Heavy: one trainer start-up each, in a
heavy-run slot (tests/heavy_slot.py); the judge run also starts a vLLM server (stopped by PID)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import DEMO_RUN_TIMEOUT_S, demo_cmd, demo_env, free_port, logged_steps

from launch.serve_judge import wait_ready
from patches import vllm_cpu_version
from search_env.paths import REPO_ROOT
from search_env.retrieval.encoder import build_tiny_encoder

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(DEMO_RUN_TIMEOUT_S + 300)]

PREFIX = "reward.custom_reward_function.reward_kwargs"
JUDGE_START_TIMEOUT_S = 300
"""vLLM's CPU engine serving the demo base model starts in ~30-60 s on 2 cores; more beside another run."""


def _train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """Two GRPO steps of the CI demo (4 prompts x 5 rollouts), no checkpoint, with ``overrides``."""
    return subprocess.run(
        demo_cmd(free_port(), "trainer.total_training_steps=2", "trainer.save_freq=-1", *overrides),
        cwd=REPO_ROOT,
        env=demo_env(run_dir),
        capture_output=True,
        text=True,
        timeout=DEMO_RUN_TIMEOUT_S,
    )


def _check_two_steps_logged(run_dir: Path, run: subprocess.CompletedProcess) -> dict[int, dict]:
    assert run.returncode == 0, run.stderr[-4000:]
    steps = logged_steps(run_dir)
    assert sorted(steps) == [1, 2]
    for step in steps.values():
        assert 0.0 <= step["reward/mean"] <= 1.0 and "reward/em" in step
    return steps


def test_two_grpo_steps_with_the_semantic_reward(tmp_path):
    encoder = build_tiny_encoder(tmp_path / "tiny-e5")
    run_dir = tmp_path / "semantic"
    run = _train(run_dir, "shape=semantic", f"+{PREFIX}.encoder={encoder}")
    steps = _check_two_steps_logged(run_dir, run)
    # a cosine, not a string match: rewards that are neither 0 nor 1 (the warm start answers)
    assert any(0.0 < s["reward/mean"] < 1.0 for s in steps.values())
    recipe = (run_dir / "recipe.yaml").read_text()
    assert "name: ${shape}" in recipe and "shape: semantic" in recipe


@pytest.fixture
def judge_server(tmp_path) -> Iterator[str]:
    """launch/serve_judge.sh on the demo's base model (vLLM's CPU build), stopped by its PID."""
    if vllm_cpu_version._installed("vllm-cpu") is None:
        pytest.skip("vllm-cpu not installed")
    port = free_port()
    log = tmp_path / "judge.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            ["bash", "launch/serve_judge.sh", str(REPO_ROOT / "assets" / "demo_base")],
            cwd=REPO_ROOT,
            env={**os.environ, "PORT": str(port), "HF_HUB_OFFLINE": "1"},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, JUDGE_START_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as err:
            raise AssertionError(f"the judge did not start: {err}: {log.read_text()[-3000:]}") from None
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the server and its engine process
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_two_grpo_steps_with_the_judge_reward(tmp_path, judge_server):
    model = httpx.get(f"{judge_server}/models", timeout=5).json()["data"][0]["id"]
    run_dir = tmp_path / "judge"
    run = _train(
        run_dir, "shape=judge", f"+{PREFIX}.judge_url={judge_server}", f"+{PREFIX}.judge_model={model}"
    )
    _check_two_steps_logged(run_dir, run)
    verdicts = [json.loads(line) for line in (run_dir / "judge_verdicts.jsonl").read_text().splitlines()]
    assert verdicts and all(v["judgement"] in ("correct", "incorrect", "unparsed") for v in verdicts)
