"""vLLM's CPU build keeps its linear weights, so verl can load new ones every step.

On a CPU, vLLM's ``UnquantizedLinearMethod.process_weights_after_loading``
(``vllm/model_executor/layers/linear.py:217``) calls
``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`` (``vllm/model_executor/layers/utils.py``):
the weight is packed for oneDNN and ``layer.weight`` emptied, so verl's weight sync
(``update_weights_from_ipc`` -> ``model.load_weights``) fails with ``Attempted to load weight ...
into parameter (torch.Size([0]))``. :func:`install` makes it keep the weight (``remove_weight=False``),
at the cost of one unpacked copy of each linear weight. CPU mode only, installed lazily in whichever
process imports the vLLM module; AMX-prepacked conv weights are not covered. See patches/README.md.
"""

from __future__ import annotations

import functools
from types import ModuleType

from patches.post_import import when_imported

TARGET = "vllm.model_executor.layers.utils"


def _keep_weights(module: ModuleType) -> None:
    original = module.dispatch_cpu_unquantized_gemm
    if getattr(original, "_rlvr_keeps_weight", False):
        return

    @functools.wraps(original)
    def dispatch(layer, remove_weight: bool) -> None:  # noqa: ANN001  (vLLM's signature)
        original(layer, remove_weight=False)

    dispatch._rlvr_keeps_weight = True  # type: ignore[attr-defined]
    module.dispatch_cpu_unquantized_gemm = dispatch


def install() -> None:
    """Keep vLLM's CPU linear weights once its layer utilities are imported (idempotent)."""
    when_imported(TARGET, _keep_weights)
