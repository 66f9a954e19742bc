"""Register verl's FSDP engines for the ``cpu`` device, and run the ref model without pinned memory.

1. ``verl/workers/engine/fsdp/transformer_impl.py:1143`` and ``:1594`` register the LM and value
   engines for ``device=["cuda", "npu"]`` only: they are registered for ``"cpu"`` too (FSDP2 + gloo;
   FSDP1 needs a GPU, hence ``strategy=fsdp2`` in the CPU recipe).
2. ``transformer_impl.py:462`` gives forward-only FSDP2 modules (the KL reference)
   ``CPUOffloadPolicy(pin_memory=True)``, which fails without an accelerator: the name is rebound to
   a subclass that forces ``pin_memory=False``.
CPU mode only, run right after ``transformer_impl`` is first imported (``patches.post_import``;
importing it eagerly would double verl's import time). See patches/README.md.
"""

from __future__ import annotations

from types import ModuleType

from cpu_compat.cpu_mode import CPU_PLATFORM_NAME
from patches.post_import import when_imported

TARGET_MODULE = "verl.workers.engine.fsdp.transformer_impl"
PINNED_REF_POLICY_LINE = "offload_policy = CPUOffloadPolicy(pin_memory=True)"


def register_cpu_engines(transformer_impl: ModuleType) -> None:
    """Register the FSDP LM-head and value-head engines under device ``cpu`` (idempotent)."""
    from verl.workers.engine.base import EngineRegistry  # heavy: verl.workers, not at plugin load

    for model_type, engine_cls in (
        ("language_model", transformer_impl.FSDPEngineWithLMHead),
        ("value_model", transformer_impl.FSDPEngineWithValueHead),
    ):
        for backend in ("fsdp", "fsdp2"):
            registry = EngineRegistry._engines[model_type][backend]
            registry.setdefault(CPU_PLATFORM_NAME, engine_cls)


def unpin_offload_policy(transformer_impl: ModuleType) -> None:
    """Rebind ``transformer_impl.CPUOffloadPolicy`` to a variant with ``pin_memory=False``."""
    policy_cls = transformer_impl.CPUOffloadPolicy
    if getattr(policy_cls, "__rlvr_unpinned__", False):
        return

    class UnpinnedCPUOffloadPolicy(policy_cls):  # type: ignore[misc, valid-type]
        """``CPUOffloadPolicy`` that never pins host memory (there is no accelerator to pin for)."""

        __rlvr_unpinned__ = True

        def __init__(self, pin_memory: bool = False, **kwargs):
            super().__init__(pin_memory=False, **kwargs)

    transformer_impl.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy


def _patch(transformer_impl: ModuleType) -> None:
    register_cpu_engines(transformer_impl)
    unpin_offload_policy(transformer_impl)


def install() -> None:
    """Apply both fixes when (or if already) ``transformer_impl`` is imported."""
    when_imported(TARGET_MODULE, _patch)
