"""The GPU-readiness parts of the launchers, checked without a GPU: which interpreter the scripts
take (and say), preflight's no-CUDA message, the real /retrieve self-test before training,
retriever.gpu reaching the server (training keeps the faiss index on CPU, evaluation's dense
retriever asks for the GPU), and the kernels the GPU settings need (with the smoke test's packed
stage on CPU). The smoke test itself: tests/launch/test_doctor.py."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from launch import preflight
from launch.doctor import gpu_smoke, smoke_checks
from launch.recipe import compose_recipe
from launch.retriever import retriever_gpu
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


# ---- preflight: why torch sees no GPU (the diagnosis: tests/launch/test_doctor.py) ----------------------------------------------------------


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
@pytest.mark.slow
def test_retriever_gpu_reaches_the_server_command(tmp_path: Path, value: str, flag: str):
    plan = preflight.run_setup(
        RECIPES / "demo_cpu.yaml", [f"retriever.gpu={value}", f"retriever.port={free_port()}"], tmp_path
    )
    args = plan.retriever.serve_args
    assert args[args.index("--gpu") + 1] == flag
    assert not any("retriever.gpu" in p for p in plan.problems)
    assert plan.retriever.backend == "bm25" and plan.retriever.index is None
    bad = preflight.run_setup(RECIPES / "demo_cpu.yaml", ["retriever.gpu=maybe"], tmp_path)
    assert any("retriever.gpu must be auto, on or off" in p for p in bad.problems)


@pytest.mark.slow
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
        flag = retriever_gpu(compose_recipe(RECIPES / recipe, []).retriever.get("gpu"))
        assert flag == "auto" and not index_on_gpu(flag), f"{recipe}: retriever.gpu={flag}"
    assert index_on_gpu("on") and index_on_gpu("true") and not index_on_gpu("off")
    assert use_gpu("auto") is None, "auto still puts the encoder on CUDA when one is visible"


@pytest.mark.slow
def test_run_sh_stops_before_training_when_the_retriever_cannot_search(
    tmp_path: Path, broken_retriever: str, tiny_model_dir: Path
):
    from search_env.data import read_jsonl, write_parquet

    questions = read_jsonl(
        REPO_ROOT / "assets" / "eval_samples" / "flashrag-quickstart" / "nq_test.jsonl", limit=4
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


# ---- kernels the GPU settings need -----------------------------------------------------------------


@pytest.mark.slow
def test_preflight_names_missing_kernels(tmp_path: Path):
    cfg = compose_recipe(RECIPES / "f1_only_s44.yaml", [])
    for present, expected in (
        (set(), {"flash-linear-attention (fla)", "needs flash-attn"}),
        ({"fla"}, {"needs flash-attn"}),
        ({"fla", "flash_attn"}, set()),
    ):
        plan = preflight.RunSetup()
        preflight.check_kernels(cfg, plan, has_module=lambda name, have=present: name in have)
        assert {e for e in expected if any(e in p for p in plan.problems)} == expected
        assert len(plan.problems) == len(expected)
    cpu = compose_recipe(RECIPES / "demo_cpu.yaml", [])
    plan = preflight.RunSetup()
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
    seqs, packed, positions, cu = smoke_checks._packed_inputs(
        [7, 30, 19], model.config.text_config.vocab_size
    )

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
