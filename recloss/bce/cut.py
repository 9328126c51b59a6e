"""Blocked pure-JAX sweep of the BCE background over the vocabulary (the `cutbce` plan).

The dense, target-free background of every position,

    bg_i = Σ_v [ (ε/2)·P(x_iv) + (1 − ε/2)·Q(x_iv) ],   x_iv = a_i·e_v + b_v
                                                          (c·tanh(x_iv/c) with logit_soft_cap c),

is computed by walking the vocabulary in blocks of ``block_v`` rows of the
table (lax.scan), each block in row tiles of ``block_n``, never holding more
than ``block_n × block_v`` logits. `sweep` implements the modes of
`recloss.sweep` ('loss', 'fused', 'grad'), which supplies the plan and the custom VJPs.

dE blocks are emitted by the scan (one write each), never a carried [V, D].
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp

from recloss import softcap, sweep as sweep_lib
from recloss.bce.bernoulli import Bernoulli

_MODES = {"loss": (True, False), "fused": (True, True), "grad": (False, True)}   # (want_loss, want_grad)


def sweep(mode: str, a, e, b, r, vocab_offset, p: sweep_lib.Plan, fwd=None, *, sparse_de=None,
          parts=None) -> sweep_lib.SweepOut:
    """One blocked pass over vocab blocks for rows a [M, D] in ``mode`` ('loss', 'fused', 'grad'):
    the `cutbce` plan's sweeps (`SWEEPS`), on `recloss.sweep.blocked`.

    r [M] scales each row's gradient (unused, and may be None, in 'loss' mode); ``fwd`` is unused
    (BCE's gradient needs no forward value). ``parts``: the per-logit math, ``parts(x, term, grad=) ->
    (value parts, dvalue)`` (None: the term's own, `recloss.bce.bernoulli.Bernoulli.parts`);
    `recloss-bench`'s matmuls-only ceiling swaps in the identity. ``sparse_de``: a sparse
    term's (ids, G) added to the f32 dE and db (`recloss.sweep.add_sparse_de`).
    Returns SweepOut(bg rows [M] f32, predicted-positive rows [M] f32, dA [M, D] f32,
    dE [V_local, D] f32, db [V_local] f32 or None); entries not asked for are None.
    """
    want_loss, want_grad = _MODES[mode]
    opts = p.opts
    d = a.shape[1]
    term = Bernoulli.background(opts)
    count = want_loss and opts.compute_metrics

    def tile(a_s, rows_s, e_j, b_j, live, col0):
        """Loss/count row sums, dA rows, dE_j and db_j contributions of one [rows, bv] logit tile."""
        e_j = sweep_lib.fence(e_j)     # an exact bit round trip: no bf16 copy of the whole table
        x = jnp.dot(a_s, e_j.T, preferred_element_type=jnp.float32)
        if b_j is not None:
            x = x + b_j.astype(jnp.float32)[None, :]
        x, slope = softcap.capped(x, opts.logit_soft_cap, grad=want_grad)
        terms, dval = (term.parts(x, grad=want_grad) if parts is None else parts(x, term, grad=want_grad))
        row_out, block_out = {}, {}
        if want_loss:
            if live is not None:
                terms = [jnp.where(live, v, 0.0) for v in terms]
            row_out["bg"] = functools.reduce(jnp.add, [jnp.sum(v, axis=-1) for v in terms])
            if count:
                hit = x > opts.threshold
                row_out["pred"] = jnp.sum(hit if live is None else hit & live, axis=-1, dtype=jnp.float32)
        if want_grad:
            g = dval * rows_s["r"][:, None]
            if slope is not None:
                g = g * slope
            if live is not None:
                g = jnp.where(live, g, 0.0)
            # G stays float32 in its products: 16-bit inputs are promoted (on a TPU at default precision
            # XLA rounds it for the MXU as a dense loss's autodiff does; float16 would underflow r·G').
            row_out["da"] = jnp.dot(g, e_j, preferred_element_type=jnp.float32)
            block_out["de"] = jnp.dot(g.T, a_s, preferred_element_type=jnp.float32)
            if b_j is not None:
                block_out["db"] = jnp.sum(g, axis=0)
        return row_out, block_out

    f32 = jnp.float32
    init, emit = {}, {}
    if want_loss:
        init["bg"] = ((), f32, 0.0)
        if count:
            init["pred"] = ((), f32, 0.0)
    if want_grad:
        init["da"] = ((d,), f32, 0.0)
        emit["de"] = (d,)
        if b is not None:
            emit["db"] = ()
    rows = {"r": r} if want_grad else {}
    carry, outs = sweep_lib.blocked(a, e, b, rows, vocab_offset, p.blocks, tile=tile, init=init, emit=emit)
    de, db = sweep_lib.add_sparse_de(a, outs.get("de"), outs.get("db"), sparse_de)
    return sweep_lib.SweepOut(carry.get("bg"), carry.get("pred"), carry.get("da"), de, db)


# The `cutbce` plan's `recloss.sweep.Sweeps`: one function per mode.
SWEEPS = sweep_lib.Sweeps(loss=functools.partial(sweep, "loss"), grad=functools.partial(sweep, "grad"),
                          fused=functools.partial(sweep, "fused"))
