"""Mosaic-TPU Pallas kernel for the CutBCE background (the `cutbce_pallas` plan).

The background of rows a_i [M, D] against a table shard E [V_local, D],

    bg_i = Σ_v [ cp·P(x_iv) + cq·Q(x_iv) ],   x_iv = a_i·e_v + b_v,   (cp, cq) = background_coefficients,

(x_iv becomes c·tanh(x_iv/c) with logit_soft_cap c: the grid applies it) is computed by
one `pallas_call` per row chunk whose grid is ``(cores, vocab blocks per core)``: the row
tile A [bn, D] and the accumulators dA [bn, D], bg, counts stay resident in VMEM while the
grid walks vocab blocks E_j [bv, D] ('arbitrary' axis). Each step runs an inner
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
'grad' (recompute: logits, dA, dE, 6·M·V·D); `recloss.sweep` supplies the custom VJPs. The
grid, the padding, the masking, the gradient accumulation and the row-chunk
loop are `recloss.pallas.grid`'s (shared with the softmax kernel); this module
supplies the per-tile math.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from recloss import sweep as sweep_lib
from recloss.bce.bernoulli import background_coefficients, bernoulli_terms
from recloss.options import LossOptions
from recloss.pallas import grid, tiling


def _transcendentals(opts: LossOptions, grad: bool) -> int:
    """Transcendental ops per logit: exp and log1p, a reciprocal for σ, powers for focal terms."""
    n = 2 + (1 if (grad or opts.focal_gamma != 0.0) else 0)
    if opts.focal_gamma != 0.0:
        n += sum(c != 0.0 for c in background_coefficients(opts))
    return n


def _spec(mode: str, opts: LossOptions) -> grid.Spec:
    """The grid spec of ``mode``: bg (and counts) lanes, the Bernoulli terms per tile, G = G'·r."""
    grad = mode in ("fused", "grad")
    loss = mode in ("fused", "loss")
    count = loss and opts.compute_metrics
    cp, cq = background_coefficients(opts)

    def tile(st: grid.Step):
        x, live, ref, rows = st.x, st.live, st.ref, st.rows
        val, dval = bernoulli_terms(x, opts, cp, cq, grad=grad)
        if loss:
            if live is not None:
                val = jnp.where(live, val, 0.0)
            ref["bg"][rows, :] += grid.lane_fold(val)
            if count:
                hit = x > opts.threshold
                if live is not None:
                    hit = hit & live
                ref["cnt"][rows, :] += grid.lane_fold(hit.astype(jnp.float32))
        if grad:
            st.grad(dval * ref["r"][rows, :])

    row_out = ([grid.RowOut("bg")] if loss else []) + ([grid.RowOut("cnt")] if count else [])
    return grid.Spec(f"cutbce_{mode}", grad, tuple(row_out), tile,
                     flops={"fused": 6, "loss": 2, "grad": 6}[mode],
                     transcendentals=_transcendentals(opts, grad), soft_cap=opts.logit_soft_cap)


def sweep(mode: str, a, e, b, r, vocab_offset, plan: sweep_lib.Plan, fwd=None, sparse_de=None
          ) -> sweep_lib.SweepOut:
    """The background of rows ``a`` [M, D] against ``e`` [V_local, D] in one kernel sweep: the
    mode of the `cutbce_pallas` plan's sweeps (`SWEEPS`; ``fwd`` is unused).

    ``r`` [M] f32 scales each row's gradient (grad modes only). Returns
    SweepOut(bg [M] f32, predicted counts [M] f32, dA [M, D] f32, dE [V_local, D],
    db [V_local] f32); entries the mode does not produce are None. dE is f32,
    or the table's dtype when one row chunk covers all rows (the sum over rows
    is then complete in f32 before the single rounding). ``sparse_de`` = (ids [M, L], G [M, L] f32): a
    sparse term's dE[ids] += G·a and db[ids] += G, added where dE is still f32 (in the kernel's VMEM
    accumulator when it writes a 16-bit dE, `recloss.pallas.grid.sweep`).
    """
    opts = plan.opts
    m, d = a.shape
    v = e.shape[0]
    t = tiling.choose(("bce", mode), m, v, d, a.dtype, e.dtype, opts, bias=b is not None, chip=plan.chip,
                      who=plan.owner)
    grad = mode in ("fused", "grad")
    loss = mode in ("fused", "loss")
    res = grid.sweep(_spec(mode, opts), t, a, e, b, vocab_offset, rows=[("r", r, 0.0)] if grad else [],
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


# The `cutbce_pallas` plan's `recloss.sweep.Sweeps`: one function per mode.
SWEEPS = sweep_lib.Sweeps(loss=functools.partial(sweep, "loss"), grad=functools.partial(sweep, "grad"),
                          fused=functools.partial(sweep, "fused"))
