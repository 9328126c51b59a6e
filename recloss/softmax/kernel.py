"""Mosaic-TPU Pallas kernels for the softmax log-partition (the `cutce_pallas` plan).

For rows a_i [M, D] against a table shard E [V_local, D] with logits
x_iv = (a_i·e_v + b_v)/τ (cap(a_i·e_v + b_v)/τ with cap(y) = c·tanh(y/c) for logit_soft_cap c,
applied by the grid), the plan honours `recloss.softmax.cut.SWEEPS`:

'loss' (2·M·V·D flops): lse_i = log Σ_{live v} exp(x_iv) (−inf for a row with
no live column) and, with compute_metrics, the row max and its global id
(first on ties). One `pallas_call` per row chunk on the shared grid of
`recloss.pallas.grid`: the row tile A [bn, D] and per-row running lanes
(max m, Σ exp(x − m), argmax id) as [bn, 128] arrays stay resident in VMEM
while the grid walks vocab blocks ('arbitrary' axis). Lane l of a row keeps
the running (max, sum-exp, id) of the columns ≡ l (mod 128), updated per sub-tile
with lane-aligned elementwise work only:

    X = (A_s E_jᵀ + b_j)/τ, dead columns = NEG       f32, on the MXU
    m' = max(m, X_0, X_1, ...)                         X_k: the k-th 128-column group
    s  = s·exp(m − m') + Σ_k exp(X_k − m')             0 while a lane has seen no live column
    id = the global id of the first X_k > running max  (strictly greater: the smallest id wins)

The lanes (and the two TensorCores' partials) are combined here, outside the
kernel: m = max over lanes, s = Σ s_l·exp(m_l − m), the id of the smallest
global id among the lanes whose max is m.

'grad' (6·M·V·D: logits, dA, dE; the recompute of `recloss.sweep.sweep_rows`): with the
forward's lse and the cotangent r, G = r_i·exp(x − lse_i)/τ on live columns,
dA = G E (resident), dE_j = Gᵀ A and db_j = Σ_rows G written once per block.
Rows with lse = −inf (no live column) and padded rows use a stand-in lse of
−NEG, so their G is exactly 0.

Masked columns use `recloss.softmax.partition.NEG`, never −inf, inside the
kernel. Row padding, D padding, masking, the two-core split, the row-chunk
loop with dE/db accumulated in HBM and the cost estimates are the grid's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from recloss import sweep as sweep_lib
from recloss.options import LossOptions
from recloss.pallas import grid, tiling
from recloss.softmax import partition


def _tiling(kind: str, a, e, b, p: sweep_lib.Plan) -> tiling.Tiling:
    m, d = a.shape
    return tiling.choose(("softmax", kind), m, e.shape[0], d, a.dtype, e.dtype, p.opts, bias=b is not None,
                         chip=p.chip, who=p.owner)


def _loss_spec(opts: LossOptions, bv: int) -> grid.Spec:
    inv_t = 1.0 / opts.temperature
    argmax = opts.compute_metrics
    neg = partition.NEG

    def tile(st: grid.Step):
        ref, rows, live = st.ref, st.rows, st.live
        x = st.x if inv_t == 1.0 else st.x * inv_t
        if live is not None:
            x = jnp.where(live, x, neg)
        groups = grid.lane_groups(x)
        m_old = ref["m"][rows, :]
        if argmax:
            best, idx = m_old, ref["id"][rows, :]
            base = (st.off_ref[0] + st.block * bv
                    + jax.lax.broadcasted_iota(jnp.int32, (1, tiling.LANES), 1))
            for k, xk in enumerate(groups):       # in column order: strictly greater keeps the first
                better = xk > best
                best = jnp.where(better, xk, best)
                idx = jnp.where(better, base + k * tiling.LANES, idx)
            m_new = best
            ref["id"][rows, :] = idx
        else:
            m_new = m_old
            for xk in groups:
                m_new = jnp.maximum(m_new, xk)
        acc = jnp.exp(groups[0] - m_new)
        for xk in groups[1:]:
            acc = acc + jnp.exp(xk - m_new)
        s = ref["s"][rows, :] * jnp.exp(m_old - m_new) + acc
        if live is not None:
            # A dead column is NEG: exp(NEG − m') = 0 once the lane has seen a live column; before
            # that m' = NEG and every exp is 1, so a lane that has seen none keeps s = 0.
            s = jnp.where(m_new > neg, s, 0.0)
        ref["s"][rows, :] = s
        ref["m"][rows, :] = m_new

    row_out = [grid.RowOut("m", jnp.float32, neg), grid.RowOut("s")]
    if argmax:
        row_out.append(grid.RowOut("id", jnp.int32, 0))
    return grid.Spec("cutce_loss", False, tuple(row_out), tile, flops=2, transcendentals=1,
                     soft_cap=opts.logit_soft_cap)


def _spec_of(spec: grid.Spec, transform) -> grid.Spec:
    return spec if transform is None else transform(spec)


def lse_sweep(a, e, b, r, vocab_offset, p: sweep_lib.Plan, fwd=None, *, transform=None) -> sweep_lib.SweepOut:
    """'loss' mode of the `cutce_pallas` plan: SweepOut(lse [M], (row max [M], argmax id [M]) or
    None) of rows ``a`` [M, D] against ``e`` [V_local, D] (``r``, ``fwd`` unused); ``transform``: a
    function of the grid spec (a roofline probe, `recloss.pallas.grid.probe`) or None."""
    t = _tiling("loss", a, e, b, p)
    res = grid.sweep(_spec_of(_loss_spec(p.opts, t.bv), transform), t, a, e, b, vocab_offset,
                     vocab_size=p.vocab_size, static_offset=p.static_offset, interpret=p.interpret)
    m_l, s_l = res.lanes("m"), res.lanes("s")            # [M, cores·128]
    m = jnp.max(m_l, axis=-1)
    s = jnp.sum(s_l * jnp.exp(m_l - m[:, None]), axis=-1)
    lse = partition.lse_of(m, s)
    aux = None
    if p.opts.compute_metrics:
        idx = jnp.min(jnp.where(m_l == m[:, None], res.lanes("id"), partition.BIG_ID), axis=-1)
        aux = (m, idx)
    return sweep_lib.SweepOut(lse, aux)


def _grad_spec(opts: LossOptions) -> grid.Spec:
    inv_t = 1.0 / opts.temperature

    def tile(st: grid.Step):
        ref, rows = st.ref, st.rows
        x = st.x if inv_t == 1.0 else st.x * inv_t
        st.grad(jnp.exp(x - ref["lse"][rows, :]) * ref["r"][rows, :])

    return grid.Spec("cutce_grad", True, (), tile, flops=6, transcendentals=1, soft_cap=opts.logit_soft_cap)


def grad_sweep(a, e, b, r, vocab_offset, p: sweep_lib.Plan, fwd=None, *, transform=None) -> sweep_lib.SweepOut:
    """'grad' mode of the `cutce_pallas` plan (the recompute): with ``fwd`` = the forward's lse
    [M] and r [M] the cotangent, SweepOut(da=, de=, db=) as `recloss.softmax.cut.grad_sweep`."""
    lse = fwd
    t = _tiling("grad", a, e, b, p)
    inv_t = 1.0 / p.opts.temperature
    # No live column (lse = −inf) and padded rows: a stand-in far above any logit, so exp() is 0.
    big = -partition.NEG
    lse = jnp.where(jnp.isneginf(lse), big, lse)
    rows = [("r", r * inv_t if inv_t != 1.0 else r, 0.0), ("lse", lse, big)]
    res = grid.sweep(_spec_of(_grad_spec(p.opts), transform), t, a, e, b, vocab_offset, rows=rows,
                     vocab_size=p.vocab_size,
                     static_offset=p.static_offset, interpret=p.interpret)
    da = res.summed("da", a.shape[1])
    de, db = res.table_grads()
    return sweep_lib.SweepOut(da=da, de=de, db=db)


def sweeps(transform=None) -> sweep_lib.Sweeps:
    """The kernels' `recloss.sweep.Sweeps`, each grid spec passed through ``transform`` first (None: the
    kernels themselves; `recloss.pallas.grid.probe` for a roofline probe)."""
    if transform is None:
        return sweep_lib.Sweeps(loss=lse_sweep, grad=grad_sweep)
    return sweep_lib.Sweeps(loss=functools.partial(lse_sweep, transform=transform),
                            grad=functools.partial(grad_sweep, transform=transform))


# The `cutce_pallas` plan's `recloss.sweep.Sweeps`.
SWEEPS = sweeps()
