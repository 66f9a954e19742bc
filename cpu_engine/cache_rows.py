"""Batch rows of a Qwen3.5 hybrid cache: join, leave, snapshot — the state of continuous batching.

``CacheRows`` holds, for B sequences, each Gated-DeltaNet layer's fixed-size state (no time axis:
rows stack unpadded) and each full-attention layer's keys/values, left-padded so every row's newest
token is in the last column, with spare rows and columns so that decode steps and joins write in
place. ``PrefillCache`` is the cache of one batched prefill of right-padded new tokens. Layout and
costs: docs/environment.md, "CPU generation" (hybrid cache rows, batched prefill).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

LINEAR = "linear_attention"
FULL = "full_attention"
SPARE_COLUMNS = 64
"""Free key/value columns a batch buffer gets when it is (re)allocated: decode steps between two
reallocations append in place."""
SPARE_ROWS = 8
"""Free rows a decoding batch's buffers get when ``merge`` allocates them: that many requests can
join (``extend``) without copying the batch."""


def layer_kinds(config: object) -> tuple[str, ...]:
    """Per-layer kinds of a text config; raises ValueError for kinds this module cannot batch."""
    kinds = tuple(getattr(config, "layer_types", None) or (FULL,) * int(config.num_hidden_layers))
    bad = sorted(set(kinds) - {LINEAR, FULL})
    if bad:
        raise ValueError(f"layer types {bad} cannot be batched by the CPU generator (only {LINEAR}, {FULL})")
    return kinds


def _with_spare(rows: int, like: torch.Tensor, width: int, spare: int = SPARE_COLUMNS) -> torch.Tensor:
    """An uninitialised [rows, heads, width + spare, head_dim] buffer shaped after ``like``.
    Callers fill the first ``width`` columns of the rows in use (pads with zeros: a masked key
    still meets the softmax weights, so it must be finite); the spare ones are written before
    being read."""
    return like.new_empty(rows, like.shape[1], width + spare, like.shape[3])


class AppendLayer(DynamicLayer):
    """A full-attention cache layer over the first ``rows`` rows of buffers with free columns:
    ``update`` writes the new keys/values in place after the ``length`` used columns, and
    reallocates (with spare columns, as many rows) only when they do not fit. It never writes into
    columns below ``length``, so views of the used part taken before (snapshots, other
    ``CacheRows``) stay valid."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int, rows: int):
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.buffers = (keys, values)
        self.length, self.rows = length, rows
        self.keys, self.values = keys[:rows, :, :length], values[:rows, :, :length]
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
                new[: self.rows, :, : self.length] = old[: self.rows, :, : self.length]
                grown.append(new)
            keys, values = grown
            self.buffers = (keys, values)
        keys[: self.rows, :, self.length : end] = key_states
        values[: self.rows, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = keys[: self.rows, :, :end], values[: self.rows, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


class PrefillCache(DynamicCache):
    """The ``DynamicCache`` of one batched prefill: the model's input [B, N] holds every row's new
    tokens right-padded to N, and ``lengths`` [B] (int64, each >= 1) says how many are real. Its
    Gated-DeltaNet layers must run ``delta_rule.padded_prefill`` (installed by
    ``delta_rule.install``), which reads ``lengths``; full-attention layers get the padding from
    the attention mask."""

    def __init__(self, config: object, lengths: torch.Tensor):
        super().__init__(config=config)
        self.lengths = lengths


@dataclass(frozen=True)
class CacheRows:
    """Cache tensors of B sequences (batch dim 0), one pair per model layer, and their mask.

    ``layers[i]`` is ``(keys, values)`` for a full-attention layer — [R, kv_heads, C, head_dim]
    buffers of which the first B rows and ``width`` columns are used (R >= B, C >= width) — and
    ``(conv_states, recurrent_states)`` for a linear-attention layer ([R, ...], the first B rows
    used). ``mask`` is [B, width] int64, 1 = a real token; a row's real tokens are one run of
    columns, the last ones in a decoding batch (left padding) and possibly followed by pad columns
    after a batched prefill. The rows past B are free (``extend`` fills them).
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
        rows = self.batch_size
        if self.kinds[i] == FULL:
            return a[:rows, :, : self.width], b[:rows, :, : self.width]
        return a[:rows], b[:rows]

    @classmethod
    def blank(cls, config: object, dtype: torch.dtype) -> CacheRows:
        """One row holding no tokens: zero Gated-DeltaNet states (the state of an empty sequence:
        a fresh prompt is prefilled from it; shapes from a Qwen3.5 text config) and no key/value
        columns."""
        kinds = layer_kinds(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        empty = torch.zeros(1, config.num_key_value_heads, 0, head_dim, dtype=dtype)
        layers = []
        for kind in kinds:
            if kind == LINEAR:
                k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
                conv_dim = 2 * config.linear_num_key_heads * k_dim + config.linear_num_value_heads * v_dim
                conv = torch.zeros(1, conv_dim, config.linear_conv_kernel_dim, dtype=dtype)
                recurrent = torch.zeros(1, config.linear_num_value_heads, k_dim, v_dim, dtype=dtype)
                layers.append((conv, recurrent))
            else:
                layers.append((empty, empty))
        return cls(kinds, tuple(layers), torch.ones(1, 0, dtype=torch.long))

    @classmethod
    def from_cache(cls, cache: DynamicCache, kinds: tuple[str, ...], mask: torch.Tensor) -> CacheRows:
        """Read the tensors out of a ``DynamicCache`` the model has just run with (a prefill: its
        linear states are new tensors)."""
        layers = []
        for kind, layer in zip(kinds, cache.layers, strict=True):
            if kind == LINEAR:
                layers.append((layer.conv_states, layer.recurrent_states))
            elif isinstance(layer, AppendLayer):
                layers.append(layer.buffers)
            else:
                layers.append((layer.keys, layer.values))
        return cls(kinds, tuple(layers), mask)

    def stepped(self, cache: DynamicCache, mask: torch.Tensor) -> CacheRows:
        """This batch after a decoding step on ``cache`` (from ``to_cache``) with ``mask``: its own
        linear-state buffers, which the step updated in place (so the free rows are kept), and the
        key/value buffers the cache's append layers hold now (reallocated if they filled up)."""
        layers = []
        for i, (kind, layer) in enumerate(zip(self.kinds, cache.layers, strict=True)):
            if kind == LINEAR:
                a, b = self.layers[i]
                if (
                    layer.conv_states.data_ptr() != a.data_ptr()
                    or layer.recurrent_states.data_ptr() != b.data_ptr()
                ):
                    raise RuntimeError(
                        "a decoding step replaced the linear-attention states instead of updating them"
                    )
                layers.append((a, b))
            else:
                layers.append(layer.buffers)
        return CacheRows(self.kinds, tuple(layers), mask)

    def to_cache(self, config: object, lengths: torch.Tensor | None = None) -> DynamicCache:
        """A ``DynamicCache`` over these tensors, not copied: the model updates the linear states
        in place (a prefill replaces them) and appends keys/values into the buffers' free columns
        (``AppendLayer``). With ``lengths`` (real new tokens per row) it is a ``PrefillCache``."""
        cache = DynamicCache(config=config) if lengths is None else PrefillCache(config, lengths)
        for i, (kind, layer) in enumerate(zip(self.kinds, cache.layers, strict=True)):
            a, b = self.layers[i]
            if kind == LINEAR:
                if not isinstance(layer, LinearAttentionCacheLayerMixin):
                    raise TypeError(f"cache layer {type(layer).__name__} is not a linear-attention layer")
                layer.dtype, layer.device = a.dtype, a.device
                layer.conv_states, layer.recurrent_states = self._used(i)
                layer.max_batch_size, layer.conv_kernel_size = self.batch_size, a.shape[-1]
                layer.is_conv_states_initialized = layer.is_recurrent_states_initialized = True
                layer.has_previous_state = True
            else:
                cache.layers[i] = AppendLayer(a, b, self.width, self.batch_size)
        return cache

    def row(self, index: int) -> CacheRows:
        """Row ``index`` alone, its real columns only, in fresh memory (the batch keeps mutating
        its own)."""
        real = torch.nonzero(self.mask[index])
        start, end = (int(real[0]), int(real[-1]) + 1) if len(real) else (0, 0)
        layers = []
        for i, kind in enumerate(self.kinds):
            a, b = self._used(i)
            if kind == LINEAR:
                layers.append((a[index : index + 1].clone(), b[index : index + 1].clone()))
            else:
                layers.append(
                    (a[index : index + 1, :, start:end].clone(), b[index : index + 1, :, start:end].clone())
                )
        return CacheRows(self.kinds, tuple(layers), torch.ones(1, end - start, dtype=torch.long))

    def drop(self, leaving: Sequence[int]) -> tuple[CacheRows, list[int]]:
        """The batch without rows ``leaving`` (not all of them), made in place: each hole they
        leave below the new batch size gets a copy of one of the last rows, so only those rows are
        copied, not the whole batch; the leading columns that are padding in every remaining row
        are cut off (a view); the freed rows join the free ones. Returns that batch, over this
        one's buffers (so this one must not be used again), and per new row the index it had here."""
        gone = set(leaving)
        keep = [i for i in range(self.batch_size) if i not in gone]
        if not keep:
            raise ValueError("drop must leave at least one row")
        size = len(keep)
        order = list(range(size))
        holes = [i for i in order if i in gone]
        for hole, mover in zip(holes, [i for i in keep if i >= size], strict=True):
            order[hole] = mover
            for i in range(len(self.kinds)):
                for tensor in self._used(i):
                    tensor[hole] = tensor[mover]
        mask = self.mask[order]
        real = torch.nonzero(mask.any(dim=0))
        start = int(real[0]) if len(real) else mask.shape[1]
        layers = tuple(
            pair if kind == LINEAR else (pair[0][:, :, start:], pair[1][:, :, start:])
            for kind, pair in zip(self.kinds, self.layers, strict=True)
        )
        return CacheRows(self.kinds, layers, mask[:, start:]), order

    def extend(self, parts: Sequence[CacheRows]) -> CacheRows | None:
        """This batch with the rows of ``parts`` after its own, written in place into its free
        rows; None when they do not fit (more rows than are free, or a part wider than this
        batch). Only the new rows are copied; the result shares this batch's buffers (this one
        stays valid)."""
        rows = self.batch_size + sum(p.batch_size for p in parts)
        if rows > self.layers[0][0].shape[0] or any(p.width > self.width for p in parts):
            return None
        return self._append(parts)

    def _append(self, parts: Sequence[CacheRows]) -> CacheRows:
        """Write ``parts`` into the free rows after this batch's (they must fit), each part's used
        columns right-aligned to this batch's width (left padding: the columns before them
        zeroed)."""
        width = self.width
        for i, kind in enumerate(self.kinds):
            row = self.batch_size
            for part in parts:
                new = slice(row, row + part.batch_size)
                for buffer, data in zip(self.layers[i], part._used(i), strict=True):
                    if kind == LINEAR:
                        buffer[new] = data
                    else:
                        buffer[new, :, : width - part.width] = 0.0
                        buffer[new, :, width - part.width : width] = data
                row += part.batch_size
        pads = [F.pad(p.mask, (width - p.width, 0)) for p in parts]
        return CacheRows(self.kinds, self.layers, torch.cat([self.mask, *pads]))

    @staticmethod
    def merge(parts: Sequence[CacheRows], spare: int = SPARE_COLUMNS, spare_rows: int = 0) -> CacheRows:
        """Stack ``parts`` row-wise in new buffers with ``spare`` free columns and ``spare_rows``
        free rows, each part's used columns right-aligned to the widest (left padding)."""
        if not parts:
            raise ValueError("merge needs at least one part")
        width = max(p.width for p in parts)
        rows = sum(p.batch_size for p in parts) + spare_rows
        layers = []
        for i, kind in enumerate(parts[0].kinds):
            a, b = parts[0].layers[i]
            if kind == LINEAR:
                layers.append((a.new_empty(rows, *a.shape[1:]), b.new_empty(rows, *b.shape[1:])))
            else:
                layers.append((_with_spare(rows, a, width, spare), _with_spare(rows, b, width, spare)))
        empty = CacheRows(parts[0].kinds, tuple(layers), torch.zeros(0, width, dtype=torch.long))
        return empty._append(parts)
