"""Rollout engines side by side: ``hf`` (HFGenerator) vs vLLM's CPU build, on the demo model.

Workload: ``--rollouts`` (32) concurrent multi-turn rollouts of demo training questions, through
verl's own ``AgentLoopWorker`` -> ``SearchAgentLoop`` -> ``SearchTool`` and a real BM25 server, with
the demo's sampling (temperature 1) and per-turn cap (``recipes/demo_cpu_base.yaml``), exactly
as a CPU training step rolls out. Both engines serve the same model folder: ``hf`` in fp32, vLLM
in bf16 (its CPU kernels' dtype; ``eval.run.backends.CPU_ENGINE_KWARGS``). Start-up is timed apart.
The engines run one at a time, each in its own process, hf -> vllm -> hf (an idle vLLM engine's
bound OpenMP threads slow a co-running hf 4-10x), ``--rounds`` batches each on the same questions after one warm-up
batch; the median round counts, hf's over both of its turns (the machine is shared). hf runs
on one intra-op thread (``--hf-threads``; faster than two for a model this small), vLLM's
OpenMP threads are bound to every core of the process (``patches.vllm_cpu_env``).

Prints, per engine: start-up seconds, rollouts/s (median and each round), model tokens/s, turns
searches per rollout; then the ratio vllm / hf in rollouts/s, the decision rule (vLLM becomes
the CPU default at >= 0.8) and its verdict.

    .venv/bin/python -m bench.rollout_engines [--model .demo/warm_start] [--world .demo/world_s0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from eval.run.backends import make_backend
from search_demo.rollout import demo_rollout_config
from search_demo.warm_start import bm25_server
from search_env.paths import REPO_ROOT
from search_env.verl_glue import rows_to_batch, write_tool_config

THRESHOLD = 0.8
"""vLLM replaces the hand-written engine on CPU when it reaches this fraction of hf's rollouts/s."""


def round_once(backend: Any, rows: list[dict[str, Any]]) -> dict[str, float]:
    """One batch of concurrent sampled rollouts: wall seconds, model tokens, searches per rollout."""
    batch = rows_to_batch(rows, n=1)
    batch.meta_info["validate"] = False
    started = time.perf_counter()
    out = backend.run(backend.generate_sequences(batch))
    seconds = time.perf_counter() - started
    extra = out.non_tensor_batch
    return {
        "seconds": seconds,
        "tokens": float(sum(int(t) for t in extra["model_tokens"])),
        "searches": float(sum(int(s) for s in extra["searches"])) / len(rows),
    }


def engine_rounds(args: argparse.Namespace) -> dict[str, Any]:
    """This process: start ``args.engine``, one warm-up batch, ``args.rounds`` timed batches."""
    torch.set_num_threads(args.hf_threads)
    rows = pd.read_parquet(args.world / "train.parquet").head(args.rollouts).to_dict("records")
    with tempfile.TemporaryDirectory() as tmp, bm25_server(args.world / "corpus.jsonl") as url:
        config = demo_rollout_config(args.model, write_tool_config(Path(tmp) / "tools.yaml", [url]))
        started = time.perf_counter()
        backend = make_backend(args.engine, config, str(args.model), seed=args.seed)
        startup = time.perf_counter() - started
        try:
            round_once(backend, rows)  # warm-up: first-call costs out of the timed rounds
            rounds = [round_once(backend, rows) for _ in range(args.rounds)]
        finally:
            backend.close()
    return {"startup": startup, "rounds": rounds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO_ROOT / ".demo/warm_start")
    parser.add_argument("--world", type=Path, default=REPO_ROOT / ".demo/world_s0")
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-threads", type=int, default=1, help="torch intra-op threads of the hf engine")
    parser.add_argument("--engine", choices=("hf", "vllm"), help=argparse.SUPPRESS)  # one child's engine
    args = parser.parse_args(argv)
    if args.engine:
        print(json.dumps(engine_rounds(args)))
        return
    for path in (args.model / "config.json", args.world / "train.parquet"):
        if not path.is_file():
            raise SystemExit(f"{path} is missing: build the demo assets with `python -m search_demo assets`")
    # One process per turn, hf -> vllm -> hf, never two engines alive: an idle vLLM engine keeps its
    # OpenMP threads bound to the cores (hf beside it ran 4-10x slower), and importing vLLM changes
    # transformers' Qwen3.5 config classes for the rest of the process.
    results: dict[str, list[dict[str, float]]] = {"hf": [], "vllm": []}
    startup: dict[str, float] = {}
    passed = list(argv if argv is not None else sys.argv[1:])
    for name in ("hf", "vllm", "hf"):
        child = subprocess.run(
            [sys.executable, __file__, *passed, "--engine", name],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if child.returncode != 0:
            raise SystemExit(f"the {name} engine failed:\n{child.stderr[-3000:]}")
        got = json.loads(child.stdout.strip().splitlines()[-1])
        startup.setdefault(name, got["startup"])
        results[name] += got["rounds"]
    rate: dict[str, float] = {}
    for name, rounds in results.items():
        per_round = [args.rollouts / r["seconds"] for r in rounds]
        rate[name] = statistics.median(per_round)
        tokens = statistics.median(r["tokens"] / r["seconds"] for r in rounds)
        print(
            f"{name:>4}: start-up {startup[name]:5.1f} s | rollouts/s median {rate[name]:6.2f} "
            f"(rounds {', '.join(f'{x:.2f}' for x in per_round)}) | model tokens/s {tokens:7.0f} | "
            f"searches/rollout {rounds[-1]['searches']:.2f}"
        )
    ratio = rate["vllm"] / rate["hf"]
    verdict = "vLLM becomes the CPU default" if ratio >= THRESHOLD else "hf stays the CPU default"
    print(f"vllm / hf rollouts/s = {ratio:.2f}  (rule: >= {THRESHOLD} -> vLLM replaces hf) -> {verdict}")


if __name__ == "__main__":
    main()
