"""Blocked pure-JAX BCE background over the vocabulary, with custom VJPs.

The dense, target-free background of every position,

    bg_i = Σ_v [ (ε/2)·P(x_iv) + (1 − ε/2)·Q(x_iv) ],   x_iv = a_i·e_v + b_v,

is computed by walking the vocabulary in blocks of ``block_v`` rows of the
table, never holding more than ``block_n × block_v`` logits. Two VJPs:

* `background_total` (scalar loss): the fwd rule is the fused single pass —
  loss, dA, dE, db in one sweep (6·M·V·D flops); bwd only scales them.
  Its primal (no gradient taken) is the loss-only sweep (2·M·V·D).
* `background_rows` (per-row loss, reduction='none'): fwd is the loss-only
  sweep; bwd recomputes each block and scales G row-wise by the cotangent.

dE blocks are emitted by the scan (one write each), never a carried [V, D].
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from recloss.options import LossOptions
from recloss.reference import bernoulli_terms

# Bytes of one float32 logit tile (block_n × block_v) the XLA path aims for.
_TILE_BYTES = 8 << 20
_MAX_ROWS = 16384


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Plan(NamedTuple):
    """Static configuration of one blocked sweep."""
    opts: LossOptions
    vocab_size: int       # real V (global); columns at or past it are inert
    block_v: int
    block_n: int
    mask: bool            # whether columns need masking (padding, vocab_size, traced offset)


def plan(m: int, v_local: int, opts: LossOptions, *, vocab_size: int, static_offset: Optional[int]) -> Plan:
    """Chooses block sizes for M rows and a V_local-row table (explicit options win)."""
    block_n = opts.block_n or min(m, _MAX_ROWS)
    block_n = max(1, min(block_n, m))
    if opts.block_v:
        block_v = opts.block_v
    else:
        block_v = max(128, min(8192, _TILE_BYTES // (4 * block_n)))
        block_v = 1 << (block_v.bit_length() - 1)
    block_v = max(1, min(block_v, v_local))
    padded = _cdiv(v_local, block_v) * block_v != v_local
    mask = padded or static_offset is None or static_offset + v_local > vocab_size
    return Plan(opts, vocab_size, block_v, block_n, mask)


def _sweep(a, e, b, r, vocab_offset, p: Plan, *, want_loss: bool, want_grad: bool):
    """One pass over vocab blocks for rows a [M, D].

    r [M] scales each row's gradient (ignored when want_grad is False).
    Returns (bg rows [M] f32, predicted-positive rows [M] f32, dA [M, D] f32,
    dE [V_local, D] f32, db [V_local] f32 or None); entries not asked for are None.
    """
    opts = p.opts
    m, d = a.shape
    v = e.shape[0]
    bv = p.block_v
    nb = _cdiv(v, bv)
    pad = nb * bv - v
    e_blocks = jnp.pad(e, ((0, pad), (0, 0))).reshape(nb, bv, d)
    b_blocks = None if b is None else jnp.pad(b, (0, pad)).reshape(nb, bv)
    cdt = e.dtype if e.dtype == a.dtype else jnp.promote_types(a.dtype, e.dtype)
    cp, cq = opts.background_p, opts.background_q
    count = want_loss and opts.compute_metrics

    def step(carry, blk):
        j, e_j, b_j = blk
        x = jnp.dot(a, e_j.T, preferred_element_type=jnp.float32)       # [M, bv]
        if b_j is not None:
            x = x + b_j.astype(jnp.float32)[None, :]
        val, dval = bernoulli_terms(x, opts, cp, cq, grad=want_grad)
        live = None
        if p.mask:
            col = j * bv + jnp.arange(bv)
            live = (col < v) & (col + vocab_offset < p.vocab_size)
        bg, pred, da = carry
        out = {}
        if want_loss:
            if live is not None:
                val = jnp.where(live[None, :], val, 0.0)
            bg = bg + jnp.sum(val, axis=-1)
            if count:
                hit = x > opts.threshold
                if live is not None:
                    hit = hit & live[None, :]
                pred = pred + jnp.sum(hit, axis=-1, dtype=jnp.float32)
        if want_grad:
            g = dval * r[:, None]
            if live is not None:
                g = jnp.where(live[None, :], g, 0.0)
            gc = g.astype(cdt)
            da = da + jnp.dot(gc, e_j, preferred_element_type=jnp.float32)
            out["de"] = jnp.dot(gc.T, a, preferred_element_type=jnp.float32)
            if b_j is not None:
                out["db"] = jnp.sum(g, axis=0)
        return (bg, pred, da), out

    zeros_m = jnp.zeros((m,), jnp.float32)
    init = (zeros_m, zeros_m, jnp.zeros((m, d), jnp.float32) if want_grad else jnp.zeros((), jnp.float32))
    (bg, pred, da), outs = jax.lax.scan(step, init, (jnp.arange(nb), e_blocks, b_blocks))
    de = outs["de"].reshape(nb * bv, d)[:v] if want_grad else None
    db = outs["db"].reshape(nb * bv)[:v] if (want_grad and b is not None) else None
    return (bg if want_loss else None, pred if count else None,
            da if want_grad else None, de, db)


def _row_chunked(a, e, b, r, vocab_offset, p: Plan, *, want_loss, want_grad):
    """Runs `_sweep` over row chunks of block_n; dE/db accumulate across chunks."""
    m, d = a.shape
    n = p.block_n
    if n >= m:
        return _sweep(a, e, b, r, vocab_offset, p, want_loss=want_loss, want_grad=want_grad)
    nc = _cdiv(m, n)
    pad = nc * n - m
    a_c = jnp.pad(a, ((0, pad), (0, 0))).reshape(nc, n, d)
    r_c = jnp.pad(r, (0, pad)).reshape(nc, n)   # padded rows: zero scale, zero gradient
    v = e.shape[0]

    def step(carry, chunk):
        de_acc, db_acc = carry
        bg, pred, da, de, db = _sweep(chunk[0], e, b, chunk[1], vocab_offset, p,
                                      want_loss=want_loss, want_grad=want_grad)
        if want_grad:
            de_acc = de_acc + de
            if db is not None:
                db_acc = db_acc + db
        return (de_acc, db_acc), (bg, pred, da)

    init = (jnp.zeros((v, d) if want_grad else (), jnp.float32),
            jnp.zeros((v,) if (want_grad and b is not None) else (), jnp.float32))
    (de, db), (bg, pred, da) = jax.lax.scan(step, init, (a_c, r_c))
    flat = lambda x: None if x is None else x.reshape((nc * n,) + x.shape[2:])[:m]
    return (flat(bg), flat(pred), flat(da), de if want_grad else None,
            db if (want_grad and b is not None) else None)


def _cast_grads(a, e, b, da, de, db, scale):
    return (
        (da * scale).astype(a.dtype),
        (de * scale).astype(e.dtype),
        None if b is None else (db * scale).astype(b.dtype),
    )


# ----------------------------------------------------------------- scalar loss, fused
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def background_total(a, e, b, r, vocab_offset, p: Plan):
    """Σ_i r_i·bg_i and predicted-positive counts per row.

    a [M, D], e [V_local, D], b [V_local] or None, r [M] f32 row scales,
    vocab_offset: global id of e's row 0. Returns (scalar f32, pred [M] f32 or None).
    """
    bg, pred, *_ = _row_chunked(a, e, b, r, vocab_offset, p, want_loss=True, want_grad=False)
    return jnp.sum(r * bg), pred


def _total_fwd(a, e, b, r, vocab_offset, p):
    bg, pred, da, de, db = _row_chunked(a, e, b, r, vocab_offset, p, want_loss=True, want_grad=True)
    return (jnp.sum(r * bg), pred), (bg, da, de, db, a, e, b, vocab_offset)


def _total_bwd(p, res, cts):
    bg, da, de, db, a, e, b, vocab_offset = res
    g = cts[0]
    ga, ge, gb = _cast_grads(a, e, b, da, de, db, g)
    return ga, ge, gb, (g * bg).astype(jnp.float32), None


background_total.defvjp(_total_fwd, _total_bwd)


# ----------------------------------------------------------------- per-row loss, recompute
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def background_rows(a, e, b, vocab_offset, p: Plan):
    """Per-row background bg [M] f32 and predicted-positive counts [M] (or None)."""
    ones = jnp.ones((a.shape[0],), jnp.float32)
    bg, pred, *_ = _row_chunked(a, e, b, ones, vocab_offset, p, want_loss=True, want_grad=False)
    return bg, pred


def _rows_fwd(a, e, b, vocab_offset, p):
    return background_rows(a, e, b, vocab_offset, p), (a, e, b, vocab_offset)


def _rows_bwd(p, res, cts):
    a, e, b, vocab_offset = res
    ct = cts[0].astype(jnp.float32)
    _, _, da, de, db = _row_chunked(a, e, b, ct, vocab_offset, p, want_loss=False, want_grad=True)
    ga, ge, gb = _cast_grads(a, e, b, da, de, db, 1.0)
    return ga, ge, gb, None


background_rows.defvjp(_rows_fwd, _rows_bwd)
