"""Environment vLLM's CPU build reads, set before a CPU-mode process starts a vLLM engine.

vLLM's CPU worker sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB; default 4, too much
beside an FSDP actor on a small machine) and pins its OpenMP threads to ``VLLM_CPU_OMP_THREADS_BIND``
(``vllm/v1/worker/cpu_worker.py``; the value ``all`` is rejected on this machine's vLLM 0.27). The
verl vLLM server is a Ray actor whose engine core is a child process, so setting them in every
CPU-mode process (this patch runs on ``import verl``) reaches it. Values already set win.
"""

from __future__ import annotations

import os

KVCACHE_GIB = 1
"""Default ``VLLM_CPU_KVCACHE_SPACE``: 1 GiB holds ~2,700 demo sequences of 1,024 tokens."""


def cpu_list(cores: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the format ``VLLM_CPU_OMP_THREADS_BIND`` takes)."""
    ordered = sorted(cores)
    runs: list[str] = []
    start = prev = ordered[0]
    for core in [*ordered[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        runs.append(f"{start}-{prev}" if prev > start else str(start))
        if core is not None:
            start = prev = core
    return ",".join(runs)


def install() -> None:
    """Set the defaults of vLLM's CPU environment variables that are not set yet (idempotent)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KVCACHE_GIB))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(os.sched_getaffinity(0)))
