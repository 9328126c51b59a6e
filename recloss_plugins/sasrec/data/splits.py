"""The paper's train/dev/test splits of Sequences, and item popularity over the train region.

Splits (CutBCE paper, Section III-E, for L labels; L = 8 gives 8, 17, 26):
for a user with n items s[0..n-1],

    test:   input s[0 : n-L],         targets s[n-L : n]
    dev:    input s[0 : n-2L-1],      targets the next L items s[n-2L-1 : n-L-1]
    train:  input s[0 : n-3L-2],      position j predicts s[j+1 : j+1+L]

Inputs keep their most recent ``max_seq_len`` items and are padded on the
right with PAD_ID (0). A user enters a split only when its input is non-empty
(n >= 3L+3 for train). Train targets never reach a dev or test target: the
last train position's targets end at s[n-2L-3], the dev input's second-to-last item.
"""

from __future__ import annotations

import dataclasses
from typing import Dict

import numpy as np

from recloss_plugins.config.keys import PAD_ID
from recloss_plugins.sasrec.data.sequences import Sequences


def split_cuts(n: np.ndarray, num_labels: int) -> Dict[str, np.ndarray]:
    """Input lengths (items before the cut) of each split for sequences of length n."""
    L = num_labels
    return {"test": n - L, "dev": n - (2 * L + 1), "train": n - (3 * L + 2)}


class _Split:
    @property
    def num_users(self) -> int:
        return self.inputs.shape[0]


@dataclasses.dataclass(frozen=True)
class EvalSplit(_Split):
    """inputs [U, N] int32 (right-padded), lengths [U] int32 (>= 1), targets [U, L] int32, users [U]."""
    inputs: np.ndarray
    lengths: np.ndarray
    targets: np.ndarray
    users: np.ndarray


@dataclasses.dataclass(frozen=True)
class TrainSplit(_Split):
    """inputs [U, N] int32 (right-padded), targets [U, N, L] int32 (0 = no target), users [U].

    Position weights are ``inputs != 0``."""
    inputs: np.ndarray
    targets: np.ndarray
    users: np.ndarray


def _window(seq: np.ndarray, cut: int, max_seq_len: int):
    start = max(0, cut - max_seq_len)
    return start, seq[start:cut]


def make_eval_split(seqs: Sequences, name: str, *, max_seq_len: int, num_labels: int) -> EvalSplit:
    """The 'dev' or 'test' split: one example per user whose input is non-empty."""
    if name not in ("dev", "test"):
        raise ValueError(f"eval split must be 'dev' or 'test', got {name!r}")
    cuts = split_cuts(seqs.lengths, num_labels)[name]
    users = np.flatnonzero(cuts >= 1)
    inputs = np.zeros((users.size, max_seq_len), np.int32)
    targets = np.zeros((users.size, num_labels), np.int32)
    lengths = np.zeros(users.size, np.int32)
    for row, u in enumerate(users):
        seq, cut = seqs.user(u), int(cuts[u])
        _, window = _window(seq, cut, max_seq_len)
        inputs[row, :window.size] = window
        lengths[row] = window.size
        tail = seq[cut:cut + num_labels]
        targets[row, :tail.size] = tail
    return EvalSplit(inputs, lengths, targets, users.astype(np.int64))


def make_train_split(seqs: Sequences, *, max_seq_len: int, num_labels: int) -> TrainSplit:
    """One example per user: the most recent ``max_seq_len`` items of the train input,
    each position targeting its next ``num_labels`` items (0 where fewer remain)."""
    L, N = num_labels, max_seq_len
    cuts = split_cuts(seqs.lengths, L)["train"]
    users = np.flatnonzero(cuts >= 1)
    inputs = np.zeros((users.size, N), np.int32)
    targets = np.zeros((users.size, N, L), np.int32)
    for row, u in enumerate(users):
        seq, cut = seqs.user(u), int(cuts[u])
        start, window = _window(seq, cut, N)
        inputs[row, :window.size] = window
        # Position j (absolute start+j) targets seq[start+j+1 : start+j+1+L]; pad past the end.
        ahead = np.zeros(window.size + L, np.int32)
        nxt = seq[start + 1:start + 1 + window.size + L - 1]
        ahead[:nxt.size] = nxt
        targets[row, :window.size] = np.lib.stride_tricks.sliding_window_view(ahead, L)[:window.size]
    return TrainSplit(inputs, targets, users.astype(np.int64))


def popularity(seqs: Sequences, num_labels: int) -> np.ndarray:
    """[vocab_size] int64 item counts over the training region of each user
    (train input plus its targets: the first n-2L-2 items); entry 0 is 0."""
    L = num_labels
    end = np.maximum(seqs.lengths - (2 * L + 2), 0)
    mask = np.zeros(seqs.items.shape[0], bool)
    for u in range(seqs.num_users):
        mask[seqs.offsets[u]:seqs.offsets[u] + end[u]] = True
    counts = np.bincount(seqs.items[mask], minlength=seqs.vocab_size).astype(np.int64)
    counts[PAD_ID] = 0
    return counts
