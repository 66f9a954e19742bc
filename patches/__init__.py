"""Small, documented runtime patches of verl 0.9.1, loaded through the ``verl.plugins`` entry point.

``pyproject.toml`` declares ``[project.entry-points."verl.plugins"] rlvr_search = "patches"``, so
``import verl`` imports this package, and installs the patches, in every process, Ray workers
included (``verl/__init__.py``): ``ALWAYS`` everywhere, ``CPU_MODE_ONLY`` only when
``patches.activation.cpu_mode_active()``. Each module names the upstream file/line it fixes and has
an idempotent ``install()``. What each patch fixes, CPU mode, and how to add one: patches/README.md.
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
