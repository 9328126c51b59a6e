"""The prepared vocabulary (vocab.npy) loads without pickle: string ids as fixed-width unicode, numbers as they
are; a pickled object array is refused, unread, with the word to prepare again."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recloss_plugins.config import default_config_path, load_config
from recloss_plugins.sasrec import data as D
from recloss_plugins.sasrec.data import pipeline as G
from recloss_plugins.sasrec.data import prepare as P
from recloss_plugins.sasrec.data import shards as S

pytestmark = pytest.mark.tier1

_UNPICKLED = []


def _record_unpickling():
    _UNPICKLED.append(True)
    return "unpickled"


class _Payload:
    """What a hostile vocab.npy would hold: unpickling it runs `_record_unpickling`."""

    def __reduce__(self):
        return (_record_unpickling, ())


def _prepare(tmp_path, rng, item_ids: str):
    n = 1500
    users = rng.integers(0, 40, n)
    items = rng.integers(0, 90, n)
    item_col = np.array([f"sku-{i:03d}-é" if i % 3 else f"s{i}" for i in items]) if item_ids == "string" else items * 11
    log = tmp_path / "log.parquet"
    pq.write_table(pa.table({"uid": users, "item_id": item_col, "timestamp": rng.integers(0, 30, n)}), log)
    cfg = load_config([str(default_config_path()), "num_labels=3", "max_seq_len=6", "dataset_type=interactions",
                       f"dataset_path={log}", f"prepared_data_path={tmp_path / 'prep'}", "prepare_num_shards=2",
                       "prepare_num_buckets=3", "min_user_interactions=10"])
    P.prepare(cfg, log=lambda *a: None)
    return cfg, D.load_interactions(str(log), min_user_interactions=10)


@pytest.mark.parametrize("item_ids", ["string", "int"])
def test_item_ids_round_trip_without_pickle(tmp_path, rng, item_ids):
    cfg, ref = _prepare(tmp_path, rng, item_ids)
    path = tmp_path / "prep" / S.VOCAB
    raw = np.load(path, allow_pickle=False)              # no pickle needed, whatever the ids
    assert raw.dtype.kind == ("U" if item_ids == "string" else "i"), raw.dtype
    if item_ids == "string":
        assert raw.dtype == np.dtype(f"<U{max(len(s) for s in raw)}")     # fixed width: the longest id
    got = S.read_vocab(S.load_manifest(cfg.prepared_data_path))
    np.testing.assert_array_equal(got, raw)
    np.testing.assert_array_equal(got[1:], ref.item_raw_ids[1:])       # the in-memory reader's ids, in dense order
    assert got[0] == got[1]                                           # padding repeats entry 1
    # Dense ids read back from the shards map to the same raw items as the in-memory sequences.
    seqs = G.GrainData(cfg.prepared_data_path, max_seq_len=6, num_labels=3).local_sequences()
    as_raw = lambda s, ids: sorted(tuple(ids[s.user(u)].tolist()) for u in range(s.num_users))
    assert as_raw(seqs, got) == as_raw(ref, ref.item_raw_ids)


def test_write_vocab_stores_python_strings_as_unicode_and_refuses_other_objects(tmp_path):
    written = S.write_vocab(tmp_path / "v.npy", np.array(["a", "a", "bcd", "日本"], dtype=object))
    back = np.load(tmp_path / "v.npy", allow_pickle=False)
    assert back.dtype == np.dtype("<U3") and written.dtype == back.dtype
    assert back.tolist() == ["a", "a", "bcd", "日本"]
    S.write_vocab(tmp_path / "n.npy", np.array([7, 7, 9], np.int64))
    assert np.load(tmp_path / "n.npy", allow_pickle=False).dtype == np.int64        # numbers as they are
    with pytest.raises(D.DataError, match=r"item ids of types \['int', 'str'\] cannot be stored without pickle"):
        S.write_vocab(tmp_path / "m.npy", np.array(["a", 3], dtype=object))


def test_a_pickled_vocabulary_is_refused_unread_with_the_word_to_prepare_again(tmp_path, rng):
    cfg, _ = _prepare(tmp_path, rng, "string")
    manifest = S.load_manifest(cfg.prepared_data_path)
    path = tmp_path / "prep" / S.VOCAB
    hostile = np.empty(manifest.vocab_size, dtype=object)
    hostile[:] = [_Payload()] * manifest.vocab_size
    with path.open("wb") as f:
        np.save(f, hostile, allow_pickle=True)              # what np.save writes for Python objects
    want = (rf"'{path}' holds a pickled object array, and recloss does not unpickle a prepared folder .*"
            r"re-run recloss-prepare-data into a new prepared_data_path")
    with pytest.raises(S.ShardError, match=want):
        S.read_vocab(manifest)
    with pytest.raises(S.ShardError, match=want):
        S.load_manifest(cfg.prepared_data_path)
    with pytest.raises(S.ShardError, match=want):
        G.GrainData(cfg.prepared_data_path, max_seq_len=6, num_labels=3)
    assert _UNPICKLED == []
    path.write_bytes(b"not a numpy file")
    with pytest.raises(S.ShardError, match=r"is not a \.npy file of item ids: .*prepare again"):
        S.read_vocab(manifest)
    assert _UNPICKLED == []
