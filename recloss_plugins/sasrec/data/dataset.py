"""A config -> its Sequences -> the Dataset the trainer needs (splits and popularity)."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import numpy as np

from recloss_plugins.sasrec.data.errors import DataError
from recloss_plugins.sasrec.data.readers import load_interactions, load_yambda
from recloss_plugins.sasrec.data.sequences import Sequences
from recloss_plugins.sasrec.data.splits import EvalSplit, TrainSplit, make_eval_split, make_train_split, popularity
from recloss_plugins.sasrec.data.synthetic import synthetic


def load_sequences(cfg) -> Sequences:
    """The dataset a config names (dataset_type: synthetic | interactions | yambda)."""
    kind = cfg.dataset_type
    if kind == "synthetic":
        seqs = synthetic(num_users=cfg.synthetic_num_users, num_items=cfg.synthetic_num_items,
                         min_len=cfg.synthetic_min_len, max_len=cfg.synthetic_max_len,
                         num_intents=cfg.synthetic_num_intents,
                         intents_per_user=cfg.synthetic_intents_per_user,
                         zipf_exponent=cfg.synthetic_zipf_exponent, follow_prob=cfg.synthetic_follow_prob,
                         switch_prob=cfg.synthetic_switch_prob, seed=cfg.seed)
        return seqs.filter_min_length(cfg.min_user_interactions) if cfg.min_user_interactions else seqs
    common = dict(file_format=cfg.file_format, user_column=cfg.user_column, item_column=cfg.item_column,
                  timestamp_column=cfg.timestamp_column, min_user_interactions=cfg.min_user_interactions)
    if kind == "interactions":
        return load_interactions(os.fspath(cfg.dataset_path), **common)
    if kind == "yambda":
        return load_yambda(os.fspath(cfg.dataset_path), event_types=tuple(cfg.yambda_event_types),
                           organic_only=cfg.yambda_organic_only,
                           min_played_ratio_pct=cfg.yambda_min_played_ratio_pct, **common)
    raise DataError(f"unknown dataset_type {kind!r}")


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Everything the trainer needs from the data."""
    sequences: Sequences
    train: TrainSplit
    dev: EvalSplit
    test: EvalSplit
    popularity: np.ndarray

    @property
    def vocab_size(self) -> int:
        return self.sequences.vocab_size


def build_dataset(cfg, seqs: Optional[Sequences] = None) -> Dataset:
    """The config's Sequences (or ``seqs``) with their train/dev/test splits and train-region popularity."""
    seqs = load_sequences(cfg) if seqs is None else seqs
    kw = dict(max_seq_len=cfg.max_seq_len, num_labels=cfg.num_labels)
    return Dataset(seqs, make_train_split(seqs, **kw), make_eval_split(seqs, "dev", **kw),
                   make_eval_split(seqs, "test", **kw), popularity(seqs, cfg.num_labels))
