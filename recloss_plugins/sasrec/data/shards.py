"""The prepared-data layout `recloss-prepare-data` writes and the Grain pipeline reads.

A prepared directory (local or gs://, `storage.as_path`) holds

    prepared.json                    the manifest: vocabulary hash, counts, filters, the shard list
    vocab.npy                        [num_items + 1] raw item ids (entry 0, padding, repeats entry 1)
    popularity.npy                   [num_items + 1] int64 train-region item counts (for num_labels)
    part-SSSSS-of-NNNNN.arrayrecord  one ArrayRecord file per shard

Shard records: 0 is a JSON header {format, vocab_hash, shard, num_shards, num_users}; 1 is the
int32 lengths of the shard's users; record 2 + u is user u's dense item ids (int32, time order).
Records are written one per chunk (group_size 1), so any user is one random read.
"""

from __future__ import annotations

import dataclasses
import json
from typing import List, Tuple

import numpy as np

from recloss_plugins.sasrec.data.errors import DataError
from recloss_plugins.sasrec.data.storage import as_path

FORMAT = "recloss-sequences/1"
MANIFEST = "prepared.json"
HEADER_RECORDS = 2          # header, lengths
WRITER_OPTIONS = "group_size:1"
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"   # random access


class ShardError(DataError):
    """Prepared shards are missing, empty, from another preparation, or do not split over the processes."""


def shard_name(shard: int, num_shards: int) -> str:
    return f"part-{shard:05d}-of-{num_shards:05d}.arrayrecord"


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What prepared.json records (see the module docstring)."""
    path: str                   # the prepared directory
    vocab_hash: str
    num_users: int
    num_items: int
    num_interactions: int
    num_labels: int             # popularity.npy counts the train region of this L
    shards: Tuple[dict, ...]    # {name, num_users, num_interactions, bytes}
    source: dict                # dataset_type, dataset_path, filters

    @property
    def vocab_size(self) -> int:
        return self.num_items + 1

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def shard_path(self, shard: int):
        return as_path(self.path, "prepared_data_path") / self.shards[shard]["name"]

    def process_shards(self, process_index: int, process_count: int) -> List[int]:
        """The shards process ``process_index`` of ``process_count`` reads: a contiguous 1/P of them."""
        if self.num_shards % process_count:
            raise ShardError(f"{self.num_shards} prepared shards in {self.path!r} do not divide over "
                             f"{process_count} processes; prepare with prepare_num_shards a multiple of "
                             f"{process_count}")
        per = self.num_shards // process_count
        return list(range(process_index * per, (process_index + 1) * per))


def load_manifest(path) -> Manifest:
    """The manifest of the prepared directory ``path``; ShardError when there is none."""
    root = as_path(path, "prepared_data_path")
    f = root / MANIFEST
    if not f.exists():
        raise ShardError(f"prepared_data_path {str(path)!r} has no {MANIFEST}: run "
                         "`recloss-prepare-data CONFIG` first (it writes the shards and the manifest)")
    try:
        m = json.loads(f.read_text())
    except ValueError as err:
        raise ShardError(f"{str(f)!r} is not valid JSON: {err}") from err
    if m.get("format") != FORMAT:
        raise ShardError(f"{str(f)!r} has format {m.get('format')!r}, expected {FORMAT!r}")
    return Manifest(str(root), m["vocab_hash"], int(m["num_users"]), int(m["num_items"]),
                    int(m["num_interactions"]), int(m["num_labels"]), tuple(m["shards"]), m["source"])


def open_shard(manifest: Manifest, shard: int):
    """(reader, lengths [users] int32) of one shard, its header checked against the manifest.

    Raises ShardError when the file is missing, empty, or from another preparation."""
    from array_record.python.array_record_module import ArrayRecordReader

    path = manifest.shard_path(shard)
    if str(path).startswith("gs://"):
        raise ShardError(f"prepared shard {str(path)!r} is a gs:// object, but ArrayRecord reads local files "
                         "only: mount the bucket on every host (gcsfuse) and set prepared_data_path to the "
                         "mount's path (recloss-prepare-data itself may write to gs://)")
    if not path.exists():
        raise ShardError(f"prepared shard {str(path)!r} is missing ({manifest.num_shards} shards are listed "
                         f"in {MANIFEST}); copy the whole prepared directory or prepare again")
    try:
        reader = ArrayRecordReader(str(path), READER_OPTIONS)
    except Exception as err:  # riegeli raises RuntimeError/ValueError for truncated files
        raise ShardError(f"prepared shard {str(path)!r} is not a readable ArrayRecord file: {err}") from err
    if reader.num_records() < HEADER_RECORDS:
        raise ShardError(f"prepared shard {str(path)!r} is empty ({reader.num_records()} records; a shard "
                         f"holds a header, the lengths and >= 1 user)")
    try:
        header = json.loads(reader.read([0])[0])
    except Exception as err:  # not JSON or an unreadable chunk: not a shard of ours
        raise ShardError(f"prepared shard {str(path)!r} has no readable header record: {err}") from err
    if header.get("vocab_hash") != manifest.vocab_hash:
        raise ShardError(f"prepared shard {str(path)!r} comes from a different preparation: vocabulary hash "
                         f"{header.get('vocab_hash')!r}, but {MANIFEST} says {manifest.vocab_hash!r}")
    lengths = np.frombuffer(reader.read([1])[0], np.int32)
    want = int(manifest.shards[shard]["num_users"])
    if lengths.size != want or reader.num_records() != HEADER_RECORDS + want or want == 0:
        raise ShardError(f"prepared shard {str(path)!r} holds {reader.num_records() - HEADER_RECORDS} users "
                         f"(lengths record: {lengths.size}), but {MANIFEST} says {want}"
                         + ("; an empty shard cannot be trained on" if want == 0 else ""))
    return reader, lengths


def decode(record: bytes) -> np.ndarray:
    return np.frombuffer(record, np.int32)


def check_num_labels(manifest: Manifest, num_labels: int) -> None:
    """ShardError unless the shards' popularity was counted for ``num_labels`` (the train region is n-2L-2)."""
    if manifest.num_labels != num_labels:
        raise ShardError(f"{manifest.path!r} was prepared with num_labels={manifest.num_labels}, this run has "
                         f"num_labels={num_labels}; prepare again with num_labels={num_labels}")


def popularity_of(manifest: Manifest, num_labels: int) -> np.ndarray:
    """[vocab_size] int64 popularity.npy, counted for ``num_labels`` (else ShardError)."""
    check_num_labels(manifest, num_labels)
    with (as_path(manifest.path, "prepared_data_path") / "popularity.npy").open("rb") as f:
        return np.load(f)
