"""A least-recently-used store of model states after token sequences, for prefix reuse.

A multi-turn rollout sends its whole context every turn: the previous prompt, the sampled turn
and the tool response. A hybrid model's linear-attention state cannot be cut back to an earlier
length, so states are kept only at the two points a later request can start from: after a
prompt (the other rollouts of a GRPO group send the same one) and at the end of a turn (the next
turn extends it). ``longest_prefix`` finds the longest stored sequence that starts the new
prompt; the generator then runs the model on the remainder only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from cpu_engine.cache_rows import CacheRows


@dataclass(frozen=True)
class Snapshot:
    """The state after ``tokens`` (one unpadded row) and the logits of the next token ([vocab])."""

    tokens: tuple[int, ...]
    rows: CacheRows
    logits: torch.Tensor

    def nbytes(self) -> int:
        return self.rows.nbytes() + self.logits.numel() * self.logits.element_size() + 8 * len(self.tokens)


class PrefixCache:
    """Snapshots keyed by their token sequence, evicted least-recently-used beyond ``max_bytes``.

    ``max_bytes`` = 0 disables the cache (``put`` stores nothing). Not thread-safe: the generator
    touches it from its engine thread only (and ``clear`` under the same lock).
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"prefix cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, snapshot: Snapshot) -> None:
        """Store (or refresh) a snapshot, then evict the oldest until the total fits."""
        size = snapshot.nbytes()
        if size > self.max_bytes:
            return
        old = self._entries.pop(snapshot.tokens, None)
        if old is not None:
            self.nbytes -= old.nbytes()
        self._entries[snapshot.tokens] = snapshot
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes()

    def longest_prefix(self, tokens: tuple[int, ...]) -> Snapshot | None:
        """The stored snapshot of the longest sequence that ``tokens`` starts with (or equals)."""
        best: Snapshot | None = None
        size = len(tokens)
        for key, snapshot in self._entries.items():
            n = len(key)
            if n > size or (best is not None and n <= len(best.tokens)) or tokens[n - 1] != key[-1]:
                continue  # cheap rejections first: most keys differ in their last token
            if tokens[:n] == key:
                best = snapshot
        if best is not None:
            self._entries.move_to_end(best.tokens)
        return best

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
