"""The doctor (launch/doctor/), checked without a GPU: the CUDA / driver diagnosis, and the GPU
smoke test (launch/gpu_smoke.sh -> ``python -m launch.doctor.gpu_smoke run``): its no-CUDA exit, its
stages, budget and report, and its CPU-checkable stages (the tiny 248K-vocab model, the report
parsers, the GPU-index stage's comparison, the checkpoint policy on disk)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import preflight
from launch.doctor import cuda, gpu_smoke, smoke_checks
from search_env.paths import REPO_ROOT
from search_env.retrieval.process import free_port

RECIPES = REPO_ROOT / "recipes"


def test_cuda_diagnosis_names_the_cause_and_the_driver_floor():
    diagnose = cuda.cuda_diagnosis
    cpu = diagnose("2.13.0+cpu", None, None, None, "/venv/bin/python")
    assert "CPU build" in cpu and "/venv/bin/python" in cpu and "PYTHON=" in cpu
    assert "no NVIDIA driver found" in cpu and ">= 580" in cpu
    assert "NVIDIA driver 575.51.03" in diagnose("2.13.0+cpu", None, "575.51.03", None, "py")
    old = diagnose("2.11.0+cu130", "13.0", "570.124.06", None, "py")
    assert "CUDA 13.0" in old and "570.124.06" in old and ">= 580" in old and "upgrade the driver" in old
    assert "no NVIDIA driver was found" in diagnose("2.11.0+cu130", "13.0", None, None, "py")
    hidden = diagnose("2.11.0+cu130", "13.0", "580.65.06", "", "py")
    assert "CUDA_VISIBLE_DEVICES" in hidden and "hides" in hidden
    assert ">= 525" in diagnose("2.5.1+cu121", "12.1", "580.65.06", "0", "py")


def test_driver_version_is_read_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 575.51.03\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert cuda.driver_version() == "575.51.03"


# ---- launch/gpu_smoke.sh: python -m launch.doctor.gpu_smoke run -----------------------------------


def _run_gpu_smoke(smoke_dir: Path, timeout_s: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "launch/gpu_smoke.sh"],
        cwd=REPO_ROOT,
        env={**os.environ, "SMOKE_DIR": str(smoke_dir)},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit; this machine has a GPU")
@pytest.mark.slow
def test_gpu_smoke_exits_2_at_once_without_cuda(tmp_path: Path):
    done = _run_gpu_smoke(tmp_path / "smoke", 120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
    assert "no CUDA device: " in done.stderr, (
        "the cuda stage's own diagnosis (python -m launch.doctor.gpu_smoke cuda)"
    )
    assert not (tmp_path / "smoke").exists(), "nothing may run without a GPU"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU smoke run needs a CUDA GPU (none here)")
def test_gpu_smoke_passes(tmp_path: Path):
    done = _run_gpu_smoke(tmp_path / "smoke", 700)
    assert done.returncode == 0, done.stdout[-4000:]


def test_the_script_only_chooses_the_interpreter_and_runs_the_python_entry_point():
    script = (REPO_ROOT / "launch" / "gpu_smoke.sh").read_text()
    code = [line for line in script.splitlines() if line.strip() and not line.startswith("#")]
    assert code[-1] == 'exec "$PYTHON" -m launch.doctor.gpu_smoke run'
    assert len(code) == 4, code  # set -euo pipefail, source _common.sh, cd, exec: the stages live in Python


def test_the_stages_keep_their_order_timeouts_and_models(tmp_path: Path):
    plan = gpu_smoke.stages(tmp_path, tmp_path / "judge_model")
    assert [(s.name, s.timeout_s) for s in plan] == [
        ("versions", 30),
        ("dense", 90),
        ("gpu-index", 60),
        ("tiny", 40),
        ("grpo", 260),
        ("policy", 15),
        ("logprobs", 10),
        ("eval", 100),
        ("packed", 40),
        ("memory", 90),
        ("judge", 120),
    ]
    assert gpu_smoke.BUDGET_S == 600 and gpu_smoke.SKIP_BELOW_S == 5
    by_name = {s.name: s.args for s in plan}
    assert by_name["memory"] == ("memory", str(REPO_ROOT / "data" / "models" / "Qwen3.5-0.8B"))
    assert by_name["judge"] == ("judge", str(tmp_path / "judge_model"), str(tmp_path / "judge"))
    assert by_name["policy"] == ("checkpoints", str(tmp_path / "run" / "checkpoints"))
    for stage in plan:  # each is a subcommand of the module
        with pytest.raises(SystemExit) as done:
            gpu_smoke.main([stage.args[0], "--help"])
        assert done.value.code == 0, stage


@pytest.mark.slow
def test_the_run_reports_each_stage_status_time_result_and_rows(tmp_path: Path, capsys):
    """A stage that passes, one that fails, one past its timeout (a read that never returns; its
    process group is stopped) and one after it; the report has every row, the total, the details."""
    good = tmp_path / "metrics.jsonl"
    data = {"training/rollout_probs_diff_valid": 1, "training/rollout_probs_diff_mean": 0.004}
    good.write_text(json.dumps({"step": 1, "data": data}) + "\n")
    hang = tmp_path / "fifo"
    os.mkfifo(hang)
    smoke = tmp_path / "smoke"
    smoke.mkdir()
    Stage = gpu_smoke.Stage
    plan = [
        Stage("good", 60, ("rollout-logprobs", str(good))),
        Stage("bad", 60, ("checkpoints", str(tmp_path / "absent"))),
        Stage("hang", 1, ("rollout-logprobs", str(hang))),
        Stage("late", 60, ("rollout-logprobs", str(good))),
    ]
    assert gpu_smoke.run(smoke, plan, budget_s=1000) == 1
    report = (smoke / "report.md").read_text()
    assert capsys.readouterr().out == report
    assert report.startswith("# GPU smoke test (") and f"python: {sys.executable}; commit " in report
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in report.splitlines() if " | " in line}
    assert rows["good"][0] == "PASS" and rows["good"][2].startswith("PASS: vLLM and FSDP agree")
    assert rows["bad"][0] == "FAIL (exit 1)" and "FileNotFoundError" in rows["bad"][2]
    assert rows["hang"][0] == "TIMEOUT (1 s)" and int(rows["hang"][1]) >= 1
    assert rows["late"][0] == "PASS"
    assert "Total: " in report and "s of a " in report and f"Logs: {smoke}/<stage>.log" in report
    assert "### good\n\n| item | value |\n|---|---|\n| step 1 rollout_probs_diff_valid | 1 |" in report
    assert f"### bad\n\n| item | value |\n|---|---|\n| log | {smoke / 'bad.log'} |" in report
    assert sorted(p.name for p in smoke.glob("*.log")) == ["bad.log", "good.log", "hang.log", "late.log"]


def test_a_stage_without_budget_left_is_skipped(tmp_path: Path, capsys):
    plan = [gpu_smoke.Stage("versions", 30, ("versions",))]
    assert gpu_smoke.run(tmp_path, plan, budget_s=gpu_smoke.SKIP_BELOW_S - 1) == 1
    assert "| versions | SKIPPED | 0 | the 4 s budget is spent |" in capsys.readouterr().out
    assert (
        not (tmp_path / "versions.log").exists()
        and "### versions" not in (tmp_path / "report.md").read_text()
    )


def test_a_stage_log_gives_its_result_line_and_rows(tmp_path: Path):
    log = "| a | 1 |\nRESULT: FAIL: x|y\n| b | 2 |\nRESULT: PASS: last one\n\n"
    assert gpu_smoke.read_log(log, tmp_path / "s.log") == ("PASS: last one", ["| a | 1 |", "| b | 2 |"])
    crash = "Traceback (most recent call last):\n" + "ValueError: " + "v|" * 100 + "\n\n"
    line, rows = gpu_smoke.read_log(crash, tmp_path / "s.log")
    assert line == ("ValueError: " + "v|" * 100)[:160].replace("|", "/") and rows == [
        f"| log | {tmp_path / 's.log'} |"
    ]
    assert gpu_smoke.read_log("", tmp_path / "s.log")[0] == ""


@pytest.mark.slow
def test_smoke_builds_a_tiny_model_with_the_real_vocabulary_and_a_recipe_that_validates(
    tmp_path: Path, capsys
):
    assert gpu_smoke.main(["tiny", str(tmp_path / "m"), "--data", str(tmp_path / "data")]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["text_config"]["vocab_size"] == 248_320 and config["model_type"] == "qwen3_5"
    assert "RESULT: PASS" in capsys.readouterr().out
    overrides = [f"retriever.port={free_port()}", f"actor_rollout_ref.model.path={tmp_path / 'm'}"]
    overrides += [f"data.train_files={tmp_path / 'data' / 'train.parquet'}"]
    overrides += [f"data.val_files={tmp_path / 'data' / 'val.parquet'}"]
    plan = preflight.run_setup(RECIPES / "gpu_smoke.yaml", overrides, tmp_path)
    cfg = plan.config
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.actor_rollout_ref.model.use_remove_padding
    assert cfg.actor_rollout_ref.actor.use_dynamic_bsz
    assert "hf_model" in cfg.actor_rollout_ref.actor.checkpoint.save_contents
    assert (
        cfg.trainer.checkpoint_callback_class.endswith("PruneOlderToWeights") and cfg.trainer.save_freq == 1
    )
    expected_here = ("torch sees no CUDA device", "flash-linear-attention", "needs flash-attn")  # CPU set
    others = [p for p in plan.problems if not any(e in p for e in expected_here)]
    assert others == [], others


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit; this machine has a GPU")
def test_smoke_gpu_index_stage_exits_2_without_cuda(tmp_path: Path, capsys):
    assert gpu_smoke.main(["gpu-index", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [], "nothing is built without a GPU"


def test_smoke_compares_gpu_and_cpu_searches():
    import numpy as np

    cpu = (np.array([[0.9, 0.5], [0.8, 0.7], [0.6, 0.1]]), np.array([[1, 2], [3, 4], [5, 6]]))
    gpu = (np.array([[0.9004, 0.5], [0.7, 0.6], [0.6, 0.2]]), np.array([[1, 2], [4, 3], [5, 9]]))
    match = smoke_checks.compare_searches(cpu, gpu)
    assert match["overlap"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert match["top1"] == pytest.approx(2 / 3) and match["score_diff"] == pytest.approx(4e-4)
    none_agree = smoke_checks.compare_searches(cpu, (gpu[0], gpu[1] + 100))
    assert none_agree["top1"] == 0.0 and none_agree["score_diff"] == 0.0


def _faiss_gpu_missing() -> str | None:
    from search_env.retrieval.placement import gpu_unavailable_reason

    return "no CUDA device" if not torch.cuda.is_available() else gpu_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(
    _faiss_gpu_missing() is not None, reason=f"needs a GPU and faiss-gpu: {_faiss_gpu_missing()}"
)
def test_smoke_gpu_index_stage_passes(tmp_path: Path, capsys):
    assert gpu_smoke.main(["gpu-index", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| placement | gpu " in out and "RESULT: PASS" in out


def test_smoke_reads_verls_rollout_logprob_metrics(tmp_path: Path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    good = {"training/rollout_probs_diff_valid": 1, "training/rollout_probs_diff_max": 0.2,
            "training/rollout_probs_diff_mean": 0.004, "training/rollout_actor_probs_pearson_corr": 0.99}  # fmt: skip
    metrics.write_text("\n".join(json.dumps({"step": s, "data": good}) for s in (1, 2)) + "\n")
    assert gpu_smoke.main(["rollout-logprobs", str(metrics)]) == 0
    metrics.write_text(
        json.dumps({"step": 1, "data": {**good, "training/rollout_probs_diff_mean": 0.3}}) + "\n"
    )
    assert gpu_smoke.main(["rollout-logprobs", str(metrics)]) == 1
    assert "| step 1 rollout_probs_diff_mean | 0.3 |" in capsys.readouterr().out


def test_smoke_checks_the_checkpoint_policy_on_disk(tmp_path: Path):
    for step, latest in ((1, False), (2, True)):
        actor = tmp_path / f"global_step_{step}" / "actor"
        (actor / "huggingface").mkdir(parents=True)
        (actor / "huggingface" / "config.json").write_text("{}")
        (actor / "huggingface" / "model.safetensors").write_bytes(b"w")
        if latest:
            for kind in ("model", "optim", "extra_state"):
                (actor / f"{kind}_world_size_1_rank_0.pt").write_bytes(b"x")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    assert gpu_smoke.main(["checkpoints", str(tmp_path)]) == 0
    (tmp_path / "global_step_1" / "actor" / "optim_world_size_1_rank_0.pt").write_bytes(b"x")
    assert gpu_smoke.main(["checkpoints", str(tmp_path)]) == 1
