"""A retriever that dies during a real CPU GRPO run (`bash launch/run.sh recipes/demo_cpu.yaml`, made
small as tests/conftest.py's demo_cmd runs it): once step 1 is logged its retriever is frozen
(SIGSTOP) for a few seconds, so step 2's first searches wait on it, then SIGKILLed, by PID.

- restarted by run.sh's watchdog: the run goes on, the searches that waited ride the restart out
  within their retry budget, and every step is logged with ``rollout/retrieval_failures``;
- not restarted (``retriever.max_restarts=0``): the steps with failed searches are logged and
  warned about, and the trainer stops non-zero after ``retriever.max_failed_steps`` (2) of them
  with a message naming the retriever URL and the steps.

The restarted run also trains with the semantic reward (``shape=semantic``: E5 cosine on a tiny local
encoder, loaded in verl's reward worker): it logs the shape's reward every step, and it is a cosine,
not a string match. One run checks both because a trainer start-up is most of a CPU run's cost (the
same reward plumbing with ``shape=judge`` runs in test_judge_e2e.py, beside its judge server).

Heavy: one trainer start-up (~1.5 min on 2 cores) each, in one of the heavy-run slots (tests/heavy_slot.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import DEMO_RUN_TIMEOUT_S, free_port, logged_steps, port_free, start_demo

from search_env.retrieval.encoder import build_tiny_encoder

FROZEN_S = 4.0
"""Step 2's rollouts start as step 1 is logged; their first searches come within about a second."""


def _run_killing_the_retriever(run_dir: Path, port: int, *overrides: str) -> tuple[int, str, int]:
    """Run the demo; once step 1 is logged, SIGSTOP its retriever (PID from retriever.pid) for
    FROZEN_S seconds, then SIGKILL it. Returns the exit status, run.sh's stderr and the killed PID."""
    proc = start_demo(run_dir, port, "trainer.save_freq=-1", *overrides)
    killed = 0
    try:
        deadline = time.monotonic() + DEMO_RUN_TIMEOUT_S
        while not ((run_dir / "metrics.jsonl").is_file() and 1 in logged_steps(run_dir)):
            assert proc.poll() is None, f"the run ended before step 1: {proc.stderr.read()[-4000:]}"
            assert time.monotonic() < deadline, f"step 1 was not logged within {DEMO_RUN_TIMEOUT_S} s"
            time.sleep(0.5)
        killed = int((run_dir / "retriever.pid").read_text())
        os.kill(killed, signal.SIGSTOP)
        time.sleep(FROZEN_S)
        os.kill(killed, signal.SIGKILL)
        _, err = proc.communicate(timeout=DEMO_RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # run.sh's trap stops what it started
            proc.wait(timeout=120)
    return proc.returncode, err, killed


@pytest.mark.timeout(DEMO_RUN_TIMEOUT_S + 120)
def test_retriever_killed_mid_run_is_restarted_and_training_goes_on(tmp_path):
    run_dir, port = tmp_path / "restart", free_port()
    encoder = build_tiny_encoder(tmp_path / "tiny-e5")
    semantic = ("shape=semantic", f"+reward.custom_reward_function.reward_kwargs.encoder={encoder}")
    rc, err, killed = _run_killing_the_retriever(run_dir, port, "trainer.total_training_steps=3", *semantic)
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


@pytest.mark.timeout(DEMO_RUN_TIMEOUT_S + 120)
def test_retriever_that_stays_down_stops_the_run_with_the_reason(tmp_path):
    run_dir, port = tmp_path / "down", free_port()
    rc, err, killed = _run_killing_the_retriever(
        run_dir,
        port,
        "trainer.total_training_steps=5",
        "retriever.max_restarts=0",
        "retriever.retry_budget_s=2",
    )
    assert rc != 0, err[-4000:]
    assert f"retriever (PID {killed}) exited with status 137 and is not restarted" in err
    steps = logged_steps(run_dir)
    assert sorted(steps) == [1, 2, 3], "stopped after the 2nd step with failed searches, its metrics logged"
    assert steps[1]["rollout/retrieval_failures"] == 0
    assert steps[2]["rollout/retrieval_failures"] > 0 and steps[3]["rollout/retrieval_failures"] > 0
    url = f"http://127.0.0.1:{port}"
    assert f"step 2: {int(steps[2]['rollout/retrieval_failures'])} of " in err and url in err
    stop = next(line for line in err.splitlines() if "retriever down:" in line)
    for part in ("2 consecutive training steps", url, "steps 2 (", ", 3 (", str(run_dir / "retriever.log")):
        assert part in stop, part
    assert "training FAILED" in err
    assert port_free(port)
