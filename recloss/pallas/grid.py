"""The vocabulary-sweep grid shared by the Mosaic-TPU kernels (BCE: `recloss.bce.kernel`, softmax:
`recloss.softmax.kernel`); an objective supplies only the math of one logit sub-tile.

`sweep` pads the problem and runs one `pallas_call` per row chunk (`call`):

* rows are padded to the tiling's ``bn · num_chunks`` (zero hidden states; each
  per-row input vector with its own fill), D to a multiple of 128 lanes;
* the grid is ``(cores, vocab blocks per core)``: the row tile A [bn, Dp], the
  per-row input vectors [bn, 1], the per-core [bn, 128] lane accumulators an
  objective asks for (`RowOut`) and, in gradient kernels, dA [bn, Dp] f32 stay
  resident in VMEM while the grid walks vocab blocks E_j [bv, Dp] ('arbitrary'
  axis). On two-TensorCore chips the leading axis of 2 splits the vocab blocks
  (the last step of the last core may have no block, and is skipped); each core
  writes its own partials, which the caller combines (`Result.summed`);
* each step masks E_j's rows past V_local (a partial last block reads
  unspecified memory), computes ``live`` [1, bv] (columns before V_local and at
  global ids < vocab_size, from iota and the prefetched vocab offset) when
  columns need masking, and runs an inner loop over row sub-tiles of ``bs`` rows:
  ``X = A_s E_jᵀ (+ b_j)`` on the MXU in f32 (then c·tanh(X/c) for a `Spec` with a
  ``soft_cap`` c), then the objective's ``tile`` callback with a `Step`; `Step.grad`
  adds ``G E_j`` to dA, ``Gᵀ A_s`` to dE_j and ``Σ_rows G`` to db_j (G times the cap's
  slope 1 − tanh²(X/c) first; dE_j, db_j written once per block);
* when the rows do not fit one resident tile, a `lax.scan` over row chunks
  accumulates dE/db in HBM (f32, aliased in place: ``input_output_aliases``);
  unrolled up to `MAX_UNROLLED_CHUNKS` chunks, a loop past it (XLA's cost
  analysis then counts one call's flops, not all of them).

Each call carries a `pl.CostEstimate` (flops and transcendentals per logit from
the `Spec`, bytes from the operands), the chip's ``vmem_limit_bytes`` and the
core axis' semantics (`recloss.pallas.tiling`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from recloss import softcap
from recloss._compat import tpu_compiler_params
from recloss.pallas import tiling


def lane_fold(x):
    """[rows, k·128] → [rows, 128] by adding lane-aligned column groups (no cross-lane work)."""
    acc = x[:, :tiling.LANES]
    for k in range(1, x.shape[1] // tiling.LANES):
        acc = acc + x[:, k * tiling.LANES:(k + 1) * tiling.LANES]
    return acc


def lane_groups(x):
    """The lane-aligned [rows, 128] column groups of ``x`` [rows, k·128], in column order."""
    return [x[:, k * tiling.LANES:(k + 1) * tiling.LANES] for k in range(x.shape[1] // tiling.LANES)]


class RowOut(NamedTuple):
    """A per-core [bn, 128] lane accumulator resident across the vocab blocks (set to ``fill`` at
    the first block of each core)."""
    name: str
    dtype: Any = jnp.float32
    fill: float = 0.0


class Products(NamedTuple):
    """How a kernel's tile gets its logits from the MXU and gives G back: ``logits(a_s, e_blk,
    precision) -> X`` [bs, bv] f32 and ``grads(ref, rows, a_s, e_blk, gc, acc, precision, rs)``, which adds
    G E_j to dA's rows and Gᵀ A_s to the block's dE accumulator ``acc`` (gc: G in the compute dtype), each
    with G's rows scaled by ``rs`` [bs, 1] f32 when it is not None (`Step.grad`'s ``row_scale``).
    The kernels' is `MXU`; a roofline probe of the elementwise work alone swaps in stand-ins
    (`probe`)."""
    logits: Callable
    grads: Callable


def _mxu_logits(a_s, e_blk, precision):
    return jax.lax.dot_general(a_s, e_blk, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _mxu_grads(ref, rows, a_s, e_blk, gc, acc, precision, rs=None):
    da = jnp.dot(gc, e_blk, precision=precision, preferred_element_type=jnp.float32)
    if rs is not None:          # diag(r) G E_j and Gᵀ diag(r) A_s: r on [bs, Dp] operands, not on G
        da = da * rs
        a_s = (a_s.astype(jnp.float32) * rs).astype(a_s.dtype)
    ref["da"][rows, :] += da
    acc[...] += jax.lax.dot_general(gc, a_s, (((0,), (0,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32)


MXU = Products(_mxu_logits, _mxu_grads)


class Spec(NamedTuple):
    """What one objective's kernel adds to the shared grid."""
    name: str                   # pallas_call name, e.g. 'cutbce_fused'
    grad: bool                  # emits dA [bn, Dp] per core, dE [V_local, Dp], db [1, V_local]
    row_out: Sequence[RowOut]   # per-core lane accumulators, in output order
    tile: Callable              # tile(step: Step) for one [bs, bv] sub-tile
    flops: int                  # flops per (row, column, padded D lane): 2 per matmul
    transcendentals: float      # per (row, column), without the soft cap's tanh
    soft_cap: Optional[float] = None   # `LossOptions.logit_soft_cap`: the tile sees c·tanh(X/c)
    products: Products = MXU    # the MXU products (a roofline probe's stand-ins: `probe`)


# The roofline probes of `recloss-bench --chip` (`probe`): the same grid, blocks and HBM traffic with
# one unit's work taken away, so a kernel's time can be set beside what each unit alone costs.
PROBES = ("matmuls", "elementwise")


def _standin_logits(a_s, e_blk, precision):
    """A stand-in X that varies by row and lane, without an MXU product."""
    lanes = jax.lax.broadcasted_iota(jnp.int32, (1, e_blk.shape[0]), 1).astype(jnp.float32)
    return a_s[:, :1].astype(jnp.float32) + e_blk[:1, :1].astype(jnp.float32) * lanes


def _lane_grads(ref, rows, a_s, e_blk, gc, acc, precision, rs=None):
    """G kept live without the MXU: summed into dA's first 128 lanes (dE stays 0)."""
    folded = lane_fold(gc.astype(jnp.float32))
    ref["da"][rows, :tiling.LANES] += folded if rs is None else folded * rs


def probe(spec: Spec, kind: str) -> Spec:
    """``spec`` as a roofline probe (a measurement, not a loss):

    'matmuls'      the three MXU products only: G = X (no objective math; row outputs get Σ_lanes X);
    'elementwise'  the objective's per-logit math on a stand-in X (a broadcast, no MXU product) and
                   G summed into dA's first 128 lanes instead of the products (dE written as zeros).

    The benchmark builds them (`recloss.bench.chip`) with a kernel module's ``sweeps(transform)``.
    """
    if kind == "elementwise":
        return spec._replace(name=spec.name + "_elementwise", products=Products(_standin_logits, _lane_grads))
    if kind == "matmuls":
        first = spec.row_out[0].name if spec.row_out else None

        def tile(st: Step):
            if first is not None:
                st.ref[first][st.rows, :] += lane_fold(st.x)
            if spec.grad:
                st.grad(st.x)
        return spec._replace(name=spec.name + "_matmuls", tile=tile, soft_cap=None, transcendentals=0)
    raise ValueError(f"probe must be one of {PROBES}, got {kind!r}")


class Step:
    """One [bs, bv] logit sub-tile as a `Spec.tile` callback sees it.

    Attributes: ref (refs by name: 'a', 'e', 'b', the row inputs, the `RowOut`
    names, 'da', 'de', 'db'), rows (the sub-tile's row slice of every resident
    [bn, ·] ref), a [bs, Dp] and e [bv, Dp] (compute dtype, E_j's rows past
    V_local zeroed), x [bs, bv] f32 (A_s E_jᵀ + b_j, soft-capped when the spec has a
    ``soft_cap``), slope [bs, bv] f32 (the cap's dx/d(A_s E_jᵀ + b_j) in gradient specs, else None),
    live [1, bv] bool or None (all columns live), block (global vocab block
    index), off_ref (the prefetched [1] int32 vocab offset).
    """

    def __init__(self, ref, rows, a, e, x, live, block, off_ref, grad, slope=None):
        self.ref, self.rows, self.a, self.e, self.x, self.live = ref, rows, a, e, x, live
        self.block, self.off_ref, self.slope = block, off_ref, slope
        self._grad = grad

    def grad(self, g, *, clean: bool = False, row_scale=None):
        """dA_s += G E_j, dE_j += Gᵀ A_s, db_j += Σ_rows G for G [bs, bv] f32 = ∂ℓ/∂x (times `slope`,
        the chain through the soft cap, when there is one; dead columns zeroed unless ``clean``: G is 0
        there already), each row of G times ``row_scale`` [bs, 1] f32 when given. The grid applies that
        scale to dA's rows after G E_j and to A_s before Gᵀ A_s (2·bs·Dp products, not bs·bv) where the
        products are float32 and no bias gradient sums G; elsewhere to G (a 16-bit A_s·r would be
        rounded a second time)."""
        self._grad(self, g, clean, row_scale)


class _Geometry(NamedTuple):
    """The grid of one call: nb vocab blocks of bv rows, split over ``cores`` as nbc steps each."""
    nb: int               # vocab blocks
    nbc: int              # grid steps per core
    may_skip: bool        # the last step of the last core has no block
    mask_rows: bool       # the last block's rows past V_local are unspecified
    cdt: Any              # compute dtype of the products
    precision: Any        # their jax.lax.Precision (`dot_precision`)

    def block(self, c, j):
        """The vocab block core c reads at step j (clamped: a skipped step re-reads the last)."""
        return jnp.minimum(c * self.nbc + j, self.nb - 1)


def _geometry(t: tiling.Tiling, a, e) -> _Geometry:
    v_local = e.shape[0]
    nb = -(-v_local // t.bv)
    nbc = -(-nb // t.cores)
    cdt = a.dtype if a.dtype == e.dtype else jnp.promote_types(a.dtype, e.dtype)
    return _Geometry(nb, nbc, nbc * t.cores != nb, v_local % t.bv != 0, cdt, dot_precision(cdt))


def dot_precision(cdt):
    """The `jax.lax.Precision` of the kernel's MXU products for operands of dtype ``cdt``, at trace time.

    Mosaic takes two: DEFAULT (its own choice for the operands' dtype) and HIGHEST (float32); each
    dot is given one explicitly, so the ambient ``jax_default_matmul_precision`` never reaches Mosaic
    unfiltered.
    16-bit operands: DEFAULT (their products are exact in the float32 accumulator, and Mosaic refuses
    float32 contract precision on bfloat16 operands: "Bad lhs type"). float32 operands: the ambient
    precision, with 'high' (tensorfloat32) taken up to HIGHEST (Mosaic in jax 0.10.2 has no HIGH:
    "Unsupported dot precision"), and a named dot algorithm as DEFAULT when it is one pass of 16-bit
    or narrower operands (BF16_BF16_F32, F16_F16_F32, ANY_F8_...), else as HIGHEST.
    """
    default, highest = jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST
    value = jax.config.jax_default_matmul_precision
    if jnp.dtype(cdt).itemsize < 4 or value is None:
        return default
    try:
        return default if jax.lax.Precision(value) == default else highest
    except ValueError:      # a lax.DotAlgorithmPreset name
        one_pass = (value.startswith(("BF16_BF16_", "F16_F16_", "ANY_F8_"))
                    and not value.endswith(("_X3", "_X6", "_X9")))
        return default if one_pass else highest


def _operands(spec: Spec, t: tiling.Tiling, g: _Geometry, a, e, b, row_in, de_in, db_in, de_dtype):
    """(inputs, outputs, aliases, scratch): [(name, array or ShapeDtypeStruct, BlockSpec)] in call
    order, the dE/db input-output aliases (dE/db of earlier row chunks are read and overwritten in
    place) and the VMEM scratch (an f32 dE accumulator for a 16-bit dE)."""
    grad, v_local = spec.grad, e.shape[0]
    bn, bv, cores, dp = t.bn, t.bv, t.cores, t.d_pad
    col = lambda: pl.BlockSpec((bv, dp), lambda c, j, *_: (g.block(c, j), 0))      # E_j, dE_j
    lane = lambda: pl.BlockSpec((1, bv), lambda c, j, *_: (0, g.block(c, j)))      # b_j, db_j
    # Resident blocks keep their index for a core's whole walk: one buffer each when the tiling says so.
    one = dict(pipeline_mode=pl.Buffered(1)) if t.resident_buffers == 1 else {}
    resident = lambda w: pl.BlockSpec((bn, w), lambda c, j, *_: (0, 0), **one)         # A, row inputs
    per_core = lambda w: pl.BlockSpec((None, bn, w), lambda c, j, *_: (c, 0, 0), **one)  # lane outputs, dA
    inputs = [(n, x, spec_) for n, x, spec_ in (
        ("a", a, resident(dp)), ("e", e, col()), ("b", b, lane()),
        *((n, x, resident(1)) for n, x in row_in),
        ("de_in", de_in, col()), ("db_in", db_in, lane())) if x is not None]
    f32 = jnp.float32
    outputs = [(o.name, jax.ShapeDtypeStruct((cores, bn, tiling.LANES), o.dtype), per_core(tiling.LANES))
               for o in spec.row_out]
    outputs += [(n, jax.ShapeDtypeStruct(shape, dt), spec_) for n, shape, dt, spec_, want in (
        ("da", (cores, bn, dp), f32, per_core(dp), grad),
        ("de", (v_local, dp), de_dtype, col(), grad),
        ("db", (1, v_local), f32, lane(), grad and b is not None)) if want]
    names = [n for n, _, _ in inputs]
    out_names = [n for n, _, _ in outputs]
    # Input positions count the scalar-prefetch operand (position 0).
    aliases = {1 + names.index(n + "_in"): out_names.index(n) for n in ("de", "db") if n + "_in" in names}
    scratch = [pltpu.VMEM((bv, dp), jnp.float32)] if grad and jnp.dtype(de_dtype) != jnp.float32 else []
    return inputs, outputs, aliases, scratch


def _kernel(spec: Spec, t: tiling.Tiling, g: _Geometry, ref_names, *, v_local: int, vocab_size: int,
            has_bias: bool, accumulate: bool, mask_cols: bool, de_scratch: bool, pairs: bool = False):
    """The kernel body: at the first step of each core the resident outputs are filled; every step
    reads E_j (its rows past V_local zeroed), masks dead columns, starts dE_j/db_j (from the last
    chunk's when accumulating) and runs ``spec.tile`` over the row sub-tiles of bs rows."""
    grad = spec.grad
    bs, bv = t.bs, t.bv
    nsub = t.bn // bs
    inits = list(spec.row_out) + ([RowOut("da")] if grad else [])

    def add_grad(step, gr, clean, rs):
        ref = step.ref
        if rs is not None and (has_bias or jnp.dtype(g.cdt) != jnp.float32):
            gr, rs = gr * rs, None
        if step.slope is not None:
            gr = gr * step.slope
        if step.live is not None and (not clean or step.slope is not None):
            # (a dead column's cap slope is of unspecified memory past the table: it can be NaN)
            gr = jnp.where(step.live, gr, 0.0)
        acc = ref["de_acc"] if de_scratch else ref["de"]
        spec.products.grads(ref, step.rows, step.a, step.e, gr.astype(g.cdt), acc, g.precision, rs)
        if has_bias:
            ref["db"][...] += jnp.sum(gr, axis=0, keepdims=True)

    def add_pairs(ref, jg, acc, start, pid, prow, pg):
        # A sparse term's dE_j[id − j·bv] += G·A[row] for the pairs whose id falls in block j (sorted by
        # id; `_pairs`), into the f32 accumulator before its one rounding. Aligned groups of rows are
        # read and written (of A: its dtype's sublane packing, 16 rows for 16 bits; 8 of the
        # accumulator), the one wanted picked by an iota mask.
        sub = tiling.sublanes(ref["a"].dtype)

        def one(p, carry):
            col, row = pid[p] - jg * bv, prow[p]
            base = pl.multiple_of((row // sub) * sub, sub)
            a_grp = ref["a"][pl.ds(base, sub), :].astype(jnp.float32)
            pick = jax.lax.broadcasted_iota(jnp.int32, (sub, 1), 0) == row - base
            upd = pg[p] * jnp.sum(jnp.where(pick, a_grp, 0.0), axis=0, keepdims=True)      # [1, Dp]
            cbase = pl.multiple_of((col // 8) * 8, 8)
            put = jax.lax.broadcasted_iota(jnp.int32, (8, 1), 0) == col - cbase
            acc[pl.ds(cbase, 8), :] += jnp.where(put, upd, 0.0)
            return carry
        jax.lax.fori_loop(start[jg], start[jg + 1], one, 0)

    def kernel(off_ref, *refs):
        if pairs:
            (start, pid, prow, pg), refs = refs[:4], refs[4:]
        ref = dict(zip(ref_names, refs))
        c, j = pl.program_id(0), pl.program_id(1)
        jg = c * g.nbc + j

        @pl.when(j == 0)
        def _init():
            for o in inits:
                shape = ref[o.name].shape
                ref[o.name][...] = (jnp.zeros(shape, o.dtype) if o.fill == 0
                                    else jnp.full(shape, o.fill, o.dtype))

        def step():
            e_blk = ref["e"][...]
            if g.mask_rows:
                row = jg * bv + jax.lax.broadcasted_iota(jnp.int32, (bv, 1), 0)
                e_blk = jnp.where(row < v_local, e_blk, jnp.zeros_like(e_blk))
            e_blk = e_blk.astype(g.cdt)
            bias = ref["b"][...].astype(jnp.float32) if has_bias else None
            live = None
            if mask_cols:
                cols = jg * bv + jax.lax.broadcasted_iota(jnp.int32, (1, bv), 1)
                live = (cols < v_local) & (cols + off_ref[0] < vocab_size)
            if grad:
                acc = ref["de_acc"] if de_scratch else ref["de"]
                acc[...] = (ref["de_in"][...] if accumulate else jnp.zeros(acc.shape, jnp.float32))
                if has_bias:
                    ref["db"][...] = (ref["db_in"][...] if accumulate
                                      else jnp.zeros(ref["db"].shape, jnp.float32))

            def sub_tile(s, carry):
                rows = pl.ds(pl.multiple_of(s * bs, bs), bs)
                a_s = ref["a"][rows, :].astype(g.cdt)
                x = spec.products.logits(a_s, e_blk, g.precision)
                if bias is not None:
                    x = x + bias
                x, slope = softcap.capped(x, spec.soft_cap, grad=grad)
                spec.tile(Step(ref, rows, a_s, e_blk, x, live, jg, off_ref, add_grad, slope))
                return carry

            jax.lax.fori_loop(0, nsub, sub_tile, 0)
            if pairs:
                add_pairs(ref, jg, ref["de_acc"], start, pid, prow, pg)
            if de_scratch:
                ref["de"][...] = ref["de_acc"][...].astype(ref["de"].dtype)

        if g.may_skip:
            pl.when(jg < g.nb)(step)
        else:
            step()

    return kernel


def _cost(spec: Spec, t: tiling.Tiling, a, e, *, outputs, rows_in: int, has_bias: bool,
          accumulate: bool) -> pl.CostEstimate:
    """The call's cost estimate: the spec's flops and transcendentals per (row, column), and the
    bytes of every operand and output."""
    v_local, bn, dp = e.shape[0], t.bn, t.d_pad
    a_bytes, e_bytes = jnp.dtype(a.dtype).itemsize, jnp.dtype(e.dtype).itemsize
    out_bytes = sum(int(o.size) * jnp.dtype(o.dtype).itemsize for _, o, _ in outputs)
    in_bytes = bn * dp * a_bytes + v_local * dp * e_bytes + (v_local * 4 if has_bias else 0)
    in_bytes += bn * 4 * rows_in + (v_local * (dp + 1) * 4 if accumulate else 0)
    tanh = 0 if spec.soft_cap is None else 1
    return pl.CostEstimate(flops=int(spec.flops * bn * v_local * dp),
                           transcendentals=int((spec.transcendentals + tanh) * bn * v_local),
                           bytes_accessed=int(in_bytes + out_bytes))


def call(spec: Spec, t: tiling.Tiling, a, e, b, row_in, de_in, db_in, off, *, vocab_size: int,
         mask_cols: bool, de_dtype, interpret, pairs=None):
    """One pallas_call over all vocab blocks for one row tile.

    a [bn, Dp], e [V_local, Dp], b [1, V_local] or None, row_in [(name, [bn, 1]
    f32)], de_in [V_local, Dp] f32 / db_in [1, V_local] f32 (accumulated into,
    aliased to the outputs) or None, off [1] int32, pairs: None or a sparse term's dE pairs for a
    16-bit dE (`_pairs`: block starts [nb+1], ids, rows [P] int32, G [P] f32; scalar-prefetched).
    Returns dict with each `RowOut` [cores, bn, 128], da [cores, bn, Dp] f32,
    de [V_local, Dp], db [1, V_local] f32 (gradient specs; db with a bias).
    """
    g = _geometry(t, a, e)
    inputs, outputs, aliases, scratch = _operands(spec, t, g, a, e, b, row_in, de_in, db_in, de_dtype)
    out_names = [n for n, _, _ in outputs]
    flags = dict(has_bias=b is not None, accumulate=de_in is not None)
    if pairs is not None and not scratch:
        raise ValueError("a sparse term's dE pairs go into the f32 accumulator of a 16-bit dE only")
    kernel = _kernel(spec, t, g, [n for n, _, _ in inputs] + out_names + (["de_acc"] if scratch else []),
                     v_local=e.shape[0], vocab_size=vocab_size, mask_cols=mask_cols, de_scratch=bool(scratch),
                     pairs=pairs is not None, **flags)
    prefetch = (off,) + (tuple(pairs) if pairs is not None else ())
    core_axis = t.chip.core_semantics if t.cores > 1 else "arbitrary"
    outs = pl.pallas_call(
        kernel,
        out_shape=[o for _, o, _ in outputs],
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(prefetch), grid=(t.cores, g.nbc),
                                               in_specs=[s for _, _, s in inputs],
                                               out_specs=[s for _, _, s in outputs],
                                               scratch_shapes=scratch),
        input_output_aliases=aliases,
        compiler_params=tpu_compiler_params(dimension_semantics=(core_axis, "arbitrary"),
                                            vmem_limit_bytes=t.chip.vmem_limit_bytes),
        cost_estimate=_cost(spec, t, a, e, outputs=outputs, rows_in=len(row_in), **flags),
        interpret=interpret,
        name=spec.name,
    )(*prefetch, *[x for _, x, _ in inputs])
    return dict(zip(out_names, outs))


class Result(NamedTuple):
    """What `sweep` returns: per-core row outputs {name: [chunks, cores, bn, w]} and the raw
    (D-padded) dE [V_local, Dp] / db [1, V_local] (None where not produced); ``sparse_in_de``: a sparse
    term's dE is already in dE (added in the kernel, before a 16-bit dE's rounding)."""
    per_chunk: dict
    de: Any
    db: Any
    m: int
    d: int
    sparse_in_de: bool = False

    def summed(self, name: str, width: int):
        """[M, width] of output ``name``: the core partials summed, padded rows and lanes dropped."""
        x = self.per_chunk[name]
        rows = x.shape[0] * x.shape[2]
        return jnp.sum(x, axis=1).reshape(rows, x.shape[-1])[:self.m, :width]

    def lanes(self, name: str):
        """[M, cores·128] of a lane output: each core's lanes side by side (to combine across)."""
        x = self.per_chunk[name]
        chunks, cores, bn, w = x.shape
        return jnp.swapaxes(x, 1, 2).reshape(chunks * bn, cores * w)[:self.m]

    def table_grads(self):
        """(dE [V_local, D] or None, db [V_local] or None), the D padding dropped."""
        de = None if self.de is None else (self.de if self.de.shape[1] == self.d else self.de[:, :self.d])
        db = None if self.db is None else self.db.reshape(self.db.shape[1])
        return de, db


def _pairs(ids, g, bv: int, nb: int):
    """A sparse term's dE as pairs sorted by id, for the kernel to add block by block: (starts [nb+1]
    int32: block j's pairs are [starts[j], starts[j+1]); ids, rows [P] int32; G [P] f32), P = M·L,
    from ids [M, L] (local, 0 where not valid) and G [M, L] (0 where not valid)."""
    l = ids.shape[1]
    flat = ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat)
    pid = flat[order]
    prow = (order // l).astype(jnp.int32)
    pg = g.reshape(-1).astype(jnp.float32)[order]
    starts = jnp.searchsorted(pid, jnp.arange(nb + 1, dtype=jnp.int32) * bv).astype(jnp.int32)
    return starts, pid, prow, pg


def sweep(spec: Spec, t: tiling.Tiling, a, e, b, vocab_offset, *, rows: Sequence = (), vocab_size: int,
          static_offset: Optional[int], interpret, sparse_de=None) -> Result:
    """Rows ``a`` [M, D] against ``e`` [V_local, D] (bias ``b`` [V_local] or None) in one sweep.

    rows: per-row inputs [(name, [M] vector, fill for padded rows)], cast to
    f32 and resident as [bn, 1]. static_offset: vocab_offset when it is a
    Python int (else None: traced), for deciding whether columns need masking.
    float16 operands are widened to float32 first (`tiling.kernel_dtype`).
    dE is f32, or the table's (kernel) dtype when one row chunk covers all rows
    (the sum over rows is then complete in f32 before the single rounding). ``sparse_de`` (ids [M, L], G
    [M, L] f32), with such a 16-bit dE: dE[ids] += G·A added in the kernel before that rounding
    (`Result.sparse_in_de`); otherwise left to the caller (dE is then f32).
    """
    a, e = a.astype(tiling.kernel_dtype(a.dtype)), e.astype(tiling.kernel_dtype(e.dtype))
    b = None if b is None else b.astype(tiling.kernel_dtype(b.dtype))
    m, d = a.shape
    v = e.shape[0]
    dp, nrows = t.d_pad, t.rows
    mask_cols = (v % t.bv != 0 or static_offset is None or static_offset + v > vocab_size)
    a_p = jnp.pad(a, ((0, nrows - m), (0, dp - d)))
    e_p = e if dp == d else jnp.pad(e, ((0, 0), (0, dp - d)))
    b_p = None if b is None else b.reshape(1, v)
    names = [n for n, _, _ in rows]
    row_p = [_pad_rows(x.astype(jnp.float32), nrows - m, fill).reshape(nrows, 1) for _, x, fill in rows]
    off = jnp.asarray(vocab_offset, jnp.int32).reshape(1)
    de_dtype = e.dtype if t.num_chunks == 1 else jnp.float32
    run = functools.partial(call, spec, t, vocab_size=vocab_size, mask_cols=mask_cols, de_dtype=de_dtype,
                            interpret=interpret)

    pairs = None
    if spec.grad and sparse_de is not None and jnp.dtype(de_dtype) != jnp.float32:
        pairs = _pairs(*sparse_de, t.bv, -(-v // t.bv))
    if t.num_chunks == 1:
        out = run(a_p, e_p, b_p, list(zip(names, row_p)), None, None, off, pairs=pairs)
        per_chunk = {k: x[None] for k, x in out.items() if k not in ("de", "db")}
        de, db = out.get("de"), out.get("db")
    else:
        a_c = a_p.reshape(t.num_chunks, t.bn, dp)
        row_c = tuple(x.reshape(t.num_chunks, t.bn, 1) for x in row_p)

        def chunk(carry, xs):
            de_acc, db_acc = carry
            out = run(xs[0], e_p, b_p, list(zip(names, xs[1])), de_acc, db_acc, off)
            rows_out = {k: x for k, x in out.items() if k not in ("de", "db")}
            if "da" in rows_out and t.cores > 1:
                # The cores' dA partials summed per chunk, so the scan stacks one [bn, Dp] f32 per chunk,
                # not one per core (on a two-core chip 1 GiB less at 65,536 rows of D = 4,096).
                rows_out["da"] = jnp.sum(rows_out["da"], axis=0, keepdims=True)
            return (out.get("de"), out.get("db")), rows_out

        init = (jnp.zeros((v, dp), jnp.float32) if spec.grad else None,
                jnp.zeros((1, v), jnp.float32) if (spec.grad and b is not None) else None)
        (de, db), per_chunk = jax.lax.scan(chunk, init, (a_c, row_c), unroll=_unroll(t.num_chunks))
    return Result(per_chunk, de, db, m, d, pairs is not None)


# Up to this many row chunks the scan is unrolled, so XLA's cost analysis counts every call; past it
# the scan stays a loop: at D = 4,096 a 65,536-row gradient sweep is 128 chunks, and unrolled they took
# 42 s to compile for v6e (8.1 GiB of temporaries) against 9 s rolled (6.5 GiB).
MAX_UNROLLED_CHUNKS = 8


def _unroll(num_chunks: int):
    return True if num_chunks <= MAX_UNROLLED_CHUNKS else 1


def _pad_rows(x, n: int, fill: float):
    return jnp.pad(x, (0, n)) if fill == 0 else jnp.pad(x, (0, n), constant_values=fill)
