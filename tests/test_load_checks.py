"""Errors at load, not at trace: recloss-train refuses, when the config is loaded, the combinations of keys that
used to fail only when the step was traced, after the data was read or prepared, or deep in a data generator.
Each message names every key involved, the bad value and what is expected."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recloss_plugins.config import ConfigError, default_config_path, load_config

pytestmark = pytest.mark.tier1

BASE = str(default_config_path())

# (overrides, the key blamed, the other keys named, the bad value as the message spells it, what is expected).
# Before these checks each passed load_config and failed later (verified by running them through
# recloss_plugins.sasrec.train.train): the gather and num_negatives when the step was traced (a
# ValueError from inside the loss, naming MeshLayout.fsdp_gather or no key), the batch splits after the data
# was loaded or the whole log prepared (with a -1 degree the mesh split is now checked when the mesh is built,
# before the data: the last test), synthetic_num_intents and vocab_size when the data was built, and
# sampled_proposal never (a non-sampled loss ignored it).
REFUSED = {
    "ring gather on a dense loss": (
        ["loss=dense_bce", "loss_fsdp_gather=ring", "ici_data_parallelism=1", "ici_fsdp_parallelism=8"],
        "loss_fsdp_gather", ["loss"], "'ring'", "set loss_fsdp_gather='once', or use a blocked strategy: cutbce"),
    "rows gather on a sampled loss": (
        ["loss=gbce", "loss_fsdp_gather=rows", "ici_data_parallelism=4", "ici_fsdp_parallelism=2"],
        "loss_fsdp_gather", ["loss"], "'rows'", "set loss_fsdp_gather='once'"),
    "ring gather without an fsdp axis": (   # no fsdp axis in this config, but the strategy takes no ring at all
        ["loss=dense_ce", "loss_fsdp_gather=ring"], "loss_fsdp_gather", ["loss"], "'ring'",
        "or use a blocked strategy"),
    "a proposal for a loss that draws no negatives": (
        ["loss=cutbce", "sampled_proposal=counts"], "sampled_proposal", ["loss"], "'counts'",
        "leave it at 'auto' or use one of them"),
    "more negatives than synthetic items": (
        ["loss=sampled_softmax", "num_negatives=600", "synthetic_num_items=511"], "num_negatives",
        ["synthetic_num_items", "loss"], "600", "expected 1 <= num_negatives <= 512"),
    "more negatives than vocab_size": (
        ["loss=gbce", "num_negatives=300", "vocab_size=256", "dataset_type=interactions", "dataset_path=log.parquet"],
        "num_negatives", ["vocab_size", "loss"], "300", "expected 1 <= num_negatives <= 256"),
    "a global batch the mesh degrees do not divide": (
        ["global_batch_size=12", "ici_data_parallelism=2", "ici_fsdp_parallelism=4", "dcn_data_parallelism=1"],
        "global_batch_size", ["ici_data_parallelism", "ici_fsdp_parallelism"], "12",
        "ici_data_parallelism=2 x ici_fsdp_parallelism=4 = 8; use a multiple of 8"),
    "a global batch the fsdp degree does not divide": (
        ["global_batch_size=12", "ici_data_parallelism=1", "dcn_data_parallelism=1", "ici_fsdp_parallelism=8"],
        "global_batch_size", ["ici_fsdp_parallelism"], "12", "ici_fsdp_parallelism=8; use a multiple of 8"),
    "a global batch the prepared shards do not divide": (
        ["dataset_type=interactions", "dataset_path=log.parquet", "prepare_num_shards=5", "global_batch_size=64"],
        "global_batch_size", ["prepare_num_shards", "prepared_data_path"], "64", "use a multiple of 5"),
    "more intents than synthetic items": (
        ["synthetic_num_intents=600", "synthetic_num_items=511"], "synthetic_num_intents", ["synthetic_num_items"],
        "600", "must be <= synthetic_num_items=511"),
    "vocab_size below the synthetic items": (
        ["vocab_size=100", "synthetic_num_items=511"], "vocab_size", ["synthetic_num_items"], "100",
        "set vocab_size: 0 or >= 512"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_combinations_are_refused_at_load_naming_every_key(name):
    overrides, key, others, value, expected = REFUSED[name]
    with pytest.raises(ConfigError) as info:
        load_config([BASE, *overrides])
    msg = str(info.value)
    assert msg.startswith(f"config key {key!r} (from override "), msg
    for other in others:
        assert other in msg, (other, msg)
    assert value in msg and expected in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("overrides", [
    ["loss=cutbce", "loss_fsdp_gather=ring"],                     # a blocked strategy takes every mode
    ["loss=cutce_pallas", "loss_fsdp_gather=rows"],
    ["loss=dense_bce", "loss_fsdp_gather=auto"],                  # auto picks one the strategy takes
    ["loss=gbce", "sampled_proposal=counts"],
    ["loss=sampled_softmax", "num_negatives=512", "synthetic_num_items=511"],        # K = V
    ["loss=sampled_softmax", "num_negatives=5000", "dataset_type=interactions", "dataset_path=log.parquet"],
    ["global_batch_size=12", "ici_fsdp_parallelism=8"],           # a -1 degree (data): the split is checked
    ["global_batch_size=0", "per_device_batch_size=3", "ici_fsdp_parallelism=4"],   # when the mesh is built
    ["dataset_type=interactions", "dataset_path=log.parquet", "prepare_num_shards=5", "global_batch_size=64",
     "prepared_data_path=/data/prepared"],                      # the shard count is the folder's, read at open
])
def test_the_combinations_that_work_still_load(overrides):
    load_config([BASE, *overrides])


def test_main_reports_a_combination_as_a_config_error(capsys):
    from recloss_plugins.sasrec.train import main
    assert main([BASE, "loss=dense_ce", "loss_fsdp_gather=rows", "ici_data_parallelism=4",
                 "ici_fsdp_parallelism=2"]) == 2
    err = capsys.readouterr().err
    assert "recloss-train: config error: config key 'loss_fsdp_gather'" in err and "loss='dense_ce'" in err


def test_loading_a_sampled_config_starts_no_jax_backend():
    """The num_negatives check traces the loss's own draw on shapes: loading a config must leave JAX's backends
    alone, since a multi-process run initialises jax.distributed after loading it."""
    code = ("from recloss_plugins.config import load_config; "
            "load_config(['loss=sampled_softmax', 'num_negatives=64']); "
            "from jax._src import xla_bridge; assert not xla_bridge.backends_are_initialized(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _log(path, n_items: int):
    rng = np.random.default_rng(0)
    n = 3000
    pq.write_table(pa.table({"uid": rng.integers(0, 60, n), "item_id": rng.integers(0, n_items, n),
                             "timestamp": np.arange(n)}), path)


def test_more_negatives_than_the_data_has_items_stop_before_the_step_is_built(tmp_path, monkeypatch):
    """V from the data is known once the data is read: the same check runs there, before anything compiles."""
    from recloss_plugins.sasrec import train as T

    _log(tmp_path / "log.parquet", 90)
    cfg = load_config([BASE, "loss=sampled_softmax", "num_negatives=200", "dataset_type=interactions",
                       f"dataset_path={tmp_path / 'log.parquet'}", "data_pipeline=memory", "num_labels=2",
                       "max_seq_len=8", "global_batch_size=8", f"base_output_directory={tmp_path}", "run_name=r"])
    built = []
    monkeypatch.setattr(T, "program_for", lambda *a, **k: built.append(1))
    with pytest.raises(ConfigError, match=r"config key 'num_negatives' is 200, more than the V=91 ids there are "
                                          r"\(the data's 90 items \+ the padding id\) with loss='sampled_softmax': "
                                          r"num_negatives=200 exceeds the vocabulary size V=91"):
        T.train(cfg, log=lambda *a: None)
    assert built == []


def test_a_global_batch_the_mesh_does_not_split_stops_before_the_data_is_read(tmp_path):
    """With a -1 degree the split is known once the mesh is built: before the log is read or prepared."""
    from recloss_plugins.sasrec import parallel
    from recloss_plugins.sasrec import train as T

    cfg = load_config([BASE, "global_batch_size=12", "ici_fsdp_parallelism=4", "dataset_type=interactions",
                       f"dataset_path={tmp_path / 'no-such-log.parquet'}", "prepare_num_shards=4",
                       f"base_output_directory={tmp_path}", "run_name=r"])
    with pytest.raises(parallel.MeshError, match=r"config key 'global_batch_size': the global batch 12 does not "
                                                  r"split over 8 batch shards"):
        T.train(cfg, log=lambda *a: None)         # a DataError (no such log) would mean the data came first
    assert not (tmp_path / "prepared").exists()
