"""GRPO through verl on the CPU demo with the semantic reward (issue #42, item 5): 2 steps with
``shape=semantic`` (E5 cosine on a tiny local encoder, loaded in verl's reward worker) finish, log the
shape's reward every step (metrics.jsonl ``reward/mean``) and it is a cosine, not a string match.
The same 2 steps with ``shape=judge`` run in test_judge_e2e.py, beside the judge server they share.
Heavy: one trainer start-up, in a heavy-run slot (tests/heavy_slot.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import DEMO_RUN_TIMEOUT_S, demo_cmd, demo_env, free_port, logged_steps

from search_env.paths import REPO_ROOT
from search_env.retrieval.encoder import build_tiny_encoder

pytestmark = pytest.mark.timeout(DEMO_RUN_TIMEOUT_S + 300)

PREFIX = "reward.custom_reward_function.reward_kwargs"


TWO_PROMPTS = (
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=10",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=10",
)
"""Steps of 2 prompts x 5 rollouts (the CI demo's 4 halved, micro-batches dividing 10): these tests
check that a shape's reward reaches verl and is logged, not what it teaches."""


def train_two_steps(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """Two GRPO steps of the CI demo at :data:`TWO_PROMPTS`, no checkpoint, with ``overrides``."""
    steps = ("trainer.total_training_steps=2", "trainer.save_freq=-1")
    return subprocess.run(
        demo_cmd(free_port(), *steps, *TWO_PROMPTS, *overrides),
        cwd=REPO_ROOT,
        env=demo_env(run_dir),
        capture_output=True,
        text=True,
        timeout=DEMO_RUN_TIMEOUT_S,
    )


def check_two_steps_logged(run_dir: Path, run: subprocess.CompletedProcess) -> dict[int, dict]:
    assert run.returncode == 0, run.stderr[-4000:]
    steps = logged_steps(run_dir)
    assert sorted(steps) == [1, 2]
    for step in steps.values():
        assert 0.0 <= step["reward/mean"] <= 1.0 and "reward/em" in step
    return steps


def test_two_grpo_steps_with_the_semantic_reward(tmp_path):
    encoder = build_tiny_encoder(tmp_path / "tiny-e5")
    run_dir = tmp_path / "semantic"
    run = train_two_steps(run_dir, "shape=semantic", f"+{PREFIX}.encoder={encoder}")
    steps = check_two_steps_logged(run_dir, run)
    # a cosine, not a string match: rewards that are neither 0 nor 1 (the warm start answers)
    assert any(0.0 < s["reward/mean"] < 1.0 for s in steps.values())
    recipe = (run_dir / "recipe.yaml").read_text()
    assert "name: ${shape}" in recipe and "shape: semantic" in recipe
