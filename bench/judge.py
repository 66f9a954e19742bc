"""Judge throughput: verdicts per second one call at a time vs batched, against the same server in one
run, and the cache-hit rate of a rerun (reward_fns.judge; docs/evaluation.md, "The judge").

Without ``--url`` it starts ``launch/serve_judge.sh MODEL_DIR`` (default: the demo's base model,
assets/demo_base, on vLLM's CPU build here) on a free port and stops it (by PID) at the end. Three
phases, each on its own N distinct questions so that no phase reuses another's prompt prefix:
``serial`` (N calls, one after another), ``batched`` (N calls at once, at most ``--concurrency`` in
flight; the server batches them) writing a verdict store, and ``rerun`` (the batched phase's items
again through that store). Every verdict is one request (``retries=0``: a reply without a verdict is
not asked again here, so both timed phases send the same requests). Prints one line per phase, then
exactly ``judge: batched_vs_serial=R rerun_calls=C unparsed=U`` (R = batched verdicts/s over serial
verdicts/s; a rerun asks exactly the U questions whose verdict was unparsed, the rest come from the
store).

    .venv/bin/python bench/judge.py [--n 16] [--max-tokens 64] [--concurrency 16]
                                    [--model-dir assets/demo_base] [--url URL --model NAME]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from reward_fns.judge import JudgeConfig, VerdictCache, judge_many
from search_env.paths import REPO_ROOT
from search_env.retrieval.process import free_port

STARTUP_S = 600


def items(phase: str, n: int) -> list[tuple[str, list[str], str]]:
    """N distinct (question, golds, prediction) items of one phase."""
    return [
        (f"[{phase} {i}] Which city is the capital of country number {i}?", [f"City {i}"], f"city {i}")
        for i in range(n)
    ]


def start_server(model_dir: Path, name: str, log: Path) -> tuple[subprocess.Popen, str]:
    """``launch/serve_judge.sh`` on a free port; returns the process and its base URL once it serves."""
    port = free_port()
    with open(log, "w") as out:
        server = subprocess.Popen(
            ["bash", "launch/serve_judge.sh", str(model_dir)],
            cwd=REPO_ROOT,
            env={**os.environ, "PORT": str(port), "JUDGE_MODEL": name, "MAX_MODEL_LEN": "2048"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            stop(server)
            sys.exit(f"the judge server did not start; its log: {log}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(1)


def stop(server: subprocess.Popen) -> None:
    """SIGTERM exactly this PID (serve_judge.sh execs vLLM's server), SIGKILL after 30 s."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16, help="verdicts per phase")
    parser.add_argument("--max-tokens", type=int, default=64, help="the judge's reply budget")
    parser.add_argument("--concurrency", type=int, default=16, help="batched phase: calls in flight")
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / "assets" / "demo_base")
    parser.add_argument("--url", help="a running judge (skip starting one)")
    parser.add_argument("--model", default="bench-judge", help="its served model name")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_judge.") as tmp:
        server, url = (
            (None, args.url)
            if args.url
            else start_server(args.model_dir, args.model, Path(tmp) / "serve.log")
        )
        try:
            base = dict(url=url, model=args.model, max_tokens=args.max_tokens, timeout_s=600.0, retries=0)
            serial_cfg = JudgeConfig(**base, max_concurrency=1)
            batched_cfg = JudgeConfig(**base, max_concurrency=args.concurrency)
            judge_many(serial_cfg, items("warm-up", 2))  # first requests pay one-off costs
            t0 = time.perf_counter()
            for item in items("serial", args.n):
                judge_many(serial_cfg, [item])
            serial = args.n / (time.perf_counter() - t0)
            store = VerdictCache(Path(tmp) / "verdicts.jsonl")
            t0 = time.perf_counter()
            verdicts, calls = judge_many(batched_cfg, items("batched", args.n), store)
            batched = args.n / (time.perf_counter() - t0)
            _, rerun_calls = judge_many(batched_cfg, items("batched", args.n), store)
        finally:
            if server is not None:
                stop(server)
    unparsed = sum(v.judgement == "unparsed" for v in verdicts)
    print(f"serial:  {serial:.2f} verdicts/s ({args.n} calls one at a time, {args.max_tokens}-token replies)")
    print(
        f"batched: {batched:.2f} verdicts/s ({calls} calls, <= {args.concurrency} in flight; {unparsed} unparsed)"
    )
    print(
        f"rerun:   {rerun_calls} calls ({unparsed} unparsed asked again), cache-hit rate {1 - rerun_calls / args.n:.0%}"
    )
    print(f"judge: batched_vs_serial={batched / serial:.2f} rerun_calls={rerun_calls} unparsed={unparsed}")


if __name__ == "__main__":
    main()
