"""Mosaic-TPU Pallas kernel for the CutBCE background (the `cutbce_pallas` plan).

The background of rows a_i [M, D] against a table shard E [V_local, D],

    bg_i = Σ_v [ cp·P(x_iv) + cq·Q(x_iv) ],   x_iv = a_i·e_v + b_v,   (cp, cq) = background_coefficients,

(x_iv becomes c·tanh(x_iv/c) with logit_soft_cap c: the grid applies it) is computed by
one `pallas_call` per row chunk whose grid is ``(cores, vocab blocks per core)``: the row
tile A [bn, D] and the accumulators dA [bn, D], bg, counts stay resident in VMEM while the
grid walks vocab blocks E_j [bv, D] ('arbitrary' axis). Each step runs an inner
loop over row sub-tiles of ``bs`` rows:

    X = A_s E_jᵀ (+ b_j)                  f32 accumulation on the MXU
    lanes, G' = Bernoulli.tile(X)          the term's one formula at its least work (γ = 0: one exp a
                                           logit, a refined approximate reciprocal, a log a lane)
    bg_s += lanes ; counts_s += Σ_lanes [X > threshold]
    G = G'·r_s ; dA_s += G E_j ; dE_j += Gᵀ A_s ; db_j += Σ_rows G      (float32 products and no bias:
                                           r_s on dA_s's rows and on A_s instead of on G)

and writes dE_j, db_j once. Columns past V_local (a partial last block reads
unspecified memory) or at global ids ≥ vocab_size are masked with iota;
padded rows have r = 0. On two-TensorCore chips the leading grid axis of 2
splits the vocab blocks and the two dA partials are summed here. When rows
do not fit VMEM, a `lax.scan` over row chunks accumulates dE/db in HBM (f32,
aliased in place).

Modes: 'fused' (loss + all gradients, 6·M·V·D flops), 'loss' (2·M·V·D) and
'grad' (recompute: logits, dA, dE, 6·M·V·D); `recloss.sweep` supplies the custom VJPs. The
grid, the padding, the masking, the gradient accumulation and the row-chunk
loop are `recloss.pallas.grid`'s (shared with the softmax kernel); this module
supplies the per-tile math.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from recloss import sweep as sweep_lib
from recloss.bce.bernoulli import Bernoulli
from recloss.options import LossOptions
from recloss.pallas import grid, tiling


_MODES = {"fused": (True, True), "loss": (True, False), "grad": (False, True)}   # (value, gradient)


def newton_steps(a_dtype, e_dtype, *, bias: bool, interpret: bool) -> int:
    """Newton steps on σ's approximate reciprocal in the gradient tile: 1 (2⁻¹⁶ relative) where every use
    of G is rounded to 16 bits first — the MXU's one pass, for 16-bit operands or float32 ones at DEFAULT
    precision on a chip (not in the interpreter, whose float32 products are exact) — and no bias
    gradient sums G in float32; else 2 (float32's 2⁻²⁴). The figures: docs/measurements.md."""
    cdt = jnp.promote_types(tiling.kernel_dtype(a_dtype), tiling.kernel_dtype(e_dtype))
    sixteen = jnp.dtype(cdt).itemsize < 4
    one_pass = grid.dot_precision(cdt) == jax.lax.Precision.DEFAULT and not interpret
    return 1 if not bias and (sixteen or one_pass) else 2


def _spec(mode: str, opts: LossOptions, bv: int, newton: int = 2) -> grid.Spec:
    """The grid spec of ``mode``: the background's `Bernoulli.tile` per sub-tile into the bg lanes (and
    the predicted-positive counts), G = ∂bg/∂x·r into the products; σ's reciprocal refined by ``newton``
    steps (`newton_steps`)."""
    loss, grad = _MODES[mode]
    count = loss and opts.compute_metrics
    term = Bernoulli.background(opts)
    threshold = float(opts.threshold)

    def tile(st: grid.Step):
        ref, rows = st.ref, st.rows
        out = term.tile(st.x, st.live, value=loss, grad=grad, newton=newton)
        if loss:
            ref["bg"][rows, :] += out.lanes
            if count:    # x > threshold; a dead column is not counted
                if threshold == 0.0 and out.positive is not None:
                    hit = out.positive          # the term's own x > 0, false at dead columns: 2 ops a logit less
                else:
                    hit = st.x > threshold
                    if st.live is not None:
                        hit = hit & st.live
                ref["cnt"][rows, :] += grid.lane_fold(jnp.where(hit, 1.0, 0.0))
        if grad:
            st.grad(out.dval, clean=out.clean, row_scale=ref["r"][rows, :])

    row_out = ([grid.RowOut("bg")] if loss else []) + ([grid.RowOut("cnt")] if count else [])
    return grid.Spec(f"cutbce_{mode}", grad, tuple(row_out), tile, flops={"fused": 6, "loss": 2, "grad": 6}[mode],
                     transcendentals=term.transcendentals(value=loss, grad=grad, bv=bv),
                     soft_cap=opts.logit_soft_cap)


def temporaries(mode: str, opts: LossOptions) -> int:
    """[bs, bv] f32 tiles of VMEM a ``mode`` tile needs (the logits and the term's), for the tiling."""
    loss, grad = _MODES[mode]
    return 1 + Bernoulli.background(opts).temporaries(value=loss, grad=grad)


def sweep(mode: str, a, e, b, r, vocab_offset, plan: sweep_lib.Plan, fwd=None, sparse_de=None, *,
          transform=None) -> sweep_lib.SweepOut:
    """The background of rows ``a`` [M, D] against ``e`` [V_local, D] in one kernel sweep: the
    mode of the `cutbce_pallas` plan's sweeps (`SWEEPS`; ``fwd`` is unused).

    ``r`` [M] f32 scales each row's gradient (grad modes only). Returns
    SweepOut(bg [M] f32, predicted counts [M] f32, dA [M, D] f32, dE [V_local, D],
    db [V_local] f32); entries the mode does not produce are None. dE is f32,
    or the table's dtype when one row chunk covers all rows (the sum over rows
    is then complete in f32 before the single rounding). ``sparse_de`` = (ids [M, L], G [M, L] f32): a
    sparse term's dE[ids] += G·a and db[ids] += G, added where dE is still f32 (in the kernel's VMEM
    accumulator when it writes a 16-bit dE, `recloss.pallas.grid.sweep`). ``transform``: a function
    of the grid spec (the benchmark's roofline probes, `recloss.pallas.grid.probe`), or None.
    """
    opts = plan.opts
    m, d = a.shape
    v = e.shape[0]
    t = tiling.choose(("bce", mode), m, v, d, a.dtype, e.dtype, opts, bias=b is not None, chip=plan.chip,
                      who=plan.owner, temps=temporaries(mode, opts))
    loss, grad = _MODES[mode]
    spec = _spec(mode, opts, t.bv, newton_steps(a.dtype, e.dtype, bias=b is not None, interpret=plan.interpret))
    res = grid.sweep(spec if transform is None else transform(spec), t, a, e, b, vocab_offset,
                     rows=[("r", r, 0.0)] if grad else [],
                     vocab_size=plan.vocab_size, static_offset=plan.static_offset,
                     interpret=plan.interpret, sparse_de=sparse_de)
    bg = res.summed("bg", tiling.LANES).sum(-1) if loss else None
    cnt = res.summed("cnt", tiling.LANES).sum(-1) if "cnt" in res.per_chunk else None
    da = res.summed("da", d) if grad else None
    de, db = res.table_grads()
    if sparse_de is not None and res.sparse_in_de:      # dE has it; the bias gradient is f32
        if db is not None:
            db = db.at[sparse_de[0].reshape(-1)].add(sparse_de[1].reshape(-1))
    else:
        de, db = sweep_lib.add_sparse_de(a, de, db, sparse_de)
    return sweep_lib.SweepOut(bg, cnt, da, de, db)


def sweeps(transform=None) -> sweep_lib.Sweeps:
    """The kernel's `recloss.sweep.Sweeps`, one function per mode, each grid spec passed through
    ``transform`` first (None: the kernel itself; `recloss.pallas.grid.probe` for a roofline probe)."""
    return sweep_lib.Sweeps(*(functools.partial(sweep, mode, transform=transform)
                              for mode in sweep_lib.Sweeps._fields))


# The `cutbce_pallas` plan's `recloss.sweep.Sweeps`: one function per mode.
SWEEPS = sweeps()
