"""Two processes on localhost, one global 2×2×2 mesh: the sharded loss equals the one-process run
(fsdp_gather='once', and 'ring' with the ring crossing the processes).

Each process is `tests/_multiprocess_worker.py` with 4 CPU devices; they meet
through `jax.distributed.initialize` at a 127.0.0.1 coordinator. The result of
process 0 (loss, metrics, gradients gathered across processes) is compared
with the same computation on this process's 8 devices and with layout=None.

The Grain tests run recloss-train on prepared shards: 2 processes × 4 devices (launch/local.py)
against 1 × 8 in this process, and a run killed with SIGKILL mid-epoch, then resumed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import recloss
from _multiprocess_worker import AXES, MESH_SHAPE, loss_and_grads, make_inputs

WORKER = Path(__file__).with_name("_multiprocess_worker.py")
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def _run_workers(seed: int, out: Path, n: int = 2):
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([str(WORKER.parents[1]), env.get("PYTHONPATH", "")]))
    port = _free_port()
    logs = [out.with_name(f"worker{i}.log") for i in range(n)]
    procs = []
    try:
        for i in range(n):
            cmd = [sys.executable, str(WORKER), "--process-id", str(i), "--num-processes", str(n),
                   "--port", str(port), "--seed", str(seed), "--out", str(out)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=logs[i].open("w"), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * n:
        tails = "\n".join(f"--- worker {i} (exit {c}):\n" + "\n".join(
            logs[i].read_text(errors="replace").splitlines()[-25:]) for i, c in enumerate(codes))
        pytest.fail(f"worker processes failed or timed out after {TIMEOUT_S}s: exit codes {codes}\n{tails}")


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    out = tmp_path / "result.npz"
    _run_workers(seed, out)
    got = np.load(out)

    inputs = make_inputs(seed)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(MESH_SHAPE), AXES)
    (loss, mets), grads = loss_and_grads(inputs, recloss.MeshLayout(mesh))
    (loss0, mets0), grads0 = loss_and_grads(inputs, None)

    # "ring_": MeshLayout(fsdp_gather='ring') with the fsdp axis across the two processes.
    for p, ref_loss, ref_mets, ref_grads in (("", loss, mets, grads), ("", loss0, mets0, grads0),
                                             ("ring_", loss0, mets0, grads0)):
        assert _rel(got[p + "loss"], ref_loss) <= 1e-5, (p, float(got[p + "loss"]), float(ref_loss))
        for k, v in ref_mets.items():
            assert _rel(got[p + k], v) <= 1e-5, (p, k, float(got[p + k]), float(v))
        for name, g in zip(("grad_hidden", "grad_table", "grad_bias"), ref_grads):
            assert got[p + name].shape == g.shape, (p, name, got[p + name].shape, g.shape)
            assert np.max(np.abs(g)) > 0
            assert _rel(got[p + name], g) <= 1e-4, (p, name, _rel(got[p + name], g))
    assert float(got["invalid_targets"]) >= 1.0


# ----------------------------------------------------------------------------- the Grain pipeline, 2 hosts
LOCAL_PY = WORKER.parents[1] / "launch" / "local.py"
GRAIN_TINY = ["num_labels=4", "max_seq_len=8", "global_batch_size=16", "emb_dim=16", "num_layers=1",
              "num_heads=2", "mlp_dim=32", "dropout=0.1", "learning_rate=3e-2", "warmup_steps=1",
              "eval_batch_size=64", "eval_block_v=80", "log_period=1", "steps=6", "checkpoint_period=2",
              "enable_tensorboard=false", "ici_fsdp_parallelism=2", "ici_vocab_parallelism=2",
              "min_user_interactions=15", "prepare_num_shards=8", "prepare_num_buckets=4"]


@pytest.fixture(scope="module")
def grain_job(tmp_path_factory):
    """A prepared 4,000-event log and the uninterrupted 1-process × 8-device reference run on it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recloss_plugins.config import default_config_path, load_config
    from recloss_plugins.sasrec import train as T
    from recloss_plugins.sasrec.data import prepare

    tmp = tmp_path_factory.mktemp("grain_mp")
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    n = 4000
    t = pa.table({"uid": rng.integers(0, 100, n), "item_id": rng.integers(0, 150, n) * 13,
                  "timestamp": rng.integers(0, 10**9, n)})
    pq.write_table(t, tmp / "log.parquet", row_group_size=900)
    args = [str(default_config_path()), "dataset_type=interactions", f"dataset_path={tmp / 'log.parquet'}",
            f"prepared_data_path={tmp / 'prep'}", f"base_output_directory={tmp / 'runs'}", *GRAIN_TINY]
    prepare.prepare(load_config(args), log=lambda *a: None)
    ref = T.train(load_config(args + ["run_name=ref", "enable_checkpointing=false"]), devices=jax.devices()[:8],
                  log=lambda *a: None)
    return tmp, args, ref


def _grain_launch(tmp, args, out, n, d, *extra):
    """The Grain worker as ``n`` processes of ``d`` devices through launch/local.py; with n = 0, one
    plain process of ``d`` devices and no jax.distributed (the same runtime as this test process)."""
    out.mkdir()
    work = [sys.executable, str(WORKER), "grain-train", str(out), *extra, *args]
    env = dict(os.environ, PYTHONPATH=str(WORKER.parents[1]))
    if n:
        cmd = [sys.executable, str(LOCAL_PY), "-n", str(n), "-d", str(d), "--timeout", str(TIMEOUT_S), "--exec",
               "--", *work]
    else:
        cmd = work
        env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={d}", JAX_PLATFORMS="cpu",
                   TPU_SKIP_MDS_QUERY="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S + 30, env=env)


def _params(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.slow
def test_grain_two_processes_train_like_one_and_read_only_their_shards(grain_job):
    import json
    tmp, args, ref = grain_job
    out = tmp / "two"
    res = _grain_launch(tmp, args + ["run_name=two", "checkpoint_period=6"], out, 2, 4)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "process 0 of 2 reads shards 0..3" in res.stdout
    opened = [[p.rsplit("/", 1)[1] for p in json.loads((out / f"opened_p{i}.json").read_text())] for i in range(2)]
    data_dir = tmp / "runs" / "two" / "checkpoints" / "6" / "data"    # each process saved its iterator state
    assert [json.loads((data_dir / f"process_{i}-of-2.json").read_text())["next_index"] for i in range(2)] == [6, 6]
    assert opened == [[f"part-{s:05d}-of-00008.arrayrecord" for s in range(4 * i, 4 * i + 4)] for i in range(2)]
    got = json.loads((out / "evals.json").read_text())
    losses = {int(k): v for k, v in got["losses"].items()}
    assert sorted(losses) == sorted(ref.losses) == list(range(6))
    assert max(ref.losses.values()) - min(ref.losses.values()) > 1e-3
    for s, v in ref.losses.items():
        assert abs(losses[s] - v) <= 1e-5 * abs(v), (s, losses[s], v)
    flat = jax.tree_util.tree_flatten_with_path(ref.state["params"])[0]
    params = _params(out / "params.npz")
    assert len(params) == len(flat)
    for k, v in flat:
        assert _rel(params[jax.tree_util.keystr(k)], np.asarray(v)) <= 1e-4, jax.tree_util.keystr(k)
    # Each process scored its own users; combined, every dev/test user of the data was scored once.
    for name in ("dev", "test", "dev_popularity"):
        assert got["evals"][name]["users"] == ref.evals[name]["users"] > 50
        for k, v in ref.evals[name].items():
            assert abs(got["evals"][name][k] - v) <= 1.0 / ref.evals[name]["users"] + 1e-9, (name, k)


@pytest.mark.slow
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
    res = _grain_launch(tmp, args + ["run_name=killed"], tmp / "killed", 0, 8, "--kill-at", str(kill_at))
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
