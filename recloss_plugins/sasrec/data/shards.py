"""The prepared-data layout `recloss-prepare-data` writes and the Grain pipeline reads.

A prepared directory (local or gs://, `storage.as_path`) holds

    prepared.json                    the manifest: vocabulary hash, counts, filters, the shard list
    vocab.npy                        [num_items + 1] raw item ids (entry 0, padding, repeats entry 1):
                                     numbers as read, strings as fixed-width unicode (<U{n}); never a
                                     pickled object array (`write_vocab`, `read_vocab`)
    popularity.npy                   [num_items + 1] int64 train-region item counts (for num_labels)
    part-SSSSS-of-NNNNN.arrayrecord  one ArrayRecord file per shard

Shard records: 0 is a JSON header {format, vocab_hash, shard, num_shards, num_users}; 1 is the
int32 lengths of the shard's users; record 2 + u is user u's dense item ids (int32, time order).
Records are written one per chunk (group_size 1), so any user is one random read.

ArrayRecord reads local files only: a process training on a gs:// preparation first copies its
own shards to local disk (`stage`), each checked against the size and SHA-256 the manifest lists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from recloss_plugins.sasrec.data.errors import DataError
from recloss_plugins.sasrec.data.storage import as_path

FORMAT = "recloss-sequences/1"
MANIFEST = "prepared.json"
VOCAB = "vocab.npy"
HEADER_RECORDS = 2          # header, lengths
WRITER_OPTIONS = "group_size:1"
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"   # random access
_COPY_BYTES = 8 << 20


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
    shards: Tuple[dict, ...]    # {name, num_users, num_interactions, bytes, sha256}
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
    vocab = root / VOCAB
    if vocab.exists():
        with vocab.open("rb") as fv:
            _vocab_dtype(fv, vocab)       # a pickled vocabulary refuses the folder, unread
    return Manifest(str(root), m["vocab_hash"], int(m["num_users"]), int(m["num_items"]),
                    int(m["num_interactions"]), int(m["num_labels"]), tuple(m["shards"]), m["source"])


def write_vocab(path, raw_ids) -> np.ndarray:
    """Writes the raw item ids ``raw_ids`` [num_items + 1] to ``path`` (local or gs://) as a .npy that
    loads without pickle: numbers as they are, strings (an object array of str) as fixed-width unicode
    ``<U{longest}``. Returns the array written."""
    a = np.asarray(raw_ids)
    if a.dtype.hasobject:
        if not all(isinstance(x, str) for x in a.flat):
            kinds = sorted({type(x).__name__ for x in a.flat})
            raise DataError(f"item ids of types {kinds} cannot be stored without pickle: expected numbers or "
                            "strings")
        a = a.astype(str)
    with as_path(path, "prepared_data_path").open("wb") as f:
        np.save(f, np.ascontiguousarray(a), allow_pickle=False)
    return a


def _vocab_dtype(f, path) -> np.dtype:
    """The dtype of the .npy open as ``f``, read from its header alone; ShardError for an object array
    (a pickle, which is never loaded) or a file that is not a .npy."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        read = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
        if read is None:
            raise ValueError(f".npy format version {version} (np.save writes 1.0 or 2.0 for an array of ids)")
        _, _, dtype = read(f)
    except ValueError as err:
        raise ShardError(f"{str(path)!r} is not a .npy file of item ids: {err}; prepare again") from err
    if dtype.hasobject:
        raise ShardError(f"{str(path)!r} holds a pickled object array, and recloss does not unpickle a prepared "
                         "folder (whoever can write to it, a shared bucket, could run code in every reader): "
                         "re-run recloss-prepare-data into a new prepared_data_path (or delete the folder, for "
                         "recloss-train to prepare its cache again); it stores string ids as fixed-width "
                         "unicode, which loads without pickle")
    return dtype


def read_vocab(manifest: "Manifest") -> np.ndarray:
    """[num_items + 1] the raw item ids of a preparation (`VOCAB`): entry i is dense id i's original id
    (entry 0, padding, repeats entry 1). Loaded with ``allow_pickle=False``, memory-mapped on a local
    disk; ShardError (never unpickling it) for a pickled object array, or a length other than the
    manifest's num_items + 1."""
    path = as_path(manifest.path, "prepared_data_path") / VOCAB
    if not path.exists():
        raise ShardError(f"prepared_data_path {manifest.path!r} has no {VOCAB}; copy the whole prepared "
                         "directory or prepare again")
    remote = str(path).startswith("gs://")
    with path.open("rb") as f:
        _vocab_dtype(f, path)
        if remote:
            f.seek(0)
            raw = np.load(f, allow_pickle=False)
    if not remote:
        raw = np.load(os.fspath(path), mmap_mode="r", allow_pickle=False)
    if raw.shape != (manifest.vocab_size,):
        raise ShardError(f"{str(path)!r} holds {raw.shape} ids, but {MANIFEST} says {manifest.num_items} items "
                         f"(+1 padding = {manifest.vocab_size}); prepare again")
    return raw


def file_sha256(path) -> str:
    """The hex SHA-256 of the file ``path`` (local or gs://), read in 8 MiB pieces."""
    h = hashlib.sha256()
    with as_path(path, "prepared_data_path").open("rb") as f:
        while piece := f.read(_COPY_BYTES):
            h.update(piece)
    return h.hexdigest()


def _matches(path: str, entry: dict) -> bool:
    return (os.path.isfile(path) and os.path.getsize(path) == int(entry["bytes"])
            and ("sha256" not in entry or file_sha256(path) == entry["sha256"]))


def default_stage_dir(manifest: Manifest) -> str:
    """Where `stage` copies a gs:// preparation by default: one folder per preparation under the
    system's temporary directory (the same on every run, so a restart reuses what is there)."""
    tag = hashlib.sha256(f"{manifest.path}|{manifest.vocab_hash}|{manifest.num_shards}".encode()).hexdigest()
    return os.path.join(tempfile.gettempdir(), "recloss-staged", tag[:16])


def stage(manifest: Manifest, shard_ids: List[int], stage_dir: Optional[str] = None
          ) -> Tuple[Dict[int, str], dict]:
    """Copies shards ``shard_ids`` of a gs:// preparation to local disk, each checked.

    A local copy whose size and SHA-256 match the manifest is kept; any other is copied again
    (through a temporary name, so a killed copy is never taken for a whole one).

    Returns:
      ({shard: local path}, {'dir', 'copied', 'reused', 'bytes' copied, 'seconds', 'unchecked'}),
      'unchecked' counting shards whose manifest entry has no sha256 (prepared before checksums;
      their size alone was checked).
    Raises:
      ShardError: a shard object missing, or whose bytes differ from the manifest's size or
        SHA-256 (a partial or corrupt upload), naming it.
    """
    t0 = time.perf_counter()
    root = stage_dir or default_stage_dir(manifest)
    os.makedirs(root, exist_ok=True)
    paths, info = {}, {"dir": root, "copied": 0, "reused": 0, "bytes": 0, "seconds": 0.0, "unchecked": 0}
    for s in shard_ids:
        entry = manifest.shards[s]
        src, dest = manifest.shard_path(s), os.path.join(root, entry["name"])
        paths[s] = dest
        info["unchecked"] += "sha256" not in entry
        if _matches(dest, entry):
            info["reused"] += 1
            continue
        if not src.exists():
            raise ShardError(f"prepared shard {str(src)!r} is missing ({manifest.num_shards} shards are listed "
                             f"in {MANIFEST}); copy the whole prepared directory or prepare again")
        partial, h, n = f"{dest}.partial-{os.getpid()}", hashlib.sha256(), 0
        try:
            with src.open("rb") as fin, open(partial, "wb") as fout:
                while piece := fin.read(_COPY_BYTES):
                    h.update(piece)
                    fout.write(piece)
                    n += len(piece)
            want_bytes, want_sha = int(entry["bytes"]), entry.get("sha256", h.hexdigest())
            if n != want_bytes or h.hexdigest() != want_sha:
                raise ShardError(f"prepared shard {str(src)!r} does not match {MANIFEST}: it has {n:,} bytes "
                                 f"and SHA-256 {h.hexdigest()[:16]}..., the manifest lists {want_bytes:,} bytes "
                                 f"and {want_sha[:16]}... (a partial or corrupt upload); prepare again")
            os.replace(partial, dest)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        info["copied"] += 1
        info["bytes"] += n
    info["seconds"] = time.perf_counter() - t0
    return paths, info


def open_shard(manifest: Manifest, shard: int, path: Optional[str] = None):
    """(reader, lengths [users] int32) of one shard, its header checked against the manifest.

    path: where the shard's file is, when not in the prepared directory (a `stage`d copy).
    Raises ShardError when the file is missing, empty, or from another preparation."""
    from array_record.python.array_record_module import ArrayRecordReader

    path = manifest.shard_path(shard) if path is None else as_path(path, "prepared_stage_dir")
    if str(path).startswith("gs://"):
        raise ShardError(f"prepared shard {str(path)!r} is a gs:// object, but ArrayRecord reads local files "
                         "only: stage it first (shards.stage, which GrainData does for a gs:// "
                         "prepared_data_path)")
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
    """[vocab_size] int64 popularity.npy, counted for ``num_labels`` (else ShardError).

    On a local disk the file is memory-mapped: a reader of some rows (a counts proposal's rows of
    this host's chips, the chunked popularity top-K) pages in just those, 8 bytes an item. From
    Cloud Storage it is read whole (8 GB at 10^9 items); copy it beside the run to avoid that."""
    check_num_labels(manifest, num_labels)
    path = as_path(manifest.path, "prepared_data_path") / "popularity.npy"
    if not str(path).startswith("gs://"):
        return np.load(os.fspath(path), mmap_mode="r", allow_pickle=False)
    with path.open("rb") as f:
        return np.load(f)
