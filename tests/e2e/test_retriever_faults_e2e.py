"""A retriever that dies during a real CPU GRPO run (`bash launch/run.sh recipes/demo_cpu.yaml`, made
small as tests/conftest.py's demo_cmd runs it): once step 1 is logged its retriever is frozen
(SIGSTOP) for a few seconds, so step 2's first searches wait on it, then SIGKILLed, by PID
(tests/conftest.py ``run_killing_the_retriever``). Restarted by run.sh's watchdog, the run goes on,
the searches that waited ride the restart out within their retry budget, and every step is logged
with ``rollout/retrieval_failures``. (Not restarted, ``retriever.max_restarts=0``, the run stops
after ``retriever.max_failed_steps`` steps with failed searches: tests/e2e/test_judge_e2e.py, on its
judge-reward run.)

The run also trains with the semantic reward (``shape=semantic``: E5 cosine on a tiny local
encoder, loaded in verl's reward worker): it logs the shape's reward every step, and it is a cosine,
not a string match. One run checks both because a trainer start-up is most of a CPU run's cost.

Heavy: one trainer start-up (~1.5 min on 2 cores), in one of the heavy-run slots (tests/heavy_slot.py)."""

from __future__ import annotations

import pytest
from conftest import DEMO_RUN_TIMEOUT_S, free_port, logged_steps, port_free, run_killing_the_retriever

from search_env.retrieval.encoder import build_tiny_encoder


@pytest.mark.timeout(DEMO_RUN_TIMEOUT_S + 120)
def test_retriever_killed_mid_run_is_restarted_and_training_goes_on(tmp_path):
    run_dir, port = tmp_path / "restart", free_port()
    encoder = build_tiny_encoder(tmp_path / "tiny-e5")
    semantic = ("shape=semantic", f"+reward.custom_reward_function.reward_kwargs.encoder={encoder}")
    rc, err, killed = run_killing_the_retriever(run_dir, port, "trainer.total_training_steps=3", *semantic)
    assert rc == 0, err[-4000:]
    note = f"retriever (PID {killed}) exited with status 137; restarted as PID"
    train_log = (run_dir / "train.log").read_text()
    assert note in err and note in train_log
    assert f"retriever http://127.0.0.1:{port} marked down" in train_log, "no search waited on the dead one"
    assert "(restart 1 of retriever.max_restarts=3)" in err
    steps = logged_steps(run_dir)
    assert sorted(steps) == [1, 2, 3]
    for step, logged in steps.items():
        assert logged["rollout/retrieval_failures"] == 0, (step, "a search outlasted the retry budget")
        assert logged["rollout/searches_mean"] > 0
    assert port_free(port), "the restarted retriever outlived the run"
    assert not (run_dir / "retriever.pid").exists()
    # the semantic reward reached verl and was logged: a cosine, neither 0 nor 1 on the warm start's answers
    assert all(0.0 <= s["reward/mean"] <= 1.0 and "reward/em" in s for s in steps.values())
    assert any(0.0 < s["reward/mean"] < 1.0 for s in steps.values())
    recipe = (run_dir / "recipe.yaml").read_text()
    assert "name: ${shape}" in recipe and "shape: semantic" in recipe
