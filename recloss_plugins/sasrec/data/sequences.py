"""Users' item sequences in CSR form: the container every other data module speaks."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Users' item sequences in CSR form.

    items: [total] int32 dense ids in 1..num_items (time order within a user).
    offsets: [U + 1] int64; user u's items are items[offsets[u]:offsets[u+1]].
    num_items: number of distinct items; the vocabulary is num_items + 1 (id 0 = padding).
    item_raw_ids: [num_items + 1] original ids (entry 0 unused) or None.
    """

    items: np.ndarray
    offsets: np.ndarray
    num_items: int
    item_raw_ids: Optional[np.ndarray] = None

    def __post_init__(self):
        if self.items.ndim != 1 or self.offsets.ndim != 1 or self.offsets[0] != 0 \
                or self.offsets[-1] != self.items.shape[0] or np.any(np.diff(self.offsets) < 0):
            raise ValueError("Sequences needs 1-D items and non-decreasing offsets from 0 to len(items)")
        if self.items.size and (self.items.min() < 1 or self.items.max() > self.num_items):
            raise ValueError(f"Sequences.items must lie in [1, {self.num_items}], got "
                             f"[{self.items.min()}, {self.items.max()}]")

    @property
    def num_users(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def vocab_size(self) -> int:
        return self.num_items + 1

    def user(self, u: int) -> np.ndarray:
        return self.items[self.offsets[u]:self.offsets[u + 1]]

    @classmethod
    def from_lists(cls, seqs: Sequence[Sequence[int]], num_items: Optional[int] = None) -> "Sequences":
        arrays = [np.asarray(s, dtype=np.int32).reshape(-1) for s in seqs]
        offsets = np.zeros(len(arrays) + 1, np.int64)
        offsets[1:] = np.cumsum([a.size for a in arrays])
        items = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        return cls(items, offsets, int(num_items if num_items is not None else (items.max() if items.size else 0)))

    def filter_min_length(self, min_len: int) -> "Sequences":
        keep = np.flatnonzero(self.lengths >= min_len)
        return Sequences.from_lists([self.user(u) for u in keep], self.num_items)._with(self.item_raw_ids)

    def _with(self, raw):
        return dataclasses.replace(self, item_raw_ids=raw)
