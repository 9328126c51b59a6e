"""recloss-bench: memory and time of each strategy, side by side, in one process.

Every timed round runs all rows back to back (interleaved, in a new seeded
order each round), so a noisy shared machine slows them alike; medians and
ratios are what to read. The rate of a 2048³ float32 matmul, run back to back
for about a second in each round, is the ceiling.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Callable, List, Optional

# Shapes follow the paper's mini-benchmark (D=128, L=8), scaled to a CPU.
DEFAULT_SHAPE = dict(batch=16, seq=256, vocab=100_000, dim=128, labels=8)
QUICK_SHAPE = dict(batch=4, seq=128, vocab=20_000, dim=64, labels=8)


MATMULS_ONLY = "cutbce blocked matmuls only (no loss math)"
OPTAX = "optax"   # a baseline, not a registered strategy
OPTAX_LABEL = "optax.sigmoid_binary_cross_entropy (dense, autodiff)"


@contextlib.contextmanager
def _identity_loss_math():
    """Traces `cutbce` with value = dvalue = logit: what is left is its three blocked matmuls
    and their bookkeeping, the ceiling of the fused pass on this machine (not a loss)."""
    from recloss.bce import cut

    saved = cut.bernoulli_parts
    cut.bernoulli_parts = lambda x, *args, **kwargs: ((x,), x if kwargs.get("grad", True) else None)
    try:
        yield
    finally:
        cut.bernoulli_parts = saved


@dataclasses.dataclass
class Row:
    """One benchmarked configuration: a strategy and how its loss is reduced."""
    label: str
    strategy: str
    flops_per_logit_dim: int      # nominal matmul flops = this × BN·V·D
    options: dict
    short: str                    # its name in the per-round progress line
    matmuls_only: bool = False    # the same blocked sweep with the loss math replaced by identity
    fn: Optional[Callable] = None
    temp_bytes: int = 0
    compile_s: float = 0.0
    times: List[float] = dataclasses.field(default_factory=list)
    loss: Optional[float] = None


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def _rows(strategies):
    rows = []
    for name in strategies:
        if name == "cutbce":
            rows.append(Row("cutbce (fused)", name, 6, {}, "cutbce"))
            rows.append(Row("cutbce (recompute, paper design)", name, 8, {"reduction": "none"}, "recompute"))
            rows.append(Row(MATMULS_ONLY, name, 6, {}, "matmuls", matmuls_only=True))
        elif name == OPTAX:
            rows.append(Row(OPTAX_LABEL, name, 6, {}, "optax"))
        else:
            rows.append(Row(name, name, 6, {}, name))
    return rows


def _optax_loss(hidden, table, targets):
    """What a user writes today: logits, a multi-hot matrix by scatter, optax's sigmoid BCE,
    mean over B·N·V (= recloss's defaults: reduction='mean', vocab_reduction='mean')."""
    import jax.numpy as jnp
    import optax

    d, v = hidden.shape[-1], table.shape[0]
    logits = hidden.reshape(-1, d) @ table.T
    ids = targets.reshape(logits.shape[0], -1)
    labels = jnp.zeros(logits.shape, logits.dtype).at[jnp.arange(ids.shape[0])[:, None], ids].set(1.0)
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


def _build(row: Row, inputs, block_v):
    import jax
    import jax.numpy as jnp
    import recloss

    hidden, table, targets = inputs
    opts = dict(row.options)
    if block_v and row.strategy != "dense_bce":
        opts["block_v"] = block_v
    per_position = opts.get("reduction") == "none"

    def loss(h, e):
        if row.strategy == OPTAX:
            return _optax_loss(h, e, targets)
        out = recloss.bce_loss(h, e, targets, strategy=row.strategy, **opts)
        # 'none' + mean: the same scalar as 'mean', but through the recompute VJP.
        return jnp.mean(out.loss) if per_position else out.loss

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    t0 = time.perf_counter()
    with _identity_loss_math() if row.matmuls_only else contextlib.nullcontext():
        compiled = fn.lower(hidden, table).compile()
    row.compile_s = time.perf_counter() - t0
    row.temp_bytes = compiled.memory_analysis().temp_size_in_bytes
    row.fn = compiled


def run_cpu(shape: dict, strategies, repeats: int, block_v: Optional[int], seed: int = 0):
    import jax
    import jax.numpy as jnp
    import numpy as np

    b, n, v, d, l = (shape[k] for k in ("batch", "seq", "vocab", "dim", "labels"))
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(b, n, d)).astype(np.float32))
    table = jnp.asarray((rng.normal(size=(v, d)) / np.sqrt(d)).astype(np.float32))
    targets = jnp.asarray(rng.integers(0, v, size=(b, n, l)).astype(np.int32))
    mat = jnp.asarray(rng.normal(size=(2048, 2048)).astype(np.float32))
    matmul = jax.jit(lambda x, y: x @ y).lower(mat, mat).compile()

    rows = _rows(strategies)
    for row in rows:
        _log(f"[bench] compiling {row.label} at B={b} N={n} V={v} D={d} L={l} ...")
        _build(row, (hidden, table, targets), block_v)
        _log(f"[bench]   compiled in {row.compile_s:.1f}s, temp {row.temp_bytes / 2**20:.1f} MiB")
        jax.block_until_ready(row.fn(hidden, table))          # warm-up
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
        def run():
            t0 = time.perf_counter()
            value, _ = jax.block_until_ready(row.fn(hidden, table))
            row.times.append(time.perf_counter() - t0)
            row.loss = float(value)
        return run

    # Each round runs the rows in a new (seeded) order: a run right after
    # dense_bce, which frees gigabytes, is measurably slower, and a fixed order
    # would always hand that to the same row.
    items = [timer(row) for row in rows] + [time_matmul]
    order_rng = np.random.default_rng(seed)
    for rep in range(repeats):
        for i in order_rng.permutation(len(items)):
            items[i]()
        done = rep + 1
        eta = (time.perf_counter() - start) / done * (repeats - done)
        _log(f"[bench] round {done}/{repeats}  " + "  ".join(
            f"{r.short}={r.times[-1]:.2f}s" for r in rows) + f"  eta {eta:.0f}s")
    matmul_rate = 2 * 2048 ** 3 / float(np.median(mm_times))
    bn = b * n
    base = next((r for r in rows if r.strategy == "dense_bce"), None)
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
    return results, dict(matmul_gflops_per_s=matmul_rate / 1e9, matmul_shape="2048x2048x2048 f32",
                         devices=str(jax.devices()[0].device_kind), cpu_count=os.cpu_count(),
                         jax_version=jax.__version__)


def format_cpu(results, info) -> str:
    lines = [
        f"loss+grad, float32, median of {results[0]['repeats']} interleaved runs (shuffled each round); "
        f"matmul ceiling {info['matmul_gflops_per_s']:.1f} GFLOP/s ({info['matmul_shape']}, ~1 s back to back "
        "in each round)",
        "",
        "| strategy | B×N | V | D | temp MiB | temp vs dense | median s | time vs dense | GFLOP/s (nominal) | of matmul |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        tvd = f"{r['temp_vs_dense']:.4f}" if r["temp_vs_dense"] is not None else "-"
        svd = f"{r['time_vs_dense']:.3f}" if r["time_vs_dense"] is not None else "-"
        lines.append(
            f"| {r['strategy']} | {r['batch']}×{r['seq']} | {r['vocab']:,} | {r['dim']} | {r['temp_mib']:.1f} | "
            f"{tvd} | {r['median_s']:.3f} | {svd} | {r['gflops_per_s']:.1f} | {100 * r['matmul_fraction']:.0f}% |")
    fused = next((r for r in results if r["strategy"] == "cutbce (fused)"), None)
    recompute = next((r for r in results if r["strategy"].startswith("cutbce (recompute")), None)
    if fused and recompute:
        lines.append("")
        lines.append(f"fused / recompute time: {fused['median_s'] / recompute['median_s']:.3f} "
                     f"(flop ratio 6/8 = 0.750)")
    optax_row = next((r for r in results if r["strategy"] == OPTAX_LABEL), None)
    if fused and optax_row:
        lines.append(f"cutbce (fused) / optax dense time: {fused['median_s'] / optax_row['median_s']:.3f}, "
                     f"temp: {fused['temp_mib'] / optax_row['temp_mib']:.4f}")
    losses = [r["loss"] for r in results if r.get("loss") is not None]
    if len(losses) > 1:
        spread = (max(losses) - min(losses)) / max(abs(min(losses)), 1e-30)
        verdict = "agree" if spread <= 1e-5 else "DISAGREE (a row computes a different loss!)"
        lines.append(f"loss values of the rows {verdict}: {min(losses):.7g} .. {max(losses):.7g} "
                     f"(relative spread {spread:.1e})")
    mm = next((r for r in results if r["strategy"] == MATMULS_ONLY), None)
    if fused and mm:
        logits = fused["batch"] * fused["seq"] * fused["vocab"]
        extra = fused["median_s"] - mm["median_s"]
        lines.append(
            f"fused / blocked matmuls alone: {fused['median_s'] / mm['median_s']:.3f}. The difference, "
            f"{extra:.3f} s, is the loss math: per logit exp(−|x|), log1p, exp(−x), one divide and ~8 "
            f"cheap ops, {logits / 1e6:.1f} M logits, {1e9 * extra / logits:.2f} ns per logit.")
    lines.append("Nominal flops: 6·BN·V·D for one fused pass or dense autodiff, 8·BN·V·D for forward + "
                 "recompute; the matmuls-only row is the same blocked sweep with the loss math replaced "
                 "by the identity (a ceiling, not a loss).")
    return "\n".join(lines)


def format_topology(topology: str, rows) -> str:
    """Markdown table of `topology.topology_rows` output (per-chip HBM, cost-analysis flops)."""
    gib = lambda x: f"{x / 2**30:.3f}" if isinstance(x, (int, float)) else str(x)
    lines = [
        f"per-chip HBM of loss+grad compiled for one chip of {topology} (XLA memory_analysis; "
        "HBM = arguments + outputs + temp)",
        "",
        "| strategy | B | N | D | V | HBM GiB | temp GiB | flops / 6·BN·V·D | compile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flops = r["flops"]
        ratio = f"{flops / r['ideal_flops']:.3f}" if isinstance(flops, (int, float)) else (
            "-" if flops is None else str(flops))
        lines.append(f"| {r['strategy']} | {r['B']} | {r['N']} | {r['D']} | {r['V']:,} | {gib(r['hbm_bytes'])} | "
                     f"{gib(r['temp_bytes'])} | {ratio} | {r['compile_s']} |")
    lines.append("")
    lines.append("flops come from compiled.cost_analysis(): Pallas kernels report their pl.CostEstimate; "
                 "XLA counts a scan body once, so the cutbce (lax.scan) column understates its work.")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="recloss-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default="dense_bce,optax,cutbce",
                        help="comma-separated strategy names (CPU timing; Pallas needs --topology); "
                             "'optax' is the dense optax code users write today, as a baseline")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--labels", type=int, default=None)
    parser.add_argument("--block-v", type=int, default=None, help="vocab block size (default: chosen)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per strategy (>= 5 recommended)")
    parser.add_argument("--quick", action="store_true", help="a small shape that runs in seconds")
    parser.add_argument("--topology", default=None,
                        help="compile for a TPU topology (v5e-8, v6e-8, v5p-8) instead of timing here; "
                             "prints per-chip HBM and cost-analysis flops")
    parser.add_argument("--shapes", default="paper",
                        help="with --topology: 'paper' (Table II + Table III shapes), 'table3', or "
                             "B,N,D,V[;B,N,D,V...]")
    parser.add_argument("--json", default=None, help="also write the results as JSON to this path")
    args = parser.parse_args(argv)

    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    strategies = [s for s in args.strategies.split(",") if s]
    import recloss
    for s in strategies:
        if s != OPTAX:
            recloss.get_strategy(s)  # unknown names fail here, with suggestions
    shape = dict(QUICK_SHAPE if args.quick else DEFAULT_SHAPE)
    for k in shape:
        if getattr(args, k) is not None:
            if getattr(args, k) <= 0:
                parser.error(f"--{k} must be a positive int, got {getattr(args, k)}")
            shape[k] = getattr(args, k)

    if args.topology:
        from recloss.bench import topology
        if args.strategies == parser.get_default("strategies"):
            strategies = ["dense_bce", "cutbce", "cutbce_pallas"]
        elif OPTAX in strategies:
            parser.error("--strategies optax is a CPU timing baseline; --topology compiles registered "
                         f"strategies only ({', '.join(recloss.available_strategies())})")
        shapes = _topology_shapes(parser, args.shapes, topology)
        rows = []
        for i, shape in enumerate(shapes):
            _log(f"[bench] {args.topology}: compiling shape {i + 1}/{len(shapes)} {tuple(shape)} ...")
            t0 = time.perf_counter()
            rows += topology.topology_rows(args.topology, strategies, [shape])
            _log(f"[bench]   done in {time.perf_counter() - t0:.0f}s")
        print(format_topology(args.topology, rows))
        payload = dict(topology=args.topology, rows=rows)
    else:
        t0 = time.perf_counter()
        results, info = run_cpu(shape, strategies, args.repeats, args.block_v)
        print(format_cpu(results, info))
        print(f"\n(total {time.perf_counter() - t0:.0f}s on {info['cpu_count']} CPU cores, jax {info['jax_version']})")
        payload = dict(info=info, rows=results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        _log(f"[bench] wrote {args.json}")
    return 0


def _topology_shapes(parser, text: str, topology):
    if text == "paper":
        return list(topology.PAPER_SHAPES)
    if text == "table3":
        return list(topology.TABLE_III)
    shapes = []
    for part in text.split(";"):
        try:
            b, n, d, v = (int(x) for x in part.split(","))
        except ValueError:
            parser.error(f"--shapes entry {part!r} is not B,N,D,V (four ints), 'paper' or 'table3'")
        shapes.append(topology.Shape(b, n, d, v))
    return shapes


if __name__ == "__main__":
    sys.exit(main())
