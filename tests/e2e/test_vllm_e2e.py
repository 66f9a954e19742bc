"""The GPU recipe's rollout path, run on a CPU: verl's own vLLM server and replica (vLLM's CPU
build) behind our agent loop, the FSDP -> vLLM weight sync every step, an actor sharded over two
ranks on two Ray nodes, and vLLM evaluation.

- Two Ray nodes are started on this machine as a user who outgrows one machine starts them
  (``ray start --head``, ``ray start --address=...``, then ``RAY_ADDRESS`` for ``launch/run.sh``):
  the launcher joins the cluster, and the actor is sharded over both nodes (2 FSDP ranks, a vLLM
  replica each).
- ``launch/run.sh recipes/demo_cpu.yaml actor_rollout_ref.rollout.name=vllm`` trains two GRPO steps
  and checkpoints each (2 shards). At each step the server's log-probs of the tokens it sampled
  equal the actor's recomputed ones within bf16 tolerance (verl's ``training/rollout_probs_diff_*``;
  the sync gathers both shards), and at step 2 that is the UPDATED actor: the step-1 weights differ
  from step 0's on those rollouts by far more than the tolerance, so a server still on the old
  weights would have failed the check. (Resuming a checkpoint is the same verl code for either
  rollout backend: tests/e2e/test_demo_e2e.py and the Slurm test resume HF-rollout runs; a
  second vLLM start-up here cost ~2.5 min of the CI's 30.)
- The ``hf`` and ``vllm`` backends' rollouts are masked and scored the same way (one agent loop,
  one reward function).
- ``BACKEND=vllm bash launch/eval.sh`` evaluates the resulting checkpoint with the study's evaluation
  preset (``study_eval``: its own stops, token passage cap and limits). The training preset's vLLM
  rollouts are the training run's own, checked above at every step; how each preset's limits are
  derived is backend-independent and unit-tested (tests/eval/).

Heavy (one trainer start-up, vLLM engines start in ~30 s on 2 cores each), the run and each of
the two later tests' vLLM engines holding every heavy-run slot
(tests/heavy_slot.py ``--all``): a vLLM engine binds its OpenMP threads to every core, and beside
another heavy run a one-step run took over 900 s (CI, 02 Dec 2026), the two later tests 297 s and
326 s instead of ~50 s each (06 Dec 2026)."""

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
import torch
from conftest import (
    DEMO_RUN_TIMEOUT_S,
    HEAVY_SLOT,
    SLOT_WAIT_S,
    demo_cmd,
    demo_env,
    demo_eval,
    free_port,
    logged_steps,
)

from patches import vllm_cpu_version
from search_env.paths import REPO_ROOT

pytestmark = [
    # the module's first test also pays for the cluster and the training run (its fixtures)
    pytest.mark.timeout(2 * DEMO_RUN_TIMEOUT_S + 300),
    pytest.mark.skipif(vllm_cpu_version._installed("vllm-cpu") is None, reason="vllm-cpu not installed"),
]

WORLD = REPO_ROOT / ".demo" / "world_s0"
PROB_TOLERANCE = 0.01
"""Mean |p_vllm - p_actor| per response token allowed: bf16 weights and activations in vLLM
against the fp32 actor (measured 0.0018 on the demo model, 0.0021 with 2 ranks)."""
RAY = str(Path(sys.executable).with_name("ray"))
PORT_RACE = "EADDRINUSE"
"""What a vLLM engine logs when its worker's distributed init port was taken between vLLM picking
it (``get_open_port``: bind to port 0, close) and listening on it. Two engines starting at once on
one machine lost that race once in a fresh-clone CI run (03 Dec 2026), so the run is retried once
on exactly that error; nothing else is retried."""


GCS_PORT_RACE = "Failed to start GCS"
"""What ``ray start --head`` prints when its GCS could not bind: a port it was given or drew was taken
between the draw and the bind by another test's daemons (seen once with the Slurm test's daemons
starting beside it, 06 Dec 2026). The head is started once more on another port; nothing else is
retried."""


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


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory) -> Iterator[dict[str, str]]:
    """A head and a second Ray node on loopback, one logical GPU each; the env to reach them."""
    tmp_path = tmp_path_factory.mktemp("ray_nodes")
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

    def start_head() -> None:
        start("head", "--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}")

    try:
        start_head()
        probe = "import ray, sys; ray.init(); sys.exit(0 if len(ray.nodes()) >= int(sys.argv[1]) else 1)"
        retried = False
        for wanted in (1, 2):
            deadline = time.monotonic() + 120
            while subprocess.run(
                [sys.executable, "-c", probe, str(wanted)],
                env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
                capture_output=True,
                timeout=60,
            ).returncode:
                log = (tmp_path / "ray_head.log").read_text()
                if wanted == 1 and not retried and procs[0].poll() is not None and GCS_PORT_RACE in log:
                    retried = True  # GCS_PORT_RACE: once more, on another port
                    procs.clear()
                    port = free_port()
                    start_head()
                    (tmp_path / "ray_head.first.log").write_text(log)
                assert time.monotonic() < deadline, log[-3000:]
                time.sleep(2)
            if wanted == 1:
                start("worker", f"--address=127.0.0.1:{port}")
        address = f"127.0.0.1:{port}"
        yield {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": env["RAY_AUTH_TOKEN"]}
    finally:
        _stop(procs[::-1])
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory, two_node_cluster: dict) -> Path:
    """The run directory after two steps on two ranks, each checkpointed."""
    run_dir, port = tmp_path_factory.mktemp("vllm") / "run", free_port()

    def train() -> subprocess.CompletedProcess:
        return subprocess.run(
            demo_cmd(
                port,
                "actor_rollout_ref.rollout.name=vllm",
                "actor_rollout_ref.actor.optim.lr=1e-3",  # a step large enough to see in the log-probs
                "trainer.nnodes=2",
                "trainer.n_gpus_per_node=1",
                # 4 prompts x 5 rollouts = 10 per rank: every micro-batch must divide it
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=10",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=10",
                f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
                "trainer.total_training_steps=2",
                "trainer.save_freq=1",
                exclusive=True,  # two engines bound to every core: beside another heavy run, > 900 s a run
            ),
            cwd=REPO_ROOT,
            env={**demo_env(run_dir), **two_node_cluster},
            capture_output=True,
            text=True,
            timeout=DEMO_RUN_TIMEOUT_S,
        )

    done = train()
    if done.returncode != 0 and PORT_RACE in (run_dir / "train.log").read_text(errors="replace"):
        done = train()  # vLLM's engine port race (PORT_RACE): a fresh start draws new ports
    assert done.returncode == 0, done.stderr[-4000:]
    assert "joining the Ray cluster at" in done.stderr
    for step in (1, 2):
        actor = run_dir / "checkpoints" / f"global_step_{step}" / "actor"
        assert sorted(p.name for p in actor.glob("model_world_size_*")) == [
            "model_world_size_2_rank_0.pt",
            "model_world_size_2_rank_1.pt",
        ]
    return run_dir


def _token_probs(model_dir: Path, texts: list[str]) -> list[torch.Tensor]:
    """Per text, the fp32 probability the model gives each next token (HF, not vLLM)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt").input_ids[:, :512]
            logp = model(ids).logits[0, :-1].log_softmax(-1)
            out.append(logp.gather(1, ids[0, 1:, None])[:, 0].exp())
    return out


def test_vllm_rollouts_track_the_updated_actor(vllm_run: Path, tmp_path: Path):
    steps = logged_steps(vllm_run)
    assert sorted(steps) == [1, 2]
    for step, s in steps.items():
        assert s["training/rollout_probs_diff_valid"] == 1.0
        assert s["training/rollout_probs_diff_mean"] <= PROB_TOLERANCE, (step, s)
        assert s["training/rollout_actor_probs_pearson_corr"] >= 0.99, (step, s)
    # the warm start searches and scores (step 2 follows an lr-1e-3 update and may have collapsed)
    assert steps[1]["rollout/searches_mean"] > 0 and steps[1]["reward/mean"] > 0
    # What a server still on the step-0 weights would have scored: step 1 vs step 0 on step 2's rollouts.
    from eval.run.checkpoints import discover, materialize

    step1 = next(c for c in discover(vllm_run / "checkpoints") if c.step == 1)
    merged = materialize(step1, tmp_path / "merged")
    texts = [json.loads(line) for line in (vllm_run / "rollouts" / "2.jsonl").read_text().splitlines()][:8]
    texts = [r["input"] + r["output"] for r in texts]
    before = _token_probs(REPO_ROOT / ".demo" / "warm_start_ci", texts)
    after = _token_probs(merged, texts)
    moved = torch.cat([(a - b).abs() for a, b in zip(after, before, strict=True)]).mean().item()
    synced = steps[2]["training/rollout_probs_diff_mean"]
    assert moved >= 3 * synced, (
        f"the update moved token probabilities by {moved:.4f}, the sync gap is {synced:.4f}"
    )


def check_masked_and_scored(tmp: str) -> None:
    """Same rows, greedy, through each backend: the loss mask is 1 exactly on the sampled tokens
    (environment tokens are tool turns), and the reward recomputed from the decoded response
    equals the stored EM. Run in its own interpreter (see the test below)."""
    tmp_path = Path(tmp)
    import pandas as pd

    from eval.run.backends import make_backend
    from reward_fns.compute_score import compute_score
    from search_demo.rollout import demo_rollout_config
    from search_demo.warm_start import bm25_server
    from search_env.verl_glue import rows_to_batch, write_tool_config

    model = REPO_ROOT / ".demo" / "warm_start_ci"
    rows = pd.read_parquet(WORLD / "train.parquet").head(6).to_dict("records")
    with bm25_server(WORLD / "corpus.jsonl") as url:
        config = demo_rollout_config(model, write_tool_config(tmp_path / "tools.yaml", [url]))
        for name in ("hf", "vllm"):
            backend = make_backend(name, config, str(model))
            try:
                batch = rows_to_batch(rows)
                batch.meta_info["validate"] = True
                out = backend.run(backend.generate_sequences(batch))
            finally:
                backend.close()
            tok = backend.tokenizer
            width = out.batch["prompts"].shape[1]
            for i, row in enumerate(rows):
                n = int(out.batch["attention_mask"][i, width:].sum())
                ids, mask = out.batch["responses"][i, :n], out.batch["response_mask"][i, :n]
                assert int(mask.sum()) == int(out.non_tensor_batch["model_tokens"][i]), name
                env_text = tok.decode(ids[mask == 0].tolist())
                assert env_text.count("<tool_response>") >= int(out.non_tensor_batch["searches"][i]), name
                assert "<answer>" not in env_text, f"{name}: a sampled token was masked out"
                response = tok.decode(ids.tolist(), skip_special_tokens=True)
                score = compute_score(
                    row["data_source"], response, row["reward_model"]["ground_truth"], shape="em_only"
                )
                assert score["em"] in (0.0, 1.0) and score["score"] == score["em"], name


def test_hf_and_vllm_rollouts_are_masked_and_scored_alike(vllm_run: Path, tmp_path: Path):
    """:func:`check_masked_and_scored` in a fresh interpreter: importing vLLM replaces transformers'
    Qwen3.5 config classes for the rest of the process, which would break later tests' HF loads."""
    check = f"import test_vllm_e2e as t; t.check_masked_and_scored({str(tmp_path)!r})"
    done = subprocess.run(
        [*HEAVY_SLOT, "--all", sys.executable, "-c", check],  # a vLLM engine: every core (module docstring)
        cwd=Path(__file__).parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])},
        capture_output=True,
        text=True,
        timeout=900 + SLOT_WAIT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]


def test_vllm_evaluates_the_checkpoint_with_the_study_eval_preset(vllm_run: Path, tmp_path: Path):
    preset = "study_eval"
    done = demo_eval(
        vllm_run / "checkpoints",
        tmp_path / "eval",
        "--steps",
        "2",
        "--limits-preset",
        preset,
        limit=1,
        backend="vllm",
        exclusive=True,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (summary_path,) = (tmp_path / "eval").glob("*/global_step_2/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["complete"] and summary["limits_preset"] == preset
    assert all(b["n"] == 1 for b in summary["benchmarks"].values())
