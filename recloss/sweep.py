"""The custom-VJP shells every blocked background plugs into.

A *sweep* walks the vocabulary once for rows a [M, D] against a table shard
e [V_local, D] and returns ``(bg [M], counts [M] or None, dA [M, D], dE
[V_local, D], db [V_local] or None)``, each entry None where the mode does not
produce it. Modes:

    'loss'   bg and counts only                            2·M·V·D flops
    'fused'  bg, counts and the gradients scaled by r      6·M·V·D
    'grad'   the gradients scaled by r only (recompute)    4·M·V·D

A plan is a hashable (static) object with a method
``plan.sweep(mode, a, e, b, r, vocab_offset)``; `recloss.bce.cut.Plan` (pure JAX)
and `recloss.bce.kernel.Plan` (Pallas) are the two today. On top of any plan:

* `background_total` (scalar loss Σ_i r_i·bg_i): without a gradient it is the
  loss-only sweep; the VJP's forward is the fused sweep, whose gradients are
  kept as residuals, and the backward only scales them by the cotangent.
* `background_rows` (per-row bg, reduction='none'): forward is the loss-only
  sweep; the backward recomputes with r = the cotangent row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def cast_grads(a, e, b, da, de, db, scale):
    """(dA, dE, db) · scale, each cast to its primal's dtype (db None without a bias)."""
    return (
        (da * scale).astype(a.dtype),
        (de * scale).astype(e.dtype),
        None if b is None else (db * scale).astype(b.dtype),
    )


# ----------------------------------------------------------------- scalar loss, fused
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def background_total(a, e, b, r, vocab_offset, plan):
    """Σ_i r_i·bg_i (f32 scalar) and predicted counts [M] f32 (or None).

    a [M, D], e [V_local, D], b [V_local] or None, r [M] f32 row scales,
    vocab_offset: global id of e's row 0 (int or int32 scalar).
    """
    bg, cnt, *_ = plan.sweep("loss", a, e, b, None, vocab_offset)
    return jnp.sum(r * bg), cnt


def _total_fwd(a, e, b, r, vocab_offset, plan):
    bg, cnt, da, de, db = plan.sweep("fused", a, e, b, r, vocab_offset)
    return (jnp.sum(r * bg), cnt), (bg, da, de, db, a, e, b)


def _total_bwd(plan, res, cts):
    bg, da, de, db, a, e, b = res
    g = cts[0]
    ga, ge, gb = cast_grads(a, e, b, da, de, db, g)
    return ga, ge, gb, (g * bg).astype(jnp.float32), None


background_total.defvjp(_total_fwd, _total_bwd)


# ----------------------------------------------------------------- per-row loss, recompute
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def background_rows(a, e, b, vocab_offset, plan):
    """Per-row background bg [M] f32 and predicted counts [M] f32 (or None)."""
    bg, cnt, *_ = plan.sweep("loss", a, e, b, None, vocab_offset)
    return bg, cnt


def _rows_fwd(a, e, b, vocab_offset, plan):
    return background_rows(a, e, b, vocab_offset, plan), (a, e, b, vocab_offset)


def _rows_bwd(plan, res, cts):
    a, e, b, vocab_offset = res
    _, _, da, de, db = plan.sweep("grad", a, e, b, cts[0].astype(jnp.float32), vocab_offset)
    ga, ge, gb = cast_grads(a, e, b, da, de, db, 1.0)
    return ga, ge, gb, None


background_rows.defvjp(_rows_fwd, _rows_bwd)
