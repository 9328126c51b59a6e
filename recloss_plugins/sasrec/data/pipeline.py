"""The trainer's Grain input pipeline over prepared shards: each process reads only its share.

With S shards, P processes and global batch B (B divisible by S, S by P), process p opens shards
[p·S/P, (p+1)·S/P) only (`shards.Manifest.process_shards`). Per shard s the stream is

    grain.MapDataset.source(train users of s) -> per-epoch shuffle -> .repeat().batch(B/S)

(a new permutation for every epoch of the shard, seeded by (seed, s, epoch)), and a
process's batch of step t is its shards' t-th batches concatenated in shard order: rows
[p·B/P, (p+1)·B/P) of the global batch, which is therefore the same for every process count. The
global array is assembled with `parallel.put_process_local` (jax.make_array_from_process_local_data).
The iterator's state (the next step index) goes into the Orbax checkpoint, so a resumed run reads
exactly the batches an uninterrupted one would.

Evaluation splits are built from the process's own users (`GrainData.eval_split`), each process
scoring its share (`eval.evaluate`).
"""

from __future__ import annotations

import sys

from typing import Dict, List, Optional

import grain
import numpy as np

from recloss_plugins.config.keys import PAD_ID
from recloss_plugins.sasrec.data import shards as shards_lib
from recloss_plugins.sasrec.data.sequences import Sequences
from recloss_plugins.sasrec.data.splits import EvalSplit, make_eval_split, split_cuts


def train_example(seq: np.ndarray, max_seq_len: int, num_labels: int) -> Dict[str, np.ndarray]:
    """One user's training example (the 'train' split of `splits.make_train_split`).

    seq: [n] dense item ids, n >= 3L+3. Returns {'inputs' [N] int32, 'targets' [N, L] int32,
    'weights' [N] float32}: the most recent N items of s[0 : n-3L-2], position j targeting
    s[start+j+1 : start+j+1+L] (0 past the end), weights = inputs != 0."""
    N, L = max_seq_len, num_labels
    cut = seq.size - (3 * L + 2)
    start = max(0, cut - N)
    window = seq[start:cut]
    inputs = np.zeros(N, np.int32)
    inputs[:window.size] = window
    ahead = np.zeros(window.size + L, np.int32)
    nxt = seq[start + 1:start + 1 + window.size + L - 1]
    ahead[:nxt.size] = nxt
    targets = np.zeros((N, L), np.int32)
    targets[:window.size] = ahead[np.arange(window.size)[:, None] + np.arange(L)[None, :]]
    return {"inputs": inputs, "targets": targets, "weights": (inputs != PAD_ID).astype(np.float32)}


class ShardTrainSource(grain.sources.RandomAccessDataSource):
    """Grain random-access source: the training examples of one shard's users with a train split."""

    def __init__(self, reader, lengths: np.ndarray, max_seq_len: int, num_labels: int):
        self._reader, self._N, self._L = reader, max_seq_len, num_labels
        self.rows = np.flatnonzero(split_cuts(lengths.astype(np.int64), num_labels)["train"] >= 1)

    def __len__(self) -> int:
        return int(self.rows.size)

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        rec = self._reader.read([shards_lib.HEADER_RECORDS + int(self.rows[index])])[0]
        return train_example(shards_lib.decode(rec), self._N, self._L)


class _EpochShuffle(grain.MapDataset):
    """Element i of epoch e = i // n: parent[perm_e[i mod n]], perm_e a numpy permutation seeded by
    (seed, e) — a fresh order every epoch. (Grain's own index shuffle costs ~0.5 ms per element
    here, the most expensive step of the pipeline; one permutation per epoch costs O(n) once.)"""

    def __init__(self, parent: grain.MapDataset, seed: int):
        super().__init__(parent)
        self._seed, self._n = int(seed), len(parent)
        self._perms: Dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self._n

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            perm = np.random.default_rng([self._seed, epoch, 0x6A7]).permutation(self._n)
            self._perms[epoch] = perm
        return perm

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        epoch, j = divmod(int(index), self._n)
        return self._parent[int(self._perm(epoch)[j])]

    def __str__(self) -> str:
        return "EpochShuffle"


class _ConcatBatches(grain.MapDataset):
    """Element i: the i-th elements (batches) of the parents, concatenated along rows in order."""

    def __init__(self, parents: List[grain.MapDataset]):
        super().__init__(parents)
        self._ds = parents

    def __len__(self) -> int:
        # __len__, not len(): Grain's batch(1) of a repeated dataset reports sys.maxsize + 1, which
        # len() refuses (OverflowError) -- a global batch of one row per shard hit it.
        return min(min(p.__len__() for p in self._ds), sys.maxsize)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        parts = [p[index] for p in self._ds]
        return {k: np.concatenate([b[k] for b in parts]) for k in parts[0]}

    def __str__(self) -> str:
        return "ConcatBatches"


class GrainData:
    """One process's view of a prepared dataset: its shards, their train stream, its eval users.

    Args:
      path: the prepared directory (`recloss-prepare-data`'s prepared_data_path).
      max_seq_len, num_labels: N and L of the splits.
      process_index, process_count: this process and the job's count (jax.process_index/count).
      stage_dir: for a gs:// ``path``, the local folder this process's shards are copied to and
        checked in (`shards.stage`; default `shards.default_stage_dir`). ``staged`` then says
        what was copied.
    Raises:
      shards.ShardError: shards missing, empty, from another preparation, or not divisible over
        the processes; a shard without a train user.
    """

    def __init__(self, path, *, max_seq_len: int, num_labels: int, process_index: int = 0,
                 process_count: int = 1, stage_dir: Optional[str] = None):
        self.manifest = shards_lib.load_manifest(path)
        self.max_seq_len, self.num_labels = int(max_seq_len), int(num_labels)
        self.process_index, self.process_count = int(process_index), int(process_count)
        shards_lib.check_num_labels(self.manifest, self.num_labels)
        self.shard_ids = self.manifest.process_shards(self.process_index, self.process_count)
        self.opened: List[str] = []
        self._eval: Dict[str, EvalSplit] = {}
        self._local: Optional[Sequences] = None
        self._readers, self._lengths = [], []
        local, self.staged = {}, None
        if self.manifest.path.startswith("gs://"):
            local, self.staged = shards_lib.stage(self.manifest, self.shard_ids, stage_dir)
        for s in self.shard_ids:
            reader, lengths = shards_lib.open_shard(self.manifest, s, local.get(s))
            self.opened.append(local.get(s, str(self.manifest.shard_path(s))))
            self._readers.append(reader)
            self._lengths.append(lengths)
        self.sources = [ShardTrainSource(r, n, self.max_seq_len, self.num_labels)
                        for r, n in zip(self._readers, self._lengths)]
        for s, src in zip(self.shard_ids, self.sources):
            if len(src) == 0:
                raise shards_lib.ShardError(
                    f"prepared shard {self.manifest.shards[s]['name']!r} has no user with a train split "
                    f"(each needs >= {3 * self.num_labels + 3} interactions); prepare with fewer shards or "
                    "a higher min_user_interactions")

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def popularity(self) -> np.ndarray:
        return shards_lib.popularity_of(self.manifest, self.num_labels)

    def local_batch_size(self, global_batch_size: int) -> int:
        S = self.manifest.num_shards
        if global_batch_size % S:
            raise shards_lib.ShardError(
                f"global batch {global_batch_size} does not divide over the {S} prepared shards (each step "
                f"takes B/S rows of every shard); use a batch that is a multiple of {S} or prepare with "
                f"prepare_num_shards dividing it")
        return global_batch_size // S * len(self.shard_ids)

    def train_dataset(self, global_batch_size: int, seed: int) -> grain.MapDataset:
        """Element t: this process's rows of global batch t ({'inputs' [b, N], 'targets' [b, N, L],
        'weights' [b, N]}, b = B·|local shards|/S)."""
        self.local_batch_size(global_batch_size)
        per_shard = global_batch_size // self.manifest.num_shards
        streams = [_EpochShuffle(grain.MapDataset.source(src), seed=int(seed) * 1_000_003 + s)
                   .repeat().batch(per_shard) for s, src in zip(self.shard_ids, self.sources)]
        return _ConcatBatches(streams)

    def train_iterator(self, global_batch_size: int, seed: int, *, read_threads: int = 4,
                       prefetch: int = 8) -> grain.DatasetIterator:
        """A checkpointable iterator over `train_dataset` (get_state / set_state)."""
        opts = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)
        return iter(self.train_dataset(global_batch_size, seed).to_iter_dataset(opts))

    def local_sequences(self) -> Sequences:
        """This process's users (its shards, in order) as Sequences; reads every local record."""
        seqs = []
        for reader, lengths in zip(self._readers, self._lengths):
            recs = reader.read(list(range(shards_lib.HEADER_RECORDS, shards_lib.HEADER_RECORDS + lengths.size)))
            seqs.extend(shards_lib.decode(r) for r in recs)
        return Sequences.from_lists(seqs, self.manifest.num_items)

    def eval_split(self, name: str) -> EvalSplit:
        """The 'dev' or 'test' split of this process's users (built once, then kept)."""
        if name not in self._eval:
            if self._local is None:
                self._local = self.local_sequences()
            self._eval[name] = make_eval_split(self._local, name, max_seq_len=self.max_seq_len,
                                               num_labels=self.num_labels)
        return self._eval[name]

    def counts(self) -> Dict[str, int]:
        """{'users', 'interactions', 'items', 'train_users'}: global counts from the manifest, plus this
        process's train users."""
        m = self.manifest
        return {"users": m.num_users, "interactions": m.num_interactions, "items": m.num_items,
                "local_train_users": int(sum(len(s) for s in self.sources))}


def frozen_state(iterator) -> "FrozenIterator":
    """An iterator standing for ``iterator``'s state now, for an asynchronous checkpoint save."""
    return FrozenIterator(iterator.get_state())


class FrozenIterator(grain.DatasetIterator):
    """A DatasetIterator that only carries a saved state (what grain.checkpoint.CheckpointSave reads)."""

    def __init__(self, state):
        super().__init__([])
        self._state = state

    def __next__(self):
        raise StopIteration

    def get_state(self):
        return self._state

    def set_state(self, state):
        self._state = state



def uses_grain(cfg) -> bool:
    """Whether a config trains on the Grain pipeline: file data (interactions, yambda) with
    data_pipeline: grain; the synthetic set always stays in memory."""
    return cfg.dataset_type != "synthetic" and cfg.data_pipeline == "grain"


def grain_data_for(cfg, process_index: int, process_count: int, *, log=print, progress_stream=None,
                   client=None) -> GrainData:
    """`GrainData` of the config's prepared_data_path for this process; with it empty, of the log's
    cache folder, which process 0 prepares first when needed (`cache.prepared_path`, whose
    ``client`` a multi-process run passes)."""
    from recloss_plugins.sasrec.data import cache

    path = cache.prepared_path(cfg, process_index=process_index, process_count=process_count, log=log,
                               progress_stream=progress_stream, client=client)
    return GrainData(path, max_seq_len=cfg.max_seq_len, num_labels=cfg.num_labels,
                     process_index=process_index, process_count=process_count,
                     stage_dir=cfg.prepared_stage_dir or None)
