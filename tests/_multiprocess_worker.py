"""The processes the multi-process tests launch (tests/conftest.py `two_process_run`, and
tests/test_multiprocess.py's kill -9 run).

    python launch/local.py -n 2 -d 4 --exec -- python tests/_multiprocess_worker.py two-process SPEC.json
    python tests/_multiprocess_worker.py grain-train OUT [--kill-at STEP] CONFIG key=value ...

``two-process``: one of the two processes of the shared run, which does in turn what each test
of the 2-process scenarios asserts on (one launch and one jax.distributed start-up for them all):
  1. recloss-train's command line (`train.main`) on synthetic data (tests/test_launch.py);
  2. the sharded loss: each process owns 4 CPU devices and together they form one global
     (data, fsdp, vocab) = (2, 2, 2) mesh; every process builds the same global inputs from the
     seed, keeps only its addressable shards, runs the jitted loss + gradients and process 0
     writes the gathered results; then the same with MeshLayout(fsdp_gather='ring') on a mesh
     whose fsdp axis crosses the processes (results prefixed ``ring_``) (tests/test_multiprocess.py);
  3. a recloss-train run on the Grain pipeline (`grain_train`) (tests/test_multiprocess.py).
"""

from __future__ import annotations

import numpy as np

MESH_SHAPE = (2, 2, 2)
AXES = ("data", "fsdp", "vocab")
RING_AXES = ("fsdp", "data", "vocab")      # the fsdp_gather='ring' run: fsdp spans the two processes
OPTIONS = dict(reduction="mean", label_smoothing=0.1, pos_weight=1.5, focal_gamma=1.0, threshold=0.2,
               block_v=64, vocab_size=1000)


def make_inputs(seed: int):
    """Global numpy inputs: hidden [4, 8, 16], table [1024, 16] (V=1000 + padding), bias, targets, weights."""
    rng = np.random.default_rng(seed)
    lead, D, L, V, rows = (4, 8), 16, 4, 1000, 1024
    t = rng.integers(0, V, size=lead + (L,))
    t = np.where(rng.random(t.shape) < 0.25, -1, t)
    t[0, 0, 1] = V + 3                                    # an invalid id
    return dict(
        hidden=rng.normal(size=lead + (D,)).astype(np.float32),
        table=(rng.normal(size=(rows, D)) / 2.0).astype(np.float32),
        bias=rng.normal(-0.5, 1.0, size=(rows,)).astype(np.float32),
        targets=t.astype(np.int32),
        weights=rng.uniform(0.0, 2.0, size=lead).astype(np.float32),
    )


def loss_and_grads(inputs, layout):
    """jit(value_and_grad) of the cutbce loss w.r.t. hidden, table, bias: ((loss, metrics), grads)."""
    import jax
    import recloss

    def f(h, e, b, t, w):
        out = recloss.bce_loss(h, e, t, w, b, strategy="cutbce", layout=layout, **OPTIONS)
        return out.loss, out.metrics

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
        inputs["hidden"], inputs["table"], inputs["bias"], inputs["targets"], inputs["weights"])


def _save_params(path, params):
    """Process 0 writes the (gathered) parameter pytree ``params`` to ``path`` (.npz, keystr names);
    every process must call it (the gather is collective)."""
    import jax
    from jax.experimental import multihost_utils

    params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        np.savez(path, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})


def grain_train(argv, initialize=True):
    """``grain-train OUT [--kill-at STEP] CONFIG key=value ...``: one process of a recloss-train run on
    the Grain pipeline (started by launch/local.py --exec, or alone). Writes OUT/opened_p<i>.json (the
    shard files this process opened) and, from process 0, OUT/params.npz (the final parameters,
    gathered), OUT/evals.json and, for a resumed run, OUT/restored.npz (the parameters as restored).
    With --kill-at the process writes OUT/saved.npz (the parameters it checkpoints at that step) and
    SIGKILLs itself right after that checkpoint is on disk: a kill -9 with nothing flushed or closed."""
    import json
    import os
    import signal
    from pathlib import Path

    import jax
    from jax.experimental import multihost_utils

    from recloss_plugins.config import load_config
    from recloss_plugins.sasrec import distributed, train
    from recloss_plugins.sasrec.data import shards

    out = Path(argv.pop(0))
    kill_at = None
    if argv[0] == "--kill-at":
        kill_at = int(argv[1])
        argv = argv[2:]
    if initialize:
        distributed.initialize_from_env()
    me = jax.process_index()
    opened = []
    real_open = shards.open_shard

    def recording_open(manifest, shard, path=None):
        opened.append(str(manifest.shard_path(shard)))
        (out / f"opened_p{me}.json").write_text(json.dumps(opened))
        return real_open(manifest, shard, path)

    shards.open_shard = recording_open
    if kill_at is not None:
        real_save = train.Checkpoints.save

        def save_then_die(self, step, *a, **k):
            real_save(self, step, *a, **k)
            if step == kill_at:
                _save_params(out / "saved.npz", a[0]["params"])
                self.manager.wait_until_finished()
                multihost_utils.sync_global_devices("checkpoint on disk")
                os.kill(os.getpid(), signal.SIGKILL)

        train.Checkpoints.save = save_then_die
    real_resume = train._resume_or_init

    def recording_resume(*a, **k):
        state, position, start = real_resume(*a, **k)
        if start:
            _save_params(out / "restored.npz", state["params"])
        return state, position, start

    train._resume_or_init = recording_resume
    res = train.train(load_config(argv), log=lambda *a: print(*a, flush=True))
    _save_params(out / "params.npz", res.state["params"])
    if me == 0:
        (out / "evals.json").write_text(json.dumps({"evals": res.evals, "losses": res.losses}))


# ----------------------------------------------------------------------------- the shared 2-process run
TIMEOUT_S = 600          # the whole two-process run (all three parts), and the kill -9 run
# The Grain scenarios (tests/test_multiprocess.py): a (2, 2, 2) mesh, 6 steps, checkpoints every 2.
GRAIN_TINY = ["num_labels=4", "max_seq_len=8", "global_batch_size=16", "emb_dim=16", "num_layers=1",
              "num_heads=2", "mlp_dim=32", "dropout=0.1", "learning_rate=3e-2", "warmup_steps=1",
              "eval_batch_size=64", "eval_block_v=80", "log_period=1", "steps=6", "checkpoint_period=2",
              "enable_tensorboard=false", "ici_fsdp_parallelism=2", "ici_vocab_parallelism=2",
              "min_user_interactions=15", "prepare_num_shards=8", "prepare_num_buckets=4"]
# recloss-train's command line on synthetic data (tests/test_launch.py): a (2, 2, 2) mesh too, so
# with 2 processes the table and batch span both.
SYNTHETIC_TINY = ["synthetic_num_users=48", "synthetic_num_items=127", "synthetic_min_len=20",
                  "synthetic_max_len=30", "synthetic_num_intents=4", "synthetic_intents_per_user=2",
                  "num_labels=4", "max_seq_len=8", "global_batch_size=16", "emb_dim=16", "num_layers=1",
                  "num_heads=2", "mlp_dim=32", "dropout=0.1", "learning_rate=3e-2", "warmup_steps=1",
                  "eval_batch_size=32", "eval_block_v=48", "log_period=1", "steps=5", "enable_tensorboard=false",
                  "ici_fsdp_parallelism=2", "ici_vocab_parallelism=2"]


def grain_args(root):
    """The config arguments of the Grain scenarios on the log prepared under ``root`` (no output directory)."""
    from recloss_plugins.config import default_config_path
    return [str(default_config_path()), "dataset_type=interactions", f"dataset_path={root / 'log.parquet'}",
            f"prepared_data_path={root / 'prep'}", *GRAIN_TINY]


def prepare_grain_log(root, seed: int):
    """A 4,000-event Parquet log drawn from ``seed`` under ``root``, prepared into 8 shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recloss_plugins.config import load_config
    from recloss_plugins.sasrec.data import prepare

    rng = np.random.default_rng(seed)
    n = 4000
    t = pa.table({"uid": rng.integers(0, 100, n), "item_id": rng.integers(0, 150, n) * 13,
                  "timestamp": rng.integers(0, 10**9, n)})
    pq.write_table(t, root / "log.parquet", row_group_size=900)
    prepare.prepare(load_config(grain_args(root)), log=lambda *a: None)


def launch_two_process(root, seed: int) -> dict:
    """Prepares the Grain log and runs ``two-process`` as 2 processes x 4 devices (launch/local.py);
    everything lands under ``root``. Returns seed, returncode, stdout, stderr, wall seconds."""
    import json
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from recloss_plugins.config import default_config_path

    root = Path(root)
    here = Path(__file__).resolve()
    prepare_grain_log(root, seed)
    spec = {"out": str(root), "seed": seed,
            "cli_args": [str(default_config_path()), *SYNTHETIC_TINY, f"base_output_directory={root / 'cli'}",
                         "run_name=p2"],
            "grain_args": [*grain_args(root), f"base_output_directory={root / 'runs'}", "run_name=two",
                           "checkpoint_period=6"]}
    (root / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(here.parents[1] / "launch" / "local.py"), "-n", "2", "-d", "4", "--timeout",
           str(TIMEOUT_S), "--exec", "--", sys.executable, str(here), "two-process", str(root / "spec.json")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parents[1]), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S + 60, env=env, cwd=root)
        code, out, err = res.returncode, res.stdout, res.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = -1, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else \
            (e.stdout or ""), f"timed out after {TIMEOUT_S + 60}s"
    return {"seed": seed, "returncode": code, "stdout": out, "stderr": err, "seconds": time.monotonic() - t0}


def sharded_loss(seed: int, out):
    """Step 2 of ``two-process`` (jax.distributed already started): writes ``out`` (.npz) from process 0."""
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding

    import recloss

    assert jax.process_count() == 2, jax.process_count()
    assert jax.local_device_count() == 4 and jax.device_count() == 8, jax.devices()
    host = make_inputs(seed)
    results = {}
    # 'once' on (data, fsdp, vocab); 'ring' and 'rows' with fsdp as the leading mesh axis, so the
    # ring's ppermutes and the rows' all-gather cross the process boundary (each process holds one
    # fsdp index).
    for prefix, axes, gather in (("", AXES, "once"), ("ring_", RING_AXES, "ring"), ("rows_", RING_AXES, "rows")):
        mesh = Mesh(np.array(jax.devices()).reshape(MESH_SHAPE), axes)
        layout = recloss.MeshLayout(mesh, fsdp_gather=gather)
        specs = recloss.get_strategy("cutbce").partition_specs(layout)
        # Leading dims [4, 8] split over the batch axes like the flattened [32] rows.
        spec = dict(hidden=layout.batch_spec(3), targets=layout.batch_spec(3), weights=layout.batch_spec(2),
                    table=specs.table, bias=specs.bias)
        glob = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec[k]),
                                                lambda idx, v=v: v[idx]) for k, v in host.items()}
        (loss, mets), grads = loss_and_grads(glob, layout)
        gathered = multihost_utils.process_allgather(dict(loss=loss, grads=grads, **mets), tiled=True)
        hidden_g, table_g, bias_g = gathered.pop("grads")
        results.update({prefix + k: np.asarray(v) for k, v in dict(
            grad_hidden=hidden_g, grad_table=table_g, grad_bias=bias_g, **gathered).items()})
    if jax.process_index() == 0:
        np.savez(out, **results)


def two_process(spec_path):
    """``two-process SPEC.json``: SPEC holds out (a directory), seed, cli_args and grain_args."""
    import json
    import sys
    from pathlib import Path

    from recloss_plugins.sasrec import train

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    print("== recloss-train command line", flush=True)
    rc = train.main(spec["cli_args"])           # starts jax.distributed from local.py's environment
    if rc:
        sys.exit(rc)
    import jax
    print(f"== sharded loss (process {jax.process_index()} of {jax.process_count()})", flush=True)
    sharded_loss(spec["seed"], out / "result.npz")
    print("== grain-train", flush=True)
    (out / "grain").mkdir(exist_ok=True)
    grain_train([str(out / "grain"), *spec["grain_args"]], initialize=False)


def main():
    import sys
    if len(sys.argv) > 1 and sys.argv[1] == "grain-train":
        return grain_train(sys.argv[2:])
    if len(sys.argv) == 3 and sys.argv[1] == "two-process":
        return two_process(sys.argv[2])
    sys.exit(f"usage: {sys.argv[0]} two-process SPEC.json | grain-train OUT [--kill-at STEP] CONFIG key=value ...")


if __name__ == "__main__":
    main()
