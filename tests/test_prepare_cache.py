"""recloss-train straight from a log (data/cache.py) and staged copies of shards (shards.stage).

The cache folder is keyed by the log's files and every preparation key: the same log and keys reuse
it, an edited log or another key prepares anew, an unfinished folder is prepared again; the other
processes of a job take process 0's word (and its error); a staged shard is checked by size and
SHA-256 and a corrupt one is named.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recloss_plugins.config import default_config_path, load_config
from recloss_plugins.sasrec.data import cache as C
from recloss_plugins.sasrec.data import pipeline as G
from recloss_plugins.sasrec.data import prepare as P
from recloss_plugins.sasrec.data import shards as S

pytestmark = pytest.mark.tier1


def _write_log(rng, path, n=3000):
    users = rng.integers(0, 90, n)
    pq.write_table(pa.table({"uid": users * 31 + 7, "item_id": rng.integers(0, 211, n) * 3,
                             "timestamp": rng.integers(0, 10**6, n)}), path, row_group_size=700)


def _cfg(tmp_path, *extra):
    return load_config([str(default_config_path()), "dataset_type=interactions",
                        f"dataset_path={tmp_path / 'log.parquet'}", f"base_output_directory={tmp_path / 'runs'}",
                        "num_labels=3", "max_seq_len=6", "prepare_num_shards=4", "prepare_num_buckets=5",
                        "min_user_interactions=20", *extra])


class _Lines(list):
    def __call__(self, *a):
        self.append(" ".join(map(str, a)))


def test_a_log_is_prepared_once_and_its_folder_is_keyed_by_files_and_keys(tmp_path, rng):
    _write_log(rng, tmp_path / "log.parquet")
    lines = _Lines()
    first = C.prepared_path(_cfg(tmp_path), log=lines)
    assert first.startswith(str(tmp_path / "runs" / "prepared" / "log.parquet-"))
    assert any(line.startswith("data: preparing") and first in line for line in lines)
    assert json.loads((S.as_path(first) / C.KEY_FILE).read_text()) == C.cache_key(_cfg(tmp_path))

    # The same shards recloss-prepare-data writes for the same config, byte for byte.
    ref = P.prepare(_cfg(tmp_path, f"prepared_data_path={tmp_path / 'ref'}"), log=lambda *a: None)
    got = S.load_manifest(first)
    assert [s["sha256"] for s in got.shards] == [s["sha256"] for s in ref["shards"]]
    for s in got.shards:
        assert S.file_sha256(S.as_path(first) / s["name"]) == s["sha256"]

    # Keys the preparation does not read share the folder, and nothing is prepared again.
    lines.clear()
    again = C.prepared_path(_cfg(tmp_path, "learning_rate=0.5", "steps=9", "loss=cutce"), log=lines)
    assert again == first and lines and lines[0].startswith("data: reusing") and len(lines) == 1

    # Every key the preparation reads, and the log's own version, is another folder.
    others = {C.prepared_path(_cfg(tmp_path, kv), log=lambda *a: None)
              for kv in ("min_user_interactions=25", "prepare_num_shards=2", "num_labels=2",
                         "prepare_num_buckets=3")}
    assert len(others) == 4 and first not in others
    st = os.stat(tmp_path / "log.parquet")
    os.utime(tmp_path / "log.parquet", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = C.prepared_path(_cfg(tmp_path), log=lambda *a: None)
    assert touched != first and os.path.isdir(first)       # the old one is left, not overwritten


def test_prepare_keys_are_every_key_the_preparation_reads(tmp_path, rng):
    """A key prepare reads but the cache key misses would let a changed config reuse stale shards."""
    _write_log(rng, tmp_path / "log.parquet")
    cfg = _cfg(tmp_path)
    read = set()

    class Recording:
        def __getattr__(self, k):
            read.add(k)
            return cfg[k]

        def __getitem__(self, k):
            read.add(k)
            return cfg[k]

    P.prepare(Recording(), log=lambda *a: None, output=tmp_path / "out")
    assert read - {"dataset_path", "prepared_data_path"} <= set(C.PREPARE_KEYS), sorted(read)
    assert {"min_user_interactions", "prepare_num_shards", "num_labels", "user_column"} <= read


def test_an_unfinished_folder_is_prepared_again(tmp_path, rng):
    _write_log(rng, tmp_path / "log.parquet")
    folder = C.prepared_path(_cfg(tmp_path), log=lambda *a: None)
    os.remove(os.path.join(folder, C.KEY_FILE))             # killed after the shards, before the marker
    with open(os.path.join(folder, S.shard_name(1, 4)), "r+b") as f:
        f.truncate(10)
    lines = _Lines()
    assert C.prepared_path(_cfg(tmp_path), log=lines) == folder
    assert lines[0].startswith("data: preparing")
    G.GrainData(folder, max_seq_len=6, num_labels=3)        # every shard opens again


class _Client:
    """The two calls of JAX's coordination client that cache.prepared_path makes."""

    def __init__(self, said=None):
        self.store, self.said = {}, said

    def key_value_set(self, key, value):
        assert key not in self.store, key                   # each call has its own key
        self.store[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        assert timeout_ms == C.WAIT_MS
        return self.said if self.said is not None else self.store[key]


def test_other_processes_take_process_0s_word_and_its_error(tmp_path, rng):
    _write_log(rng, tmp_path / "log.parquet")
    client = _Client()
    folder = C.prepared_path(_cfg(tmp_path), process_index=0, process_count=2, client=client,
                             log=lambda *a: None)
    assert list(client.store.values()) == [f"ok {folder}"]
    # Process 1 reads process 0's word (its own call, the same call count) and checks the folder.
    client.said = f"ok {folder}"
    assert C.prepared_path(_cfg(tmp_path), process_index=1, process_count=2, client=client) == folder
    client.said = f"ok {tmp_path / 'elsewhere'}"
    with pytest.raises(S.ShardError, match="cannot see: set prepared_cache_dir to storage every host shares"):
        C.prepared_path(_cfg(tmp_path), process_index=1, process_count=2, client=client)

    # Process 0's failure reaches the others as a named error, and process 0 raises its own.
    bad = _cfg(tmp_path, "min_user_interactions=10000")
    client = _Client()
    with pytest.raises(P.DataError, match="no user has >= 10000 interactions"):
        C.prepared_path(bad, process_index=0, process_count=2, client=client, log=lambda *a: None)
    (said,) = client.store.values()
    assert said.startswith("error: DataError: no user has >= 10000")
    with pytest.raises(S.ShardError, match="process 0 could not prepare .*no user has >= 10000"):
        C.prepared_path(bad, process_index=1, process_count=2, client=_Client(said))
    with pytest.raises(S.ShardError, match="needs JAX's coordination client"):
        C.prepared_path(bad, process_index=1, process_count=2, client=None)


def test_a_set_prepared_data_path_is_used_as_it_is(tmp_path):
    cfg = _cfg(tmp_path, f"prepared_data_path={tmp_path / 'mine'}")
    assert C.prepared_path(cfg, process_index=1, process_count=2, client=None) == str(tmp_path / "mine")
    assert not (tmp_path / "runs").exists()


def test_staged_shards_are_checked_copied_once_and_corruption_is_named(tmp_path, rng):
    _write_log(rng, tmp_path / "log.parquet")
    src = P.prepare(_cfg(tmp_path, f"prepared_data_path={tmp_path / 'prep'}"), log=lambda *a: None)
    m = S.load_manifest(tmp_path / "prep")
    stage = tmp_path / "stage"
    paths, info = S.stage(m, [1, 3], str(stage))
    assert sorted(os.listdir(stage)) == [S.shard_name(1, 4), S.shard_name(3, 4)]
    assert (info["copied"], info["reused"], info["unchecked"]) == (2, 0, 0)
    assert info["bytes"] == src["shards"][1]["bytes"] + src["shards"][3]["bytes"]
    for s, p in paths.items():
        assert S.file_sha256(p) == m.shards[s]["sha256"]
        S.open_shard(m, s, p)

    # A whole copy is kept; a damaged one (same size, one byte flipped) is copied again.
    with open(paths[3], "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    _, info = S.stage(m, [1, 3], str(stage))
    assert (info["copied"], info["reused"]) == (1, 1)
    assert S.file_sha256(paths[3]) == m.shards[3]["sha256"]

    # A corrupt or partial source is named, and leaves no file behind under the shard's name.
    shutil.rmtree(stage)
    name = S.shard_name(3, 4)
    with open(tmp_path / "prep" / name, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(S.ShardError, match=f"{name}' does not match prepared.json: .*partial or corrupt"):
        S.stage(m, [3], str(stage))
    assert os.listdir(stage) == []
    os.remove(tmp_path / "prep" / name)
    with pytest.raises(S.ShardError, match=f"{name}' is missing"):
        S.stage(m, [3], str(stage))

    # A manifest from before checksums: the size alone is checked, and counted.
    old = json.loads((tmp_path / "prep" / S.MANIFEST).read_text())
    for s in old["shards"]:
        del s["sha256"]
    (tmp_path / "prep" / S.MANIFEST).write_text(json.dumps(old))
    _, info = S.stage(S.load_manifest(tmp_path / "prep"), [0], str(stage))
    assert (info["copied"], info["unchecked"]) == (1, 1)


def test_default_stage_folder_is_one_per_preparation(tmp_path, rng):
    _write_log(rng, tmp_path / "log.parquet")
    P.prepare(_cfg(tmp_path, f"prepared_data_path={tmp_path / 'a'}"), log=lambda *a: None)
    P.prepare(_cfg(tmp_path, f"prepared_data_path={tmp_path / 'b'}", "prepare_num_shards=2"), log=lambda *a: None)
    a, b = (S.default_stage_dir(S.load_manifest(tmp_path / d)) for d in "ab")
    assert a != b and a == S.default_stage_dir(S.load_manifest(tmp_path / "a"))
