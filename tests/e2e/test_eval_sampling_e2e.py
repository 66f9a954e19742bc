"""End to end: the demo's warm start evaluated with ``--samples 4 --temperature 0.7`` on CPU.

A real ``python -m eval run`` (hf backend, verl's agent loop, a BM25 retriever over the demo
world) on one question per type: the summary carries pass@1..pass@4 and avg@4 with their CIs, the
rows hold 4 seeded samples per question, a rerun of a lost sample draws the same rollout, and a
greedy run into the same results folder is refused, naming the sampling setting.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import SERVER_START_TIMEOUT_S, ensure_ci_assets

from eval.__main__ import main
from search_env.paths import REPO_ROOT
from search_env.retrieval.process import spawn_server

WORLD = REPO_ROOT / ".demo" / "world_s0"
WARM_START = REPO_ROOT / ".demo" / "warm_start_ci"
SAMPLES = 4
FAST = ["--max-turns", "3", "--max-turn-tokens", "48", "--response-length", "256"]
"""Short turns: the warm start searches and answers within them."""


def _args(out: Path, url: str, *extra: str) -> list[str]:
    return [
        "run",
        "--run-dir",
        str(WARM_START),
        "--suite",
        str(WORLD / "test"),
        "--out",
        str(out),
        "--limit",
        "1",
        "--backend",
        "hf",
        "--retriever-url",
        url,
        "--run-name",
        "warm_start",
        "--shape",
        "em_only",
        "--seed",
        "0",
        *FAST,
        *extra,
    ]


def test_samples_give_pass_at_k_and_refuse_greedy(tmp_path: Path, capsys):
    ensure_ci_assets()
    sampled = ["--samples", str(SAMPLES), "--temperature", "0.7", "--sample-seed", "5"]
    with spawn_server(
        ["--backend", "bm25", "--corpus", str(WORLD / "corpus.jsonl")],
        startup_timeout_s=SERVER_START_TIMEOUT_S,
        log_path=tmp_path / "retriever.log",
    ) as server:
        done = subprocess.run(
            [sys.executable, "-m", "eval", *_args(tmp_path / "out", server.url, *sampled)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        step_dir = tmp_path / "out" / "warm_start" / "global_step_0"
        summary = json.loads((step_dir / "summary.json").read_text())
        names = [f"pass@{k}" for k in range(1, SAMPLES + 1)] + [f"avg@{SAMPLES}"]
        for entry in [*summary["benchmarks"].values(), summary["macro"]]:
            assert entry["samples"] == SAMPLES
            for name in names:
                low, high = entry["ci"][name]
                assert 0 <= low <= entry[name] <= high <= 1, (name, entry)
            passes = [entry[f"pass@{k}"] for k in range(1, SAMPLES + 1)]
            assert passes == sorted(passes), "pass@k cannot fall with k"
            assert abs(entry["pass@1"] - entry[f"avg@{SAMPLES}"]) < 1e-12
        assert summary["eval"]["sampling"] == {
            "temperature": 0.7,
            "top_p": 1.0,
            "top_k": -1,
            "samples": SAMPLES,
            "seed": 5,
        }
        rows_path = step_dir / "rows.jsonl"
        lines = rows_path.read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        assert len(rows) == SAMPLES * len(summary["benchmarks"])
        for bench in summary["benchmarks"]:
            assert sorted(r["sample"] for r in rows if r["benchmark"] == bench) == list(range(SAMPLES))
        assert len({(r["prediction"], r["model_tokens"]) for r in rows}) > 1, "the samples are not sampled"

        # a lost sample is rolled out again with its own seed: the same rollout
        (shared,) = (tmp_path / "out" / ".step0").glob("*/rows.jsonl")  # step 0's rows, shared by runs
        for path in (rows_path, shared):
            path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:-1]))
        assert main(_args(tmp_path / "out", server.url, *sampled)) == 0
        assert rows_path.read_text().splitlines() == lines

        capsys.readouterr()
        assert main(_args(tmp_path / "out", server.url)) == 1
        said = capsys.readouterr().err
        assert "evaluation settings differ: sampling is" in said and "--samples" in said, said
