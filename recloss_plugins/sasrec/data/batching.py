"""The deterministic, resumable stream of training batches over a TrainSplit."""

from __future__ import annotations

from typing import Dict

import numpy as np

from recloss_plugins.config.keys import PAD_ID
from recloss_plugins.sasrec.data.errors import DataError
from recloss_plugins.sasrec.data.splits import TrainSplit


class TrainBatches:
    """Deterministic, resumable stream of training batches.

    Example ``g`` of the stream (g = 0, 1, ...) is user ``perm_e[g mod U]`` of
    epoch ``e = g // U``, where ``perm_e`` is a permutation seeded by (seed, e).
    The batch at stream position ``p`` holds examples p..p+B-1, so the data
    position (examples consumed) is all a checkpoint needs to resume exactly.
    """

    def __init__(self, split: TrainSplit, batch_size: int, seed: int):
        if split.num_users == 0:
            raise DataError("the train split is empty: no user has enough interactions "
                            "(each needs at least 3*num_labels+3)")
        self.split, self.batch_size, self.seed = split, int(batch_size), int(seed)
        self._perms: Dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng([self.seed, epoch, 0x5A5])
            self._perms[epoch] = rng.permutation(self.split.num_users)
        return self._perms[epoch]

    def indices(self, position: int) -> np.ndarray:
        """[B] split rows of the batch starting at stream position ``position``."""
        g = position + np.arange(self.batch_size, dtype=np.int64)
        U = self.split.num_users
        epochs, slots = g // U, g % U
        out = np.empty(self.batch_size, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[slots[sel]]
        return out

    def batch(self, position: int) -> Dict[str, np.ndarray]:
        """{'inputs' [B, N] int32, 'targets' [B, N, L] int32, 'weights' [B, N] float32}."""
        rows = self.indices(position)
        inputs = self.split.inputs[rows]
        return {"inputs": inputs, "targets": self.split.targets[rows],
                "weights": (inputs != PAD_ID).astype(np.float32)}
