"""recloss-train end to end on tiny synthetic data: artifacts, resume equality (BCE, softmax, sampled),
strategy equality per objective, the softmax objective's training and metrics, non-finite stop, the
(2, 2, 2) mesh against one device, and compile_topology's quiet stderr."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import recloss
from recloss_plugins.config import default_config_path, load_config
from recloss_plugins.sasrec import data as D
from recloss_plugins.sasrec.checkpoints import Checkpoints
from recloss_plugins.sasrec.train import NonFiniteLossError, main, train

pytestmark = pytest.mark.tier1

TINY = [
    "synthetic_num_users=48", "synthetic_num_items=511", "synthetic_min_len=20", "synthetic_max_len=30",
    "synthetic_num_intents=4", "synthetic_intents_per_user=2", "num_labels=4", "max_seq_len=8",
    "global_batch_size=16", "emb_dim=16", "num_layers=1", "num_heads=2", "mlp_dim=32", "dropout=0.1",
    "learning_rate=3e-3", "warmup_steps=2", "eval_batch_size=32", "eval_block_v=200", "log_period=2",
]


def _cfg(tmp_path, *extra):
    return load_config([str(default_config_path()), *TINY, f"base_output_directory={tmp_path}", *extra])


def _one_device():
    return jax.devices()[:1]


def _params(result):
    return [np.asarray(x) for x in jax.tree.leaves(result.state["params"])]


def test_end_to_end_writes_every_artifact(tmp_path, capsys):
    rc = main([str(default_config_path()), *TINY, f"base_output_directory={tmp_path}", "run_name=e2e",
               "steps=6", "checkpoint_period=4", "eval_interval=2", "eval_max_users=16"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "config:" in out and "per-device memory" in out and "step 6/6 | loss" in out
    assert "precision" in out and "items/s" in out and "ETA" in out
    assert "SASRec" in out and "popularity" in out
    run = tmp_path / "e2e"
    cfg = load_config([str(run / "config.yml")])
    assert cfg.steps == 6 and cfg.run_name == "e2e"
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [2, 4, 6]
    assert all(np.isfinite(r["loss"]) and 0 <= r["recall"] <= 1 for r in train_rows)
    assert {r["split"] for r in rows} >= {"dev", "test", "dev_popularity", "test_popularity"}
    dev_rows = [r for r in rows if r["split"] == "dev"]
    assert [r["step"] for r in dev_rows] == [2, 4, 6]
    assert [r["users"] for r in dev_rows] == [16, 16, 48]      # periodic evals use eval_max_users
    assert "step 2 dev: hit@8" in out
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    ckpt = Checkpoints(run / "checkpoints", 0)
    assert ckpt.manager.all_steps() == [4, 6]
    ckpt.close()
    res = json.loads((run / "eval_results.json").read_text())
    assert set(res) == {"step", "dev", "test", "dev_popularity", "test_popularity"}
    assert 0 <= res["test"]["hit@8"] <= 1


# cutbce keeps the program knobs the other tests share (one compile per session); cutce resumes the
# softmax objective the same way; sampled_softmax also redraws step 5's negatives (key from seed and step);
# rowwise_adagrad resumes the item tables' per-row accumulators, and a bfloat16 table its rounded rows.
@pytest.mark.parametrize("loss", ["cutbce", "cutce", "sampled_softmax", "cutbce+rowwise_adagrad",
                                  "cutbce+rowwise_adagrad+bfloat16"])
def test_resume_ends_with_the_same_parameters(tmp_path, loss):
    loss, _, item_optimizer = loss.partition("+")
    item_optimizer, _, table_dtype = item_optimizer.partition("+")
    common = ["steps=7", "checkpoint_period=2", "log_period=1", f"loss={loss}"]
    if loss == "sampled_softmax":
        common += ["num_negatives=64", "in_batch_negatives=true"]
    if item_optimizer:
        common += [f"item_optimizer={item_optimizer}", "item_learning_rate=0.05"]
    if table_dtype:         # the stochastic rounding's draws are the run's: a resume redraws them
        common += [f"item_table_dtype={table_dtype}"]
    ds = D.build_dataset(_cfg(tmp_path, *common))
    full = train(_cfg(tmp_path, *common, "run_name=full"), devices=_one_device(), dataset=ds,
                 log=lambda *a: None)
    # Preempted after step 5: the last checkpoint is step 4; step 5 is redone on resume.
    cut = train(_cfg(tmp_path, *common, "run_name=cut"), devices=_one_device(), dataset=ds,
                stop_after=5, log=lambda *a: None)
    assert cut.steps_done == 5 and not cut.evals
    logs = []
    resumed = train(_cfg(tmp_path, *common, "run_name=cut"), devices=_one_device(), dataset=ds, log=logs.append)
    assert any("resumed from" in l and "step 4" in l for l in logs)
    assert sorted(resumed.losses) == [4, 5, 6]
    assert resumed.data_position == full.data_position == 7 * 16
    for s in (4, 5, 6):
        assert resumed.losses[s] == full.losses[s]
    for a, b in zip(_params(full), _params(resumed)):
        np.testing.assert_array_equal(a, b)
    assert resumed.evals["test"] == full.evals["test"]


def test_a_counts_proposal_trains_and_without_counts_is_uniform_and_says_so(tmp_path):
    """``sampled_proposal=counts``: the step takes the training counts' log q as its argument and trains;
    a training split that counts no item (padding aside) draws uniformly and the log says so."""
    import dataclasses

    from recloss_plugins.sasrec.program import counts_any
    assert not counts_any(np.array([7, 0, 0]), 3) and counts_any(np.array([0, 0, 2]), 3, chunk=1)
    assert not counts_any(np.array([0, 0, 0, 4]), 3)     # past V does not count
    common = ["steps=3", "log_period=1", "enable_checkpointing=false", "enable_tensorboard=false",
              "loss=sampled_softmax", "num_negatives=16", "sampled_proposal=counts"]
    ds = D.build_dataset(_cfg(tmp_path, *common))
    assert counts_any(ds.popularity, ds.vocab_size)
    for name, data in (("counted", ds), ("uncounted", dataclasses.replace(ds, popularity=np.zeros_like(ds.popularity)))):
        logs = []
        r = train(_cfg(tmp_path, *common, f"run_name={name}"), devices=_one_device(), dataset=data, log=logs.append)
        assert sorted(r.losses) == [0, 1, 2] and all(np.isfinite(v) for v in r.losses.values())
        assert any("from the counts proposal" in l for l in logs)
        assert any("counts no item" in l for l in logs) == (name == "uncounted")


def _of(objective):
    return list(recloss.available_strategies(objective))


@pytest.mark.parametrize("objective,names", [("bce", ("dense_bce", "cutbce", "cutbce_pallas")),
                                             ("softmax", ("dense_ce", "cutce", "cutce_pallas"))])
def test_strategies_give_equal_loss_curves(tmp_path, objective, names):
    # The dense baseline, the blocked strategy and the Pallas one once it is registered.
    expected, names = names, [n for n in names if n in _of(objective)]
    assert names[:2] == list(expected[:2])
    # Same program knobs as the resume test, so the cutbce program is compiled once per session.
    common = ["steps=7", "checkpoint_period=2", "log_period=1", "enable_checkpointing=false",
              "enable_tensorboard=false"]
    ds = D.build_dataset(_cfg(tmp_path, *common))
    curves = {}
    for name in names:
        r = train(_cfg(tmp_path, *common, f"loss={name}", f"run_name={name}"), devices=_one_device(),
                  dataset=ds, log=lambda *a: None)
        curves[name] = np.array([r.losses[s] for s in range(7)])
    ref = curves[names[0]]
    assert ref[-1] < ref[0]
    for name, curve in curves.items():
        np.testing.assert_allclose(curve, ref, rtol=2e-5, err_msg=name)


def test_softmax_strategy_trains_logs_top1_and_beats_popularity(tmp_path, capsys):
    # The softmax objective end to end through the command line: loss=cutce with a z-loss.
    rc = main([str(default_config_path()), *TINY, f"base_output_directory={tmp_path}", "run_name=ce",
               "loss=cutce", "z_loss=1e-4", "steps=200", "log_period=20", "checkpoint_period=100",
               "enable_tensorboard=false"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "loss=cutce" in out and "step 200/200 | loss" in out
    assert "top1" in out and "mean_lse" in out and "precision" not in out
    run = tmp_path / "ce"
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(20, 201, 20))
    for r in train_rows:
        assert {"loss", "top1", "mean_lse", "grad_norm", "items_per_sec"} <= set(r) and "precision" not in r
        assert np.isfinite(r["loss"]) and 0 <= r["top1"] <= 1 and np.isfinite(r["mean_lse"])
    assert train_rows[-1]["loss"] < 0.75 * train_rows[0]["loss"]
    assert train_rows[-1]["top1"] > train_rows[0]["top1"]
    res = json.loads((run / "eval_results.json").read_text())
    assert res["dev"]["hit@8"] > res["dev_popularity"]["hit@8"]
    assert res["dev"]["ndcg@8"] > res["dev_popularity"]["ndcg@8"]
    assert load_config([str(run / "config.yml")]).loss == "cutce"


def test_loss_metrics_follow_the_objective():
    from recloss_plugins.sasrec.logging_utils import loss_metrics
    bce = [(0, {"tp": 2.0, "fp": 2.0, "fn": 6.0, "weight_sum": 4.0}), (1, {"tp": 2.0, "fp": 0.0, "fn": 0.0,
                                                                          "weight_sum": 4.0})]
    assert loss_metrics("bce", bce) == {"precision": pytest.approx(4 / 6), "recall": pytest.approx(4 / 10)}
    ce = [(0, {"top1": 1.0, "mean_lse": 2.0, "weight_sum": 4.0}), (1, {"top1": 3.0, "mean_lse": 5.0,
                                                                        "weight_sum": 2.0})]
    assert loss_metrics("softmax", ce) == {"top1": pytest.approx(4 / 6), "mean_lse": pytest.approx(18 / 6)}
    assert set(loss_metrics("", ce)) == {"top1", "mean_lse"} and loss_metrics("", [(0, {})]) == {}
    assert all(np.isnan(v) for v in loss_metrics("softmax", [(0, {"weight_sum": 0.0})]).values())
    sampled = [(0, {"top1": 1.0, "weight_sum": 4.0}), (1, {"top1": 3.0, "weight_sum": 2.0})]
    assert loss_metrics("sampled", sampled) == {"top1": pytest.approx(4 / 6)}   # no log-partition to log


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    # lr 1e30 reached at step index 1 blows the parameters up; the loss of step index 2 is NaN.
    cfg = _cfg(tmp_path, "steps=8", "checkpoint_period=2", "log_period=1", "learning_rate=1e30",
               "warmup_steps=2", "run_name=nan")
    with pytest.raises(NonFiniteLossError, match=r"at step 3.*last good checkpoint is step 2"):
        train(cfg, log=lambda *a: None)
    ckpt = Checkpoints(tmp_path / "nan" / "checkpoints", 0)
    assert ckpt.manager.all_steps() == [2]
    ckpt.close()
    rc = main([str(default_config_path()), *TINY, f"base_output_directory={tmp_path}", "run_name=nan2",
               "steps=8", "learning_rate=1e30", "warmup_steps=2", "log_period=1"])
    assert rc == 1


# The shapes are compared before Orbax reads anything: a restore failing part-way left TensorStore
# reads calling into a closed event loop ("Event loop is closed" dumped as unraisable exceptions).
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_resume_refuses_a_different_model(tmp_path):
    train(_cfg(tmp_path, "steps=7", "checkpoint_period=2", "log_period=1", "run_name=m"), devices=_one_device(),
          stop_after=2, log=lambda *a: None)
    from recloss_plugins.config import ConfigError
    with pytest.raises(ConfigError, match=r"has shape \(.*\) in the checkpoint but \(.*\) in this run.*new run_name"):
        train(_cfg(tmp_path, "steps=4", "emb_dim=32", "run_name=m"), devices=_one_device(), log=lambda *a: None)


def test_bfloat16_untied_run_learns(tmp_path):
    r = train(_cfg(tmp_path, "steps=8", "dtype=bfloat16", "untie_embeddings=true", "dropout=0",
                   "enable_checkpointing=false", "log_period=1", "learning_rate=1e-2", "run_name=bf16"),
              devices=_one_device(), log=lambda *a: None)
    assert "out_table" in r.state["params"]
    losses = [r.losses[s] for s in range(8)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert r.state["params"]["out_table"].dtype == np.float32


def test_mesh_2x2x2_matches_one_device(tmp_path):
    assert len(jax.devices()) == 8
    # V = 512 = padded rows on both meshes, so both initialise the same table. The one-device
    # run shares its program with the resume test.
    common = ["steps=7", "checkpoint_period=2", "log_period=1", "enable_checkpointing=false",
              "enable_tensorboard=false", "loss=cutbce"]
    ds = D.build_dataset(_cfg(tmp_path, *common))
    one = train(_cfg(tmp_path, *common, "run_name=one"), devices=_one_device(), dataset=ds, log=lambda *a: None)
    logs = []
    mesh = train(_cfg(tmp_path, *common, "run_name=mesh", "ici_data_parallelism=2", "ici_fsdp_parallelism=2",
                      "ici_vocab_parallelism=2"), dataset=ds, log=logs.append)
    assert any("{'data': 2, 'fsdp': 2, 'vocab': 2}" in l for l in logs)
    # The model's batch is split over the vocab axis too (the loss gathers its rows back over it).
    assert mesh.program.model_batch_axes == ("data", "fsdp", "vocab")
    assert any("model: batch split over ('data', 'fsdp', 'vocab') (8 ways)" in l for l in logs), logs
    assert mesh.program.rows == one.program.rows == 512
    table = mesh.state["params"]["item_emb"]["embedding"]
    assert table.sharding.spec[0] == ("vocab", "fsdp")
    np.testing.assert_allclose([mesh.losses[s] for s in range(7)], [one.losses[s] for s in range(7)], rtol=2e-5)
    for a, b in zip(_params(one), _params(mesh)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
    assert mesh.evals["test"]["hit@8"] == pytest.approx(one.evals["test"]["hit@8"], abs=1 / 48)


@pytest.mark.parametrize("extra", [["loss=cutbce_pallas"], ["loss=cutce", "untie_embeddings=true"]],
                         ids=["tied-cutbce_pallas", "untied-cutce"])
def test_data_parallel_step_by_hand_matches_one_device(tmp_path, extra):
    """8-way data parallel (the table whole on every chip) runs the step under its own shard_map with
    the gradients summed in place; with dropout on (masks drawn for the whole batch) it trains as
    one device does."""
    assert len(jax.devices()) == 8
    common = ["steps=5", "log_period=1", "enable_checkpointing=false", "enable_tensorboard=false", *extra]
    ds = D.build_dataset(_cfg(tmp_path, *common))
    one = train(_cfg(tmp_path, *common, "run_name=one"), devices=_one_device(), dataset=ds, log=lambda *a: None)
    logs = []
    dp = train(_cfg(tmp_path, *common, "run_name=dp", "ici_data_parallelism=8"), dataset=ds, log=logs.append)
    assert one.program.manual is None and dp.program.manual is not None
    assert dp.program.manual.batch_axes == ("data",)
    assert any("train step: data parallel under shard_map over ('data',)" in l for l in logs), logs
    np.testing.assert_allclose([dp.losses[s] for s in range(5)], [one.losses[s] for s in range(5)], rtol=2e-5)
    for a, b in zip(_params(one), _params(dp)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)


@pytest.mark.tpu_aot
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (jax[tpu]) is not installed")
def test_compile_topology_runs_without_libtpu_noise():
    # A fresh process, as libtpu complains once, when it loads; without the TPU_WORKER_* defaults
    # that recloss.bench.topology may have set in this one.
    env = {k: v for k, v in os.environ.items() if k not in ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_HOST_BOUNDS")}
    env.update(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
    run = subprocess.run([sys.executable, "-m", "recloss_plugins.sasrec.train", str(default_config_path()), *TINY,
                          "compile_topology=v6e-8"], capture_output=True, text=True, env=env, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr
    assert "per-chip HBM" in run.stdout
    # The five largest buffers, each with its size and kind (recloss.aot).
    lines = run.stdout.splitlines()
    at = next(i for i, l in enumerate(lines) if l.startswith("largest buffers at the memory peak ("))
    assert all(l.split()[1] in ("B", "KiB", "MiB", "GiB") and l.split()[2] in ("argument", "output", "temporary")
               for l in lines[at + 1:at + 6]), lines[at:at + 6]
    assert "argument state['params']" in run.stdout or "argument state['opt_state']" in run.stdout
    assert "unexpected worker hostname" not in run.stderr and "could not determine" not in run.stderr, run.stderr


# ----------------------------------------------------------------------------- PRNG implementation
# MaxText's train.main sets jax_default_prng_impl=unsafe_rbg for the whole process: the trainer's
# keys (init, dropout, negatives) and checkpoints must not depend on it.
PRNG_RUN = ["steps=4", "checkpoint_period=2", "log_period=1", "loss=sampled_softmax", "num_negatives=64",
            "dropout=0.1", "enable_tensorboard=false"]


def test_keys_and_checkpoints_ignore_the_global_prng_impl(tmp_path, monkeypatch):
    import collections

    from recloss_plugins.sasrec import program as program_lib
    old = jax.config.jax_default_prng_impl          # threefry2x32 unless JAX_DEFAULT_PRNG_IMPL says otherwise
    other = "unsafe_rbg" if old != "unsafe_rbg" else "threefry2x32"
    ds = D.build_dataset(_cfg(tmp_path, *PRNG_RUN))
    quiet = dict(devices=_one_device(), dataset=ds, log=lambda *a: None)
    ref = train(_cfg(tmp_path, *PRNG_RUN, "run_name=ref"), **quiet)
    # Written under the default; resumed below under unsafe_rbg (the other global setting).
    train(_cfg(tmp_path, *PRNG_RUN, "run_name=cut"), stop_after=2, **quiet)
    ckpt = Checkpoints(tmp_path / "cut" / "checkpoints", 0)
    assert ckpt.meta(2)["prng_impl"] == program_lib.PRNG_IMPL == "threefry2x32"
    ckpt.close()
    ref_keys = (np.asarray(jax.random.key_data(program_lib.negatives_key(0, 3))),
                np.asarray(ref.program.init()["rng"]))

    jax.config.update("jax_default_prng_impl", other)    # what MaxText's train.main does
    monkeypatch.setattr(program_lib, "_PROGRAMS", collections.OrderedDict())   # programs traced afresh
    try:
        assert str(jax.random.key_impl(jax.random.key(0))) == other      # the global setting took effect
        logs = []
        resumed = train(_cfg(tmp_path, *PRNG_RUN, "run_name=cut"), devices=_one_device(), dataset=ds,
                        log=logs.append)
        assert resumed.program is not ref.program
        keys = (np.asarray(jax.random.key_data(program_lib.negatives_key(0, 3))),
                np.asarray(resumed.program.init()["rng"]))
        init = [np.asarray(x) for x in jax.tree.leaves(resumed.program.init()["params"])]
    finally:
        jax.config.update("jax_default_prng_impl", old)
    # The same keys and initial parameters under either global setting ...
    for a, b in zip(keys, ref_keys):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(init, jax.tree.leaves(ref.program.init()["params"])):
        np.testing.assert_array_equal(a, np.asarray(b))
    # ... and the resumed steps draw the dropout masks and negatives of the uninterrupted run.
    assert any("resumed from" in l and "step 2" in l for l in logs), logs
    assert sorted(resumed.losses) == [2, 3]
    for s in (2, 3):
        assert resumed.losses[s] == ref.losses[s]
    for a, b in zip(_params(ref), _params(resumed)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("recorded, rng_shape, named", [
    ("unsafe_rbg", (2,), "unsafe_rbg"),        # the recorded implementation decides
    (None, (4,), "rbg or unsafe_rbg"),          # written before it was recorded: the key data's shape
])
def test_resume_refuses_a_checkpoint_of_another_prng_impl(tmp_path, monkeypatch, recorded, rng_shape, named):
    from recloss_plugins.config import ConfigError
    real_save = Checkpoints.save

    def save_as_other_impl(self, step, state, meta, data=None):
        meta = dict(meta)
        meta.pop("prng_impl")
        if recorded:
            meta["prng_impl"] = recorded
        state = dict(state, rng=jax.numpy.zeros(rng_shape, jax.numpy.uint32))
        return real_save(self, step, state, meta, data)

    monkeypatch.setattr(Checkpoints, "save", save_as_other_impl)
    run = ["steps=7", "checkpoint_period=2", "log_period=1", "run_name=other"]
    train(_cfg(tmp_path, *run), devices=_one_device(), stop_after=2, log=lambda *a: None)
    monkeypatch.setattr(Checkpoints, "save", real_save)
    with pytest.raises(ConfigError) as err:
        train(_cfg(tmp_path, *run), devices=_one_device(), log=lambda *a: None)
    msg = str(err.value)
    assert f"holds {named} PRNG keys" in msg and "draws threefry2x32 keys" in msg and "new run_name" in msg, msg
