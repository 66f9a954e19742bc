"""The GPU-readiness parts of the launchers, checked without a GPU: which interpreter the scripts
take (and say), preflight's CUDA / driver diagnosis, the real /retrieve self-test before training,
retriever.gpu reaching the server (training keeps the faiss index on CPU, evaluation's dense
retriever asks for the GPU), the multi-GPU one-command evaluation form, and the smoke script's
CPU-checkable pieces (its no-CUDA exits, the tiny 248K-vocab model, its report parsers and the
GPU-index stage's comparison)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from launch import gpu_smoke, preflight
from launch.doctor import cuda
from search_env.paths import REPO_ROOT
from search_env.retrieval.process import free_port

RECIPES = REPO_ROOT / "recipes"


# ---- interpreter choice (launch/_common.sh, the one thing the wrappers decide) --------------------


def _fake_python(path: Path, has_verl: bool) -> Path:
    """An executable `python` that forwards to this interpreter but reports verl missing if asked."""
    path.parent.mkdir(parents=True, exist_ok=True)
    probe = "" if has_verl else 'case "$*" in *find_spec*verl*) exit 1;; esac\n'
    path.write_text(f'#!/bin/sh\n{probe}exec {shlex.quote(sys.executable)} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _chosen(tmp_path: Path, env: dict[str, str], with_repo_venv: bool = True) -> tuple[str, str]:
    """(PYTHON, log line) as a copy of launch/_common.sh in a fake checkout resolves them."""
    repo = tmp_path / "repo"
    (repo / "launch").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / "launch" / "_common.sh", repo / "launch" / "_common.sh")
    if with_repo_venv:
        _fake_python(repo / ".venv" / "bin" / "python", has_verl=True)
    base = {"PATH": env.pop("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    done = subprocess.run(
        ["bash", "-c", 'source "$1/launch/_common.sh"; echo "$PYTHON"', "_", str(repo)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr.strip()


def test_the_users_environment_wins_over_the_repo_venv(tmp_path: Path):
    venv = _fake_python(tmp_path / "gpu_env" / "bin" / "python", has_verl=True)
    conda = _fake_python(tmp_path / "conda" / "bin" / "python", has_verl=True)
    on_path = _fake_python(tmp_path / "bin" / "python", has_verl=True)
    explicit = _fake_python(tmp_path / "explicit" / "python", has_verl=False)

    chosen, said = _chosen(tmp_path, {"PYTHON": str(explicit), "VIRTUAL_ENV": str(venv.parent.parent)})
    assert chosen == str(explicit) and "(PYTHON)" in said, "an explicit PYTHON is used as given"
    chosen, said = _chosen(
        tmp_path, {"VIRTUAL_ENV": str(venv.parent.parent), "CONDA_PREFIX": str(conda.parent.parent)}
    )
    assert chosen == str(venv) and "active virtualenv" in said
    chosen, said = _chosen(tmp_path, {"CONDA_PREFIX": str(conda.parent.parent)})
    assert chosen == str(conda) and "active conda env" in said
    chosen, said = _chosen(tmp_path, {"PATH": f"{on_path.parent}:/usr/bin:/bin"})
    assert chosen == str(on_path) and "python on PATH" in said
    assert said.startswith("[") and f"python: {chosen}" in said, "the scripts say which interpreter"


def test_the_repo_venv_is_only_a_fallback(tmp_path: Path):
    bare = _fake_python(tmp_path / "bin" / "python", has_verl=False)
    chosen, said = _chosen(tmp_path, {"PATH": f"{bare.parent}:/usr/bin:/bin"})
    assert chosen == str(tmp_path / "repo" / ".venv" / "bin" / "python")
    assert "cannot import verl" in said and str(bare) in said
    chosen, _ = _chosen(tmp_path / "no_venv", {"PATH": f"{bare.parent}:/usr/bin:/bin"}, with_repo_venv=False)
    assert chosen == str(bare), "without a usable .venv the PATH python stays (need_verl names the fix)"


# ---- preflight: why torch sees no GPU ----------------------------------------------------------


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message; this machine has a GPU")
def test_preflight_prints_torch_cuda_and_driver_when_no_device(tmp_path: Path, capsys):
    assert preflight.main(["--run-dir", str(tmp_path), str(RECIPES / "f1_only_s44.yaml")]) == 2
    err = capsys.readouterr().err
    assert "torch sees no CUDA device" in err and torch.__version__ in err
    assert ("CPU build" in err) == (torch.version.cuda is None)


# ---- retriever.gpu and the real /retrieve self-test --------------------------------------------


@pytest.mark.parametrize(
    ("value", "flag"), [("auto", "auto"), ("off", "off"), ("true", "on"), ("false", "off")]
)
def test_retriever_gpu_reaches_the_server_command(tmp_path: Path, value: str, flag: str):
    plan = preflight.make_plan(
        RECIPES / "demo_cpu.yaml", [f"retriever.gpu={value}", f"retriever.port={free_port()}"], tmp_path
    )
    args = plan.retriever.serve_args
    assert args[args.index("--gpu") + 1] == flag
    assert not any("retriever.gpu" in p for p in plan.problems)
    assert plan.retriever.backend == "bm25" and plan.retriever.index is None
    bad = preflight.make_plan(RECIPES / "demo_cpu.yaml", ["retriever.gpu=maybe"], tmp_path)
    assert any("retriever.gpu must be auto, on or off" in p for p in bad.problems)


def test_every_training_recipe_keeps_the_faiss_index_on_cpu():
    """retriever.gpu=auto in training: the E5 encoder on CUDA, the index on CPU (the study's split:
    the GPUs' memory belongs to vLLM and FSDP); only `on` (evaluation) moves the index."""
    import yaml

    from search_env.retrieval.factory import index_on_gpu, use_gpu

    def retriever_keys(path: Path) -> dict:
        data = yaml.safe_load(path.read_text())
        return (data.get("retriever") or {}) if isinstance(data, dict) else {}

    setters = [p.name for p in sorted(RECIPES.glob("*.yaml")) if "gpu" in retriever_keys(p)]
    assert setters == ["base.yaml"], "only recipes/base.yaml sets retriever.gpu"
    for recipe in ("f1_only_s44.yaml", "micro_dense.yaml", "demo_cpu.yaml", "gpu_smoke.yaml"):
        flag = preflight.retriever_gpu(preflight.compose_recipe(RECIPES / recipe, []).retriever.get("gpu"))
        assert flag == "auto" and not index_on_gpu(flag), f"{recipe}: retriever.gpu={flag}"
    assert index_on_gpu("on") and index_on_gpu("true") and not index_on_gpu("off")
    assert use_gpu("auto") is None, "auto still puts the encoder on CUDA when one is visible"


class _BrokenSearch(BaseHTTPRequestHandler):
    """Healthy on GET /health, HTTP 500 on every search: a backend that fails on its first query."""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"status": "healthy", "backend": "dense"}')

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "faiss: index is not trained"}')

    def log_message(self, *args):
        pass


@pytest.fixture
def broken_retriever():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BrokenSearch)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _probe(url: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "search_env.retrieval", "probe", url, "--timeout", "2", *flags],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_probe_sends_one_real_search(retrieval_server_url: str, broken_retriever: str):
    assert _probe(retrieval_server_url, "--require-hits").returncode == 0
    failed = _probe(broken_retriever)
    assert failed.returncode == 1 and "HTTP 500" in failed.stderr and "index is not trained" in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1, "one line saying why"
    gone = _probe("http://127.0.0.1:9")
    assert gone.returncode == 1 and "not healthy" in gone.stderr


def test_run_sh_stops_before_training_when_the_retriever_cannot_search(
    tmp_path: Path, broken_retriever: str, tiny_model_dir: Path
):
    from search_env.data import read_jsonl, write_parquet

    questions = read_jsonl(
        REPO_ROOT / "tests" / "fixtures" / "flashrag-quickstart" / "nq_test.jsonl", limit=4
    )
    parquet = write_parquet(questions, "nq", "train", tmp_path / "train.parquet")
    done = subprocess.run(
        [
            "bash",
            "launch/run.sh",
            "recipes/demo_cpu.yaml",
            "launch.build_demo_assets=false",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files={parquet}",
            f"data.val_files={parquet}",
            f"retriever.urls=[{broken_retriever}]",
            "retriever.backend=dense",
            "retriever.index=/data/wiki18/e5_IVF4096_SQ8.index",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "RLVR_RUN_DIR": str(tmp_path / "run")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        "retriever self-test failed (backend dense, index /data/wiki18/e5_IVF4096_SQ8.index)" in done.stderr
    )
    assert "HTTP 500" in done.stderr and "training was not started" in done.stderr
    assert not (tmp_path / "run" / "train.log").exists(), "the trainer must not have started"
    assert f"python: {os.environ['PYTHON']}" in done.stderr


def test_eval_runner_refuses_a_retriever_that_cannot_search(broken_retriever: str):
    from eval.retrievers import check_retrievers

    with pytest.raises(RuntimeError, match="failed its test search.*HTTP 500"):
        check_retrievers([broken_retriever])


# ---- multi-GPU evaluation, one command ------------------------------------------------------------


@pytest.mark.e2e
def test_eval_sh_runs_one_process_per_gpu_on_one_results_folder(tmp_path: Path, tiny_model_dir: Path):
    """GPUS=a,b: two `python -m eval run` processes share OUT (here on CPU with the hf backend, on
    the untrained model as its own step 0); the table is printed once, each row written once."""
    env = {
        **os.environ,
        "GPUS": "0,1",
        "BACKEND": "hf",
        "LIMIT": "1",
        "OUT": str(tmp_path / "out"),
        "RETRIEVER_PORT": str(free_port()),
        "TIMEOUT_S": "600",
    }
    args = ["--shape", "f1_only", "--seed", "0", "--max-turns", "1", "--max-turn-tokens", "8"]
    args += ["--response-length", "32", "--benchmarks", "nq", "bamboogle"]
    done = subprocess.run(
        ["bash", "launch/eval.sh", str(tiny_model_dir), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.count("| step |") == 1 and "CUDA_VISIBLE_DEVICES=1" in done.stdout
    logs = sorted((tmp_path / "out").glob("*.gpu*.log"))
    assert [p.name.split(".")[-2] for p in logs] == ["gpu0", "gpu1"]
    (rows,) = (tmp_path / "out").glob("*/global_step_0/rows.jsonl")
    assert len(rows.read_text().splitlines()) == 2, "one row per benchmark, written by one process"


@pytest.mark.e2e
def test_eval_sh_starts_a_dense_retriever_with_its_nodes_index_placement(tmp_path: Path):
    """With INDEX and ENCODER, eval.sh serves that dense index instead of BM25, with --gpu on where
    torch sees a GPU (the index on the GPU(s) where it fits) and auto elsewhere; RETRIEVER_GPU
    overrides. The run directory here holds no checkpoint, so the evaluation itself stops at once."""
    from search_env.retrieval import SAMPLE_CORPUS
    from search_env.retrieval.corpus import Corpus
    from search_env.retrieval.encoder import Encoder, build_tiny_encoder
    from search_env.retrieval.index_build import build_index

    encoder = build_tiny_encoder(tmp_path / "bert", hidden_size=32)
    index = tmp_path / "demo_IVF16_SQ8.index"
    build_index(Corpus(SAMPLE_CORPUS), Encoder(encoder, use_gpu=False), index, "IVF16,SQ8", use_gpu=False)
    (tmp_path / "ckpt").mkdir()

    def eval_sh(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "launch/eval.sh", str(tmp_path / "ckpt")],
            cwd=REPO_ROOT,
            env={
                **os.environ,
                "RETRIEVER_PORT": str(free_port()),
                "OUT": str(tmp_path / "out"),
                "RETRIEVER_GPU": "",
                **env,
            },
            capture_output=True,
            text=True,
            timeout=300,
        )

    done = eval_sh(INDEX=str(index), ENCODER=str(encoder))
    expected = "on" if torch.cuda.is_available() else "auto"
    assert (
        f"starting retriever --backend dense --index {index} --encoder {encoder} --gpu {expected}"
        in done.stdout
    )
    assert "failed its test search" not in done.stderr, done.stderr[-2000:]
    assert "+ " in done.stdout, "the evaluation was started after the retriever answered its test search"
    broken = tmp_path / "no_weights"  # a config.json without weights: the server dies at start-up
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    off = eval_sh(INDEX=str(index), ENCODER=str(broken), RETRIEVER_GPU="off")
    assert f"--encoder {broken} --gpu off" in off.stdout
    assert off.returncode == 1 and "the retriever did not become healthy" in off.stderr
    half = eval_sh(INDEX=str(index), ENCODER="")
    assert (
        half.returncode == 2 and "a dense retriever needs INDEX" in half.stderr and "ENCODER" in half.stderr
    )


# ---- launch/gpu_smoke.sh --------------------------------------------------------------------------


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
def test_gpu_smoke_exits_2_at_once_without_cuda(tmp_path: Path):
    done = _run_gpu_smoke(tmp_path / "smoke", 120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
    assert "no CUDA device: " in done.stderr, (
        "the cuda stage's own diagnosis (python -m launch.gpu_smoke cuda)"
    )
    assert not (tmp_path / "smoke").exists(), "nothing may run without a GPU"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU smoke run needs a CUDA GPU (none here)")
def test_gpu_smoke_passes(tmp_path: Path):
    done = _run_gpu_smoke(tmp_path / "smoke", 700)
    assert done.returncode == 0, done.stdout[-4000:]


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
    plan = preflight.make_plan(RECIPES / "gpu_smoke.yaml", overrides, tmp_path)
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
    match = gpu_smoke.compare_searches(cpu, gpu)
    assert match["overlap"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert match["top1"] == pytest.approx(2 / 3) and match["score_diff"] == pytest.approx(4e-4)
    none_agree = gpu_smoke.compare_searches(cpu, (gpu[0], gpu[1] + 100))
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


# ---- kernels the GPU settings need -----------------------------------------------------------------


def test_preflight_names_missing_kernels(tmp_path: Path):
    cfg = preflight.compose_recipe(RECIPES / "f1_only_s44.yaml", [])
    for present, expected in (
        (set(), {"flash-linear-attention (fla)", "needs flash-attn"}),
        ({"fla"}, {"needs flash-attn"}),
        ({"fla", "flash_attn"}, set()),
    ):
        plan = preflight.Plan()
        preflight.check_kernels(cfg, plan, has_module=lambda name, have=present: name in have)
        assert {e for e in expected if any(e in p for p in plan.problems)} == expected
        assert len(plan.problems) == len(expected)
    cpu = preflight.compose_recipe(RECIPES / "demo_cpu.yaml", [])
    plan = preflight.Plan()
    preflight.check_kernels(cpu, plan, has_module=lambda name: False)
    assert plan.problems == [], "the CPU demo needs neither (sdpa, no remove-padding)"


@contextmanager
def _qwen35_classes_restored() -> Iterator[None]:
    """Undo verl's ``apply_monkey_patch`` afterwards: it replaces methods on transformers' Qwen3.5
    classes (the Gated-DeltaNet forward among them) for the whole process, and the patched forward
    cannot run with a generation cache, which every later test in this process would inherit."""
    import transformers.integrations.flash_attention as flash_attention
    import transformers.models.qwen3_5.modeling_qwen3_5 as dense
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as moe

    classes = [
        c
        for m in (dense, moe)
        for c in vars(m).values()
        if isinstance(c, type) and c.__module__ == m.__name__
    ]
    saved = [(c, {k: v for k, v in vars(c).items() if not k.startswith("__")}) for c in classes]
    attention = flash_attention._flash_attention_forward
    try:
        yield
    finally:
        for cls, attrs in saved:
            for name in [k for k in vars(cls) if not k.startswith("__") and k not in attrs]:
                delattr(cls, name)
            for name, value in attrs.items():
                if vars(cls).get(name) is not value:
                    setattr(cls, name, value)
        flash_attention._flash_attention_forward = attention


def test_packed_sequences_need_fla_and_the_smoke_harness_runs(tmp_path: Path, capsys):
    with _qwen35_classes_restored():
        _check_packed_sequences(tmp_path, capsys)


def _check_packed_sequences(tmp_path: Path, capsys) -> None:
    """Why check_kernels asks for fla: without it verl 0.9.1 passes cu_seqlens to transformers'
    torch Gated-DeltaNet fallback, which takes **kwargs and ignores them, so a packed sequence sees
    the ones before it. With the split verl does when the kernel does NOT accept cu_seqlens, packed
    equals one-by-one. Also runs the smoke script's packed stage on CPU (its harness, fp32 + sdpa)."""
    import inspect

    import verl.models.transformers.qwen3_5 as verl_qwen35
    from transformers import AutoModelForImageTextToText
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    from search_demo import tiny

    model_dir = tiny.build_random_model(
        tmp_path / "gdn_only",
        tiny.build_tokenizer(0),
        {**tiny.TEXT_CONFIG, "layer_types": ["linear_attention"] * 4},
    )
    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    model.config.use_cache = model.config.text_config.use_cache = False
    apply_monkey_patch(model, use_remove_padding=True)
    smoke = gpu_smoke
    seqs, packed, positions, cu = smoke._packed_inputs([7, 30, 19], model.config.text_config.vocab_size)

    def worst_gap() -> float:
        with torch.no_grad():
            out = model(
                input_ids=packed, position_ids=positions, cu_seqlens=cu, cu_seqlens_cpu=cu, use_cache=False
            )
            gaps = []
            for seq, start, end in zip(seqs, cu[:-1].tolist(), cu[1:].tolist(), strict=True):
                alone = model(input_ids=seq[None], position_ids=torch.arange(len(seq))[None], use_cache=False)
                gaps.append(float((alone.logits[0] - out.logits[0, start:end]).abs().max()))
        return max(gaps)

    assert worst_gap() > 1e-2, "verl's fallback keeps packed sequences apart now: relax check_kernels"
    real = verl_qwen35._call_accepts_kwarg
    verl_qwen35._call_accepts_kwarg = lambda fn, name: name in inspect.signature(fn).parameters
    try:
        assert worst_gap() < 1e-5
    finally:
        verl_qwen35._call_accepts_kwarg = real
    assert smoke.main(["packed", str(model_dir), "--cpu"]) == 1  # the harness runs; without fla it must fail
    assert "| max /log-prob packed - alone/ |" in capsys.readouterr().out
