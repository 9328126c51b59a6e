"""Interaction logs (CSV/TSV/Parquet, or Yambda's flat Parquet layout) -> Sequences."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from recloss_plugins.sasrec.data.errors import DataError
from recloss_plugins.sasrec.data.sequences import Sequences
from recloss_plugins.sasrec.data.tables import data_files, format_of, read_columns


def log_to_sequences(users: np.ndarray, items: np.ndarray, times: np.ndarray, min_len: int) -> Sequences:
    """Group by user, order by time (stable: file order breaks ties), remap items to 1..K.

    users, items, times: [rows] raw column values of one log. Users with fewer
    than ``min_len`` events are dropped (0 keeps all), and so are items seen
    only in those users."""
    if users.size == 0:
        raise DataError("the interaction log has no rows")
    try:
        order = np.lexsort((times, users))
    except TypeError as err:
        raise DataError(f"user or timestamp column has mixed value types: {err}") from err
    users, items = users[order], items[order]
    raw_items, dense = np.unique(items, return_inverse=True)
    dense = (dense.reshape(-1) + 1).astype(np.int32)
    bounds = np.flatnonzero(users[1:] != users[:-1]) + 1
    offsets = np.concatenate([[0], bounds, [users.size]]).astype(np.int64)
    seqs = Sequences(dense, offsets, int(raw_items.size), np.concatenate([[raw_items[0]], raw_items]))
    if min_len > 0:
        keep = seqs.lengths >= min_len
        if not keep.any():
            raise DataError(f"no user has >= {min_len} interactions (min_user_interactions)")
        kept = [seqs.user(u) for u in np.flatnonzero(keep)]
        # Re-densify so items only seen in dropped users leave the vocabulary.
        flat = np.concatenate(kept)
        used, remap = np.unique(flat, return_inverse=True)
        offs = np.zeros(len(kept) + 1, np.int64)
        offs[1:] = np.cumsum([k.size for k in kept])
        raw = seqs.item_raw_ids[used]
        seqs = Sequences((remap.reshape(-1) + 1).astype(np.int32), offs, int(used.size),
                         np.concatenate([[raw[0]], raw]))
    return seqs


def load_interactions(path: str, *, file_format: str = "auto", user_column: str = "uid",
                      item_column: str = "item_id", timestamp_column: str = "timestamp",
                      min_user_interactions: int = 0) -> Sequences:
    """A CSV/TSV (header row) or Parquet log, or a directory of such files, into Sequences."""
    cols = {"user_column": user_column, "item_column": item_column, "timestamp_column": timestamp_column}
    parts = [read_columns(f, format_of(f, file_format), cols) for f in data_files(path, file_format)]
    cat = {c: np.concatenate([p[c] for p in parts]) for c in cols.values()}
    return log_to_sequences(cat[user_column], cat[item_column], cat[timestamp_column], min_user_interactions)


def load_yambda(path: str, *, file_format: str = "auto", user_column: str = "uid",
                item_column: str = "item_id", timestamp_column: str = "timestamp",
                event_types: Sequence[str] = (), organic_only: bool = False,
                min_played_ratio_pct: float = 0.0, min_user_interactions: int = 31) -> Sequences:
    """Yambda's flat Parquet layout (one row per event: uid, item_id, timestamp, and
    optionally event_type, is_organic, played_ratio_pct), filtered, into Sequences.

    Filters: event_type in ``event_types`` (if given), is_organic == 1 (if
    ``organic_only``), played_ratio_pct >= ``min_played_ratio_pct`` (null values,
    e.g. likes, are kept), then users with >= ``min_user_interactions`` events
    (the paper keeps users with > 30)."""
    cols = {"user_column": user_column, "item_column": item_column, "timestamp_column": timestamp_column}
    optional = ("event_type", "is_organic", "played_ratio_pct")
    users, items, times = [], [], []
    for f in data_files(path, file_format):
        t = read_columns(f, format_of(f, file_format), cols, optional)
        keep = np.ones(t[user_column].shape[0], bool)
        if event_types:
            if "event_type" not in t:
                raise DataError(f"yambda_event_types={list(event_types)} but {str(f)!r} has no "
                                "'event_type' column (only multi_event files have one)")
            keep &= np.isin(np.asarray(t["event_type"]).astype(str), list(event_types))
        if organic_only:
            if "is_organic" not in t:
                raise DataError(f"yambda_organic_only is true but {str(f)!r} has no 'is_organic' column")
            keep &= np.asarray(t["is_organic"]).astype(np.float64) == 1
        if min_played_ratio_pct > 0:
            if "played_ratio_pct" not in t:
                raise DataError(f"yambda_min_played_ratio_pct={min_played_ratio_pct} but {str(f)!r} has "
                                "no 'played_ratio_pct' column")
            ratio = np.asarray(t["played_ratio_pct"], dtype=np.float64)  # nulls -> nan: kept
            keep &= ~(ratio < min_played_ratio_pct)
        users.append(t[user_column][keep])
        items.append(t[item_column][keep])
        times.append(t[timestamp_column][keep])
    users, items, times = (np.concatenate(x) for x in (users, items, times))
    if users.size == 0:
        raise DataError(f"no Yambda events left in {path!r} after the event filters")
    return log_to_sequences(users, items, times, min_user_interactions)
