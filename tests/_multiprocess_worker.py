"""One process of the two-process sharded-loss check (launched by tests/test_multiprocess.py).

    python tests/_multiprocess_worker.py --process-id 0 --port 12345 --seed 7 --out result.npz

Each process owns 4 CPU devices (XLA_FLAGS set by the launcher); together they
form one global (data, fsdp, vocab) = (2, 2, 2) mesh. Every process builds the
same global inputs from the seed, keeps only its addressable shards, runs the
jitted loss + gradients and process 0 writes the gathered results; then the same
with MeshLayout(fsdp_gather='ring') on a mesh whose fsdp axis crosses the processes
(results prefixed ``ring_``).
"""

from __future__ import annotations

import argparse

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


def grain_train(argv):
    """``grain-train OUT [--kill-at STEP] CONFIG key=value ...``: one process of a recloss-train run on
    the Grain pipeline (started by launch/local.py --exec, or alone). Writes OUT/opened_p<i>.json (the
    shard files this process opened) and, from process 0, OUT/params.npz (the final parameters,
    gathered) and OUT/evals.json. With --kill-at the process SIGKILLs itself right after the
    checkpoint of that step is on disk: a kill -9 with nothing flushed or closed."""
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
    distributed.initialize_from_env()
    me = jax.process_index()
    opened = []
    real_open = shards.open_shard

    def recording_open(manifest, shard):
        opened.append(str(manifest.shard_path(shard)))
        (out / f"opened_p{me}.json").write_text(json.dumps(opened))
        return real_open(manifest, shard)

    shards.open_shard = recording_open
    if kill_at is not None:
        real_save = train.Checkpoints.save

        def save_then_die(self, step, *a, **k):
            real_save(self, step, *a, **k)
            if step == kill_at:
                self.manager.wait_until_finished()
                multihost_utils.sync_global_devices("checkpoint on disk")
                os.kill(os.getpid(), signal.SIGKILL)

        train.Checkpoints.save = save_then_die
    res = train.train(load_config(argv), log=lambda *a: print(*a, flush=True))
    params = multihost_utils.process_allgather(res.state["params"], tiled=True)
    if me == 0:
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        np.savez(out / "params.npz", **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})
        (out / "evals.json").write_text(json.dumps({"evals": res.evals, "losses": res.losses}))


def main():
    import sys
    if len(sys.argv) > 1 and sys.argv[1] == "grain-train":
        return grain_train(sys.argv[2:])
    parser = argparse.ArgumentParser()
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import jax
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                               num_processes=args.num_processes, process_id=args.process_id,
                               initialization_timeout=60)
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding

    import recloss

    assert jax.process_count() == args.num_processes, jax.process_count()
    assert jax.local_device_count() == 4 and jax.device_count() == 8, jax.devices()
    host = make_inputs(args.seed)
    results = {}
    # 'once' on (data, fsdp, vocab); 'ring' with fsdp as the leading mesh axis, so the
    # ring's ppermutes cross the process boundary (each process holds one fsdp index).
    for prefix, axes, gather in (("", AXES, "once"), ("ring_", RING_AXES, "ring")):
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
    if args.process_id == 0:
        np.savez(args.out, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
