"""Batch rows of a Qwen3.5 hybrid cache: join, leave, snapshot — the state of continuous batching.

A Qwen3.5 text model mixes two layer kinds (``config.layer_types``), and transformers 5.10's
``DynamicCache`` holds one cache layer per model layer:

- ``linear_attention`` (Gated DeltaNet, ``LinearAttentionLayer``): a fixed-size state per
  sequence — ``conv_states`` [B, conv_dim, kernel] and ``recurrent_states`` [B, heads, k, v].
  It has no time axis, so rows of different lengths stack without padding.
- ``full_attention`` (``DynamicLayer``): keys / values [B, kv_heads, T, head_dim], growing by one
  column per decoded token.

``CacheRows`` keeps those tensors for B sequences plus ``mask`` [B, T] (1 = a real token). Rows of
different lengths are **left-padded on the attention axis only**: pad columns hold zeros and are
masked out of attention, and every row's newest token sits in the last column, so one decode
step appends one column for all rows. Linear-attention layers never see a pad: each row's state
is exactly the state after its own real tokens. (Padding a *prefill* would not be exact: a pad
position still decays the recurrent state, ``g = -exp(A_log) * softplus(dt_bias)``; so prefill
runs per sequence, unpadded, and only decoding is batched.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

LINEAR = "linear_attention"
FULL = "full_attention"


def layer_kinds(config: object) -> tuple[str, ...]:
    """Per-layer kinds of a text config; raises ValueError for kinds this module cannot batch."""
    kinds = tuple(getattr(config, "layer_types", None) or (FULL,) * int(config.num_hidden_layers))
    bad = sorted(set(kinds) - {LINEAR, FULL})
    if bad:
        raise ValueError(f"layer types {bad} cannot be batched by the CPU generator (only {LINEAR}, {FULL})")
    return kinds


@dataclass(frozen=True)
class CacheRows:
    """Cache tensors of B sequences (batch dim 0), one pair per model layer, and their mask.

    ``layers[i]`` is ``(keys, values)`` for a full-attention layer and ``(conv_states,
    recurrent_states)`` for a linear-attention layer. ``mask`` is [B, T] int64; row b's real
    tokens are its last ``mask[b].sum()`` columns.
    """

    kinds: tuple[str, ...]
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    mask: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        """Columns of the attention axis (T)."""
        return int(self.mask.shape[1])

    def lengths(self) -> list[int]:
        """Real tokens per row."""
        return self.mask.sum(dim=1).tolist()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)

    @classmethod
    def from_cache(cls, cache: DynamicCache, kinds: tuple[str, ...], mask: torch.Tensor) -> CacheRows:
        """Read the tensors out of a ``DynamicCache`` the model has just run with."""
        layers = []
        for kind, layer in zip(kinds, cache.layers, strict=True):
            if kind == LINEAR:
                layers.append((layer.conv_states, layer.recurrent_states))
            else:
                layers.append((layer.keys, layer.values))
        return cls(kinds, tuple(layers), mask)

    def to_cache(self, config: object) -> DynamicCache:
        """A ``DynamicCache`` over these tensors (not copied: the model updates linear states in place)."""
        cache = DynamicCache(config=config)
        for kind, layer, (a, b) in zip(self.kinds, cache.layers, self.layers, strict=True):
            layer.dtype, layer.device = a.dtype, a.device
            if kind == LINEAR:
                if not isinstance(layer, LinearAttentionCacheLayerMixin):
                    raise TypeError(f"cache layer {type(layer).__name__} is not a linear-attention layer")
                layer.conv_states, layer.recurrent_states = a, b
                layer.max_batch_size, layer.conv_kernel_size = a.shape[0], a.shape[-1]
                layer.is_conv_states_initialized = layer.is_recurrent_states_initialized = True
                layer.has_previous_state = True
            else:
                layer.keys, layer.values = a, b
                layer.is_initialized = True
        return cache

    def fork(self) -> CacheRows:
        """A copy safe to run the model on: linear states cloned (updated in place), KV shared
        (the full-attention layers concatenate, never write in place)."""
        layers = tuple(
            (a.clone(), b.clone()) if kind == LINEAR else (a, b)
            for kind, (a, b) in zip(self.kinds, self.layers, strict=True)
        )
        return CacheRows(self.kinds, layers, self.mask)

    def row(self, index: int) -> CacheRows:
        """Row ``index`` alone, unpadded, in fresh memory (the batch keeps mutating its own)."""
        length = int(self.mask[index].sum())
        layers = []
        for kind, (a, b) in zip(self.kinds, self.layers, strict=True):
            if kind == LINEAR:
                layers.append((a[index : index + 1].clone(), b[index : index + 1].clone()))
            else:
                start = a.shape[-2] - length
                layers.append(
                    (a[index : index + 1, :, start:].clone(), b[index : index + 1, :, start:].clone())
                )
        return CacheRows(self.kinds, tuple(layers), torch.ones(1, length, dtype=torch.long))

    def select(self, indices: Sequence[int]) -> CacheRows:
        """Rows ``indices`` in that order, with the leading columns that are padding in all of them dropped."""
        idx = torch.tensor(list(indices), dtype=torch.long)
        mask = self.mask.index_select(0, idx)
        real = torch.nonzero(mask.any(dim=0))
        start = int(real[0]) if len(real) else mask.shape[1]
        layers = []
        for kind, (a, b) in zip(self.kinds, self.layers, strict=True):
            a, b = a.index_select(0, idx), b.index_select(0, idx)
            if kind == FULL and start:
                a, b = a[:, :, start:], b[:, :, start:]
            layers.append((a, b))
        return CacheRows(self.kinds, tuple(layers), mask[:, start:])

    @staticmethod
    def merge(parts: Sequence[CacheRows]) -> CacheRows:
        """Stack ``parts`` row-wise, left-padding each part's attention axis to the widest."""
        if not parts:
            raise ValueError("merge needs at least one part")
        width = max(p.width for p in parts)
        kinds = parts[0].kinds
        layers = []
        for i, kind in enumerate(kinds):
            pieces_a, pieces_b = [], []
            for part in parts:
                a, b = part.layers[i]
                if kind == FULL and part.width < width:
                    pad = (0, 0, width - part.width, 0)
                    a, b = F.pad(a, pad), F.pad(b, pad)
                pieces_a.append(a)
                pieces_b.append(b)
            layers.append((torch.cat(pieces_a), torch.cat(pieces_b)))
        mask = torch.cat([F.pad(p.mask, (width - p.width, 0)) for p in parts])
        return CacheRows(kinds, tuple(layers), mask)
