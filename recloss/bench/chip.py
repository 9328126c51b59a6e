"""recloss-bench --chip: the on-chip suite. It measures the TPU it runs on and refuses any other backend.

For each shape (`SHAPES`: the paper's Table II v5e point, the paper's shape in float32 and bfloat16,
softmax at L = 1 there, and an LLM head) every row is compiled, its loss and gradients are checked
against a reference (`reference`: the pure-JAX blocked strategy at float32 inputs and 'highest' matmul
precision) before it is timed, and then every row of the shape is timed in each round, in a new seeded
order, beside two rates of the chip measured in the same round: an 8192³ bfloat16 matmul (the roof)
and a 1 GiB copy (HBM). Rows:

    dense_*, cut*, cut*_pallas     the strategies (loss and gradients in hidden and table)
    xla chain                      X = A Eᵀ, an optimization barrier, then dA = X E and dE = Xᵀ A: the three
                                   materialised matmuls XLA runs without recloss (no loss math)
    tokamax:<impl>                 Tokamax's linear_softmax_cross_entropy_loss where installed (L = 1)
    <kernel> [matmuls]             the Pallas kernel's grid with only its three MXU products
    <kernel> [elementwise]         the same grid with only its per-logit math (`probe_strategy`, whose
                                   kernels' specs are `recloss.pallas.grid.probe`'s)

"useful" is 6·BN·V·D flops for every row, whatever it recomputes, over its median time; each Pallas
row's bound is the largest of its two probes' times and its HBM floor (the bytes XLA's cost analysis
counts, at the copy's rate): MXU, VPU/EUP or HBM.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from recloss.bench import peers

ROOF_N = 8192
COPY_BYTES = 1 << 30
# A row's loss and gradients against the reference, as relative errors (the gradients in the row's
# dtype: one bfloat16 rounding is 2e-3, and every product at DEFAULT precision is one bfloat16 pass).
CHECK_TOL = dict(loss=5e-3, dhidden=2e-2, dtable=2e-2)


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    objective: str      # 'bce' or 'softmax'
    B: int
    N: int
    V: int
    D: int
    L: int
    dtype: str          # of hidden and table

    @property
    def key(self) -> str:
        return f"{self.name}-{'f32' if self.dtype == 'float32' else 'bf16'}"

    @property
    def entry(self) -> Callable:
        """The objective's entry point (`recloss.bce_loss` or `recloss.softmax_loss`)."""
        import recloss
        return recloss.bce_loss if self.objective == "bce" else recloss.softmax_loss


SHAPES: Dict[str, Shape] = {s.key: s for s in (
    Shape("table2", "bce", 128, 128, 100_000, 128, 8, "float32"),  # the paper's Table II v5e point
    Shape("paper", "bce", 8, 256, 876_939, 256, 8, "float32"),
    Shape("paper", "bce", 8, 256, 876_939, 256, 8, "bfloat16"),
    Shape("softmax", "softmax", 8, 256, 876_939, 256, 1, "float32"),
    Shape("softmax", "softmax", 8, 256, 876_939, 256, 1, "bfloat16"),
    Shape("llm-head", "softmax", 4, 2048, 151_936, 1024, 1, "bfloat16"),  # an LLM head (Qwen's V)
    Shape("llm-head", "softmax", 4, 2048, 151_936, 1024, 1, "float32"),
)}
STRATEGIES = {"bce": ("dense_bce", "cutbce", "cutbce_pallas"), "softmax": ("dense_ce", "cutce", "cutce_pallas")}
CHAIN = "xla chain"


@dataclasses.dataclass
class ChipRow:
    label: str
    kind: str                        # 'strategy', 'chain', 'peer' or 'probe'
    strategy: Optional[str] = None   # the registered strategy (or 'tokamax:<impl>')
    probe: Optional[str] = None      # `recloss.pallas.grid.PROBES`
    fn: Optional[Callable] = None
    table_layout: str = "VD"
    result: dict = dataclasses.field(default_factory=dict)
    times: List[float] = dataclasses.field(default_factory=list)


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def rows_for(shape: Shape, tokamax: Sequence[str] = ()) -> List[ChipRow]:
    """The rows of ``shape``: its objective's strategies, the XLA chain, Tokamax's ``tokamax``
    implementations (softmax, L = 1) and both probes of the Pallas strategy."""
    names = STRATEGIES[shape.objective]
    rows = [ChipRow(n, "strategy", n) for n in names] + [ChipRow(CHAIN, "chain")]
    if shape.objective == "softmax" and shape.L == 1:
        rows += [ChipRow(f"{peers.PREFIX}:{impl}", "peer", f"{peers.PREFIX}:{impl}", table_layout="DV")
                 for impl in tokamax]
    kernel = names[-1]
    rows += [ChipRow(f"{kernel} [{p}]", "probe", kernel, probe=p) for p in ("matmuls", "elementwise")]
    return rows


def probe_strategy(name: str, kind: str):
    """The Pallas strategy ``name`` with its kernels' grid specs made the roofline probe ``kind``
    (`recloss.pallas.grid.probe`): a measurement, not a loss. A strategy object, called like the entry
    point with the default options."""
    import functools

    import recloss
    from recloss.bce import kernel as bce_kernel
    from recloss.pallas import grid
    from recloss.softmax import kernel as softmax_kernel

    base = type(recloss.get_strategy(name))
    module = {"bce": bce_kernel, "softmax": softmax_kernel}[base.objective]
    probe = type(f"{base.__name__}Probe", (base,),
                 {"kernel_sweeps": module.sweeps(functools.partial(grid.probe, kind=kind))})
    return probe(recloss.LossOptions())


def _loss(shape: Shape, row: ChipRow) -> Callable:
    """(hidden, table, targets) -> scalar loss of ``row`` (peers: their table layout; probes: the
    strategy's kernels as that probe)."""
    if row.kind == "peer":
        from recloss.bench.rows import tokamax_loss
        return tokamax_loss(row.strategy.split(":", 1)[1])
    if row.probe:
        strategy = probe_strategy(row.strategy, row.probe)
        return lambda h, e, t: strategy(h, e, t).loss
    return lambda h, e, t: shape.entry(h, e, t, strategy=row.strategy).loss


def _chain(h, e):
    """XLA's three materialised matmuls: X = A Eᵀ (f32 accumulation), a barrier, dA = X E, dE = Xᵀ A."""
    import jax
    import jax.numpy as jnp

    a = h.reshape(-1, h.shape[-1])
    x = jax.lax.optimization_barrier(jnp.dot(a, e.T, preferred_element_type=jnp.float32)).astype(a.dtype)
    da = jnp.dot(x, e, preferred_element_type=jnp.float32).astype(a.dtype)
    de = jnp.dot(x.T, a, preferred_element_type=jnp.float32).astype(e.dtype)
    return jnp.sum(da[:1].astype(jnp.float32)), (da.reshape(h.shape), de)


def _compile(shape: Shape, row: ChipRow, h, tables, t):
    import jax

    if row.kind == "chain":
        fn = jax.jit(_chain)
        args = (h, tables["VD"])
    else:
        loss = _loss(shape, row)
        fn = jax.jit(jax.value_and_grad(lambda h, e: loss(h, e, t), argnums=(0, 1)))
        args = (h, tables[row.table_layout])
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    row.result["compile_s"] = round(time.perf_counter() - t0, 1)
    mem = compiled.memory_analysis()
    row.result["temp_mib"] = round(mem.temp_size_in_bytes / 2**20, 1)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if cost and cost.get("bytes accessed"):
        row.result["bytes_accessed"] = float(cost["bytes accessed"])
    row.fn = lambda: compiled(*args)


def reference(shape: Shape, h, e, t):
    """(loss, dhidden, dtable as host arrays) of the pure-JAX blocked strategy at float32 inputs and 'highest'
    precision."""
    import jax
    import jax.numpy as jnp

    name = STRATEGIES[shape.objective][1]
    f32 = jnp.float32
    with jax.default_matmul_precision("highest"):
        fn = jax.jit(jax.value_and_grad(lambda h, e: shape.entry(h, e, t, strategy=name).loss, argnums=(0, 1)))
        loss, (dh, de) = fn(h.astype(f32), e.astype(f32))
    # Kept on the host: the chip's memory is the rows'.
    return float(loss), *(x.astype("float32") for x in jax.device_get((dh, de)))


def _rel(got, ref) -> float:
    import numpy as np

    got = np.asarray(got).astype(np.float32)
    return float(np.linalg.norm(got - ref) / max(float(np.linalg.norm(ref)), 1e-30))


def _check(row: ChipRow, ref) -> None:
    """Loss and gradients of one call of ``row`` against ``ref`` (on the host); sets result['check'] and
    'errors'."""
    import jax

    loss, (dh, de) = jax.block_until_ready(row.fn())
    dh, de = jax.device_get((dh, de))
    if row.table_layout == "DV":
        de = de.T
    errs = dict(loss=abs(float(loss) - ref[0]) / max(abs(ref[0]), 1e-30), dhidden=_rel(dh, ref[1]),
                dtable=_rel(de, ref[2]))
    row.result["errors"] = {k: float(f"{v:.3g}") for k, v in errs.items()}
    row.result["loss"] = float(loss)
    ok = all(errs[k] <= CHECK_TOL[k] for k in errs)
    row.result["check"] = "passed" if ok else ("disagrees (a peer)" if row.kind == "peer" else "FAILED")


def _inputs(shape: Shape, seed: int):
    import jax
    import jax.numpy as jnp

    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    dt = jnp.dtype(shape.dtype)
    h = jax.random.normal(k1, (shape.B, shape.N, shape.D), jnp.float32).astype(dt)
    e = (jax.random.normal(k2, (shape.V, shape.D), jnp.float32) / shape.D ** 0.5).astype(dt)
    t = jax.random.randint(k3, (shape.B, shape.N, shape.L), 0, shape.V, jnp.int32)
    return h, e, t


def _rates():
    """Two timers of the chip's own rates: an 8192³ bfloat16 matmul and a 1 GiB copy (read + write)."""
    import jax
    import jax.numpy as jnp

    m = jnp.ones((ROOF_N, ROOF_N), jnp.bfloat16)
    mm = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32)).lower(m).compile()
    buf = jnp.ones((COPY_BYTES // 4,), jnp.float32)
    cp = jax.jit(lambda x: x * 2.0).lower(buf).compile()

    def timer(fn, arg, work, calls):
        def run():
            jax.block_until_ready(fn(arg))
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn(arg)
            jax.block_until_ready(out)
            return work * calls / (time.perf_counter() - t0)
        return run

    return timer(mm, m, 2 * ROOF_N ** 3, 20), timer(cp, buf, 2 * COPY_BYTES, 20)


def _blocks(shape: Shape, strategy: str) -> dict:
    """The kernel tiles a Pallas strategy runs with at ``shape`` (per sweep mode)."""
    import jax.numpy as jnp

    import recloss
    from recloss.pallas import tiling

    opts = recloss.LossOptions()
    chip = tiling.get_chip()
    m = shape.B * shape.N
    modes = ("fused", "loss") if shape.objective == "bce" else ("loss", "grad")
    out = {}
    for mode in modes:
        t = tiling.choose((shape.objective, mode), m, shape.V, shape.D, jnp.dtype(shape.dtype),
                          jnp.dtype(shape.dtype), opts, bias=False, chip=chip)
        out[mode] = dict(bn=t.bn, bs=t.bs, bv=t.bv, chunks=t.num_chunks, cores=t.cores)
    return out


def run(shapes: Sequence[str], rounds: int = 9, seed: int = 0, partial: Optional[Callable] = None) -> dict:
    """The suite at ``shapes`` (keys of `SHAPES`): the payload {'info', 'rows'} it records.
    ``partial(payload)`` is called after each shape with what is measured so far."""
    import gc

    import jax
    import numpy as np

    import recloss
    from recloss import aot

    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"unknown suite shape(s) {unknown}: expected some of {list(SHAPES)}")
    if jax.default_backend() != "tpu":
        raise RuntimeError(f"the on-chip suite measures a TPU; JAX's backend here is {jax.default_backend()!r}")
    why = peers.import_error()
    tokamax = () if why else tuple(i for i in peers.implementations(peers.KNOWN) if i != "chunked_xla")
    roof, hbm = _rates()
    info = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, libtpu=aot.libtpu_version() or "unknown",
                recloss=recloss.__version__, tokamax=peers.version(), tokamax_absent=why, rounds=rounds,
                date=time.strftime("%Y-%m-%d"), roof=f"{ROOF_N}^3 bfloat16 matmul",
                copy=f"{COPY_BYTES >> 20} MiB float32 copy", precision=str(jax.config.jax_default_matmul_precision))
    out_rows, roofs, copies = [], [], []
    t_start = time.perf_counter()
    for si, key in enumerate(shapes):
        shape = SHAPES[key]
        _log(f"[chip] shape {si + 1}/{len(shapes)} {key}: B={shape.B} N={shape.N} V={shape.V:,} D={shape.D} "
             f"L={shape.L} {shape.dtype}")
        h, e, t = _inputs(shape, seed + si)
        tables = {"VD": e}
        rows = rows_for(shape, tokamax)
        if any(r.table_layout == "DV" for r in rows):
            tables["DV"] = jax.numpy.asarray(e.T)
        ref = reference(shape, h, e, t)
        timed = []
        for row in rows:
            row.result.update(shape=key, objective=shape.objective, B=shape.B, N=shape.N, V=shape.V, D=shape.D,
                              L=shape.L, dtype=shape.dtype, row=row.label, kind=row.kind)
            try:
                _compile(shape, row, h, tables, t)
            except Exception as err:   # e.g. more HBM than the chip has (a dense row): recorded, not timed
                row.result["compile_error"] = str(err).strip().splitlines()[0][:300]
                _log(f"[chip]   {row.label}: did not compile: {row.result['compile_error']}")
                continue
            try:
                if row.kind in ("strategy", "peer"):
                    _check(row, ref)
                else:
                    jax.block_until_ready(row.fn())
            except Exception as err:   # e.g. its temporaries do not fit beside the suite's arrays
                row.result["run_error"] = " ".join(str(err).strip().splitlines()[:2])[:300]
                _log(f"[chip]   {row.label}: did not run: {row.result['run_error']}")
                row.fn = None
                continue
            if row.result.get("check") == "FAILED":
                _log(f"[chip]   {row.label}: check FAILED {row.result['errors']}: not timed")
                continue
            if row.kind == "strategy" and row.strategy.endswith("_pallas"):
                row.result["blocks"] = _blocks(shape, row.strategy)
            timed.append(row)
            _log(f"[chip]   {row.label}: compiled in {row.result['compile_s']}s, temp {row.result['temp_mib']} MiB"
                 + (f", check {row.result['check']} {row.result['errors']}" if "check" in row.result else ""))
        order = np.random.default_rng(seed + si)
        items = [(r.fn, r.times) for r in timed]
        s0 = time.perf_counter()
        for rnd in range(rounds):
            for i in order.permutation(len(items) + 2):
                if i == len(items):
                    roofs.append(roof())
                elif i == len(items) + 1:
                    copies.append(hbm())
                else:
                    fn, times = items[i]
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn())
                    times.append(time.perf_counter() - t0)
            per_round = (time.perf_counter() - s0) / (rnd + 1)
            left = per_round * (rounds - rnd - 1)
            _log(f"[chip]   round {rnd + 1}/{rounds}  " + "  ".join(
                f"{r.label}={1e3 * r.times[-1]:.2f}ms" for r in timed) + f"  eta {left:.0f}s this shape, "
                f"{time.perf_counter() - t_start:.0f}s so far")
        for row in timed:
            row.result["median_ms"] = round(1e3 * float(np.median(row.times)), 3)
            row.result["min_ms"] = round(1e3 * float(np.min(row.times)), 3)
        out_rows += [r.result for r in rows]
        del rows, timed, items, h, e, t, tables, ref
        gc.collect()
        if partial:       # what is measured so far survives a run cut short
            partial(_finish(dict(info), out_rows, roofs, copies, t_start, done=False))
    return _finish(info, out_rows, roofs, copies, t_start, done=True)


def _finish(info, out_rows, roofs, copies, t_start, done: bool) -> dict:
    import numpy as np

    out_rows = [dict(r) for r in out_rows]
    info["roof_tflops"] = round(float(np.median(roofs)) / 1e12, 1)
    info["hbm_gbps"] = round(float(np.median(copies)) / 1e9, 1)
    _derive(out_rows, info)
    info["total_s"] = round(time.perf_counter() - t_start)
    if not done:
        info["partial"] = True
    return dict(info=info, rows=out_rows)


def _derive(rows: List[dict], info: dict) -> None:
    """Useful TFLOP/s and the share of the roof per timed row; each Pallas row's probes and bound."""
    roof, hbm = info["roof_tflops"] * 1e12, info["hbm_gbps"] * 1e9
    for r in rows:
        if "median_ms" in r:
            useful = 6 * r["B"] * r["N"] * r["V"] * r["D"]
            r["useful_tflops"] = round(useful / (r["median_ms"] / 1e3) / 1e12, 1)
            r["roof_fraction"] = round(useful / (r["median_ms"] / 1e3) / roof, 3)
    for r in rows:
        if r["kind"] != "strategy" or not r["row"].endswith("_pallas") or "median_ms" not in r:
            continue
        probe = {p: next((q.get("median_ms") for q in rows if q["shape"] == r["shape"]
                          and q["row"] == f"{r['row']} [{p}]"), None) for p in ("matmuls", "elementwise")}
        floors = {"MXU": probe["matmuls"], "VPU/EUP": probe["elementwise"]}
        if r.get("bytes_accessed"):
            floors["HBM"] = round(1e3 * r["bytes_accessed"] / hbm, 3)
        known = {k: v for k, v in floors.items() if v is not None}
        r["floors_ms"] = known
        if known:
            r["bound"] = max(known, key=known.get)


def format_table(payload: dict) -> str:
    """The suite's table, as recloss-bench prints it and the docs render it."""
    info, rows = payload["info"], payload["rows"]
    lines = [f"On-chip suite: {info['device']}, jax {info['jax']}, libtpu {info['libtpu']}"
             + (f", Tokamax {info['tokamax']}" if info.get("tokamax") else ", Tokamax absent")
             + f"; medians of {info['rounds']} interleaved rounds. Roof ({info['roof']}, same run): "
             f"{info['roof_tflops']} TFLOP/s; HBM ({info['copy']}): {info['hbm_gbps']} GB/s.", "",
             "| shape | row | ms | useful TFLOP/s | of roof | temp MiB | check | bound (floors, ms) |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        shape = f"{r['shape']} (B={r['B']} N={r['N']} V={r['V']:,} D={r['D']} L={r['L']})"
        if "compile_error" in r:
            lines.append(f"| {shape} | {r['row']} | did not compile | | | | | {r['compile_error'][:90]} |")
            continue
        if "run_error" in r:
            lines.append(f"| {shape} | {r['row']} | did not run | | | {r.get('temp_mib', '')} | | "
                         f"{r['run_error'][:90]} |")
            continue
        if "median_ms" not in r:
            lines.append(f"| {shape} | {r['row']} | not timed | | | {r.get('temp_mib', '')} | "
                         f"{r.get('check', '')} {r.get('errors', '')} | |")
            continue
        check = r.get("check", "no loss")
        bound = ""
        if r.get("bound"):
            bound = f"{r['bound']} (" + ", ".join(f"{k} {v:.2f}" for k, v in r["floors_ms"].items()) + ")"
        # A probe does part of the work: its time is a floor, not a rate.
        rate = ("", "") if r["kind"] == "probe" else (r["useful_tflops"], f"{100 * r['roof_fraction']:.0f} %")
        lines.append(f"| {shape} | {r['row']} | {r['median_ms']:.2f} | {rate[0]} | {rate[1]} | {r['temp_mib']} | "
                     f"{check} | {bound} |")
    return "\n".join(lines)


def _timed(rows: List[dict], shape: str, row: str) -> Optional[float]:
    return next((r["median_ms"] for r in rows if r["shape"] == shape and r["row"] == row and "median_ms" in r),
                None)


def format_summary(payload: dict) -> str:
    """What the record says about each Pallas kernel, as ratios of its medians: against the XLA chain
    (the same three products, logits materialised), bfloat16 against float32 inputs, and which unit
    bounds it (its probes and HBM floor)."""
    rows = payload["rows"]
    lines = []
    kernels = sorted({r["row"] for r in rows if r["kind"] == "strategy" and r["row"].endswith("_pallas")})
    for kernel in kernels:
        mine = [r for r in rows if r["row"] == kernel and "median_ms" in r]
        chain = [f"{r['shape']} {r['median_ms'] / _timed(rows, r['shape'], CHAIN):.2f}" for r in mine
                 if _timed(rows, r["shape"], CHAIN)]
        bounds = [f"{r['shape']} {r['bound']}" for r in mine if r.get("bound")]
        pairs = []
        for r in mine:
            if r["dtype"] == "bfloat16":
                f32 = _timed(rows, r["shape"].replace("-bf16", "-f32"), kernel)
                if f32:
                    pairs.append(f"{r['shape'].rsplit('-', 1)[0]} {r['median_ms'] / f32:.2f}")
        lines.append(f"- `{kernel}` ÷ the XLA chain: {', '.join(chain)}; bfloat16 ÷ float32 inputs: "
                     f"{', '.join(pairs) or 'not recorded'}; bound by {', '.join(bounds)}.")
    return "\n".join(lines)


def format_tests(record: dict) -> str:
    """One line of what `make test-tpu` recorded."""
    c = record["counts"]
    return (f"`make test-tpu` on {record['device']} (jax {record['jax']}, libtpu {record['libtpu']}, "
            f"{record['date']}, matmul precision {record['matmul_precision']}): {c['passed']} passed, "
            f"{c['failed']} failed, {c['error']} errors, {c['skipped']} skipped in {record['seconds']:.0f} s"
            + (f"; failed: {', '.join(record['failed'])}" if record["failed"] else "") + ".")
