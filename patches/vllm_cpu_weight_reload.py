"""vLLM's CPU build keeps its linear weights, so verl can load new ones every step.

On a CPU, vLLM's ``UnquantizedLinearMethod.process_weights_after_loading``
(``vllm/model_executor/layers/linear.py:217``) calls
``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``
(``vllm/model_executor/layers/utils.py``): the weight is packed for oneDNN (or sgl-kernel) and
``layer.weight`` is replaced by an empty tensor to save memory. verl's weight sync
(``vLLMColocateWorkerExtension.update_weights_from_ipc``) then calls ``model.load_weights`` into
those empty parameters (``AssertionError: Attempted to load weight (torch.Size([128, 256])) into
parameter (torch.Size([0]))``) before it re-runs ``process_weights_after_loading``.

:func:`install` wraps ``dispatch_cpu_unquantized_gemm`` so that it keeps the weight
(``remove_weight=False``): the sync writes into it and the post-load pass packs it again. Cost:
one unpacked copy of each linear weight (the model's size in bf16). CPU mode only; installed
lazily in whichever process imports the vLLM module (the vLLM workers import verl, and so this
package, through verl's worker extension). Conv weights prepacked on AMX CPUs
(``causal_conv1d_weight_pack``) are not covered: this project's CPUs have no AMX.
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
