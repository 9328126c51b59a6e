"""Data files: CSV/TSV/Parquet interaction logs and Yambda into Sequences, their errors, and
a config's dataset built from a file."""

import pytest

from recloss_plugins.sasrec import data as D

pytestmark = pytest.mark.tier1


def _write_csv(path, header, rows, sep=","):
    path.write_text(sep.join(header) + "\n" + "\n".join(sep.join(str(x) for x in r) for r in rows) + "\n")


def test_csv_loader_orders_by_time_and_remaps_items(tmp_path):
    rows = [("u2", "x", 5), ("u1", "b", 3), ("u1", "a", 1), ("u2", "y", 1), ("u1", "c", 2), ("u2", "a", 9)]
    f = tmp_path / "log.csv"
    _write_csv(f, ["user", "item", "ts"], rows)
    s = D.load_interactions(str(f), user_column="user", item_column="item", timestamp_column="ts")
    raw = s.item_raw_ids
    assert s.num_users == 2 and s.num_items == 5 and s.vocab_size == 6
    assert [raw[i] for i in s.user(0)] == ["a", "c", "b"]          # u1 by ts 1, 2, 3
    assert [raw[i] for i in s.user(1)] == ["y", "x", "a"]          # u2 by ts 1, 5, 9
    assert sorted(s.items.tolist()) == [1, 1, 2, 3, 4, 5] and 0 not in s.items


def test_tsv_and_directory_and_format_override(tmp_path):
    d = tmp_path / "logs"
    d.mkdir()
    _write_csv(d / "a.tsv", ["uid", "item_id", "timestamp"], [(1, 10, 1), (1, 11, 2)], sep="\t")
    _write_csv(d / "b.tsv", ["uid", "item_id", "timestamp"], [(1, 12, 3), (2, 10, 1)], sep="\t")
    s = D.load_interactions(str(d))
    assert s.num_users == 2 and [s.item_raw_ids[i] for i in s.user(0)] == [10, 11, 12]
    odd = tmp_path / "log.txt"
    _write_csv(odd, ["uid", "item_id", "timestamp"], [(1, 10, 1)], sep="\t")
    with pytest.raises(D.DataError, match="cannot tell the format"):
        D.load_interactions(str(odd))
    assert D.load_interactions(str(odd), file_format="tsv").num_items == 1


def test_parquet_loader(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    t = pa.table({"uid": [7, 7, 7, 3], "item_id": [100, 200, 100, 300], "timestamp": [3, 1, 2, 1],
                  "extra": [0, 0, 0, 0]})
    f = tmp_path / "log.parquet"
    pq.write_table(t, f)
    s = D.load_interactions(str(f))
    assert s.num_users == 2 and s.num_items == 3
    assert [s.item_raw_ids[i] for i in s.user(1)] == [200, 100, 100]   # uid 7 (sorted after 3)


def test_loader_errors_are_clear(tmp_path):
    f = tmp_path / "log.csv"
    _write_csv(f, ["user_id", "item_id", "timestamp"], [(1, 2, 3)])
    with pytest.raises(D.DataError, match=r"no column 'uid' \(config key 'user_column'\).*did you mean 'user_id'"):
        D.load_interactions(str(f))
    with pytest.raises(D.DataError, match="does not exist"):
        D.load_interactions(str(tmp_path / "missing.csv"))
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(D.DataError):
        D.load_interactions(str(empty))
    (tmp_path / "nodata").mkdir()
    with pytest.raises(D.DataError, match="without data files"):
        D.load_interactions(str(tmp_path / "nodata"))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"this is not parquet")
    with pytest.raises(D.DataError, match="not a readable Parquet"):
        D.load_interactions(str(bad))
    holes = tmp_path / "holes.csv"
    holes.write_text("uid,item_id,timestamp\n1,,3\n1,2,4\n")
    with pytest.raises(D.DataError, match="item_id"):
        D.load_interactions(str(holes))


def test_min_user_interactions_drops_users_and_their_items(tmp_path):
    f = tmp_path / "log.csv"
    _write_csv(f, ["uid", "item_id", "timestamp"],
               [(1, 10, 1), (1, 11, 2), (1, 12, 3), (2, 99, 1), (2, 10, 2)])
    s = D.load_interactions(str(f), min_user_interactions=3)
    assert s.num_users == 1 and s.num_items == 3 and 99 not in list(s.item_raw_ids[1:])
    with pytest.raises(D.DataError, match="no user has >= 4"):
        D.load_interactions(str(f), min_user_interactions=4)


def test_yambda_filters(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    uid = [1] * 6 + [2] * 3
    t = pa.table({
        "uid": uid, "item_id": [5, 6, 7, 8, 9, 5, 5, 6, 7], "timestamp": list(range(6)) + [0, 1, 2],
        "event_type": ["listen", "like", "listen", "listen", "listen", "dislike", "listen", "listen", "listen"],
        "is_organic": [1, 1, 0, 1, 1, 1, 1, 1, 1],
        "played_ratio_pct": pa.array([90, None, 100, 10, 95, None, 100, 100, 100], pa.int64()),
    })
    f = tmp_path / "multi_event.parquet"
    pq.write_table(t, f)
    s = D.load_yambda(str(f), min_user_interactions=0)
    assert s.num_users == 2 and s.items.size == 9
    s = D.load_yambda(str(f), event_types=["listen"], min_user_interactions=0)
    assert s.items.size == 7
    s = D.load_yambda(str(f), event_types=["listen"], organic_only=True, min_played_ratio_pct=50,
                      min_user_interactions=0)
    # user 1 keeps items 5 (90%) and 9 (95%); 7 is not organic, 8 played 10%.
    assert [s.item_raw_ids[i] for i in s.user(0)] == [5, 9]
    s = D.load_yambda(str(f), min_played_ratio_pct=50, min_user_interactions=4)
    assert s.num_users == 1 and [s.item_raw_ids[i] for i in s.user(0)] == [5, 6, 7, 9, 5]  # nulls kept
    plain = tmp_path / "listens.parquet"
    pq.write_table(t.select(["uid", "item_id", "timestamp"]), plain)
    with pytest.raises(D.DataError, match="no 'event_type' column"):
        D.load_yambda(str(plain), event_types=["listen"], min_user_interactions=0)
    with pytest.raises(D.DataError, match="no 'is_organic' column"):
        D.load_yambda(str(plain), organic_only=True, min_user_interactions=0)


def test_load_sequences_from_config(tmp_path):
    from recloss_plugins.config import default_config_path, load_config
    f = tmp_path / "log.csv"
    rows = [(u, 1 + (u * 7 + i) % 50, i) for u in range(4) for i in range(30)]
    _write_csv(f, ["uid", "item_id", "timestamp"], rows)
    cfg = load_config([str(default_config_path()), "dataset_type=interactions", f"dataset_path={f}",
                       "max_seq_len=12"])
    ds = D.build_dataset(cfg)
    assert ds.sequences.num_users == 4 and ds.train.num_users == 4
    assert ds.train.inputs.shape == (4, 12) and ds.train.targets.shape == (4, 12, 8)
    assert ds.dev.targets.shape == (4, 8) and ds.popularity[0] == 0
