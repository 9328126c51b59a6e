"""Blocked pure-JAX sweeps of the softmax log-partition (the `cutce` sweep), on `recloss.sweep.blocked`.

Logits x = cap(a·e + b)/τ, cap(y) = c·tanh(y/c) with logit_soft_cap c (else y).
'loss' mode: per row a running (max, Σ exp(x − max)) over vocab blocks, and the
running argmax for the metrics: lse [M] = log Σ_v exp(x_v) over the shard's live
columns (−inf when it has none), 2·M·V·D flops.
'grad' mode (the recompute of `recloss.sweep.sweep_rows`): with the forward's
lse and the cotangent r, G = r·exp(x − lse)/τ per tile (times the cap's slope with a cap),
then dA = G E, dE_j = Gᵀ A, db_j = Σ_rows G: 6·M·V·D flops (the logits again, dA, dE). Nothing
of size M·V exists at any time.
"""

from __future__ import annotations

import jax.numpy as jnp

from recloss import softcap, sweep as sweep_lib
from recloss.softmax import partition


def _logits(a_s, e_j, b_j, inv_t, cap, *, grad=False):
    """(x [rows, bv] f32 = cap(a_s·e_jᵀ + b_j)·inv_t, the cap's slope or None): see `softcap.capped`."""
    x = jnp.dot(a_s, e_j.T, preferred_element_type=jnp.float32)
    if b_j is not None:
        x = x + b_j.astype(jnp.float32)[None, :]
    x, slope = softcap.capped(x, cap, grad=grad)
    return (x if inv_t == 1.0 else x * inv_t), slope


def lse_sweep(a, e, b, r, vocab_offset, p: sweep_lib.Plan, fwd=None) -> sweep_lib.SweepOut:
    """'loss' mode of the `cutce` plan: SweepOut(lse [M], (row max [M], argmax id [M]) or None)
    of rows ``a`` [M, D] against ``e`` [V_local, D] (``r``, ``fwd`` unused)."""
    inv_t = 1.0 / p.opts.temperature
    argmax = p.opts.compute_metrics

    def tile(a_s, rows_s, e_j, b_j, live, col0):
        e_j = sweep_lib.fence(e_j)     # an exact bit round trip: no bf16 copy of the whole table
        xm = partition.masked(_logits(a_s, e_j, b_j, inv_t, p.opts.logit_soft_cap)[0], live)
        m, s = partition.tile_lse(xm, live)
        out = {"m": m, "s": s}
        if argmax:
            # int32 throughout: col0 (a scan index) and vocab_offset are int64 under jax_enable_x64,
            # and the carry must keep the int32 type of its init.
            out["id"] = (jnp.argmax(xm, axis=-1) + col0 + vocab_offset).astype(jnp.int32)
        return out, {}

    def combine(old, new):
        m, s = partition.merge_lse(old["m"], old["s"], new["m"], new["s"])
        out = {"m": m, "s": s}
        if argmax:   # strictly greater: the first block (smallest id) wins ties, as jnp.argmax
            out["id"] = jnp.where(new["m"] > old["m"], new["id"], old["id"])
        return out

    init = {"m": ((), jnp.float32, partition.NEG), "s": ((), jnp.float32, 0.0)}
    if argmax:
        init["id"] = ((), jnp.int32, 0)
    carry, _ = sweep_lib.blocked(a, e, b, {}, vocab_offset, p.blocks, tile=tile, init=init, emit={},
                                 combine=combine)
    lse = partition.lse_of(carry["m"], carry["s"])
    aux = (carry["m"], carry["id"]) if argmax else None
    return sweep_lib.SweepOut(lse, aux)


def grad_sweep(a, e, b, r, vocab_offset, p: sweep_lib.Plan, fwd=None) -> sweep_lib.SweepOut:
    """'grad' mode of the `cutce` plan (the recompute): with ``fwd`` = the forward's lse [M] and
    r [M] the cotangent, SweepOut(da=dA [M, D] f32, de=dE [V_local, D] f32, db=db [V_local] or None)."""
    lse = fwd
    inv_t = 1.0 / p.opts.temperature
    d = a.shape[1]
    cdt = jnp.promote_types(a.dtype, e.dtype)

    def tile(a_s, rows_s, e_j, b_j, live, col0):
        e_j = sweep_lib.fence(e_j)
        x, slope = _logits(a_s, e_j, b_j, inv_t, p.opts.logit_soft_cap, grad=True)
        g = jnp.exp(x - rows_s["lse"][:, None]) * (rows_s["r"] * inv_t)[:, None]
        if slope is not None:
            g = g * slope
        if live is not None:
            g = jnp.where(live, g, 0.0)
        gc = g.astype(cdt)
        block_out = {"de": jnp.dot(gc.T, a_s, preferred_element_type=jnp.float32)}
        if b_j is not None:
            block_out["db"] = jnp.sum(g, axis=0)
        return {"da": jnp.dot(gc, e_j, preferred_element_type=jnp.float32)}, block_out

    emit = {"de": (d,)}
    if b is not None:
        emit["db"] = ()
    # An empty shard has lse = −inf and no live column; a finite stand-in keeps exp() finite there.
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    carry, outs = sweep_lib.blocked(a, e, b, {"r": r, "lse": lse}, vocab_offset, p.blocks, tile=tile,
                                    init={"da": ((d,), jnp.float32, 0.0)}, emit=emit)
    return sweep_lib.SweepOut(da=carry["da"], de=outs["de"], db=outs.get("db"))


# The `cutce` plan's `recloss.sweep.Sweeps` (no 'fused' mode: the gradient needs the global lse).
SWEEPS = sweep_lib.Sweeps(loss=lse_sweep, grad=grad_sweep)
