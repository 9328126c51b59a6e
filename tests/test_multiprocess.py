"""Two processes on localhost, one global 2×2×2 mesh: the sharded loss equals the one-process run
(fsdp_gather='once', and 'ring' with the ring crossing the processes).

The two processes are the shared run of tests/conftest.py `two_process_run`
(`tests/_multiprocess_worker.py two-process` through launch/local.py, 4 CPU devices each, meeting
through `jax.distributed.initialize` at a 127.0.0.1 coordinator): its sharded-loss part writes the
result of process 0 (loss, metrics, gradients gathered across processes), compared here with the
same computation on this process's 8 devices and with layout=None.

The Grain tests run recloss-train on prepared shards: 2 processes × 4 devices (the shared run's
Grain part) against 1 × 8 in this process, and a run killed with SIGKILL mid-epoch, then resumed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import recloss
from _multiprocess_worker import AXES, MESH_SHAPE, TIMEOUT_S, grain_args, loss_and_grads, make_inputs
from conftest import xla_flags

pytestmark = pytest.mark.tier2

WORKER = Path(__file__).with_name("_multiprocess_worker.py")


def _rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def test_two_processes_match_one_process(two_process_run):
    two_process_run.check()
    got = np.load(two_process_run.dir / "result.npz")

    inputs = make_inputs(two_process_run.seed)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(MESH_SHAPE), AXES)
    (loss, mets), grads = loss_and_grads(inputs, recloss.MeshLayout(mesh))
    (loss0, mets0), grads0 = loss_and_grads(inputs, None)

    # "ring_" / "rows_": MeshLayout(fsdp_gather='ring' / 'rows') with the fsdp axis across the two processes.
    for p, ref_loss, ref_mets, ref_grads in (("", loss, mets, grads), ("", loss0, mets0, grads0),
                                             ("ring_", loss0, mets0, grads0), ("rows_", loss0, mets0, grads0)):
        assert _rel(got[p + "loss"], ref_loss) <= 1e-5, (p, float(got[p + "loss"]), float(ref_loss))
        for k, v in ref_mets.items():
            assert _rel(got[p + k], v) <= 1e-5, (p, k, float(got[p + k]), float(v))
        for name, g in zip(("grad_hidden", "grad_table", "grad_bias"), ref_grads):
            assert got[p + name].shape == g.shape, (p, name, got[p + name].shape, g.shape)
            assert np.max(np.abs(g)) > 0
            assert _rel(got[p + name], g) <= 1e-4, (p, name, _rel(got[p + name], g))
    assert float(got["invalid_targets"]) >= 1.0


# ----------------------------------------------------------------------------- the Grain pipeline, 2 hosts
@pytest.fixture(scope="module")
def grain_job(two_process_run, tmp_path_factory):
    """The shared run's prepared 4,000-event log and the uninterrupted 1-process × 8-device reference
    run on it (in this process; outputs under this module's own temporary directory)."""
    from recloss_plugins.config import load_config
    from recloss_plugins.sasrec import train as T

    tmp = tmp_path_factory.mktemp("grain_mp")
    args = grain_args(two_process_run.dir) + [f"base_output_directory={tmp / 'runs'}"]
    ref = T.train(load_config(args + ["run_name=ref", "enable_checkpointing=false"]), devices=jax.devices()[:8],
                  log=lambda *a: None)
    return tmp, args, ref


def _grain_launch(args, out, d, *extra):
    """The Grain worker as one plain process of ``d`` devices and no jax.distributed (the same runtime
    as this test process)."""
    out.mkdir()
    cmd = [sys.executable, str(WORKER), "grain-train", str(out), *extra, *args]
    env = dict(os.environ, PYTHONPATH=str(WORKER.parents[1]), XLA_FLAGS=xla_flags(d),
               JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=out)


def _params(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def test_grain_two_processes_train_like_one_and_read_only_their_shards(two_process_run, grain_job):
    import json
    _, _, ref = grain_job
    two_process_run.check()
    run, out = two_process_run.dir, two_process_run.dir / "grain"
    assert "process 0 of 2 reads shards 0..3" in two_process_run.stdout
    opened = [[p.rsplit("/", 1)[1] for p in json.loads((out / f"opened_p{i}.json").read_text())] for i in range(2)]
    data_dir = run / "runs" / "two" / "checkpoints" / "6" / "data"    # each process saved its iterator state
    assert [json.loads((data_dir / f"process_{i}-of-2.json").read_text())["next_index"] for i in range(2)] == [6, 6]
    assert opened == [[f"part-{s:05d}-of-00008.arrayrecord" for s in range(4 * i, 4 * i + 4)] for i in range(2)]
    got = json.loads((out / "evals.json").read_text())
    losses = {int(k): v for k, v in got["losses"].items()}
    assert sorted(losses) == sorted(ref.losses) == list(range(6))
    tol = {s: 1e-5 * abs(v) for s, v in ref.losses.items()}
    for s, v in ref.losses.items():
        assert abs(losses[s] - v) <= tol[s], (s, losses[s], v)
    flat = jax.tree_util.tree_flatten_with_path(ref.state["params"])[0]
    init = dict(jax.tree_util.tree_flatten_with_path(ref.program.init()["params"])[0])
    params = _params(out / "params.npz")
    assert len(params) == len(flat)
    for k, v in flat:
        assert _rel(params[jax.tree_util.keystr(k)], np.asarray(v)) <= 1e-4, jax.tree_util.keystr(k)
    # The equalities mean something: training moved the parameters far beyond that tolerance (AdamW
    # steps of ~learning_rate each), and the loss curve beyond the loss tolerance (no fixed spread,
    # which a seed's luck can undercut: 7e-4 with seed 3692176108).
    moved = _rel(np.concatenate([np.ravel(v) for _, v in flat]),
                 np.concatenate([np.ravel(init[k]) for k, _ in flat]))
    assert moved > 100 * 1e-4, moved
    assert max(ref.losses.values()) - min(ref.losses.values()) > 10 * max(tol.values()), ref.losses
    # Each process scored its own users; combined, every dev/test user of the data was scored once.
    for name in ("dev", "test", "dev_popularity"):
        assert got["evals"][name]["users"] == ref.evals[name]["users"] > 50
        for k, v in ref.evals[name].items():
            assert abs(got["evals"][name][k] - v) <= 1.0 / ref.evals[name]["users"] + 1e-9, (name, k)


def test_grain_kill_9_mid_epoch_then_resume_gives_the_uninterrupted_parameters(grain_job):
    import json
    from recloss_plugins.config import load_config
    from recloss_plugins.sasrec import train as T
    from recloss_plugins.sasrec.data import pipeline

    tmp, args, ref = grain_job
    kill_at = 4
    shard_users = [len(s) for s in pipeline.grain_data_for(load_config(args), 0, 1).sources]
    rows = kill_at * 16 // 8                            # rows each shard gave by the kill
    assert all(rows % m for m in shard_users), shard_users     # mid-epoch in every shard
    res = _grain_launch(args + ["run_name=killed"], tmp / "killed", 8, "--kill-at", str(kill_at))
    assert res.returncode == -9, res.stdout[-3000:] + res.stderr[-3000:]
    assert "step 4/6" in res.stdout and "step 5/6" not in res.stdout
    ckpts = tmp / "runs" / "killed" / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [2, 4]
    assert json.loads((ckpts / "4" / "data" / "process_0-of-1.json").read_text())["next_index"] == kill_at
    resumed = T.train(load_config(args + ["run_name=killed"]), devices=jax.devices()[:8], log=lambda *a: None)
    assert sorted(resumed.losses) == [4, 5]
    for s in resumed.losses:
        assert resumed.losses[s] == ref.losses[s], s
    for a, b in zip(jax.tree.leaves(ref.state["params"]), jax.tree.leaves(resumed.state["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_grain_kill_9_with_row_wise_adagrad_and_a_bf16_table_then_resume_gives_the_uninterrupted_run(grain_job):
    """``item_optimizer: rowwise_adagrad`` with ``item_table_dtype: bfloat16`` on the (2, 2, 2) mesh (the
    accumulators split like the table's rows, the rows stochastically rounded from the run's keys):
    killed with SIGKILL after the step-4 checkpoint, resumed, it ends with the parameters, losses and
    final metrics of the run that was never stopped."""
    from recloss_plugins.config import load_config
    from recloss_plugins.sasrec import train as T

    tmp, args, _ = grain_job
    ada = args + ["item_optimizer=rowwise_adagrad", "item_learning_rate=0.1", "item_adagrad_initial_accumulator=0.01",
                  "item_table_dtype=bfloat16"]
    ref = T.train(load_config(ada + ["run_name=ada-ref", "enable_checkpointing=false"]), devices=jax.devices()[:8],
                  log=lambda *a: None)
    res = _grain_launch(ada + ["run_name=ada-killed"], tmp / "ada-killed", 8, "--kill-at", "4")
    assert res.returncode == -9, res.stdout[-3000:] + res.stderr[-3000:]
    assert "step 4/6" in res.stdout and "step 5/6" not in res.stdout
    resumed = T.train(load_config(ada + ["run_name=ada-killed"]), devices=jax.devices()[:8], log=lambda *a: None)
    assert sorted(resumed.losses) == [4, 5]
    for s in resumed.losses:
        assert resumed.losses[s] == ref.losses[s], s
    assert resumed.state["params"]["item_emb"]["embedding"].dtype == jnp.bfloat16
    for a, b in zip(jax.tree.leaves(ref.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed.evals == ref.evals


def _grain_launch_processes(args, out, n, d, *extra):
    """The Grain worker as ``n`` processes x ``d`` devices meeting through jax.distributed (launch/local.py)."""
    out.mkdir()
    cmd = [sys.executable, str(WORKER.parents[1] / "launch" / "local.py"), "-n", str(n), "-d", str(d), "--timeout",
           str(TIMEOUT_S), "--exec", "--", sys.executable, str(WORKER), "grain-train", str(out), *extra, *args]
    env = dict(os.environ, PYTHONPATH=str(WORKER.parents[1]), XLA_FLAGS=xla_flags(d), JAX_PLATFORMS="cpu")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S + 60, env=env, cwd=out)


def test_grain_kill_9_on_2_processes_then_resume_on_1_and_on_4_continues_the_same_run(grain_job):
    """2 processes x 4 devices, kill -9 after the step-4 checkpoint; the run resumed as 1 x 8 and as
    4 x 2 restores exactly the saved parameters onto its own mesh, continues the same global batches
    and ends as the uninterrupted run (within the 2-vs-1-process rounding of the test above)."""
    import json
    import shutil

    from recloss_plugins.config import load_config
    from recloss_plugins.sasrec import train as T

    tmp, args, ref = grain_job
    kill_at, runs = 4, tmp / "runs"
    res = _grain_launch_processes(args + ["run_name=elastic"], tmp / "elastic", 2, 4, "--kill-at", str(kill_at))
    assert res.returncode != 0 and "step 4/6" in res.stdout and "step 5/6" not in res.stdout, \
        res.stdout[-3000:] + res.stderr[-3000:]
    data = runs / "elastic" / "checkpoints" / str(kill_at) / "data"
    assert sorted(p.name for p in data.glob("process_*")) == ["process_0-of-2.json", "process_1-of-2.json"]
    saved = _params(tmp / "elastic" / "saved.npz")
    for name in ("on1", "on4"):
        shutil.copytree(runs / "elastic", runs / name)

    # 1 process x 8 devices, in this process (the restored state is what _resume_or_init returns).
    lines, restored = [], {}
    real = T._resume_or_init

    def recording(*a, **k):
        out = real(*a, **k)
        flat = jax.tree_util.tree_flatten_with_path(out[0]["params"])[0]
        restored.update({jax.tree_util.keystr(p): np.asarray(v) for p, v in flat})
        return out

    T._resume_or_init = recording
    try:
        on1 = T.train(load_config(args + ["run_name=on1"]), devices=jax.devices()[:8], log=lines.append)
    finally:
        T._resume_or_init = real
    said = next(line for line in lines if line.startswith("resumed from"))
    assert "step 4 (data position 64); saved by 2 processes, resumed on 1:" in said, said
    assert "continues the same global order from global batch 4" in said, said

    # 4 processes x 2 devices.
    res = _grain_launch_processes(args + ["run_name=on4"], tmp / "on4", 4, 2)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert "saved by 2 processes, resumed on 4:" in res.stdout and "process 0 of 4 reads shards 0..1" in res.stdout
    got4 = json.loads((tmp / "on4" / "evals.json").read_text())

    assert sorted(restored) == sorted(saved) and len(saved) > 3
    for k, v in saved.items():
        np.testing.assert_array_equal(restored[k], v, err_msg=k)
        np.testing.assert_array_equal(_params(tmp / "on4" / "restored.npz")[k], v, err_msg=k)
    flat = dict((jax.tree_util.keystr(k), np.asarray(v))
                for k, v in jax.tree_util.tree_flatten_with_path(ref.state["params"])[0])
    final4 = _params(tmp / "on4" / "params.npz")
    final1 = {jax.tree_util.keystr(k): np.asarray(v)
              for k, v in jax.tree_util.tree_flatten_with_path(on1.state["params"])[0]}
    for losses, final in ((on1.losses, final1), ({int(k): v for k, v in got4["losses"].items()}, final4)):
        assert sorted(losses) == [4, 5]
        for s, v in losses.items():
            assert abs(v - ref.losses[s]) <= 1e-5 * abs(ref.losses[s]), (s, v, ref.losses[s])
        for k, v in flat.items():
            assert _rel(final[k], v) <= 1e-4, k
    for evals in (on1.evals, got4["evals"]):
        for name in ("dev", "test"):
            assert evals[name]["users"] == ref.evals[name]["users"]
            for k, v in ref.evals[name].items():
                assert np.isfinite(evals[name][k]) and abs(evals[name][k] - v) <= 1.0 / ref.evals[name]["users"] + 1e-9
