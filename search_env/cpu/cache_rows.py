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
masked out of attention, and every row's newest token sits in column T - 1, so one decode step
appends one column for all rows. The batch's key/value buffers have ``SPARE_COLUMNS`` more
columns than T, so a step writes its column in place; only a join, a leave or a full buffer
copies them. Linear-attention layers never see a pad: each row's state
is exactly the state after its own real tokens. (Padding a *prefill* would not be exact: a pad
position still decays the recurrent state, ``g = -exp(A_log) * softplus(dt_bias)``; so prefill
runs per sequence, unpadded, and only decoding is batched.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

LINEAR = "linear_attention"
FULL = "full_attention"
SPARE_COLUMNS = 64
"""Free key/value columns a batch buffer gets when it is (re)allocated: decode steps between two
reallocations append in place."""


def layer_kinds(config: object) -> tuple[str, ...]:
    """Per-layer kinds of a text config; raises ValueError for kinds this module cannot batch."""
    kinds = tuple(getattr(config, "layer_types", None) or (FULL,) * int(config.num_hidden_layers))
    bad = sorted(set(kinds) - {LINEAR, FULL})
    if bad:
        raise ValueError(f"layer types {bad} cannot be batched by the CPU generator (only {LINEAR}, {FULL})")
    return kinds


def _with_spare(batch: int, like: torch.Tensor, width: int) -> torch.Tensor:
    """An uninitialised [batch, heads, width + SPARE_COLUMNS, head_dim] buffer shaped after
    ``like``. Callers fill its first ``width`` columns (pads with zeros: a masked key still meets
    the softmax weights, so it must be finite); the spare ones are written before being read."""
    return like.new_empty(batch, like.shape[1], width + SPARE_COLUMNS, like.shape[3])


class AppendLayer(DynamicLayer):
    """A full-attention cache layer over a buffer with free columns: ``update`` writes the new
    keys/values in place after the ``length`` used columns, and reallocates (with spare) only when
    they do not fit. It never writes into columns below ``length``, so views of the used part
    taken before (snapshots, other ``CacheRows``) stay valid."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.buffers = (keys, values)
        self.length = length
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[-2]
        keys, values = self.buffers
        if end > keys.shape[-2]:
            grown = []
            for old in (keys, values):
                new = _with_spare(old.shape[0], old, end)
                new[:, :, : self.length] = old[:, :, : self.length]
                grown.append(new)
            keys, values = grown
            self.buffers = (keys, values)
        keys[:, :, self.length : end] = key_states
        values[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


@dataclass(frozen=True)
class CacheRows:
    """Cache tensors of B sequences (batch dim 0), one pair per model layer, and their mask.

    ``layers[i]`` is ``(keys, values)`` for a full-attention layer — [B, kv_heads, C, head_dim]
    buffers of which the first ``width`` columns are used (C >= width) — and ``(conv_states,
    recurrent_states)`` for a linear-attention layer. ``mask`` is [B, width] int64; row b's real
    tokens are its last ``mask[b].sum()`` used columns.
    """

    kinds: tuple[str, ...]
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    mask: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        """Used columns of the attention axis (T)."""
        return int(self.mask.shape[1])

    def lengths(self) -> list[int]:
        """Real tokens per row."""
        return self.mask.sum(dim=1).tolist()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)

    def _used(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.layers[i]
        if self.kinds[i] == FULL:
            return a[:, :, : self.width], b[:, :, : self.width]
        return a, b

    @classmethod
    def from_cache(cls, cache: DynamicCache, kinds: tuple[str, ...], mask: torch.Tensor) -> CacheRows:
        """Read the tensors out of a ``DynamicCache`` the model has just run with."""
        layers = []
        for kind, layer in zip(kinds, cache.layers, strict=True):
            if kind == LINEAR:
                layers.append((layer.conv_states, layer.recurrent_states))
            elif isinstance(layer, AppendLayer):
                layers.append(layer.buffers)
            else:
                layers.append((layer.keys, layer.values))
        return cls(kinds, tuple(layers), mask)

    def to_cache(self, config: object) -> DynamicCache:
        """A ``DynamicCache`` over these tensors, not copied: the model updates the linear states
        in place and appends keys/values into the buffers' free columns (``AppendLayer``)."""
        cache = DynamicCache(config=config)
        for i, (kind, layer) in enumerate(zip(self.kinds, cache.layers, strict=True)):
            a, b = self.layers[i]
            if kind == LINEAR:
                if not isinstance(layer, LinearAttentionCacheLayerMixin):
                    raise TypeError(f"cache layer {type(layer).__name__} is not a linear-attention layer")
                layer.dtype, layer.device = a.dtype, a.device
                layer.conv_states, layer.recurrent_states = a, b
                layer.max_batch_size, layer.conv_kernel_size = a.shape[0], a.shape[-1]
                layer.is_conv_states_initialized = layer.is_recurrent_states_initialized = True
                layer.has_previous_state = True
            else:
                cache.layers[i] = AppendLayer(a, b, self.width)
        return cache

    def fork(self) -> CacheRows:
        """A copy safe to run the model on while this one is kept (a cached snapshot): linear
        states cloned (updated in place), keys/values cut to the used columns, so an append
        reallocates instead of writing into this object's buffers."""
        layers = tuple(
            (a.clone(), b.clone()) if kind == LINEAR else self._used(i)
            for i, (kind, (a, b)) in enumerate(zip(self.kinds, self.layers, strict=True))
        )
        return CacheRows(self.kinds, layers, self.mask)

    def row(self, index: int) -> CacheRows:
        """Row ``index`` alone, unpadded, in fresh memory (the batch keeps mutating its own)."""
        length = int(self.mask[index].sum())
        layers = []
        for i, kind in enumerate(self.kinds):
            a, b = self._used(i)
            if kind == LINEAR:
                layers.append((a[index : index + 1].clone(), b[index : index + 1].clone()))
            else:
                start = self.width - length
                layers.append(
                    (a[index : index + 1, :, start:].clone(), b[index : index + 1, :, start:].clone())
                )
        return CacheRows(self.kinds, tuple(layers), torch.ones(1, length, dtype=torch.long))

    def select(self, indices: Sequence[int]) -> CacheRows:
        """Rows ``indices`` in that order, in new buffers (with spare columns), without the
        leading columns that are padding in all of them."""
        idx = torch.tensor(list(indices), dtype=torch.long)
        mask = self.mask.index_select(0, idx)
        real = torch.nonzero(mask.any(dim=0))
        start = int(real[0]) if len(real) else mask.shape[1]
        width = mask.shape[1] - start
        layers = []
        for i, kind in enumerate(self.kinds):
            a, b = self._used(i)
            if kind == LINEAR:
                layers.append((a.index_select(0, idx), b.index_select(0, idx)))
                continue
            pair = []
            for old in (a, b):
                new = _with_spare(len(idx), old, width)
                new[:, :, :width] = old.index_select(0, idx)[:, :, start:]
                pair.append(new)
            layers.append(tuple(pair))
        return CacheRows(self.kinds, tuple(layers), mask[:, start:])

    @staticmethod
    def merge(parts: Sequence[CacheRows]) -> CacheRows:
        """Stack ``parts`` row-wise in new buffers (with spare columns), each part's used columns
        right-aligned to the widest (left padding)."""
        if not parts:
            raise ValueError("merge needs at least one part")
        width = max(p.width for p in parts)
        batch = sum(p.batch_size for p in parts)
        kinds = parts[0].kinds
        layers = []
        for i, kind in enumerate(kinds):
            used = [p._used(i) for p in parts]
            if kind == LINEAR:
                layers.append((torch.cat([a for a, _ in used]), torch.cat([b for _, b in used])))
                continue
            keys, values = _with_spare(batch, used[0][0], width), _with_spare(batch, used[0][1], width)
            row = 0
            for part, (a, b) in zip(parts, used, strict=True):
                rows, pad = slice(row, row + part.batch_size), width - part.width
                for buffer, data in ((keys, a), (values, b)):
                    buffer[rows, :, :pad] = 0.0
                    buffer[rows, :, pad:width] = data
                row += part.batch_size
            layers.append((keys, values))
        mask = torch.zeros(batch, width, dtype=torch.long)
        row = 0
        for part in parts:
            mask[row : row + part.batch_size, width - part.width :] = part.mask
            row += part.batch_size
        return CacheRows(kinds, tuple(layers), mask)
