"""Mosaic-TPU Pallas kernel for the CutBCE background (the `cutbce_pallas` plan).

The background of rows a_i [M, D] against a table shard E [V_local, D],

    bg_i = Σ_v [ cp·P(x_iv) + cq·Q(x_iv) ],   x_iv = a_i·e_v + b_v,   cp, cq = opts.background_p/_q,

is computed by one `pallas_call` per row chunk whose grid is
``(cores, vocab blocks per core)``: the row tile A [bn, D] and the
accumulators dA [bn, D], bg, counts stay resident in VMEM while the grid
walks vocab blocks E_j [bv, D] ('arbitrary' axis). Each step runs an inner
loop over row sub-tiles of ``bs`` rows:

    X = A_s E_jᵀ (+ b_j)                  f32 accumulation on the MXU
    val, G' = bernoulli_terms(X)           the one shared formula, in f32
    bg_s += Σ_lanes val ; counts_s += Σ_lanes [X > threshold]
    G = G'·r_s ; dA_s += G E_j ; dE_j += Gᵀ A_s ; db_j += Σ_rows G

and writes dE_j, db_j once. Columns past V_local (a partial last block reads
unspecified memory) or at global ids ≥ vocab_size are masked with iota;
padded rows have r = 0. On two-TensorCore chips the leading grid axis of 2
splits the vocab blocks and the two dA partials are summed here. When rows
do not fit VMEM, a `lax.scan` over row chunks accumulates dE/db in HBM (f32,
aliased in place).

Modes: 'fused' (loss + all gradients, 6·M·V·D flops), 'loss' (2·M·V·D) and
'grad' (recompute, 4·M·V·D); `recloss.sweep` supplies the custom VJPs.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from recloss._compat import tpu_compiler_params
from recloss.bce.bernoulli import bernoulli_terms
from recloss.options import LossOptions
from recloss.pallas import tiling

_LANES = tiling.LANES


class Plan(NamedTuple):
    """Static configuration of one background evaluation (hashable: a custom-VJP static argument)."""
    opts: LossOptions
    vocab_size: int                  # real V (global); columns at or past it are inert
    static_offset: Optional[int]     # vocab_offset when it is a Python int, else None
    chip: tiling.Chip
    interpret: Any                   # False, True or a pltpu.InterpretParams

    def sweep(self, mode: str, a, e, b, r, vocab_offset, fwd=None):
        """One kernel sweep in ``mode``; see `sweep` below and `recloss.sweep` (``fwd`` is unused)."""
        return sweep(mode, a, e, b, r, vocab_offset, self)


def _lane_fold(x):
    """[rows, k·128] → [rows, 128] by adding lane-aligned column groups (no cross-lane work)."""
    acc = x[:, :_LANES]
    for k in range(1, x.shape[1] // _LANES):
        acc = acc + x[:, k * _LANES:(k + 1) * _LANES]
    return acc


def _transcendentals(opts: LossOptions, grad: bool) -> int:
    """Transcendental ops per logit: exp and log1p, a reciprocal for σ, powers for focal terms."""
    n = 2 + (1 if (grad or opts.focal_gamma != 0.0) else 0)
    if opts.focal_gamma != 0.0:
        n += (opts.background_p != 0.0) + (opts.background_q != 0.0)
    return n


def _call(mode: str, t: tiling.Tiling, a, e, b, r, de_in, db_in, off, *, v_local: int, plan: Plan,
          mask_cols: bool, de_dtype):
    """One pallas_call over all vocab blocks for one row tile.

    a [bn, Dp], e [V_local, Dp], b [1, V_local] or None, r [bn, 1] f32 (grad
    modes), de_in [V_local, Dp] f32 / db_in [1, V_local] f32 (accumulated into,
    aliased to the outputs) or None, off [1] int32.
    Returns dict with bg, cnt [cores, bn, 128] f32 (loss modes; cnt only with
    metrics), da [cores, bn, Dp] f32, de [V_local, Dp], db [1, V_local] f32.
    """
    opts = plan.opts
    grad = mode in ("fused", "grad")
    loss = mode in ("fused", "loss")
    count = loss and opts.compute_metrics
    has_bias = b is not None
    accumulate = de_in is not None
    bn, bs, bv, cores, dp = t.bn, t.bs, t.bv, t.cores, t.d_pad
    nb = -(-v_local // bv)
    nbc = -(-nb // cores)
    may_skip = nbc * cores != nb          # the last step of the last core has no block
    mask_rows = v_local % bv != 0          # the last block's rows past V_local are unspecified
    cdt = a.dtype if a.dtype == e.dtype else jnp.promote_types(a.dtype, e.dtype)
    cp, cq = opts.background_p, opts.background_q
    vocab_size = plan.vocab_size
    nsub = bn // bs

    def blk(c, j):
        return jnp.minimum(c * nbc + j, nb - 1)

    col = lambda: pl.BlockSpec((bv, dp), lambda c, j, o: (blk(c, j), 0))          # E_j, dE_j
    lane = lambda: pl.BlockSpec((1, bv), lambda c, j, o: (0, blk(c, j)))          # b_j, db_j
    resident = lambda w: pl.BlockSpec((bn, w), lambda c, j, o: (0, 0))           # A, r
    per_core = lambda w: pl.BlockSpec((None, bn, w), lambda c, j, o: (c, 0, 0))  # bg, cnt, dA
    inputs = [(n, x, spec) for n, x, spec in (
        ("a", a, resident(dp)), ("e", e, col()), ("b", b, lane()), ("r", r, resident(1)),
        ("de_in", de_in, col()), ("db_in", db_in, lane())) if x is not None]
    f32 = jnp.float32
    outputs = [(n, jax.ShapeDtypeStruct(shape, dt), spec) for n, shape, dt, spec, want in (
        ("bg", (cores, bn, _LANES), f32, per_core(_LANES), loss),
        ("cnt", (cores, bn, _LANES), f32, per_core(_LANES), count),
        ("da", (cores, bn, dp), f32, per_core(dp), grad),
        ("de", (v_local, dp), de_dtype, col(), grad),
        ("db", (1, v_local), f32, lane(), grad and has_bias)) if want]
    names = [n for n, _, _ in inputs]
    out_names = [n for n, _, _ in outputs]
    # dE/db of earlier row chunks are read and overwritten in place. Input
    # positions count the scalar-prefetch operand (position 0).
    aliases = {1 + names.index(n + "_in"): out_names.index(n) for n in ("de", "db") if n + "_in" in names}
    scratch = []
    de_scratch = grad and jnp.dtype(de_dtype) != jnp.float32
    if de_scratch:
        scratch.append(pltpu.VMEM((bv, dp), jnp.float32))

    def kernel(off_ref, *refs):
        ref = dict(zip(names + out_names + (["de_acc"] if de_scratch else []), refs))
        c, j = pl.program_id(0), pl.program_id(1)
        jg = c * nbc + j

        @pl.when(j == 0)
        def _init():
            for name in ("bg", "cnt", "da"):
                if name in ref:
                    ref[name][...] = jnp.zeros(ref[name].shape, jnp.float32)

        def step():
            e_blk = ref["e"][...]
            if mask_rows:
                row = jg * bv + jax.lax.broadcasted_iota(jnp.int32, (bv, 1), 0)
                e_blk = jnp.where(row < v_local, e_blk, jnp.zeros_like(e_blk))
            e_blk = e_blk.astype(cdt)
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
                a_s = ref["a"][rows, :].astype(cdt)
                x = jax.lax.dot_general(a_s, e_blk, (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32)
                if bias is not None:
                    x = x + bias
                val, dval = bernoulli_terms(x, opts, cp, cq, grad=grad)
                if loss:
                    if live is not None:
                        val = jnp.where(live, val, 0.0)
                    ref["bg"][rows, :] += _lane_fold(val)
                    if count:
                        hit = x > opts.threshold
                        if live is not None:
                            hit = hit & live
                        ref["cnt"][rows, :] += _lane_fold(hit.astype(jnp.float32))
                if grad:
                    g = dval * ref["r"][rows, :]
                    if live is not None:
                        g = jnp.where(live, g, 0.0)
                    gc = g.astype(cdt)
                    ref["da"][rows, :] += jnp.dot(gc, e_blk, preferred_element_type=jnp.float32)
                    acc = ref["de_acc"] if de_scratch else ref["de"]
                    acc[...] += jax.lax.dot_general(gc, a_s, (((0,), (0,)), ((), ())),
                                                    preferred_element_type=jnp.float32)
                    if has_bias:
                        ref["db"][...] += jnp.sum(g, axis=0, keepdims=True)
                return carry

            jax.lax.fori_loop(0, nsub, sub_tile, 0)
            if de_scratch:
                ref["de"][...] = ref["de_acc"][...].astype(ref["de"].dtype)

        if may_skip:
            pl.when(jg < nb)(step)
        else:
            step()

    factor = {"fused": 6, "loss": 2, "grad": 4}[mode]
    a_bytes, e_bytes = jnp.dtype(a.dtype).itemsize, jnp.dtype(e.dtype).itemsize
    out_bytes = sum(int(o.size) * jnp.dtype(o.dtype).itemsize for _, o, _ in outputs)
    in_bytes = bn * dp * a_bytes + v_local * dp * e_bytes + (v_local * 4 if has_bias else 0)
    in_bytes += (bn * 4 if grad else 0) + (v_local * (dp + 1) * 4 if accumulate else 0)
    cost = pl.CostEstimate(
        flops=int(factor * bn * v_local * dp),
        transcendentals=int(_transcendentals(opts, grad) * bn * v_local),
        bytes_accessed=int(in_bytes + out_bytes))
    core_axis = t.chip.core_semantics if cores > 1 else "arbitrary"
    params = tpu_compiler_params(dimension_semantics=(core_axis, "arbitrary"),
                                 vmem_limit_bytes=t.chip.vmem_limit_bytes)
    outs = pl.pallas_call(
        kernel,
        out_shape=[o for _, o, _ in outputs],
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(cores, nbc),
                                               in_specs=[spec for _, _, spec in inputs],
                                               out_specs=[spec for _, _, spec in outputs],
                                               scratch_shapes=scratch),
        input_output_aliases=aliases,
        compiler_params=params,
        cost_estimate=cost,
        interpret=plan.interpret,
        name=f"cutbce_{mode}",
    )(off, *[x for _, x, _ in inputs])
    return dict(zip(out_names, outs))


def sweep(mode: str, a, e, b, r, vocab_offset, plan: Plan):
    """The background of rows ``a`` [M, D] against ``e`` [V_local, D] in one kernel sweep.

    ``r`` [M] f32 scales each row's gradient (grad modes only). Returns
    (bg [M] f32, predicted counts [M] f32, dA [M, D] f32, dE [V_local, D],
    db [V_local] f32); entries the mode does not produce are None. dE is f32,
    or the table's dtype when one row chunk covers all rows (the sum over rows
    is then complete in f32 before the single rounding).
    """
    opts = plan.opts
    m, d = a.shape
    v = e.shape[0]
    t = tiling.choose(mode, m, v, d, a.dtype, e.dtype, opts, bias=b is not None, chip=plan.chip)
    grad = mode in ("fused", "grad")
    loss = mode in ("fused", "loss")
    dp, rows = t.d_pad, t.rows
    mask_cols = (v % t.bv != 0 or plan.static_offset is None
                 or plan.static_offset + v > plan.vocab_size)
    a_p = jnp.pad(a, ((0, rows - m), (0, dp - d)))
    e_p = e if dp == d else jnp.pad(e, ((0, 0), (0, dp - d)))
    b_p = None if b is None else b.reshape(1, v)
    r_p = None if not grad else jnp.pad(r.astype(jnp.float32), (0, rows - m)).reshape(rows, 1)
    off = jnp.asarray(vocab_offset, jnp.int32).reshape(1)
    de_dtype = e.dtype if t.num_chunks == 1 else jnp.float32
    call = functools.partial(_call, mode, t, v_local=v, plan=plan, mask_cols=mask_cols,
                             de_dtype=de_dtype)

    if t.num_chunks == 1:
        out = call(a_p, e_p, b_p, r_p, None, None, off)
        per_chunk = {k: out[k][None] for k in ("bg", "cnt", "da") if k in out}
        de, db = out.get("de"), out.get("db")
    else:
        a_c = a_p.reshape(t.num_chunks, t.bn, dp)
        r_c = None if r_p is None else r_p.reshape(t.num_chunks, t.bn, 1)

        def chunk(carry, xs):
            de_acc, db_acc = carry
            out = call(xs[0], e_p, b_p, xs[1], de_acc, db_acc, off)
            rows_out = {k: out[k] for k in ("bg", "cnt", "da") if k in out}
            return (out.get("de"), out.get("db")), rows_out

        init = (jnp.zeros((v, dp), jnp.float32) if grad else None,
                jnp.zeros((1, v), jnp.float32) if (grad and b is not None) else None)
        # Unrolled: chunks are few, and XLA's cost analysis then counts every call.
        (de, db), per_chunk = jax.lax.scan(chunk, init, (a_c, r_c), unroll=True)

    def rows_of(x, width):
        # [chunks, cores, bn, w] → [M, w]: sum the core partials, drop padded rows.
        return jnp.sum(x, axis=1).reshape(rows, x.shape[-1])[:m, :width]

    bg = rows_of(per_chunk["bg"], _LANES).sum(-1) if loss else None
    cnt = rows_of(per_chunk["cnt"], _LANES).sum(-1) if "cnt" in per_chunk else None
    da = rows_of(per_chunk["da"], d) if grad else None
    de = None if de is None else (de if dp == d else de[:, :d])
    db = None if db is None else db.reshape(v)
    return bg, cnt, da, de, db
