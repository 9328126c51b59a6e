"""recloss-bench: memory and time of each strategy, side by side, in one process.

--objective bce (default) times dense_bce, the optax code users write and cutbce;
--objective softmax times dense_ce, optax.softmax_cross_entropy, cutce and, with
--labels 1 and Tokamax installed, Tokamax's linear_softmax_cross_entropy_loss.
Every timed round runs all rows back to back (interleaved, in a new seeded
order each round), so a noisy shared machine slows them alike; medians and
ratios are what to read. The rate of a 2048³ float32 matmul, run back to back
for about a second in each round, is the ceiling.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Optional

from recloss.bench import chip, peers, plot
from recloss.bench.rows import (MATMULS_ONLY, OBJECTIVES, OPTAX, OPTAX_LABEL, OPTAX_SOFTMAX_LABEL,  # noqa: F401
                                TOKAMAX, Objective, Row, expand_peers, format_cpu, format_cpu_total,
                                format_topology, is_peer, rows_for)

# Shapes follow the paper's mini-benchmark (D=128, L=8), scaled to a CPU.
DEFAULT_SHAPE = dict(batch=16, seq=256, vocab=100_000, dim=128, labels=8)
QUICK_SHAPE = dict(batch=4, seq=128, vocab=20_000, dim=64, labels=8)


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def _build(row: Row, inputs, block_v):
    import jax

    hidden, table, targets = inputs
    extra = {"block_v": block_v} if block_v and row.takes_block_v else {}

    def loss(h, e):
        return row.loss_of(h, e, targets, **extra)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    t0 = time.perf_counter()
    compiled = fn.lower(hidden, table).compile()
    row.compile_s = time.perf_counter() - t0
    row.temp_bytes = compiled.memory_analysis().temp_size_in_bytes
    row.fn = compiled


def run_cpu(shape: dict, strategies, repeats: int, block_v: Optional[int], seed: int = 0,
            objective: str = "bce", precision: Optional[str] = None, labels: Optional[set] = None):
    """Compiles every row of ``strategies`` (peers already expanded) and times them interleaved.

    ``precision``: jax.default_matmul_precision for every row and the ceiling (None: JAX's default).
    ``labels``: keep only the rows of these labels (e.g. {'cutbce (fused)'}; None: all).
    Returns (one result dict per row, info: the matmul ceiling, devices and versions).
    """
    import jax
    import numpy as np

    import recloss

    obj = OBJECTIVES[objective]
    hidden, tables, targets, mat = _cpu_inputs(shape, seed)
    precise = (lambda: jax.default_matmul_precision(precision)) if precision else contextlib.nullcontext
    with precise():
        matmul = jax.jit(lambda x, y: x @ y).lower(mat, mat).compile()
    rows = [r for r in rows_for(obj, strategies) if labels is None or r.label in labels]
    _compile_rows(rows, hidden, tables, targets, block_v, precise, shape)
    mm_times = _time_interleaved(rows, hidden, tables, matmul, mat, repeats, seed)
    matmul_rate = 2 * 2048 ** 3 / float(np.median(mm_times))
    results = _cpu_results(rows, shape, obj, matmul_rate)
    v = shape["vocab"]
    info = dict(matmul_gflops_per_s=matmul_rate / 1e9, matmul_shape="2048x2048x2048 f32",
                devices=str(jax.devices()[0].device_kind), cpu_count=os.cpu_count(),
                jax_version=jax.__version__, recloss_version=recloss.__version__)
    if objective != "bce":
        info.update(objective=objective, dense=obj.dense, precision=precision or "default")
    if jax.default_backend() == "tpu":
        from recloss import aot
        info["libtpu_version"] = aot.libtpu_version() or "unknown"
    if any(r.peer for r in rows):
        info["tokamax_version"] = peers.version()
    if any(r.strategy == f"{TOKAMAX}:chunked_xla" for r in rows) and v % peers.CHUNKED_V_BLOCK:
        info["chunked_xla_padding"] = _chunked_padding(hidden, tables["VD"], targets)
    return results, info


def _cpu_inputs(shape: dict, seed: int):
    """(hidden [B, N, D], {'VD': table [V, D]}, targets [B, N, L], a 2048² matrix for the ceiling)."""
    import jax.numpy as jnp
    import numpy as np

    b, n, v, d, l = (shape[k] for k in ("batch", "seq", "vocab", "dim", "labels"))
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(b, n, d)).astype(np.float32))
    table = jnp.asarray((rng.normal(size=(v, d)) / np.sqrt(d)).astype(np.float32))
    targets = jnp.asarray(rng.integers(0, v, size=(b, n, l)).astype(np.int32))
    mat = jnp.asarray(rng.normal(size=(2048, 2048)).astype(np.float32))
    return hidden, {"VD": table}, targets, mat


def _compile_rows(rows, hidden, tables, targets, block_v, precise, shape):
    """Compiles each row (its table in the row's layout, laid out once outside the timed call) and
    runs it once to warm up."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    b, n, v, d, l = (shape[k] for k in ("batch", "seq", "vocab", "dim", "labels"))
    for row in rows:
        if row.table_layout not in tables:      # 'DV'
            tables[row.table_layout] = jnp.asarray(np.asarray(tables["VD"]).T.copy())
        _log(f"[bench] compiling {row.label} at B={b} N={n} V={v} D={d} L={l} ...")
        with precise():
            _build(row, (hidden, tables[row.table_layout], targets), block_v)
        _log(f"[bench]   compiled in {row.compile_s:.1f}s, temp {row.temp_bytes / 2**20:.1f} MiB")
        jax.block_until_ready(row.fn(hidden, tables[row.table_layout]))          # warm-up


def _time_interleaved(rows, hidden, tables, matmul, mat, repeats: int, seed: int) -> list:
    """``repeats`` rounds of every row and the matmul ceiling, each round in a new (seeded) order:
    a run right after a dense row, which frees gigabytes, is measurably slower, and a fixed order
    would always hand that to the same row. Appends to each row's times; returns the ceiling's
    seconds per 2048³ product, one per round."""
    import jax
    import numpy as np

    # The ceiling is a sustained rate: each round runs the product back to back
    # for about a second (a single ~0.1 s call reads high or low by chance).
    t0 = time.perf_counter()
    jax.block_until_ready(matmul(mat, mat))
    mm_calls = max(3, int(1.0 / max(time.perf_counter() - t0, 1e-3)))
    mm_times = []
    start = time.perf_counter()

    def time_matmul():
        t0 = time.perf_counter()
        for _ in range(mm_calls):
            out = matmul(mat, mat)
        jax.block_until_ready(out)
        mm_times.append((time.perf_counter() - t0) / mm_calls)

    def timer(row):
        arg = tables[row.table_layout]

        def run():
            t0 = time.perf_counter()
            value, _ = jax.block_until_ready(row.fn(hidden, arg))
            row.times.append(time.perf_counter() - t0)
            row.loss = float(value)
        return run

    items = [timer(row) for row in rows] + [time_matmul]
    order_rng = np.random.default_rng(seed)
    for rep in range(repeats):
        for i in order_rng.permutation(len(items)):
            items[i]()
        done = rep + 1
        eta = (time.perf_counter() - start) / done * (repeats - done)
        _log(f"[bench] round {done}/{repeats}  " + "  ".join(
            f"{r.short}={r.times[-1]:.2f}s" for r in rows) + f"  eta {eta:.0f}s")
    return mm_times


def _cpu_results(rows, shape: dict, obj, matmul_rate: float) -> list:
    """One dict per row: medians, nominal and achieved flops, the share of the ceiling, the ratios
    to the dense baseline, the compiled temporaries and the loss."""
    import numpy as np

    b, n, v, d, l = (shape[k] for k in ("batch", "seq", "vocab", "dim", "labels"))
    bn = b * n
    base = next((r for r in rows if r.strategy == obj.dense), None)
    results = []
    for row in rows:
        med = float(np.median(row.times))
        flops = row.flops_per_logit_dim * bn * v * d
        results.append(dict(
            strategy=row.label, batch=b, seq=n, vocab=v, dim=d, labels=l,
            temp_mib=row.temp_bytes / 2**20, median_s=med, min_s=float(np.min(row.times)),
            repeats=len(row.times), compile_s=row.compile_s, nominal_gflop=flops / 1e9,
            gflops_per_s=flops / med / 1e9, matmul_fraction=flops / med / matmul_rate,
            time_vs_dense=(med / float(np.median(base.times))) if base else None,
            temp_vs_dense=(row.temp_bytes / base.temp_bytes) if base and base.temp_bytes else None,
            loss=None if row.matmuls_only else row.loss,
        ))
        if row.peer:
            results[-1]["peer"] = True
    return results


def _chunked_padding(hidden, table, targets) -> dict:
    """The loss offset chunked_xla's zero-padded vocab columns predict (`peers.padding_bias`),
    from the exact per-row log-partition Z = ℓ + x_target (cutce, L = 1, loss only)."""
    import jax
    import jax.numpy as jnp
    import recloss

    @jax.jit
    def lse(h, e, t):
        ell = recloss.softmax_loss(h, e, t, strategy="cutce", reduction="none").loss.reshape(-1)
        h2, t1 = h.reshape(-1, h.shape[-1]), t.reshape(-1)
        return ell + jnp.sum(h2 * e[t1], axis=-1), jnp.mean(ell)

    z, exact = lse(hidden, table, targets)
    bias, pad = peers.padding_bias(z, table.shape[0])
    return dict(v_block=peers.CHUNKED_V_BLOCK, pad_columns=pad, predicted_offset=bias,
                predicted_relative=bias / float(exact))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recloss-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objective", choices=sorted(OBJECTIVES), default="bce",
                        help="bce (recloss.bce_loss) or softmax (recloss.softmax_loss)")
    parser.add_argument("--strategies", default=None,
                        help="comma-separated strategy names (CPU timing; Pallas needs --topology); "
                             "'optax' is the dense optax code users write today, as a baseline; "
                             "'tokamax' (softmax, --labels 1) is Tokamax's linear_softmax_cross_entropy_loss, "
                             "every implementation there is, or 'tokamax:xla', 'tokamax:chunked_xla', ... "
                             "(default: bce dense_bce,optax,cutbce; softmax dense_ce,optax,cutce,tokamax)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--labels", type=int, default=None)
    parser.add_argument("--block-v", type=int, default=None, help="vocab block size (default: chosen)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per strategy (>= 5 recommended; default 5, --chip 9)")
    parser.add_argument("--precision", choices=("default", "high", "highest"), default=None,
                        help="jax.default_matmul_precision for every row and the ceiling (Tokamax takes no "
                             "precision argument; this is the equivalent)")
    parser.add_argument("--quick", action="store_true", help="a small shape that runs in seconds")
    parser.add_argument("--topology", default=None,
                        help="compile for a TPU topology (v5e-8, v6e-8, v5p-8) instead of timing here; "
                             "prints per-chip HBM and cost-analysis flops")
    parser.add_argument("--shapes", default="paper",
                        help="with --topology: 'paper' (Table II + Table III shapes), 'table2', 'table3', or "
                             "B,N,D,V[;B,N,D,V...]")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this path")
    parser.add_argument("--largest-vocab", action="store_true",
                        help="with --topology: per strategy, the largest V whose loss+grad compiles for one chip "
                             "at --batch/--seq/--dim/--labels (default the paper's 8, 256, 256, 8; float32), by "
                             "doubling then bisection (about 15 compiles a strategy; recloss.bench.topology."
                             "largest_vocab)")
    parser.add_argument("--sampled-bias", action="store_true",
                        help="instead of timing: sampled_softmax's gradient, averaged over --draws draws, against "
                             "the exact softmax gradient by K (uniform and counts negatives, accidental hits kept "
                             "and removed) on a popularity-skewed state (recloss.bench.sampled_bias; --quick: a "
                             "small catalogue; --plot PATH draws cos dE against K)")
    parser.add_argument("--draws", type=int, default=32, help="--sampled-bias: draws per K (>= 2)")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="draw the benchmark as a PNG: per-chip HBM of loss+grad vs V (1e5..1e7) from the "
                             "v6e AOT compile and CPU time per step vs V, dense and blocked strategies of both "
                             "objectives (a few minutes; --quick: seconds, smaller shapes); needs matplotlib: "
                             "pip install 'recloss[plot]'")
    parser.add_argument("--chip", action="store_true",
                        help="the on-chip suite (a TPU only; recloss.bench.chip): every strategy at the paper's "
                             "and an LLM head's shapes, f32 and bf16, beside the XLA chain, Tokamax where installed "
                             "and each kernel's roofline probes, checked before timed, medians of --repeats "
                             "interleaved rounds (default 9) beside the chip's own matmul and HBM rates")
    parser.add_argument("--chip-shapes", default=None,
                        help="--chip, --tune: comma-separated suite shapes (default all: "
                             + ", ".join(chip.SHAPES) + ")")
    parser.add_argument("--tune", action="store_true",
                        help="search the Pallas kernels' block sizes on this chip (a TPU only; recloss.bench.tune): "
                             "each suite shape's loss and gradients with every candidate (bs, bv) and the "
                             "heuristic's, checked, medians of --repeats interleaved rounds (default 5)")
    parser.add_argument("--tune-table", default=None, metavar="PATH",
                        help="--tune: write the chip's table there (the package's is "
                             "recloss/pallas/tuned/<chip>.json, which recloss.pallas.tiling reads)")
    return parser


def _tune(parser, args) -> int:
    import jax

    from recloss.bench import tune

    shapes = args.chip_shapes.split(",") if args.chip_shapes else list(chip.SHAPES)
    unknown = [s for s in shapes if s not in chip.SHAPES]
    if unknown:
        parser.error(f"--chip-shapes: unknown shape(s) {unknown}: expected some of {list(chip.SHAPES)}")
    if jax.default_backend() != "tpu":
        parser.error(f"--tune measures a TPU: JAX's backend here is {jax.default_backend()!r}")
    payload = tune.run(shapes, rounds=args.repeats or 5)
    print(tune.format_table(payload))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        _log(f"[bench] wrote {args.json}")
    if args.tune_table:
        command = "recloss-bench --tune" + (f" --chip-shapes {args.chip_shapes}" if args.chip_shapes else "")
        with open(args.tune_table, "w") as fh:
            json.dump(tune.table(payload, command), fh, indent=1)
            fh.write("\n")
        _log(f"[bench] wrote {args.tune_table}: {len(payload['entries'])} entries")
    return 0


def _chip(parser, args) -> dict:
    import jax

    shapes = args.chip_shapes.split(",") if args.chip_shapes else list(chip.SHAPES)
    unknown = [s for s in shapes if s not in chip.SHAPES]
    if unknown:
        parser.error(f"--chip-shapes: unknown shape(s) {unknown}: expected some of {list(chip.SHAPES)}")
    if jax.default_backend() != "tpu":
        parser.error(f"--chip measures a TPU: JAX's backend here is {jax.default_backend()!r} "
                     "(for TPU memory without a chip, use --topology)")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    def partial(payload):
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(payload, fh, indent=2)

    payload = chip.run(shapes, rounds=args.repeats or 9, partial=partial)
    print(chip.format_table(payload))
    return payload


def _strategies(parser, args, objective) -> tuple:
    """(strategy names, explicit?): --strategies checked against --objective (an unknown name fails
    with suggestions), or the objective's defaults."""
    import recloss

    explicit = args.strategies is not None
    strategies = [s for s in args.strategies.split(",") if s] if explicit else list(objective.cpu_strategies)
    for s in strategies:
        if s == OPTAX:
            continue
        if is_peer(s):
            if objective.name != "softmax":
                parser.error(f"--strategies {s} is a softmax peer: use --objective softmax")
            continue
        st = recloss.get_strategy(s)  # unknown names fail here, with suggestions
        if st.objective and st.objective != objective.name:
            mine = recloss.available_strategies(objective.name)
            parser.error(f"strategy {s!r} computes the {st.objective!r} objective, not --objective "
                         f"{objective.name}; its strategies: {', '.join(mine)}")
    return strategies, explicit


def _cpu_shape(parser, args) -> dict:
    shape = dict(QUICK_SHAPE if args.quick else DEFAULT_SHAPE)
    for k in shape:
        if getattr(args, k) is not None:
            if getattr(args, k) <= 0:
                parser.error(f"--{k} must be a positive int, got {getattr(args, k)}")
            shape[k] = getattr(args, k)
    return shape


def _topology_payload(parser, args, objective, strategies, explicit) -> dict:
    """Compiles the rows for --topology shape by shape, prints the table and returns the JSON payload."""
    import recloss
    from recloss.bench import topology

    if not explicit:
        registered = recloss.available_strategies()
        strategies = [s for s in objective.topology_strategies if s in registered or is_peer(s)]
    elif OPTAX in strategies:
        parser.error("--strategies optax is a CPU timing baseline; --topology compiles registered "
                     f"strategies only ({', '.join(recloss.available_strategies())})")
    strategies, notes = expand_peers(strategies, None, peers.KNOWN)
    if objective.name == "softmax" and "cutce_pallas" not in recloss.available_strategies():
        notes.append("cutce_pallas is not registered in this recloss (recloss.available_strategies()): "
                     "no row")
    shapes = _topology_shapes(parser, args.shapes, topology)
    _topology_devices(parser, args.topology)
    rows = []
    for i, shape in enumerate(shapes):
        _log(f"[bench] {args.topology}: compiling shape {i + 1}/{len(shapes)} {tuple(shape)} ...")
        t0 = time.perf_counter()
        rows += topology.topology_rows(args.topology, strategies, [shape])
        _log(f"[bench]   done in {time.perf_counter() - t0:.0f}s")
    print(format_topology(args.topology, rows, objective.name, notes))
    payload = dict(topology=args.topology, objective=objective.name, rows=rows, notes=notes)
    if any(is_peer(s) for s in strategies):
        payload["tokamax_version"] = peers.version()
    return payload


def _topology_devices(parser, name: str):
    """--topology's devices, or a usage error naming the value (before any compile)."""
    from recloss import aot

    try:
        return aot.topology_devices(name)
    except aot.TopologyError as err:
        parser.error(f"--topology {name}: {err}")


def _cpu_payload(args, objective, strategies, shape) -> dict:
    """Times the rows on this machine, prints the table and returns the JSON payload."""
    strategies, notes = expand_peers(strategies, shape["labels"])
    for note in notes:
        _log(f"[bench] {note}")
    t0 = time.perf_counter()
    results, info = run_cpu(shape, strategies, args.repeats, args.block_v, objective=objective.name,
                            precision=args.precision)
    info["total_s"] = round(time.perf_counter() - t0)
    print(format_cpu(results, info, notes))
    print("\n" + format_cpu_total(info))
    payload = dict(info=info, rows=results)
    if notes:
        payload["notes"] = notes
    return payload


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    if args.tune:
        return _tune(parser, args)
    if args.repeats is None and not args.chip:
        args.repeats = 5
    if args.chip:
        payload = _chip(parser, args)
        failed = [r["row"] for r in payload["rows"] if r.get("check") == "FAILED"
                  or ("compile_error" in r and r["kind"] != "peer" and not r["row"].startswith("dense_"))]
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(payload, fh, indent=2)
            _log(f"[bench] wrote {args.json}")
        if failed:
            _log(f"[bench] FAILED a check or did not compile (not timed): {', '.join(failed)}")
        return 1 if failed else 0
    if args.sampled_bias:
        return _sampled_bias(parser, args)
    if args.plot:
        return _plot(parser, args)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    objective = OBJECTIVES[args.objective]
    strategies, explicit = _strategies(parser, args, objective)
    shape = _cpu_shape(parser, args)
    if args.largest_vocab:
        payload = _largest_vocab(parser, args, objective, strategies, explicit)
    elif args.topology:
        payload = _topology_payload(parser, args, objective, strategies, explicit)
    else:
        payload = _cpu_payload(args, objective, strategies, shape)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        _log(f"[bench] wrote {args.json}")
    return 0


# --largest-vocab's shape when --batch/--seq/--dim/--labels are not given: the paper's Table III loss.
LARGEST_VOCAB_SHAPE = dict(batch=8, seq=256, dim=256, labels=8)


def _largest_vocab(parser, args, objective, strategies, explicit) -> dict:
    """--largest-vocab: `topology.largest_vocab` per strategy, printed as one table."""
    import recloss
    from recloss.bench import topology

    if not args.topology:
        parser.error("--largest-vocab compiles for a TPU chip: add --topology (e.g. v6e-8)")
    if args.vocab is not None:
        parser.error("--largest-vocab finds V itself: drop --vocab")
    if not explicit:
        registered = recloss.available_strategies()
        strategies = [s for s in objective.topology_strategies if s in registered]
    bad = [s for s in strategies if s == OPTAX or is_peer(s)]
    if bad:
        parser.error(f"--largest-vocab compiles recloss strategies, not {bad[0]!r}; "
                     f"its strategies: {', '.join(recloss.available_strategies(objective.name))}")
    dims = {k: default if getattr(args, k) is None else getattr(args, k)   # positive: `_cpu_shape` checked
            for k, default in LARGEST_VOCAB_SHAPE.items()}
    _topology_devices(parser, args.topology)
    shape = topology.Shape(dims["batch"], dims["seq"], dims["dim"], 0, dims["labels"])
    rows = []
    for i, s in enumerate(strategies, 1):
        _log(f"[bench] {args.topology}: largest V for {s} ({i}/{len(strategies)}) ...")
        rows.append(topology.largest_vocab(s, args.topology, shape, log=_log))
    print(topology.format_largest_vocab(rows))
    return dict(topology=args.topology, objective=objective.name, largest_vocab=rows)


def _sampled_bias(parser, args) -> int:
    from recloss.bench import sampled_bias

    if args.draws < 2:
        parser.error(f"--draws must be >= 2 (a mean over draws), got {args.draws}")
    if args.topology or args.strategies:
        parser.error("--sampled-bias runs on this machine with its own rows: drop --topology and --strategies")
    payload = sampled_bias.run(quick=args.quick, draws=args.draws, log=_log)
    print(sampled_bias.format_table(payload))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=1)
        _log(f"[bench] wrote {args.json}")
    if args.plot:
        sampled_bias.render(payload, args.plot)
        _log(f"[bench] wrote {args.plot}")
    return 0


def plot_payload(*, topology: str = plot.TOPOLOGY, topology_strategies=plot.TOPOLOGY_STRATEGIES,
                 topology_vocabs=plot.TOPOLOGY_VOCABS, topology_shape: Optional[dict] = None,
                 cpu_strategies: Optional[dict] = None, cpu_vocabs=plot.CPU_VOCABS,
                 cpu_shape: Optional[dict] = None, repeats: int = 3) -> dict:
    """The data of `plot.render`'s figure: {'topology': rows of `topology.topology_rows`, 'cpu': rows
    of `run_cpu` (each with its 'objective'), 'info': shapes, versions, timings}."""
    import jax

    import recloss
    from recloss.bench import topology as topo

    tshape = dict(plot.TOPOLOGY_SHAPE if topology_shape is None else topology_shape)
    cshape = dict(plot.CPU_SHAPE if cpu_shape is None else cpu_shape)
    cpu_strategies = plot.CPU_STRATEGIES if cpu_strategies is None else cpu_strategies
    t0 = time.perf_counter()
    rows = []
    for v in topology_vocabs:
        _log(f"[bench] {topology}: compiling {len(topology_strategies)} strategies at V={v:,} ...")
        rows += topo.topology_rows(topology, topology_strategies,
                                   [topo.Shape(tshape["B"], tshape["N"], tshape["D"], v, tshape["L"])])
    t1 = time.perf_counter()
    cpu = []
    for objective, strategies in cpu_strategies.items():
        for v in cpu_vocabs:
            _log(f"[bench] CPU {objective} at V={v:,} ...")
            # cutbce's fused row only (not its recompute and matmuls-only rows): one line per strategy.
            results, info = run_cpu(dict(cshape, vocab=v), list(strategies), repeats, None,
                                    objective=objective, labels=set(strategies) | {"cutbce (fused)"})
            cpu += [dict(r, objective=objective, strategy=r["strategy"].replace(" (fused)", ""))
                    for r in results]
    info = dict(topology=topology, topology_shape=tshape, cpu_shape=cshape, repeats=repeats,
                jax_version=jax.__version__, recloss_version=recloss.__version__,
                topology_s=round(t1 - t0), cpu_s=round(time.perf_counter() - t1),
                cpu_matmul_gflops_per_s=info["matmul_gflops_per_s"] if cpu else None,
                cpu_count=info["cpu_count"] if cpu else None)
    return dict(topology=rows, cpu=cpu, info=info)


def _plot(parser, args) -> int:
    try:
        plot._pyplot()       # fail before minutes of compiles when matplotlib is missing
    except RuntimeError as err:
        parser.error(str(err))
    t0 = time.perf_counter()
    payload = plot_payload(repeats=args.repeats, **(plot.QUICK if args.quick else {}))
    plot.render(payload, args.plot)
    _log(f"[bench] wrote {args.plot} in {time.perf_counter() - t0:.0f}s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        _log(f"[bench] wrote {args.json}")
    return 0


def _topology_shapes(parser, text: str, topology):
    if text == "paper":
        return list(topology.PAPER_SHAPES)
    if text == "table2":
        return list(topology.TABLE_II)
    if text == "table3":
        return list(topology.TABLE_III)
    shapes = []
    for part in text.split(";"):
        try:
            b, n, d, v = (int(x) for x in part.split(","))
        except ValueError:
            parser.error(f"--shapes entry {part!r} is not B,N,D,V (four ints), 'paper', 'table2' or 'table3'")
        shapes.append(topology.Shape(b, n, d, v))
    return shapes


if __name__ == "__main__":
    sys.exit(main())
