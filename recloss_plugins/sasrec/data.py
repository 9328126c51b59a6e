"""Interaction logs -> per-user item sequences -> the paper's train/dev/test splits -> batches.

Sequences are held as one flat int32 array of dense item ids (1..#items; 0 is
padding) with CSR offsets, each user's items in time order.

Splits (CutBCE paper, Section III-E, for L labels; L = 8 gives 8, 17, 26):
for a user with n items s[0..n-1],

    test:   input s[0 : n-L],         targets s[n-L : n]
    dev:    input s[0 : n-2L-1],      targets the next L items s[n-2L-1 : n-L-1]
    train:  input s[0 : n-3L-2],      position j predicts s[j+1 : j+1+L]

Inputs keep their most recent ``max_seq_len`` items and are padded on the
right with 0. A user enters a split only when its input is non-empty (n >= 3L+3
for train). Train targets never reach a dev or test target: the last train
position's targets end at s[n-2L-3], the dev input's second-to-last item.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

PAD = 0


class DataError(ValueError):
    """A data file is missing, unreadable, or lacks what the config asks for."""


@dataclasses.dataclass(frozen=True)
class Sequences:
    """Users' item sequences in CSR form.

    items: [total] int32 dense ids in 1..num_items (time order within a user).
    offsets: [U + 1] int64; user u's items are items[offsets[u]:offsets[u+1]].
    num_items: number of distinct items; the vocabulary is num_items + 1 (id 0 = padding).
    item_raw_ids: [num_items + 1] original ids (entry 0 unused) or None.
    """

    items: np.ndarray
    offsets: np.ndarray
    num_items: int
    item_raw_ids: Optional[np.ndarray] = None

    def __post_init__(self):
        if self.items.ndim != 1 or self.offsets.ndim != 1 or self.offsets[0] != 0 \
                or self.offsets[-1] != self.items.shape[0] or np.any(np.diff(self.offsets) < 0):
            raise ValueError("Sequences needs 1-D items and non-decreasing offsets from 0 to len(items)")
        if self.items.size and (self.items.min() < 1 or self.items.max() > self.num_items):
            raise ValueError(f"Sequences.items must lie in [1, {self.num_items}], got "
                             f"[{self.items.min()}, {self.items.max()}]")

    @property
    def num_users(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def vocab_size(self) -> int:
        return self.num_items + 1

    def user(self, u: int) -> np.ndarray:
        return self.items[self.offsets[u]:self.offsets[u + 1]]

    @classmethod
    def from_lists(cls, seqs: Sequence[Sequence[int]], num_items: Optional[int] = None) -> "Sequences":
        arrays = [np.asarray(s, dtype=np.int32).reshape(-1) for s in seqs]
        offsets = np.zeros(len(arrays) + 1, np.int64)
        offsets[1:] = np.cumsum([a.size for a in arrays])
        items = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
        return cls(items, offsets, int(num_items if num_items is not None else (items.max() if items.size else 0)))

    def filter_min_length(self, min_len: int) -> "Sequences":
        keep = np.flatnonzero(self.lengths >= min_len)
        return Sequences.from_lists([self.user(u) for u in keep], self.num_items)._with(self.item_raw_ids)

    def _with(self, raw):
        return dataclasses.replace(self, item_raw_ids=raw)


# ----------------------------------------------------------------------------- splits
def split_cuts(n: np.ndarray, num_labels: int) -> Dict[str, np.ndarray]:
    """Input lengths (items before the cut) of each split for sequences of length n."""
    L = num_labels
    return {"test": n - L, "dev": n - (2 * L + 1), "train": n - (3 * L + 2)}


@dataclasses.dataclass(frozen=True)
class EvalSplit:
    """inputs [U, N] int32 (right-padded), lengths [U] int32 (>= 1), targets [U, L] int32, users [U]."""
    inputs: np.ndarray
    lengths: np.ndarray
    targets: np.ndarray
    users: np.ndarray

    @property
    def num_users(self) -> int:
        return self.inputs.shape[0]


@dataclasses.dataclass(frozen=True)
class TrainSplit:
    """inputs [U, N] int32 (right-padded), targets [U, N, L] int32 (0 = no target), users [U].

    Position weights are ``inputs != 0``."""
    inputs: np.ndarray
    targets: np.ndarray
    users: np.ndarray

    @property
    def num_users(self) -> int:
        return self.inputs.shape[0]


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
    counts[PAD] = 0
    return counts


# ----------------------------------------------------------------------------- batches
class TrainBatches:
    """Deterministic, resumable stream of training batches.

    Example ``g`` of the stream (g = 0, 1, ...) is user ``perm_e[g mod U]`` of
    epoch ``e = g // U``, where ``perm_e`` is a permutation seeded by (seed, e).
    The batch at stream position ``p`` holds examples p..p+B-1, so the data
    position (examples consumed) is all a checkpoint needs to resume exactly.
    """

    def __init__(self, split: TrainSplit, batch_size: int, seed: int):
        if split.num_users == 0:
            raise DataError("the train split is empty: no user has enough interactions "
                            "(each needs at least 3*num_labels+3)")
        self.split, self.batch_size, self.seed = split, int(batch_size), int(seed)
        self._perms: Dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng([self.seed, epoch, 0x5A5])
            self._perms[epoch] = rng.permutation(self.split.num_users)
        return self._perms[epoch]

    def indices(self, position: int) -> np.ndarray:
        """[B] split rows of the batch starting at stream position ``position``."""
        g = position + np.arange(self.batch_size, dtype=np.int64)
        U = self.split.num_users
        epochs, slots = g // U, g % U
        out = np.empty(self.batch_size, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[slots[sel]]
        return out

    def batch(self, position: int) -> Dict[str, np.ndarray]:
        """{'inputs' [B, N] int32, 'targets' [B, N, L] int32, 'weights' [B, N] float32}."""
        rows = self.indices(position)
        inputs = self.split.inputs[rows]
        return {"inputs": inputs, "targets": self.split.targets[rows],
                "weights": (inputs != PAD).astype(np.float32)}


# ----------------------------------------------------------------------------- synthetic
def synthetic(*, num_users: int, num_items: int, min_len: int, max_len: int, num_intents: int,
              intents_per_user: int, zipf_exponent: float, follow_prob: float, switch_prob: float,
              seed: int) -> Sequences:
    """Multi-intent sessions with power-law popularity and sequential structure.

    Items are split into ``num_intents`` clusters; within a cluster item
    popularity follows rank^-zipf_exponent, and cluster popularity
    rank^-zipf_exponent/2. Each item has a fixed successor in its cluster.
    A user mixes ``intents_per_user`` clusters; at each step it switches to
    another of its clusters with ``switch_prob`` (drawing a popular item
    there), else follows the current item's successor with ``follow_prob``,
    else draws a popular item of the current cluster. Lengths are uniform in
    [min_len, max_len]. Everything is a function of ``seed``.
    """
    if num_intents > num_items:
        raise ValueError(f"synthetic_num_intents={num_intents} exceeds synthetic_num_items={num_items}")
    rng = np.random.default_rng([seed, 0x51])
    ids = rng.permutation(num_items).astype(np.int32) + 1
    groups = np.array_split(ids, num_intents)
    width = max(g.size for g in groups)
    members = np.zeros((num_intents, width), np.int32)
    cdf = np.ones((num_intents, width))
    for k, g in enumerate(groups):
        w = (np.arange(1, g.size + 1, dtype=np.float64)) ** -zipf_exponent
        members[k, :g.size] = g
        cdf[k, :g.size] = np.cumsum(w) / w.sum()
        cdf[k, g.size - 1:] = 1.0
    # Row k of the flat CDF spans (k, k+1], so one searchsorted draws from any mix of clusters.
    flat_cdf = (cdf + np.arange(num_intents)[:, None]).ravel()

    def popular(k):
        idx = np.searchsorted(flat_cdf, k + rng.random(k.size), side="right")
        return members.ravel()[np.minimum(idx, k * width + width - 1)]

    intent_of = np.zeros(num_items + 1, np.int64)
    for k, g in enumerate(groups):
        intent_of[g] = k
    sizes = np.array([g.size for g in groups])
    # Successor: a popularity-weighted draw from the item's cluster, never the item itself.
    succ = np.zeros(num_items + 1, np.int32)
    todo = ids[sizes[intent_of[ids]] > 1]
    succ[ids[sizes[intent_of[ids]] == 1]] = ids[sizes[intent_of[ids]] == 1]
    while todo.size:
        cand = popular(intent_of[todo])
        ok = cand != todo
        succ[todo[ok]] = cand[ok]
        todo = todo[~ok]
    iw = np.arange(1, num_intents + 1, dtype=np.float64) ** (-zipf_exponent / 2)
    iw /= iw.sum()
    user_intents = np.stack([rng.choice(num_intents, intents_per_user, replace=False, p=iw)
                             for _ in range(num_users)])
    lengths = rng.integers(min_len, max_len + 1, num_users)

    cur_k = user_intents[np.arange(num_users), rng.integers(0, intents_per_user, num_users)]
    cur = popular(cur_k)
    out = np.zeros((num_users, max_len), np.int32)
    out[:, 0] = cur
    for t in range(1, max_len):
        r = rng.random(num_users)
        switch = r < switch_prob
        follow = (~switch) & (r < switch_prob + (1 - switch_prob) * follow_prob)
        new_k = user_intents[np.arange(num_users), rng.integers(0, intents_per_user, num_users)]
        cur_k = np.where(switch, new_k, cur_k)
        cur = np.where(follow, succ[cur], popular(cur_k))
        out[:, t] = cur
    return Sequences.from_lists([out[u, :lengths[u]] for u in range(num_users)], num_items)


# ----------------------------------------------------------------------------- files
_EXT_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".parquet": "parquet", ".pq": "parquet"}


def _format_of(path: Path, file_format: str) -> str:
    if file_format != "auto":
        return file_format
    suffixes = [s.lower() for s in path.suffixes]
    for s in reversed(suffixes):
        if s in _EXT_FORMATS:
            return _EXT_FORMATS[s]
    raise DataError(f"cannot tell the format of {str(path)!r} from its extension; set file_format to "
                    f"csv, tsv or parquet (known extensions: {sorted(_EXT_FORMATS)})")


def _files(path: str, file_format: str) -> List[Path]:
    p = Path(path)
    if not p.exists():
        raise DataError(f"dataset_path {path!r} does not exist")
    if p.is_file():
        return [p]
    exts = ([e for e, f in _EXT_FORMATS.items() if f == file_format] if file_format != "auto"
            else list(_EXT_FORMATS))
    files = sorted(f for f in p.iterdir() if f.is_file() and "".join(f.suffixes[-1:]).lower() in exts)
    if not files:
        raise DataError(f"dataset_path {path!r} is a directory without data files "
                        f"(looked for {sorted(exts)})")
    return files


def _pyarrow(what: str):
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
        import pyarrow.csv  # noqa: F401
        return pyarrow
    except ImportError as err:
        raise DataError(f"{what} needs the 'pyarrow' package: pip install pyarrow") from err


def _missing(col: str, have: Sequence[str], path, key: str) -> DataError:
    close = difflib.get_close_matches(col, list(have), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return DataError(f"{str(path)!r} has no column {col!r} (config key {key!r}); its columns are "
                     f"{list(have)}{hint}")


def _read_csv_stdlib(path: Path, delimiter: str, columns: Dict[str, str]) -> Dict[str, np.ndarray]:
    import csv
    with open(path, newline="") as f:
        reader = csv.reader(f, delimiter=delimiter)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise DataError(f"{str(path)!r} is empty (expected a header row)") from None
        for key, col in columns.items():
            if col not in header:
                raise _missing(col, header, path, key)
        idx = {col: header.index(col) for col in columns.values()}
        rows = [r for r in reader if r]
    out = {}
    for col, i in idx.items():
        try:
            vals = [r[i] for r in rows]
        except IndexError:
            raise DataError(f"{str(path)!r} has a row with fewer fields than its header") from None
        out[col] = _numeric_or_str(np.array(vals, dtype=object), path, col)
    return out


def _numeric_or_str(vals: np.ndarray, path, col: str) -> np.ndarray:
    if any(v is None or (isinstance(v, str) and v.strip() == "") for v in vals):
        raise DataError(f"column {col!r} of {str(path)!r} has empty values")
    for kind in (np.int64, np.float64):
        try:
            return vals.astype(kind)
        except (ValueError, TypeError):
            pass
    return vals.astype(str)


def _read_table(path: Path, fmt: str, columns: Dict[str, str], optional: Sequence[str] = ()):
    """{column: numpy array} of the named (and present optional) columns of one file."""
    if fmt == "parquet":
        pa = _pyarrow("reading Parquet")
        try:
            schema = pa.parquet.read_schema(path)
        except Exception as err:  # pyarrow raises several types for corrupt files
            raise DataError(f"{str(path)!r} is not a readable Parquet file: {err}") from err
        names = list(schema.names)
        for key, col in columns.items():
            if col not in names:
                raise _missing(col, names, path, key)
        want = list(dict.fromkeys(list(columns.values()) + [c for c in optional if c in names]))
        table = pa.parquet.read_table(path, columns=want)
        return _arrow_to_numpy(table, path, set(columns.values()))
    delimiter = "\t" if fmt == "tsv" else ","
    try:
        import pyarrow.csv as pacsv
    except ImportError:
        return _read_csv_stdlib(path, delimiter, columns)
    try:
        table = pacsv.read_csv(path, parse_options=pacsv.ParseOptions(delimiter=delimiter))
    except Exception as err:
        raise DataError(f"{str(path)!r} is not a readable {fmt.upper()} file: {err}") from err
    for key, col in columns.items():
        if col not in table.column_names:
            raise _missing(col, table.column_names, path, key)
    want = list(dict.fromkeys(list(columns.values()) + [c for c in optional if c in table.column_names]))
    return _arrow_to_numpy(table.select(want), path, set(columns.values()))


def _arrow_to_numpy(table, path, required) -> Dict[str, np.ndarray]:
    out = {}
    for name in table.column_names:
        col = table.column(name)
        if name in required and col.null_count:
            raise DataError(f"column {name!r} of {str(path)!r} has {col.null_count} null values")
        arr = col.to_numpy(zero_copy_only=False)
        if arr.dtype == object and name in required:
            arr = arr.astype(str)
        out[name] = arr
    return out


def _to_sequences(users: np.ndarray, items: np.ndarray, times: np.ndarray, min_len: int) -> Sequences:
    """Group by user, order by time (stable: file order breaks ties), remap items to 1..K."""
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
    parts = [_read_table(f, _format_of(f, file_format), cols) for f in _files(path, file_format)]
    cat = {c: np.concatenate([p[c] for p in parts]) for c in cols.values()}
    return _to_sequences(cat[user_column], cat[item_column], cat[timestamp_column], min_user_interactions)


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
    for f in _files(path, file_format):
        t = _read_table(f, _format_of(f, file_format), cols, optional)
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
    return _to_sequences(users, items, times, min_user_interactions)


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
    seqs = load_sequences(cfg) if seqs is None else seqs
    kw = dict(max_seq_len=cfg.max_seq_len, num_labels=cfg.num_labels)
    return Dataset(seqs, make_train_split(seqs, **kw), make_eval_split(seqs, "dev", **kw),
                   make_eval_split(seqs, "test", **kw), popularity(seqs, cfg.num_labels))
