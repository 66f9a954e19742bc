"""launch/eval.sh end to end on CPU: one process per GPU on one results folder (GPUS=a,b), evaluating
with the run's own saved recipe (its top-k and turns, recorded in run.json), and the dense retriever it
starts with its node's index placement (INDEX and ENCODER)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import torch
from omegaconf import OmegaConf

from launch.recipe import compose_recipe
from search_env.paths import EVAL_RECIPE, REPO_ROOT
from search_env.retrieval.process import free_port


def test_eval_sh_runs_one_process_per_gpu_on_one_results_folder(tmp_path: Path, tiny_model_dir: Path):
    """GPUS=a,b: two `python -m eval run` processes share OUT (here on CPU with the hf backend, on
    the untrained model as its own step 0); the table is printed once, each row written once. The
    run's saved recipe says top-k 3 and 1 assistant turn: the evaluation runs and records both."""
    turns = "actor_rollout_ref.rollout.multi_turn.max_assistant_turns"
    (tmp_path / "run").mkdir()
    OmegaConf.save(
        compose_recipe(EVAL_RECIPE, ["retriever.top_k=3", f"{turns}=1"]), tmp_path / "run" / "recipe.yaml"
    )
    shutil.copytree(tiny_model_dir, tmp_path / "run" / "checkpoints")
    env = {
        **os.environ,
        "GPUS": "0,1",
        "BACKEND": "hf",
        "LIMIT": "1",
        "OUT": str(tmp_path / "out"),
        "RETRIEVER_PORT": str(free_port()),
        "TIMEOUT_S": "600",
    }
    args = ["--shape", "f1_only", "--seed", "0", "--max-turn-tokens", "8"]
    args += ["--response-length", "32", "--benchmarks", "nq", "bamboogle"]
    done = subprocess.run(
        ["bash", "launch/eval.sh", str(tmp_path / "run" / "checkpoints"), *args],
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
    recorded = json.loads((rows.parent.parent / "run.json").read_text())["eval"]
    assert (recorded["topk"], recorded["limits"]["max_assistant_turns"]) == (3, 1)


def test_eval_sh_starts_a_dense_retriever_with_its_nodes_index_placement(tmp_path: Path):
    """With RETRIEVER_BACKEND=dense, INDEX and ENCODER, eval.sh serves that dense index instead of BM25, with --gpu on where
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
                "RETRIEVER_BACKEND": "dense",
                **env,
            },
            capture_output=True,
            text=True,
            timeout=300,
        )

    done = eval_sh(INDEX=str(index), ENCODER=str(encoder))
    expected = "on" if torch.cuda.is_available() else "auto"
    assert (
        "--backend dense" in done.stdout
        and f"--gpu {expected} --index {index} --encoder {encoder}" in done.stdout
    )
    assert "failed its test search" not in done.stderr, done.stderr[-2000:]
    assert "+ " in done.stdout, "the evaluation was started after the retriever answered its test search"
    broken = tmp_path / "no_weights"  # a config.json without weights: the server dies at start-up
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    off = eval_sh(INDEX=str(index), ENCODER=str(broken), RETRIEVER_GPU="off")
    assert f"--gpu off --index {index} --encoder {broken}" in off.stdout
    assert off.returncode == 1 and "the retriever did not become healthy" in off.stderr
    half = eval_sh(INDEX=str(index), ENCODER="")
    assert half.returncode == 2 and "retriever.encoder: no config.json in None" in half.stderr
