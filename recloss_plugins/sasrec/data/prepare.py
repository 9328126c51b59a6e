"""recloss-prepare-data: an interaction log -> per-user sequence shards the Grain pipeline reads.

    recloss-prepare-data configs/base.yml dataset_type=interactions dataset_path=log.parquet \\
        prepared_data_path=/data/log.prepared prepare_num_shards=16

Three passes, none holding the whole log:

1. stream the log in pieces (`stream.iter_chunks`: Parquet row groups, CSV blocks, the Yambda
   filters applied) and append each event to one of ``prepare_num_buckets`` temporary bucket
   files chosen by a hash of its user (all of a user's events land in one bucket);
2. per bucket: order by (user, time), stable (file order breaks ties, as `readers.log_to_sequences`),
   drop users with fewer than ``min_user_interactions`` events, keep the rest with raw item ids;
   the kept items' union is the vocabulary, remapped to 1..K in raw-id order (0 = padding);
3. write the users, in (bucket, user id or string id's key) order, into ``prepare_num_shards`` ArrayRecord shards of
   nearly equal user counts, with the train-region popularity and the manifest (`shards`).

The sequences are exactly those `readers.load_interactions` / `load_yambda` build in memory (same
filters, same dense ids); only the user order differs. Peak memory is one bucket (≈ 1/buckets of
the log) plus the vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from typing import Callable, List, Optional

import numpy as np

from recloss_plugins.sasrec.data.errors import DataError
from recloss_plugins.sasrec.data.shards import (FORMAT, MANIFEST, VOCAB, WRITER_OPTIONS, ShardError, file_sha256,
                                                shard_name, write_vocab)
from recloss_plugins.sasrec.data.storage import as_path, make_dir
from recloss_plugins.sasrec.data.stream import iter_chunks

USAGE = """usage: recloss-prepare-data [CONFIG.yml] [key=value ...]

Turns the interaction log of the config (dataset_type interactions or yambda, dataset_path,
the column and filter keys) into prepare_num_shards per-user sequence shards under
prepared_data_path, which recloss-train (data_pipeline: grain) then reads, each process its share.
"""


def _bucket_of(users: np.ndarray, num_buckets: int) -> np.ndarray:
    """A stable hash of each user id -> [0, num_buckets) (the same in every run and process).

    users: [rows] numeric ids, or [rows, 2] uint64 `stream.string_keys` (already uniform bits)."""
    if users.ndim == 2:
        return (users[:, 0] % np.uint64(num_buckets)).astype(np.int64)
    if users.dtype.kind == "f":
        users = (users.astype(np.float64) + 0.0).view(np.uint64)   # + 0.0: -0.0 and 0.0 are one user
    if users.dtype.kind in "iu":
        h = users.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        return ((h >> np.uint64(33)) % np.uint64(num_buckets)).astype(np.int64)
    return np.fromiter((zlib.crc32(str(u).encode()) % num_buckets for u in users), np.int64, users.size)


def _user_runs(users: np.ndarray, times: np.ndarray):
    """(order, offsets): the stable (user, time) order of a bucket's events and the [users + 1]
    offsets of each user's run in it. users: [rows] ids or [rows, 2] keys."""
    def runs(keys, u):
        try:
            order = np.lexsort(keys)
        except TypeError as err:
            raise DataError(f"user or timestamp column has mixed value types: {err}") from err
        u = u[order]
        return order, u, np.flatnonzero(u[1:] != u[:-1]) + 1

    if users.ndim == 1:
        order, _, bounds = runs((times, users), users)
    else:
        # Order by the first half alone; the second only tells apart ids whose first halves collide
        # (2^-64 a pair), which then take the full three-key sort.
        order, _, bounds = runs((times, users[:, 0]), users[:, 0])
        second = users[order, 1]
        if np.delete(second[1:] != second[:-1], bounds - 1).any():
            order, u, _ = runs((times, users[:, 1], users[:, 0]), users)
            bounds = np.flatnonzero((u[1:] != u[:-1]).any(axis=1)) + 1
    return order, np.concatenate([[0], bounds, [users.shape[0]]]).astype(np.int64)


def _append(f, arrays):
    for a in arrays:
        np.save(f, np.ascontiguousarray(a), allow_pickle=False)


def _read_all(path, n_per_chunk: int) -> List[np.ndarray]:
    """The chunks `_append` wrote to ``path``, concatenated per column."""
    cols = [[] for _ in range(n_per_chunk)]
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        while f.tell() < size:
            for c in cols:
                c.append(np.load(f, allow_pickle=False))
    return [np.concatenate(c) if c else np.zeros(0) for c in cols]


def _hash_vocab(raw: np.ndarray, source: dict) -> str:
    h = hashlib.sha256(json.dumps(source, sort_keys=True).encode())
    h.update(str(raw.dtype).encode())
    h.update(raw.astype(str).tobytes() if raw.dtype.kind in "OUS" else raw.tobytes())
    return h.hexdigest()[:16]


def prepare(cfg, *, log: Callable = print, progress_stream=None, work_dir: Optional[str] = None,
            output=None) -> dict:
    """Prepares the config's log under ``cfg.prepared_data_path`` (or ``output``, recloss-train's
    cache folder); returns the manifest dict (plus 'seconds' and 'bytes'). See the module
    docstring for the passes and the layout."""
    if output is None and not cfg.prepared_data_path:
        raise DataError("config key 'prepared_data_path' is empty: set the directory the shards go to")
    S, K, min_len, L = cfg.prepare_num_shards, cfg.prepare_num_buckets, cfg.min_user_interactions, cfg.num_labels
    t0 = time.perf_counter()
    out = as_path(cfg.prepared_data_path if output is None else output, "prepared_data_path")
    tmp = tempfile.mkdtemp(prefix="recloss-prepare-", dir=work_dir)
    try:
        rows = _bucket_events(cfg, tmp, K, progress_stream)
        log(f"prepare: read {rows:,} events into {K} user buckets ({time.perf_counter() - t0:.1f}s)")
        counts, vocab = _keep_users(tmp, K, min_len, progress_stream)
        U = sum(counts)
        if U < S:
            raise ShardError(f"only {U} users are left, fewer than prepare_num_shards={S}: every shard needs "
                             "at least one user; lower prepare_num_shards")
        source = _source(cfg)
        vocab_hash = _hash_vocab(vocab, source)
        log(f"prepare: {U:,} users kept, {vocab.size:,} items ({time.perf_counter() - t0:.1f}s)")
        make_dir(out, "prepared_data_path")
        shard_info, lengths, pop = _write_shards(out, tmp, K, S, L, U, vocab, vocab_hash, progress_stream)
        write_vocab(out / VOCAB, np.concatenate([vocab[:1], vocab]))     # no pickle: read_vocab
        with (out / "popularity.npy").open("wb") as f:
            np.save(f, pop)
        manifest = {"format": FORMAT, "vocab_hash": vocab_hash, "num_users": int(U),
                    "num_items": int(vocab.size), "num_interactions": int(lengths.sum()),
                    "num_labels": int(L), "shards": shard_info, "source": source}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - t0
    total = sum(s["bytes"] for s in shard_info)
    log(f"prepared {out}: {U:,} users, {vocab.size:,} items, {manifest['num_interactions']:,} interactions "
        f"(of {rows:,} events read), {S} shards, {total / 2**20:.1f} MiB, {seconds:.1f}s")
    return {**manifest, "seconds": seconds, "bytes": total, "events_read": rows}


def _bucket_events(cfg, tmp: str, K: int, progress_stream) -> int:
    """Pass 1: streams the log and appends each event to the bucket file of its user; returns the
    number of events read (DataError when there are none)."""
    from recloss_plugins.sasrec.logging_utils import Progress

    files = [open(os.path.join(tmp, f"bucket{k:05d}.npy"), "wb") for k in range(K)]
    rows = 0
    progress = Progress(0, 0, progress_stream)
    try:
        for chunk in iter_chunks(cfg):
            n = chunk["user"].shape[0]
            if n == 0:
                continue
            b = _bucket_of(chunk["user"], K)
            order = np.argsort(b, kind="stable")
            cuts = np.searchsorted(b[order], np.arange(K + 1))
            for k in range(K):
                sel = order[cuts[k]:cuts[k + 1]]
                if sel.size:
                    # take(axis=0), not [sel]: numpy's fancy index of [rows, 2] keys is ~4x slower.
                    _append(files[k], [np.take(chunk[c], sel, axis=0) for c in ("user", "item", "time")])
            rows += n
            progress.extra = f" {rows:,} events read"
            progress.update(0, force=True)
    finally:
        for f in files:
            f.close()
        progress.clear()
    if rows == 0:
        raise DataError(f"the interaction log {cfg.dataset_path!r} has no rows (after the filters)")
    return rows


def _keep_users(tmp: str, K: int, min_len: int, progress_stream):
    """Pass 2: per bucket, the users in (user, time) order with at least ``min_len`` events, their raw
    items kept (file kept<k>.npy: items, lengths); returns (users kept per bucket, the sorted raw
    vocabulary of their items). DataError when no user is kept."""
    from recloss_plugins.sasrec.logging_utils import Progress

    counts, vocab_parts = [], []
    progress = Progress(K, 0, progress_stream)
    for k in range(K):
        path = os.path.join(tmp, f"bucket{k:05d}.npy")
        users, items, times = _read_all(path, 3) if os.path.getsize(path) else ([np.zeros(0)] * 3)
        os.remove(path)
        if users.size:
            order, offsets = _user_runs(users, times)
            items = items[order]
            lengths = np.diff(offsets)
            keep = lengths >= max(min_len, 1)
            mask = np.repeat(keep, lengths)
            items = items[mask]
            lengths = lengths[keep]
            vocab_parts.append(np.unique(items))
        else:
            items, lengths = np.zeros(0, np.int64), np.zeros(0, np.int64)
        with open(os.path.join(tmp, f"kept{k:05d}.npy"), "wb") as f:
            _append(f, (items, lengths))
        counts.append(int(lengths.size))
        progress.update(k + 1)
    progress.clear()
    if sum(counts) == 0:
        raise DataError(f"no user has >= {min_len} interactions (min_user_interactions)")
    return counts, np.unique(np.concatenate(vocab_parts))


def _source(cfg) -> dict:
    """The config keys the preparation read (the vocabulary's hash covers them)."""
    source = {"dataset_type": cfg.dataset_type, "dataset_path": str(cfg.dataset_path),
              "min_user_interactions": cfg.min_user_interactions, "user_column": cfg.user_column,
              "item_column": cfg.item_column, "timestamp_column": cfg.timestamp_column}
    if cfg.dataset_type == "yambda":
        source.update(yambda_event_types=list(cfg.yambda_event_types),
                      yambda_organic_only=bool(cfg.yambda_organic_only),
                      yambda_min_played_ratio_pct=float(cfg.yambda_min_played_ratio_pct))
    return source


def _write_shards(out, tmp: str, K: int, S: int, L: int, U: int, vocab, vocab_hash: str, progress_stream):
    """Pass 3: the ``U`` kept users, in (bucket, user) order, as ``S`` ArrayRecord shards of nearly
    equal user counts under ``out``, their items remapped to 1..|vocab|. Returns (the shards' manifest
    entries, every user's length [U] int32, the train-region popularity [|vocab| + 1])."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from recloss_plugins.sasrec.logging_utils import Progress

    bounds = np.linspace(0, U, S + 1).round().astype(np.int64)
    all_lengths = []
    for k in range(K):
        with open(os.path.join(tmp, f"kept{k:05d}.npy"), "rb") as f:
            np.load(f)
            all_lengths.append(np.load(f))
    all_lengths = np.concatenate(all_lengths).astype(np.int32)
    pop = np.zeros(vocab.size + 1, np.int64)
    shard_info, writer, shard, g = [], None, -1, 0
    local_tmp = os.path.join(tmp, "shard.arrayrecord")
    progress = Progress(S, 0, progress_stream)

    def finish():
        writer.close()
        digest = file_sha256(local_tmp)
        name = shard_name(shard, S)
        dest = out / name
        if str(dest).startswith("gs://"):
            dest.write_bytes(open(local_tmp, "rb").read())
        else:
            shutil.move(local_tmp, os.fspath(dest))
        lo, hi = bounds[shard], bounds[shard + 1]
        shard_info.append({"name": name, "num_users": int(hi - lo),
                           "num_interactions": int(all_lengths[lo:hi].sum()),
                           "bytes": int(dest.stat().length), "sha256": digest})
        progress.update(shard + 1)

    for k in range(K):
        with open(os.path.join(tmp, f"kept{k:05d}.npy"), "rb") as f:
            items, lengths = np.load(f), np.load(f)
        dense = (np.searchsorted(vocab, items) + 1).astype(np.int32)
        offs = np.concatenate([[0], np.cumsum(lengths)])
        for u in range(lengths.size):
            while g >= bounds[shard + 1] or shard < 0:
                if writer is not None:
                    finish()
                shard += 1
                writer = ArrayRecordWriter(local_tmp, WRITER_OPTIONS)
                lo, hi = bounds[shard], bounds[shard + 1]
                writer.write(json.dumps({"format": FORMAT, "vocab_hash": vocab_hash, "shard": shard,
                                         "num_shards": S, "num_users": int(hi - lo)}).encode())
                writer.write(all_lengths[lo:hi].tobytes())
            writer.write(dense[offs[u]:offs[u + 1]].tobytes())
            g += 1
        # Train region (train input + its targets): the first n - 2L - 2 items, as splits.popularity.
        pos = np.arange(dense.size) - np.repeat(offs[:-1], lengths)
        region = pos < np.repeat(np.maximum(lengths - (2 * L + 2), 0), lengths)
        pop += np.bincount(dense[region], minlength=pop.size)
    finish()
    progress.clear()
    pop[0] = 0
    return shard_info, all_lengths, pop


def main(argv=None) -> int:
    from recloss_plugins.config import ConfigError, command_config

    cfg, code = command_config("recloss-prepare-data", USAGE, sys.argv[1:] if argv is None else argv)
    if cfg is None:
        return code
    try:
        prepare(cfg, log=lambda *a: print(*a, flush=True))
    except ConfigError as err:     # a storage error (gs://) is one
        print(f"recloss-prepare-data: config error: {err}", file=sys.stderr)
        return 2
    except DataError as err:
        print(f"recloss-prepare-data: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
