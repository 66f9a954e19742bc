"""Attention for batched one-token decoding on CPU, registered in transformers as ``cpu_decode``.

With a padding mask, transformers' ``sdpa`` path repeats every key/value head for grouped-query
attention (``repeat_kv``) and runs PyTorch's CPU flash kernel, which is slow for one query per
row: on the demo model (32 rows, ~700 keys, 3 full-attention layers) a decode step takes ~4x
longer with rows of mixed length than without a mask. ``decode_attention`` computes the same
softmax(q·kᵀ·scale + mask)·v with two batched matmuls over the key/value heads, the query heads
of a group stacked as rows (no key/value copy, strided buffers read in place). Prefill and any
query longer than one token go to ``sdpa`` unchanged. Masks are built as for ``sdpa``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "cpu_decode"
"""The ``attn_implementation`` name (``from_pretrained(..., attn_implementation=NAME)``)."""


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``sdpa_attention_forward``'s contract: query [B, H, Q, D], key/value [B, KVH, T, D], mask
    bool (True = attend) or additive, broadcastable to [B, 1, Q, T]; returns [B, Q, H, D]."""
    if query.shape[2] != 1 or dropout:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # head h reads kv head h // group
    scores = torch.matmul(grouped, key.transpose(-1, -2))
    scores.mul_(dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores.masked_fill_(~attention_mask, float("-inf"))
        else:
            scores.add_(attention_mask)
    out = torch.matmul(torch.softmax(scores, dim=-1), value)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
