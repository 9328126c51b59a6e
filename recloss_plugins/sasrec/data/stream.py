"""Interaction logs read in pieces: Parquet row groups and CSV/TSV blocks, never a whole file at once.

`iter_chunks` yields one dict of numpy columns (user, item, timestamp) per piece, with the Yambda
filters (event type, organic, played ratio) applied piece by piece, so the preparing process holds
one piece (``chunk_rows`` rows for Parquet, ``block_bytes`` of text for CSV) at a time.

String user ids never become Python objects: `string_keys` turns the Arrow column into a 128-bit
key per row with numpy alone (two multiply-xorshift chains over the UTF-8 bytes), and the preparation groups
and orders users by that key. A user id is only ever compared for equality, so the key loses
nothing unless two distinct ids collide: about n^2 / 2^129 for n distinct ids (1e-20 at 1e9).
"""

from __future__ import annotations

import os
from typing import Dict, Iterator, Sequence

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from recloss_plugins.sasrec.data.errors import DataError
from recloss_plugins.sasrec.data.tables import _arrow_to_numpy, _missing, data_files, format_of, open_parquet

OPTIONAL = ("event_type", "is_organic", "played_ratio_pct")


def _batches(path, fmt: str, want: Dict[str, str], optional: Sequence[str], chunk_rows: int,
             block_bytes: int) -> Iterator[pa.RecordBatch]:
    fs, inner = fsspec.core.url_to_fs(os.fspath(path))
    with fs.open(inner, "rb") as handle:     # closed at the end: no gcsfs task left pending at exit
        if fmt == "parquet":
            pf, cols = open_parquet(handle, path, want, optional)
            yield from pf.iter_batches(batch_size=chunk_rows, columns=cols)
            return
        delimiter = "\t" if fmt == "tsv" else ","
        try:
            reader = pacsv.open_csv(handle, read_options=pacsv.ReadOptions(block_size=block_bytes),
                                    parse_options=pacsv.ParseOptions(delimiter=delimiter))
        except Exception as err:
            raise DataError(f"{str(path)!r} is not a readable {fmt.upper()} file: {err}") from err
        names = reader.schema.names
        for key, col in want.items():
            if col not in names:
                raise _missing(col, names, path, key)
        cols = list(dict.fromkeys(list(want.values()) + [c for c in optional if c in names]))
        for batch in reader:
            yield batch.select(cols)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64: a bijection that mixes every input bit into
    every output bit."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


# The low `8 * r` bits of a little-endian word: the first r bytes of a value's last, partial word.
_KEEP = np.array([(1 << (8 * r)) - 1 for r in range(8)] + [(1 << 64) - 1], np.uint64)
# Per half: a seed (digits of pi), an odd multiplier (xxHash's and rrmxmx's) and a shift, all
# different, so a pair of values whose word differences cancel one chain's state does not cancel both.
_HALVES = ((np.uint64(0x243F6A8885A308D3), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(29)),
           (np.uint64(0x13198A2E03707344), np.uint64(0x9FB21C651E98DF25), np.uint64(32)))
_BLOCK = 1 << 16      # rows hashed at a time: the temporaries stay in cache (~1.5x faster than 1 M)


def string_keys(arr: pa.Array) -> np.ndarray:
    """[rows, 2] uint64: a 128-bit key of each string (or binary) value of ``arr``, vectorised.

    Each half h chains its value's bytes 8 at a time as little-endian words w_0, w_1, ... (the last
    zero-padded): k = (len + seed_h)·M_h; per word k = (k XOR w_c)·M_h, k ^= k >> s_h (each step a
    bijection of k); then key_h = splitmix64(k), so every bit of every byte reaches every key bit.
    Equal values get equal keys in every run, process and numpy version (integer arithmetic alone);
    the work is a handful of numpy passes per 8 bytes of the longest value, no per-row Python."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        return string_keys(arr.dictionary)[np.asarray(arr.indices.fill_null(0))]
    if not pa.types.is_large_binary(arr.type):
        arr = arr.cast(pa.large_binary())
    n = len(arr)
    _, off_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(off_buf, np.int64)[arr.offset:arr.offset + n + 1] if n else np.zeros(1, np.int64)
    data = np.frombuffer(data_buf, np.uint8)[offsets[0]:offsets[-1]] if data_buf is not None else \
        np.zeros(0, np.uint8)
    # The bytes as aligned little-endian words; the word at byte offset o is A[q] >> 8r | A[q+1] << 64-8r
    # (q, r = divmod(o, 8)): two gathers and shifts per row and word, no per-byte work.
    A = np.concatenate([data, np.zeros(16 + (-data.size) % 8, np.uint8)]).view(np.uint64)
    out = np.empty((n, 2), np.uint64)
    for lo in range(0, n, _BLOCK):
        off = offsets[lo:lo + _BLOCK + 1]
        lens, starts = np.diff(off), off[:-1] - offsets[0]
        q0, r = starts >> 3, ((starts & 7) << 3).astype(np.uint64)
        halves = [(lens.astype(np.uint64) + seed) * mul for seed, mul, _ in _HALVES]
        for c in range(-(-int(lens.max(initial=0)) // 8)):
            left = lens - 8 * c
            q = np.minimum(q0 + c, A.size - 2)      # values already done read in bounds; `where` drops it
            # (x << 1) << (63 - r) is x << (64 - r) for r > 0 and 0 for r = 0, without a shift by 64.
            word = (A[q] >> r) | ((A[q + 1] << np.uint64(1)) << (np.uint64(63) - r))
            word &= _KEEP[np.clip(left, 0, 8)]
            more = left > 0
            every = more.all()
            for h, (_, mul, shift) in enumerate(_HALVES):
                k = (halves[h] ^ word) * mul
                k ^= k >> shift
                halves[h] = k if every else np.where(more, k, halves[h])
        halves = [_splitmix64(k) for k in halves]
        out[lo:lo + _BLOCK, 0], out[lo:lo + _BLOCK, 1] = halves
    return out


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or \
        pa.types.is_large_binary(t) or str(t) in ("string_view", "binary_view")


def iter_chunks(cfg, *, chunk_rows: int = 1 << 20, block_bytes: int = 64 << 20
                ) -> Iterator[Dict[str, np.ndarray]]:
    """{'user', 'item', 'time'}: the numpy columns of each piece of the config's log, filtered.

    'item' and 'time' are [rows]; 'user' is [rows] for numeric user ids and [rows, 2] uint64
    `string_keys` for string ones.

    cfg: a recloss-train config with dataset_type interactions or yambda (its dataset_path,
    file_format, *_column keys and, for yambda, the yambda_* filters)."""
    if cfg.dataset_type not in ("interactions", "yambda"):
        raise DataError(f"dataset_type {cfg.dataset_type!r} has no log file to read; "
                        "use interactions or yambda")
    want = {"user_column": cfg.user_column, "item_column": cfg.item_column,
            "timestamp_column": cfg.timestamp_column}
    yambda = cfg.dataset_type == "yambda"
    optional = OPTIONAL if yambda else ()
    for f in data_files(os.fspath(cfg.dataset_path), cfg.file_format):
        fmt = format_of(f, cfg.file_format)
        for batch in _batches(f, fmt, want, optional, chunk_rows, block_bytes):
            table = pa.Table.from_batches([batch])
            user = table.column(cfg.user_column)
            keys = None
            if _is_text(user.type):
                if user.null_count:
                    raise DataError(f"column {cfg.user_column!r} of {str(f)!r} has {user.null_count} null values")
                keys = string_keys(user)
                table = table.drop_columns([cfg.user_column])
            t = _arrow_to_numpy(table, f, set(want.values()))
            if keys is not None:
                t[cfg.user_column] = keys
            out = {"user": t[cfg.user_column], "item": t[cfg.item_column], "time": t[cfg.timestamp_column]}
            if yambda:
                keep = _yambda_keep(t, cfg, f)
                out = {k: v[keep] for k, v in out.items()}
            yield out


def _yambda_keep(t, cfg, path) -> np.ndarray:
    n = next(iter(t.values())).shape[0]
    keep = np.ones(n, bool)
    if cfg.yambda_event_types:
        if "event_type" not in t:
            raise DataError(f"yambda_event_types={list(cfg.yambda_event_types)} but {str(path)!r} has no "
                            "'event_type' column (only multi_event files have one)")
        keep &= np.isin(np.asarray(t["event_type"]).astype(str), list(cfg.yambda_event_types))
    if cfg.yambda_organic_only:
        if "is_organic" not in t:
            raise DataError(f"yambda_organic_only is true but {str(path)!r} has no 'is_organic' column")
        keep &= np.asarray(t["is_organic"]).astype(np.float64) == 1
    if cfg.yambda_min_played_ratio_pct > 0:
        if "played_ratio_pct" not in t:
            raise DataError(f"yambda_min_played_ratio_pct={cfg.yambda_min_played_ratio_pct} but "
                            f"{str(path)!r} has no 'played_ratio_pct' column")
        ratio = np.asarray(t["played_ratio_pct"], dtype=np.float64)  # nulls -> nan: kept
        keep &= ~(ratio < cfg.yambda_min_played_ratio_pct)
    return keep
