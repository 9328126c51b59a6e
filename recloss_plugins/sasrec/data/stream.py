"""Interaction logs read in pieces: Parquet row groups and CSV/TSV blocks, never a whole file at once.

`iter_chunks` yields one dict of numpy columns (user, item, timestamp) per piece, with the Yambda
filters (event type, organic, played ratio) applied piece by piece, so the preparing process holds
one piece (``chunk_rows`` rows for Parquet, ``block_bytes`` of text for CSV) at a time.
"""

from __future__ import annotations

import os
from typing import Dict, Iterator, Sequence

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recloss_plugins.sasrec.data.errors import DataError
from recloss_plugins.sasrec.data.tables import _arrow_to_numpy, _missing, data_files, format_of

OPTIONAL = ("event_type", "is_organic", "played_ratio_pct")


def _batches(path, fmt: str, want: Dict[str, str], optional: Sequence[str], chunk_rows: int,
             block_bytes: int) -> Iterator[pa.RecordBatch]:
    fs, inner = fsspec.core.url_to_fs(os.fspath(path))
    if fmt == "parquet":
        try:
            pf = pq.ParquetFile(fs.open(inner, "rb"))
        except Exception as err:  # pyarrow raises several types for corrupt files
            raise DataError(f"{str(path)!r} is not a readable Parquet file: {err}") from err
        names = list(pf.schema_arrow.names)
        for key, col in want.items():
            if col not in names:
                raise _missing(col, names, path, key)
        cols = list(dict.fromkeys(list(want.values()) + [c for c in optional if c in names]))
        yield from pf.iter_batches(batch_size=chunk_rows, columns=cols)
        return
    delimiter = "\t" if fmt == "tsv" else ","
    try:
        reader = pacsv.open_csv(fs.open(inner, "rb"), read_options=pacsv.ReadOptions(block_size=block_bytes),
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


def iter_chunks(cfg, *, chunk_rows: int = 1 << 20, block_bytes: int = 64 << 20
                ) -> Iterator[Dict[str, np.ndarray]]:
    """{'user', 'item', 'time'}: [rows] numpy columns of each piece of the config's log, filtered.

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
            t = _arrow_to_numpy(pa.Table.from_batches([batch]), f, set(want.values()))
            keep = np.ones(batch.num_rows, bool)
            if yambda:
                keep = _yambda_keep(t, cfg, f)
            yield {"user": t[cfg.user_column][keep], "item": t[cfg.item_column][keep],
                   "time": t[cfg.timestamp_column][keep]}


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
