"""One process of the two-process sharded-loss check (launched by tests/test_multiprocess.py).

    python tests/_multiprocess_worker.py --process-id 0 --port 12345 --seed 7 --out result.npz

Each process owns 4 CPU devices (XLA_FLAGS set by the launcher); together they
form one global (data, fsdp, vocab) = (2, 2, 2) mesh. Every process builds the
same global inputs from the seed, keeps only its addressable shards, runs the
jitted loss + gradients and process 0 writes the gathered results.
"""

from __future__ import annotations

import argparse

import numpy as np

MESH_SHAPE = (2, 2, 2)
AXES = ("data", "fsdp", "vocab")
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


def main():
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
    mesh = Mesh(np.array(jax.devices()).reshape(MESH_SHAPE), AXES)
    layout = recloss.MeshLayout(mesh)
    specs = recloss.get_strategy("cutbce").partition_specs(layout)
    host = make_inputs(args.seed)
    # Leading dims [4, 8] split over the batch axes like the flattened [32] rows.
    spec = dict(hidden=layout.batch_spec(3), targets=layout.batch_spec(3), weights=layout.batch_spec(2),
                table=specs.table, bias=specs.bias)
    glob = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec[k]), lambda idx, v=v: v[idx])
            for k, v in host.items()}
    (loss, mets), grads = loss_and_grads(glob, layout)
    gathered = multihost_utils.process_allgather(dict(loss=loss, grads=grads, **mets), tiled=True)
    if args.process_id == 0:
        hidden_g, table_g, bias_g = gathered.pop("grads")
        np.savez(args.out, grad_hidden=hidden_g, grad_table=table_g, grad_bias=bias_g,
                 **{k: np.asarray(v) for k, v in gathered.items()})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
