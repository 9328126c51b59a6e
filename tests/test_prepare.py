"""recloss-prepare-data: shards hold exactly the in-memory reader's sequences; bad shards are named errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from recloss_plugins.config import default_config_path, load_config
from recloss_plugins.sasrec import data as D
from recloss_plugins.sasrec.data import pipeline as G
from recloss_plugins.sasrec.data import prepare as P
from recloss_plugins.sasrec.data import shards as S

pytestmark = pytest.mark.tier1


def _log(rng, n_events, n_users, n_items, string_users=False):
    users = (rng.random(n_events) ** 2 * n_users).astype(np.int64)   # skewed: some users fall below the filter
    items = rng.integers(10_000, 10_000 + n_items, n_events)
    times = rng.integers(0, 50, n_events)            # many equal timestamps: file order breaks ties
    cols = {"uid": np.array([f"user-{u}" for u in users]) if string_users else users * 7919 + 3,
            "item_id": items, "timestamp": times}
    return pa.table(cols)


def _cfg(tmp_path, *extra):
    return load_config([str(default_config_path()), "num_labels=3", "max_seq_len=6",
                        f"prepared_data_path={tmp_path / 'prep'}", *extra])


def _as_raw(seqs):
    return sorted(tuple(seqs.item_raw_ids[seqs.user(u)].tolist()) for u in range(seqs.num_users))


@pytest.mark.parametrize("kind", ["csv_string_users", "parquet_dir", "parquet_dir_string_users", "yambda_filters"])
def test_shards_hold_the_in_memory_sequences_vocabulary_and_popularity(tmp_path, rng, kind):
    log = tmp_path / "log"
    if kind == "csv_string_users":
        t = _log(rng, 3001, 97, 251, string_users=True)
        log = tmp_path / "log.csv"
        pacsv.write_csv(t, log)
        extra = ["dataset_type=interactions", "min_user_interactions=25"]
        ref = D.load_interactions(str(log), min_user_interactions=25)
    elif kind.startswith("parquet_dir"):
        # Two files of several row groups: a user's events span pieces, each with its own dictionary.
        t = _log(rng, 4003, 113, 307, string_users=kind.endswith("string_users"))
        log.mkdir()
        pq.write_table(t.slice(0, 1500), log / "a.parquet", row_group_size=333)
        pq.write_table(t.slice(1500), log / "b.parquet", row_group_size=511)
        extra = ["dataset_type=interactions", "min_user_interactions=30"]
        ref = D.load_interactions(str(log), min_user_interactions=30)
    else:
        t = _log(rng, 3500, 61, 199)
        n = t.num_rows
        t = t.append_column("event_type", pa.array(rng.choice(["listen", "like", "skip"], n)))
        t = t.append_column("is_organic", pa.array(rng.integers(0, 2, n)))
        ratio = rng.uniform(0, 100, n)
        t = t.append_column("played_ratio_pct", pa.array(ratio, mask=rng.random(n) < 0.2))
        log = tmp_path / "events.parquet"
        pq.write_table(t, log, row_group_size=400)
        extra = ["dataset_type=yambda", "min_user_interactions=9", "yambda_event_types=[listen,like]",
                 "yambda_organic_only=true", "yambda_min_played_ratio_pct=30"]
        ref = D.load_yambda(str(log), event_types=["listen", "like"], organic_only=True,
                            min_played_ratio_pct=30, min_user_interactions=9)
    # Some users and items are filtered out, so the remap is exercised.
    assert ref.num_users < len(set(t.column("uid").to_pylist()))
    cfg = _cfg(tmp_path, f"dataset_path={log}", "prepare_num_shards=4", "prepare_num_buckets=5", *extra)
    lines = []
    man = P.prepare(cfg, log=lines.append)
    assert (man["num_users"], man["num_items"], man["num_interactions"]) == \
        (ref.num_users, ref.num_items, int(ref.items.size))
    assert "shards" in lines[-1] and f"{ref.num_users:,} users" in lines[-1]
    assert sum(s["num_users"] for s in man["shards"]) == ref.num_users
    assert max(s["num_users"] for s in man["shards"]) - min(s["num_users"] for s in man["shards"]) <= 1

    got = G.GrainData(cfg.prepared_data_path, max_seq_len=6, num_labels=3).local_sequences()
    raw = np.load(tmp_path / "prep" / "vocab.npy")
    np.testing.assert_array_equal(raw[1:], ref.item_raw_ids[1:])        # same dense ids
    assert _as_raw(D.Sequences(got.items, got.offsets, got.num_items, raw)) == _as_raw(ref)
    np.testing.assert_array_equal(np.load(tmp_path / "prep" / "popularity.npy"), D.popularity(ref, 3))


def _reference_key(value: bytes):
    """stream.string_keys's definition, one byte string at a time in plain Python."""
    mask = 2**64 - 1

    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    out = []
    for seed, mul, shift in ((0x243F6A8885A308D3, 0xC2B2AE3D27D4EB4F, 29), (0x13198A2E03707344, 0x9FB21C651E98DF25, 32)):
        k = ((len(value) + seed) * mul) & mask
        for c in range(0, len(value), 8):
            k = ((k ^ int.from_bytes(value[c:c + 8], "little")) * mul) & mask
            k ^= k >> shift
        out.append(mix(k))
    return tuple(out)


def test_string_keys_are_the_definition_in_every_arrow_layout_and_tell_ids_apart(rng, monkeypatch):
    from recloss_plugins.sasrec.data import stream
    monkeypatch.setattr(stream, "_BLOCK", 97)        # many blocks, one of them partial
    alphabet = list("abcxyz019-_:") + ["é", "ß", "\x00", "日本", "🙂"]
    values = ["", "\x00", "a", "a\x00", "user-1", "user-10", "user-01"]
    values += ["".join(rng.choice(alphabet, int(n))) for n in rng.integers(0, 40, 400)]
    values += ["x" * n for n in range(1, 33)] + ["x" * 300]            # every word boundary, a long tail
    base = "user-0123456789abcdef"
    values += [base[:i] + "#" + base[i + 1:] for i in range(len(base))]   # one byte apart, every position
    values += [v for v in values[:60]]                                # duplicates
    got = stream.string_keys(pa.array(values))
    assert got.shape == (len(values), 2) and got.dtype == np.uint64
    want = np.array([_reference_key(v.encode()) for v in values], np.uint64)
    np.testing.assert_array_equal(got, want)
    # Equal ids, equal keys; distinct ids, distinct keys (both halves).
    distinct = sorted(set(values))
    keys = {tuple(k) for k in stream.string_keys(pa.array(distinct))}
    assert len(keys) == len(distinct) and len({k[0] for k in keys}) == len({k[1] for k in keys}) == len(distinct)
    layouts = {
        "large_string": pa.array(values, pa.large_string()),
        "binary": pa.array([v.encode() for v in values], pa.binary()),
        "dictionary": pa.array(values).dictionary_encode(),
        "chunked": pa.chunked_array([pa.array(values[:100]), pa.array(values[100:])]),
    }
    for name, arr in layouts.items():
        np.testing.assert_array_equal(stream.string_keys(arr), want, err_msg=name)
    np.testing.assert_array_equal(stream.string_keys(pa.array(values).slice(33, 200)), want[33:233])
    assert stream.string_keys(pa.array([], pa.string())).shape == (0, 2)


def test_user_runs_tell_apart_ids_whose_first_key_halves_collide():
    # (5, 1) and (5, 2) share the first half: two users, each in time order, file order breaking ties.
    users = np.array([[5, 1], [5, 2], [5, 1], [3, 9], [5, 2], [5, 1]], np.uint64)
    times = np.array([4, 3, 2, 1, 0, 2])
    order, offsets = P._user_runs(users, times)
    np.testing.assert_array_equal(order, [3, 2, 5, 0, 4, 1])
    np.testing.assert_array_equal(offsets, [0, 1, 4, 6])
    order, offsets = P._user_runs(users[[0, 2, 3, 5]], times[[0, 2, 3, 5]])   # no collision: the fast path
    np.testing.assert_array_equal(order, [2, 1, 3, 0])
    np.testing.assert_array_equal(offsets, [0, 1, 4])


def test_null_string_user_ids_are_a_named_error(tmp_path):
    log = tmp_path / "log.parquet"
    pq.write_table(pa.table({"uid": pa.array(["a", None, "b"]), "item_id": [1, 2, 3], "timestamp": [1, 2, 3]}), log)
    cfg = _cfg(tmp_path, "dataset_type=interactions", f"dataset_path={log}", "prepare_num_shards=1")
    with pytest.raises(D.DataError, match=r"column 'uid' of .*log\.parquet' has 1 null values"):
        P.prepare(cfg, log=lambda *a: None)


def test_train_example_is_the_train_split_row(rng):
    seqs = D.Sequences.from_lists([rng.integers(1, 40, n) for n in (12, 13, 20, 31, 57)], 39)
    split = D.make_train_split(seqs, max_seq_len=9, num_labels=3)
    assert split.num_users == 5
    for row, u in enumerate(split.users):
        ex = G.train_example(seqs.user(int(u)), 9, 3)
        np.testing.assert_array_equal(ex["inputs"], split.inputs[row])
        np.testing.assert_array_equal(ex["targets"], split.targets[row])
        np.testing.assert_array_equal(ex["weights"], (split.inputs[row] != 0).astype(np.float32))


@pytest.fixture
def prepared(tmp_path, rng):
    log = tmp_path / "log.parquet"
    pq.write_table(_log(rng, 2500, 60, 150), log)
    cfg = _cfg(tmp_path, "dataset_type=interactions", f"dataset_path={log}", "prepare_num_shards=4",
               "prepare_num_buckets=3", "min_user_interactions=12")
    P.prepare(cfg, log=lambda *a: None)
    return cfg


def _open(cfg, index=0, count=1):
    return G.GrainData(cfg.prepared_data_path, max_seq_len=6, num_labels=3, process_index=index,
                       process_count=count)


def test_bad_shards_are_named_errors(tmp_path, rng, prepared):
    root = tmp_path / "prep"
    with pytest.raises(S.ShardError, match=r"4 prepared shards .* do not divide over 3 processes"):
        _open(prepared, 0, 3)
    with pytest.raises(S.ShardError, match=r"global batch 10 does not divide over the 4 prepared shards"):
        _open(prepared).train_dataset(10, 0)
    # From a different preparation: same layout, another log, so another vocabulary hash.
    other = tmp_path / "other"
    log2 = tmp_path / "log2.parquet"
    pq.write_table(_log(rng, 2500, 60, 150), log2)
    P.prepare(_cfg(tmp_path, "dataset_type=interactions", f"dataset_path={log2}", f"prepared_data_path={other}",
                   "prepare_num_shards=4", "prepare_num_buckets=3", "min_user_interactions=12"),
              log=lambda *a: None)
    name = S.shard_name(2, 4)
    saved = (root / name).read_bytes()
    shutil.copy(other / name, root / name)
    with pytest.raises(S.ShardError, match=rf"{name}' comes from a different preparation: vocabulary hash"):
        _open(prepared)
    _open(prepared, 0, 2)           # process 0 of 2 never opens shard 2
    (root / name).unlink()
    with pytest.raises(S.ShardError, match=rf"prepared shard '.*{name}' is missing"):
        _open(prepared, 1, 2)
    from array_record.python.array_record_module import ArrayRecordWriter
    w = ArrayRecordWriter(str(root / name), S.WRITER_OPTIONS)
    w.close()
    with pytest.raises(S.ShardError, match=rf"{name}' is empty \(0 records"):
        _open(prepared, 1, 2)
    (root / name).write_bytes(saved)
    _open(prepared)
    man = json.loads((root / S.MANIFEST).read_text())
    man["shards"][3]["num_users"] += 1
    (root / S.MANIFEST).write_text(json.dumps(man))
    with pytest.raises(S.ShardError, match=r"holds \d+ users .* says \d+"):
        _open(prepared)
    with pytest.raises(S.ShardError, match=r"has no prepared.json: run `recloss-prepare-data CONFIG` first"):
        G.GrainData(tmp_path / "nowhere", max_seq_len=6, num_labels=3)


def test_training_refuses_bad_prepared_data_before_it_starts(tmp_path, prepared):
    from recloss_plugins.sasrec import train as T
    base = [str(default_config_path()), "dataset_type=interactions", f"dataset_path={prepared.dataset_path}",
            "num_labels=3", "max_seq_len=6", f"base_output_directory={tmp_path / 'runs'}", "run_name=r",
            "emb_dim=8", "num_heads=1", "mlp_dim=8", "num_layers=1"]
    # An empty prepared_data_path prepares the log first (tests/test_prepare_cache.py); a log it
    # cannot prepare stops the run there.
    with pytest.raises(D.DataError, match="'who'"):
        T.train(load_config(base + ["user_column=who"]))
    with pytest.raises(S.ShardError, match="prepared with num_labels=3, this run has num_labels=2"):
        T.train(load_config(base + [f"prepared_data_path={prepared.prepared_data_path}", "num_labels=2",
                                    "global_batch_size=8"]), devices=[__import__("jax").devices()[0]])
    with pytest.raises(S.ShardError, match="global batch 6 does not divide over the 4 prepared shards"):
        T.train(load_config(base + [f"prepared_data_path={prepared.prepared_data_path}", "global_batch_size=6"]),
                devices=[__import__("jax").devices()[0]])
    assert not (tmp_path / "runs" / "r" / "checkpoints").exists()


def test_prepare_command_reports_and_refuses_too_many_shards(tmp_path, rng, capsys):
    log = tmp_path / "log.parquet"
    pq.write_table(_log(rng, 900, 20, 50), log)
    base = [str(default_config_path()), "dataset_type=interactions", f"dataset_path={log}",
            f"prepared_data_path={tmp_path / 'p'}", "prepare_num_buckets=2"]
    assert P.main(base + ["prepare_num_shards=2"]) == 0
    out = capsys.readouterr().out
    assert "20 users" in out and "2 shards" in out and "MiB" in out
    assert P.main(base + ["prepare_num_shards=64"]) == 1
    assert "ShardError: only 20 users are left, fewer than prepare_num_shards=64" in capsys.readouterr().err
    assert P.main(base[:-2] + ["prepared_data_path="]) == 1
    assert "'prepared_data_path' is empty" in capsys.readouterr().err
