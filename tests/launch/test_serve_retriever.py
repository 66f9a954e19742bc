"""``python -m launch retriever RECIPE`` (launch/serve_retriever.sh): the retriever a recipe's
``retriever:`` block describes, served in the foreground; a setting to fix stops it before anything
starts, naming the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.retriever import main
from search_env.paths import EVAL_RECIPE, REPO_ROOT
from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.probe import search_once, wait_healthy
from search_env.retrieval.process import free_port


@pytest.mark.slow
def test_the_recipes_retriever_serves_in_the_foreground_with_its_top_k(tmp_path: Path):
    port = free_port()
    log = tmp_path / "retriever.log"
    command = [sys.executable, "-m", "launch", "retriever", str(EVAL_RECIPE), f"retriever.port={port}"]
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [*command, "retriever.top_k=3", "--", "--max-batch", "8"],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 120, process)
        search_once(f"http://127.0.0.1:{port}", require_hits=True)
    finally:
        process.terminate()  # by PID: the exec'd server is this process
        process.wait(timeout=60)
    started = log.read_text().splitlines()[0]
    assert (
        f"serve --backend bm25 --corpus {REPO_ROOT / 'search_env/retrieval/data/wiki18_sample_1000.jsonl'}"
        in started
    )
    assert str(SAMPLE_CORPUS).endswith("wiki18_sample_1000.jsonl")
    assert f"--port {port} --topk 3" in started and started.endswith("--max-batch 8")


@pytest.mark.slow
def test_a_setting_to_fix_stops_before_anything_starts(capsys):
    assert main([str(EVAL_RECIPE), "retriever.backend=dense", f"retriever.port={free_port()}"]) == 2
    assert "retriever.index: None is missing" in capsys.readouterr().err
    assert main([str(EVAL_RECIPE), "retriever.urls=[http://127.0.0.1:9]"]) == 2
    assert "names running retrievers: pass retriever.urls=null" in capsys.readouterr().err
    done = subprocess.run(
        ["bash", "launch/serve_retriever.sh", str(EVAL_RECIPE), "retriever.backend=grep"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "retriever.backend must be dense or bm25" in done.stderr
