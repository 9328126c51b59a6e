"""Per-chip HBM and flops of loss+grad, compiled ahead of time for a TPU topology (no TPU needed).

libtpu (``jax[tpu]``) compiles for a named topology on any machine; each
strategy's ``jit(value_and_grad(loss))`` is compiled for ONE chip of it and
read back through ``compiled.memory_analysis()`` / ``cost_analysis()``.

    rows = topology_rows("v6e-8", ["dense_bce", "cutbce", "cutbce_pallas"], PAPER_SHAPES)
    rows = topology_rows("v6e-8", ["dense_ce", "cutce", "tokamax:mosaic_tpu"], TABLE_II)

A strategy compiles through its objective's entry point (`recloss.bce_loss` or
`recloss.softmax_loss`); 'tokamax:<implementation>' compiles Tokamax's
linear_softmax_cross_entropy_loss (`recloss.bench.peers`) on one label per position.
"""

from __future__ import annotations

import tempfile
import time
from typing import Iterable, NamedTuple, Optional, Sequence

from recloss import aot


class Shape(NamedTuple):
    """One loss problem per chip: hidden [B, N, D], table [V, D], targets [B, N, L]."""
    B: int
    N: int
    D: int
    V: int
    L: int = 8
    dtype: str = "float32"


# The paper's Table II (single chip, D=128, L=8) and Table III's loss (B=8 per chip of a v6e-8 at
# global batch 64, N=256, D=256, V=876,939).
TABLE_II = tuple(Shape(b, n, 128, v) for v in (100_000, 200_000, 876_939) for b in (32, 128) for n in (32, 128))
TABLE_III = (Shape(8, 256, 256, 876_939),)
PAPER_SHAPES = TABLE_II + TABLE_III


def compile_loss_grad(strategy: str, topology: str, shape: Shape, *, with_bias: bool = False,
                      compiler_options: Optional[dict] = None, **options):
    """``jit(value_and_grad(Σ loss, (hidden, table[, bias])))`` compiled for one chip of ``topology``.

    The strategy's entry point (bce_loss or softmax_loss) is taken from its objective; the sum
    makes ``reduction='none'`` scalar (and is the loss itself otherwise).

    Kernels are compiled for real: the TPU mesh is set (``jax.set_mesh``), so a Pallas strategy's
    platform is 'tpu' and its Mosaic kernel compiles, not its interpreter. Raises whatever the
    compiler raises (an HBM out-of-memory is a RESOURCE_EXHAUSTED error).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import recloss

    mesh = aot.one_chip_mesh(topology)
    rep = NamedSharding(mesh, PartitionSpec())
    dt = jnp.dtype(shape.dtype)
    args = [jax.ShapeDtypeStruct((shape.B, shape.N, shape.D), dt, sharding=rep),
            jax.ShapeDtypeStruct((shape.V, shape.D), dt, sharding=rep),
            jax.ShapeDtypeStruct((shape.B, shape.N, shape.L), jnp.int32, sharding=rep)]
    if with_bias:
        args.append(jax.ShapeDtypeStruct((shape.V,), dt, sharding=rep))
    spec = recloss.get_strategy(strategy)
    entry = recloss.softmax_loss if spec.objective == "softmax" else recloss.bce_loss

    def loss(h, e, t, *maybe_bias):
        bias = maybe_bias[0] if maybe_bias else None
        return jnp.sum(entry(h, e, t, None, bias, strategy=strategy, **options).loss)

    argnums = (0, 1, 3) if with_bias else (0, 1)
    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss, argnums=argnums)).lower(*args).compile(
            compiler_options=compiler_options)


def compile_peer_loss_grad(name: str, topology: str, shape: Shape):
    """Tokamax's loss+grad ('tokamax:<implementation>') compiled for one chip of ``topology``:
    hidden [B·N, D], weights [D, V] (its layout), labels [B·N] (one per position)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from recloss.bench import peers

    mesh = aot.one_chip_mesh(topology)
    rep = NamedSharding(mesh, PartitionSpec())
    dt = jnp.dtype(shape.dtype)
    m = shape.B * shape.N
    args = [jax.ShapeDtypeStruct((m, shape.D), dt, sharding=rep),
            jax.ShapeDtypeStruct((shape.D, shape.V), dt, sharding=rep),
            jax.ShapeDtypeStruct((m,), jnp.int32, sharding=rep)]
    loss = peers.loss_fn(name.split(":", 1)[1])
    with jax.set_mesh(mesh), peers.cross_compile():
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()


def is_oom(err: BaseException) -> bool:
    """Whether a compile error is the compiler running out of HBM."""
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def flops_of(compiled) -> Optional[float]:
    """XLA's cost-analysis flops of a compiled program (Pallas kernels count their CostEstimate), or
    None when it reports none."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return None if not cost or "flops" not in cost else float(cost["flops"])


# Where `largest_vocab` starts doubling, and where it gives up (rows of the table).
LARGEST_VOCAB_START = 1 << 14
LARGEST_VOCAB_CAP = 1 << 34


def largest_vocab(strategy: str, topology: str, shape: Shape, *, tolerance: float = 0.005,
                  log=None) -> dict:
    """The largest V (a multiple of 128) whose loss+grad at ``shape`` (its V ignored) compiles for one
    chip of ``topology``: V doubles from `LARGEST_VOCAB_START` until the compiler refuses it for HBM,
    then bisects to within ``tolerance``·V.

    The TPU compiler refuses a program when XLA's own count of HBM (arguments, outputs and the
    temporaries its buffer assignment reserves: `recloss.aot.hbm_bytes`) passes the chip's;
    on a v5e chip, compiling there refused at the same V as this compile on a CPU host, and every
    program that compiled ran (docs/kernels.md). `memory_analysis` can count more.

    Returns dict(topology, strategy, B, N, D, L, dtype, fits: the largest V that compiled (None when
    none did), hbm_bytes: per-chip memory_analysis total there, xla_hbm_bytes: XLA's count there,
    refused: the smallest V refused, compiles, compile_s). A compile error that is not out-of-HBM
    is raised.
    """
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance!r}")
    say = log or (lambda msg: None)
    start, compiles, hbm = time.perf_counter(), 0, {}

    def fits(v: int) -> bool:
        nonlocal compiles
        compiles += 1
        with tempfile.TemporaryDirectory(prefix="recloss-largest-") as dump:
            try:
                compiled = compile_loss_grad(strategy, topology, shape._replace(V=v),
                                             compiler_options=aot.dump_options(dump))
            except Exception as err:
                if not is_oom(err):
                    raise
                say(f"[bench] {strategy} V={v:,}: out of HBM")
                return False
            hbm[v] = (int(aot.memory_report(compiled)["total"]), aot.hbm_bytes(dump))
        say(f"[bench] {strategy} V={v:,}: {hbm[v][1] / 2**30:.2f} GiB per chip by XLA's count, "
            f"{hbm[v][0] / 2**30:.2f} by memory_analysis")
        return True

    lo, hi = 0, LARGEST_VOCAB_START
    while hi <= LARGEST_VOCAB_CAP and fits(hi):
        lo, hi = hi, 2 * hi
    if hi > LARGEST_VOCAB_CAP:
        raise ValueError(f"{strategy} compiled at V={lo:,} on one {topology} chip; no refusal below "
                         f"{LARGEST_VOCAB_CAP:,} rows")
    while hi - lo > max(128, tolerance * lo):
        mid = (lo + hi) // 2 // 128 * 128
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    ma_bytes, xla_bytes = hbm.get(lo, (None, None))
    return dict(topology=topology, strategy=strategy, B=shape.B, N=shape.N, D=shape.D, L=shape.L,
                dtype=shape.dtype, fits=lo or None, hbm_bytes=ma_bytes, xla_hbm_bytes=xla_bytes, refused=hi,
                compiles=compiles, compile_s=round(time.perf_counter() - start, 1))


def format_largest_vocab(rows) -> str:
    """`largest_vocab` rows as a table: the largest catalogue per chip, and its ratio to the first row."""
    if not rows:
        return "(no rows)"
    r0 = rows[0]
    head = (f"largest V whose loss+grad compiles for one {r0['topology']} chip: B={r0['B']} N={r0['N']} "
            f"D={r0['D']} L={r0['L']} {r0['dtype']}; per-chip HBM there by XLA's count (what the compiler "
            f"holds against the chip) and by memory_analysis")
    lines = [head, f"  {'strategy':<16} {'largest V':>12} {'XLA HBM':>10} {'mem_analysis':>12} {'refused at':>12} "
                   f"{'÷ ' + r0['strategy']:>16} {'compiles':>9}"]
    gib = lambda b: "" if b is None or b < 0 else f"{b / 2**30:.2f} GiB"
    for r in rows:
        ratio = "" if not (r["fits"] and r0["fits"]) else f"{r['fits'] / r0['fits']:.2f}x"
        fits = "none" if r["fits"] is None else f"{r['fits']:,}"
        lines.append(f"  {r['strategy']:<16} {fits:>12} {gib(r['xla_hbm_bytes']):>10} {gib(r['hbm_bytes']):>12} "
                     f"{r['refused']:>12,} {ratio:>16} {r['compiles']:>4} ({r['compile_s']:.0f}s)")
    return "\n".join(lines)


def topology_rows(topology: str, strategies: Iterable[str] = ("dense_bce", "cutbce", "cutbce_pallas"),
                  shapes: Optional[Sequence[Shape]] = None) -> list:
    """Compiles loss+grad per strategy and shape for one chip of ``topology``.

    Args:
      topology: a Cloud TPU slice name ('v6e-8', 'v5e-8', 'v5p-8', ...) or a libtpu name like 'v6e:2x4'
        (`recloss.aot.topology_name`).
      strategies: registered strategy names, or 'tokamax:<implementation>' (Tokamax's loss, L=1).
      shapes: `Shape`s (or (B, N, D, V[, L[, dtype]]) tuples); default `PAPER_SHAPES`.
    Returns:
      one dict per (shape, strategy): topology, strategy, B, N, D, V, L, dtype,
      hbm_bytes (argument + output + temp, per chip), temp_bytes, argument_bytes,
      output_bytes, flops (XLA's
      cost analysis; Pallas kernels report their CostEstimate), ideal_flops
      (6·B·N·V·D, the fused loss+grad), compile_s. When compilation fails the
      measured cells hold 'OOM' (out of HBM) or 'error: <message>'.
    """
    shapes = PAPER_SHAPES if shapes is None else tuple(Shape(*s) for s in shapes)
    aot.topology_devices(topology)          # fail early, with the topology's name, if it is unknown
    rows = []
    for shape in shapes:
        for strategy in strategies:
            row = dict(topology=topology, strategy=strategy, **shape._asdict(),
                       ideal_flops=6 * shape.B * shape.N * shape.V * shape.D)
            if strategy.startswith("tokamax:"):
                row["L"] = 1            # its API: one label per position
            start = time.perf_counter()
            try:
                if strategy.startswith("tokamax:"):
                    compiled = compile_peer_loss_grad(strategy, topology, shape)
                else:
                    compiled = compile_loss_grad(strategy, topology, shape)
            except Exception as err:   # a failed cell, not a failed table
                cell = "OOM" if is_oom(err) else f"error: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
                row.update(hbm_bytes=cell, temp_bytes=cell, argument_bytes=cell, output_bytes=cell, flops=cell)
            else:
                ma = compiled.memory_analysis()
                row.update(hbm_bytes=int(ma.argument_size_in_bytes + ma.output_size_in_bytes
                                         + ma.temp_size_in_bytes),
                           temp_bytes=int(ma.temp_size_in_bytes), argument_bytes=int(ma.argument_size_in_bytes),
                           output_bytes=int(ma.output_size_in_bytes), flops=flops_of(compiled))
            row["compile_s"] = round(time.perf_counter() - start, 1)
            rows.append(row)
    return rows
