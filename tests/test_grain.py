"""The Grain pipeline: per-process shares of one global batch, seeded shuffles, exact resume, local eval."""

from __future__ import annotations

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recloss_plugins.config import default_config_path, load_config
from recloss_plugins.sasrec import data as D
from recloss_plugins.sasrec import eval as eval_lib
from recloss_plugins.sasrec import parallel
from recloss_plugins.sasrec.data import pipeline as G
from recloss_plugins.sasrec.data import prepare as P

pytestmark = pytest.mark.tier1

N, L, SHARDS = 6, 3, 4


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, fresh_seed):
    tmp = tmp_path_factory.mktemp("grain")
    rng = np.random.default_rng(fresh_seed("prepared"))
    n = 3000
    users = (rng.random(n) ** 1.5 * 90).astype(np.int64)
    t = pa.table({"uid": users, "item_id": rng.integers(500, 700, n), "timestamp": rng.integers(0, 10**6, n)})
    pq.write_table(t, tmp / "log.parquet", row_group_size=640)
    args = [str(default_config_path()), "dataset_type=interactions", f"dataset_path={tmp / 'log.parquet'}",
            f"prepared_data_path={tmp / 'prep'}", f"prepare_num_shards={SHARDS}", "prepare_num_buckets=3",
            f"num_labels={L}", f"max_seq_len={N}", "min_user_interactions=13"]
    P.prepare(load_config(args), log=lambda *a: None)
    return tmp, args


def _data(prepared, index=0, count=1):
    return G.GrainData(prepared[0] / "prep", max_seq_len=N, num_labels=L, process_index=index, process_count=count)


def _take(it, steps):
    return [next(it) for _ in range(steps)]


def test_global_batch_is_the_same_for_any_process_count(prepared):
    B = 8
    one = _data(prepared)
    steps = max(len(s) for s in one.sources) + 1       # 2 rows of each shard per step: > 2 epochs of each
    halves = [_data(prepared, p, 2) for p in range(2)]
    assert [h.shard_ids for h in halves] == [[0, 1], [2, 3]]
    # Each process opens only its own shards.
    assert [[f.rsplit("/", 1)[1] for f in h.opened] for h in halves] == \
        [["part-00000-of-00004.arrayrecord", "part-00001-of-00004.arrayrecord"],
         ["part-00002-of-00004.arrayrecord", "part-00003-of-00004.arrayrecord"]]
    full = _take(one.train_iterator(B, seed=5), steps)
    parts = [_take(h.train_iterator(B, seed=5), steps) for h in halves]
    for t in range(steps):
        assert parts[0][t]["inputs"].shape == (B // 2, N) and parts[0][t]["targets"].shape == (B // 2, N, L)
        for k in full[t]:
            np.testing.assert_array_equal(np.concatenate([parts[0][t][k], parts[1][t][k]]), full[t][k])
    # Rows [2s, 2s+2) of every batch come from shard s; within an epoch of a shard each of its train
    # users appears once, and the next epoch is another permutation.
    src = one.sources[1]
    rows = np.stack([src[i]["inputs"] for i in range(len(src))])
    seen = np.concatenate([b["inputs"][2:4] for b in full])       # the rows of shard 1
    m = len(src)
    assert 2 * steps > 2 * m > 0, (m, steps)
    epoch0 = [int(np.flatnonzero((rows == r).all(1))[0]) for r in seen[:m]]
    epoch1 = [int(np.flatnonzero((rows == r).all(1))[0]) for r in seen[m:2 * m]]
    assert sorted(epoch0) == list(range(m)) and sorted(epoch1) == list(range(m)) and epoch0 != epoch1
    other = _take(one.train_iterator(B, seed=6), steps)
    assert any(not np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(full, other))
    np.testing.assert_array_equal(full[0]["weights"], (full[0]["inputs"] != 0).astype(np.float32))


@pytest.mark.parametrize("per_shard", [1, 2, 3, 5])
def test_every_per_shard_batch_streams(prepared, per_shard):
    """Global batch = per_shard x the shard count, one row per shard included: each shard gives
    batch(per_shard) of its repeated stream (Grain reports batch(1)'s length as sys.maxsize + 1); the
    concatenation has a length and yields batches of the global size."""
    one = _data(prepared)
    B = per_shard * SHARDS
    assert len(one.train_dataset(B, seed=1)) > 10**18
    batches = _take(one.train_iterator(B, seed=1), 3)
    assert [b["inputs"].shape for b in batches] == [(B, N)] * 3


def test_a_batch_the_shards_cannot_serve_is_named(prepared):
    msg = rf"global batch {SHARDS + 1} does not divide over the {SHARDS} prepared shards"
    with pytest.raises(D.ShardError, match=msg):
        _data(prepared).train_dataset(SHARDS + 1, seed=1)


def test_iterator_state_restores_the_following_batches(prepared):
    d = _data(prepared)
    it = d.train_iterator(8, seed=1)
    _take(it, 5)
    state = it.get_state()
    frozen = G.frozen_state(it)
    after = _take(it, 4)
    assert frozen.get_state() == state        # the snapshot a checkpoint saves does not move on
    fresh = _data(prepared).train_iterator(8, seed=1)
    fresh.set_state(state)
    for a, b in zip(after, _take(fresh, 4)):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_a_position_saved_by_another_process_count_continues_the_same_global_batches(prepared):
    """train._continue_grain: each process of a resume on another process count starts at global batch
    ``step``; what it then reads is its part of what the saving processes would have read next.
    Positions that disagree with the step, or a state of another shape, are refused by name."""
    from recloss_plugins.config import ConfigError
    from recloss_plugins.sasrec import train as T

    B, step = 8, 7
    halves = [_data(prepared, p, 2).train_iterator(B, seed=3) for p in range(2)]
    for it in halves:
        _take(it, step)
    saved = {p: it.get_state() for p, it in enumerate(halves)}
    expected = [np.concatenate(parts) for parts in zip(*[[b["inputs"] for b in _take(it, 3)] for it in halves])]
    one = _data(prepared).train_iterator(B, seed=3)
    T._continue_grain(one, saved, step, "run")
    for want, got in zip(expected, _take(one, 3)):
        np.testing.assert_array_equal(got["inputs"], want)

    with pytest.raises(ConfigError, match=r"input positions \{0: 7, 1: 6\} are not all 7"):
        T._continue_grain(_data(prepared).train_iterator(B, seed=3), {0: saved[0], 1: {"next_index": 6}}, step, "r")
    with pytest.raises(ConfigError, match=r"saved input state has fields \['epoch', 'next_index'\]"):
        T._continue_grain(_data(prepared).train_iterator(B, seed=3),
                          {p: {**st, "epoch": 1} for p, st in saved.items()}, step, "r")


def test_put_process_local_builds_the_global_batch(prepared):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2, 1), ("data", "fsdp", "vocab"))
    sh = jax.sharding.NamedSharding(mesh, parallel.layout_for(mesh).batch_spec(2))
    x = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
    assert parallel.process_rows(sh, 8) == (0, 8)
    np.testing.assert_array_equal(np.asarray(parallel.put_process_local(x, sh, 8)), x)
    with pytest.raises(parallel.MeshError, match=r"fed 6 batch rows, but its devices hold rows \[0, 8\) of 8"):
        parallel.put_process_local(x[:6], sh, 8)


def test_local_eval_of_the_prepared_users_matches_the_in_memory_eval(prepared, tmp_path):
    from recloss_plugins.sasrec.program import program_for
    args = prepared[1] + ["emb_dim=16", "num_layers=1", "num_heads=2", "mlp_dim=32", "eval_batch_size=24",
                          "eval_block_v=64"]
    cfg = load_config(args)
    mesh = parallel.build_mesh(cfg, jax.devices()[:1])       # sharded eval: tests/test_multiprocess.py
    mem = D.build_dataset(cfg)
    gd = _data(prepared)
    assert gd.vocab_size == mem.vocab_size
    program = program_for(cfg, mesh, gd.vocab_size)
    params = program.init()["params"]
    for name in ("dev",):           # 'test' differs only in the split's cut (tests/test_multiprocess.py runs it)
        got = eval_lib.evaluate(program, params, gd.eval_split(name), popularity_counts=gd.popularity)
        ref = eval_lib.evaluate(program, params, getattr(mem, name), popularity_counts=mem.popularity,
                                replicated=True)
        assert got["model"]["users"] == ref["model"]["users"] == getattr(mem, name).num_users > 24
        assert got["model"]["hit@8"] > 0
        for part in ("model", "popularity"):
            for k, v in ref[part].items():
                assert got[part][k] == pytest.approx(v, abs=1e-9), (name, part, k)
    capped = eval_lib.evaluate(program, params, gd.eval_split("dev"), max_users=10)
    assert capped["model"]["users"] == 10
