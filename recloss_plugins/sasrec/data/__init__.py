"""Interaction logs -> per-user item sequences -> the paper's train/dev/test splits -> batches.

Sequences are held as one flat int32 array of dense item ids (1..#items;
``recloss_plugins.config.keys.PAD_ID`` = 0 is padding) with CSR offsets, each
user's items in time order.

Modules:
    errors     DataError
    sequences  Sequences, the CSR container every other module speaks
    splits     the paper's train/dev/test splits and train-region popularity
    batching   TrainBatches, the deterministic, resumable batch stream
    synthetic  the seeded multi-intent generator
    storage    local paths and gs:// URLs as one etils.epath.Path (as_path), StorageError
    tables     data files -> numpy columns (CSV/TSV/Parquet via pyarrow)
    readers    interaction logs and Yambda -> Sequences
    dataset    a config -> Sequences -> Dataset (splits + popularity)
    stream     interaction logs read in pieces (Parquet row groups, CSV blocks)
    shards     the prepared-shard layout (manifest, ArrayRecord shards), ShardError
    prepare    recloss-prepare-data: a log -> per-user sequence shards
    pipeline   the Grain pipeline over prepared shards: GrainData, each process its share
    cache      recloss-train on a log: prepared once into a folder keyed by its files and keys
"""

from recloss_plugins.sasrec.data.batching import TrainBatches
from recloss_plugins.sasrec.data.dataset import Dataset, build_dataset, load_sequences
from recloss_plugins.sasrec.data.errors import DataError
from recloss_plugins.sasrec.data.readers import load_interactions, load_yambda
from recloss_plugins.sasrec.data.sequences import Sequences
from recloss_plugins.sasrec.data.shards import ShardError
from recloss_plugins.sasrec.data.storage import StorageError, as_path, make_dir
from recloss_plugins.sasrec.data.splits import (
    EvalSplit,
    TrainSplit,
    make_eval_split,
    make_train_split,
    popularity,
    split_cuts,
)
from recloss_plugins.sasrec.data.synthetic import synthetic

__all__ = [
    "DataError", "Dataset", "EvalSplit", "Sequences", "ShardError", "StorageError", "TrainBatches", "TrainSplit",
    "as_path",
    "build_dataset", "load_interactions", "load_sequences", "load_yambda", "make_dir", "make_eval_split",
    "make_train_split", "popularity", "split_cuts", "synthetic",
]
