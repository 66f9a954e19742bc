"""End to end: `python -m eval run` on a run with real FSDP shards, the tiny model and a BM25 server.

The run folder is built like verl's trainer builds it: step 5 is saved by verl's own
``FSDPCheckpointManager`` (FSDP2, gloo, world size 1) and merged back by verl's model merger;
step 0 is the run config's untrained model. Rows are real sample questions (``--suite
samples``), rolled out through verl's AgentLoopWorker and scored by reward_fns.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eval.__main__ import main
from eval.run.store import RowStore
from eval.run.summary import summarize
from search_env.paths import REPO_ROOT
from search_env.retrieval.process import free_port
from search_env.rollout_record import TERMINATIONS

BENCHMARKS = ["nq", "musique", "bamboogle"]
LIMIT = 2
FAST_LIMITS = ["--max-turns", "2", "--max-turn-tokens", "16", "--response-length", "96"]
"""Short turns keep the random tiny model fast; run.json records them."""

SAVE_FSDP = r"""
import sys, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForImageTextToText, AutoTokenizer
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
src, dst = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", rank=0, world_size=1)
model = AutoModelForImageTextToText.from_pretrained(src)
fully_shard(model, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",)))
manager = FSDPCheckpointManager(model, processing_class=AutoTokenizer.from_pretrained(src),
                                checkpoint_config={"save_contents": ["model"], "load_contents": ["model"]})
manager.save_checkpoint(dst, global_step=5)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """RUN/global_step_5/actor with verl FSDP shards of a differently seeded tiny model, + config.yaml."""
    from search_demo.tiny import build_tiny

    root = tmp_path_factory.mktemp("runs")
    trained = build_tiny(root / "seed1_model", seed=1)
    run = root / "f1_only_s3"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    subprocess.run(
        [sys.executable, "-c", SAVE_FSDP, str(trained), str(run / "global_step_5" / "actor")],
        check=True,
        env=env,
        timeout=300,
        capture_output=True,
    )
    (run / "latest_checkpointed_iteration.txt").write_text("5")
    config = {
        "shape": "f1_only",
        "seed": 3,
        "trainer": {"total_training_steps": 5},
        "actor_rollout_ref": {"model": {"path": str(tiny_model_dir)}},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run


def _args(run: Path, out: Path, url: str, *extra: str) -> list[str]:
    return [
        "run",
        "--run-dir",
        str(run),
        "--suite",
        "samples",
        "--out",
        str(out),
        "--limit",
        str(LIMIT),
        "--benchmarks",
        *BENCHMARKS,
        "--retriever-url",
        url,
        "--max-in-flight",
        "1",
        *FAST_LIMITS,
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, run_dir: Path, retrieval_server_url: str) -> Path:
    """An uninterrupted evaluation (in process); returns OUT/<run>."""
    out = tmp_path_factory.mktemp("eval_ref")
    assert main(_args(run_dir, out, retrieval_server_url)) == 0
    return out / "f1_only_s3"


def test_every_checkpoint_evaluated_and_summarised(
    reference: Path, run_dir: Path, retrieval_server_url: str, capsys: pytest.CaptureFixture[str]
):
    info = json.loads((reference / "run.json").read_text())
    assert (info["run"], info["shape"], info["seed"], info["horizon"]) == ("f1_only_s3", "f1_only", 3, 5)
    assert info["eval"]["limits"]["max_turn_tokens"] == 16 and info["eval"]["sampling"]["temperature"] == 0.0
    fingerprint = json.loads((reference / "global_step_5" / "checkpoint.json").read_text())["fingerprint"]
    assert (
        reference / "merged" / f"global_step_5.{fingerprint}" / "model.safetensors"
    ).is_file()  # verl's merger ran
    for step in (0, 5):
        rows = RowStore(reference / f"global_step_{step}" / "rows.jsonl").rows()
        assert sorted({r["benchmark"] for r in rows}) == sorted(BENCHMARKS)
        assert len(rows) == LIMIT * len(BENCHMARKS)
        assert all(r["termination"] in TERMINATIONS and isinstance(r["answered"], bool) for r in rows)
        assert all(r["model_tokens"] >= 1 and r["golds"] for r in rows)
        summary = json.loads((reference / f"global_step_{step}" / "summary.json").read_text())
        settings = summary.pop("eval")
        assert summary == summarize(rows, BENCHMARKS, step)
        assert settings["stage"] == "full" and settings["rows"] == dict.fromkeys(BENCHMARKS, LIMIT)
        assert settings["retriever"]["backend"] == "bm25" and settings["suite_fingerprint"]
    # a second invocation finds everything done and changes nothing
    before = {p: p.read_bytes() for p in reference.rglob("*.json*")}
    capsys.readouterr()
    assert main(_args(run_dir, reference.parent, retrieval_server_url)) == 0
    out = capsys.readouterr().out
    assert "step 5: " not in out  # no step had rows left to do
    assert out.splitlines()[0].startswith("plan full (--limit given")
    assert {p: p.read_bytes() for p in reference.rglob("*.json*")} == before
    assert main(_args(run_dir, reference.parent, "http://127.0.0.1:9")) == 1  # an unreachable retriever
    assert "retrieval server http://127.0.0.1:9 is not reachable" in capsys.readouterr().err


def test_kill_and_resume_gives_identical_rows(
    reference: Path, run_dir: Path, retrieval_server_url: str, tmp_path: Path
):
    """SIGKILL a `python -m eval run` mid-run, tear its last line, resume: same rows as uninterrupted."""
    out = tmp_path / "eval_killed"
    rows_path = out / "f1_only_s3" / "global_step_0" / "rows.jsonl"
    cmd = [sys.executable, "-m", "eval", *_args(run_dir, out, retrieval_server_url)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (rows_path.is_file() and len(rows_path.read_text().splitlines()) >= 2):
            assert proc.poll() is None, "eval run ended before it could be killed"
            assert time.monotonic() < deadline, "no rows written in time"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert not (out / "f1_only_s3" / "global_step_5" / "summary.json").exists()
    # Tear the last line of the checkpoint the kill interrupted: the one with rows but no summary
    # (global_step_0 can already be complete: the batched generator may finish it between polls).
    steps = sorted((out / "f1_only_s3").glob("global_step_*"))
    unfinished = [d for d in steps if (d / "rows.jsonl").is_file() and not (d / "summary.json").exists()]
    torn_dir = unfinished[0] if unfinished else out / "f1_only_s3" / "global_step_5"
    torn_dir.mkdir(exist_ok=True)
    with open(torn_dir / "rows.jsonl", "a") as f:
        f.write('{"benchmark": "nq", "id": "torn')  # as if killed in the middle of a write
    assert main(_args(run_dir, out, retrieval_server_url)) == 0
    for step in (0, 5):
        name = f"global_step_{step}"
        # greedy decoding: a different process, resumed midway, writes byte-identical rows
        assert (out / "f1_only_s3" / name / "rows.jsonl").read_bytes() == (
            reference / name / "rows.jsonl"
        ).read_bytes()
        assert (out / "f1_only_s3" / name / "summary.json").read_text() == (
            reference / name / "summary.json"
        ).read_text()


def test_torn_tail_after_the_last_row_is_cut(
    reference: Path, run_dir: Path, retrieval_server_url: str, tmp_path: Path
):
    """Killed after its last row but before its summary: the resumed run cuts the torn tail."""
    out = tmp_path / "eval_torn"
    shutil.copytree(reference, out / reference.name, ignore=shutil.ignore_patterns("merged"))
    step_dir = out / reference.name / "global_step_5"
    (step_dir / "summary.json").unlink()
    with open(step_dir / "rows.jsonl", "a") as f:
        f.write('{"benchmark": "nq", "id": "torn')
    assert main(_args(run_dir, out, retrieval_server_url)) == 0
    assert (step_dir / "rows.jsonl").read_bytes() == (reference / "global_step_5" / "rows.jsonl").read_bytes()
    assert (step_dir / "summary.json").read_text() == (
        reference / "global_step_5" / "summary.json"
    ).read_text()


def test_changed_settings_are_refused(
    reference: Path, run_dir: Path, retrieval_server_url: str, capsys: pytest.CaptureFixture[str]
):
    assert main(_args(run_dir, reference.parent, retrieval_server_url, "--max-turns", "3")) == 1
    said = capsys.readouterr().err
    assert "evaluation settings differ: rollout limits is" in said and "'max_assistant_turns': 3" in said


def _vllm_skip_reason() -> str | None:
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return (
            "vllm on this tiny model needs a CUDA GPU (vLLM's CPU kernels take linear-attention head dim "
            "64/128, this model has 16); tests/e2e/test_vllm_e2e.py runs the vllm backend on CPU"
        )
    if importlib.util.find_spec("vllm") is None:
        return "vllm backend needs vLLM (pip install -e .[gpu])"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_vllm_skip_reason() is not None, reason=str(_vllm_skip_reason()))
def test_vllm_backend_matches_protocol(
    reference: Path, run_dir: Path, retrieval_server_url: str, tmp_path: Path
):
    assert main(_args(run_dir, tmp_path, retrieval_server_url, "--backend", "vllm", "--steps", "0")) == 0
    rows = RowStore(tmp_path / "f1_only_s3" / "global_step_0" / "rows.jsonl").rows()
    assert len(rows) == LIMIT * len(BENCHMARKS)
