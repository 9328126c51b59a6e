"""Is K = 128 enough here? `recloss.sampled_bias` on the trainer's own model, data and step.

    python -m tools.sampled_bias configs/base.yml [key=value ...] [--ks 16,128,1024]

trains the config as recloss-train does (its ``loss`` and ``steps``; checkpoints off), then, on
the trained parameters and the first training batch, compares the sampled_softmax gradient,
averaged over ``--draws`` draws, with the exact softmax gradient for each K, with negatives drawn
uniformly and from the training counts (logQ), accidental hits removed and kept. Printed as the
table of ``recloss-bench --sampled-bias``; ``--json`` writes it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import List, Optional

import numpy as np

from tools.figures import config_parser


def measure(cfg, *, ks, draws: int, log=print) -> dict:
    """Trains ``cfg`` and measures its model's sampled gradients (see the module docstring)."""
    import jax
    from flax import nnx

    import recloss
    from recloss_plugins.sasrec import data as data_lib
    from recloss_plugins.sasrec.program import log_q_of
    from recloss_plugins.sasrec.train import train

    t0 = time.perf_counter()
    res = train(cfg, log=log)
    program = res.program
    ds = data_lib.build_dataset(cfg)
    batch = data_lib.TrainBatches(ds.train, program.batch_size, cfg.seed).batch(0)
    model = nnx.merge(program.graphdef, jax.device_get(res.state["params"]))
    hidden, table, bias = model(batch["inputs"]), model.output_table(), model.output_bias()
    V = program.vocab_size
    proposals = {name: log_q_of(name, V, ds.popularity) for name in ("uniform", "counts")}
    rows = []
    for removed in (True, False):
        out = recloss.sampled_bias(hidden, table, batch["targets"], batch["weights"], bias,
                                   key=jax.random.key(cfg.seed), num_negatives=ks, draws=draws,
                                   proposals=proposals, pad_id=0, vocab_size=V, remove_accidental_hits=removed,
                                   log=lambda line, r=removed: log(f"[bias] hits {'removed' if r else 'kept':>7} {line}"))
        rows += [dict(r, hits_removed=removed) for r in out]
    info = dict(vocab=V - 1, dim=cfg.emb_dim, rows=int(np.prod(batch["inputs"].shape)), labels=cfg.num_labels,
                ks=list(ks), draws=draws, seed=cfg.seed, total_s=round(time.perf_counter() - t0, 1),
                jax_version=jax.__version__,
                state=f"SASRec after {res.steps_done} steps of loss={cfg.loss} on {cfg.dataset_type} data, "
                      "its first training batch")
    return {"info": info, "rows": rows}


def main(argv: Optional[List[str]] = None) -> int:
    from recloss.bench.sampled_bias import format_table
    from recloss_plugins.config import ConfigError, load_config

    p = config_parser(__doc__)
    p.add_argument("--ks", default="16,128,1024", help="comma-separated K values (default %(default)s)")
    p.add_argument("--draws", type=int, default=32, help="draws per K (>= 2)")
    p.add_argument("--json", help="write the rows and what ran as JSON here")
    args = p.parse_args(argv)
    try:
        ks = [int(k) for k in args.ks.split(",") if k]
    except ValueError:
        p.error(f"--ks must be comma-separated ints, got {args.ks!r}")
    if not ks or min(ks) < 1:
        p.error(f"--ks must be ints >= 1, got {args.ks!r}")
    if args.draws < 2:
        p.error(f"--draws must be >= 2 (a mean over draws), got {args.draws}")
    try:
        cfg = load_config(args.config + ["enable_checkpointing=false", "enable_tensorboard=false"])
    except ConfigError as err:
        print(f"sampled_bias: config error: {err}", file=sys.stderr)
        return 2
    payload = measure(cfg, ks=ks, draws=args.draws, log=lambda *a: print(*a, file=sys.stderr, flush=True))
    print(format_table(payload))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
