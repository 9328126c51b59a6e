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
    """Chooses block sizes for M rows and a V_local-row table (explicit options win).

    The default block_v is a power of two sized to ``_TILE_BYTES`` of logits, or a
    divisor of V_local within a factor 2 below it: then the table is walked in
    place and the emitted dE blocks already form [V_local, D], with no copy.
    """
    block_n = max(1, min(opts.block_n or min(m, _MAX_ROWS), m))
    if opts.block_v:
        block_v = opts.block_v
    else:
        target = max(128, min(8192, _TILE_BYTES // (4 * block_n)))
        target = 1 << (target.bit_length() - 1)
        block_v = next((c for c in range(target, target // 2, -1) if v_local % c == 0), target)
    block_v = max(1, min(block_v, v_local))
    mask = static_offset is None or static_offset + v_local > vocab_size
    return Plan(opts, vocab_size, block_v, block_n, mask)


def _sweep(a, e, b, r, vocab_offset, p: Plan, *, want_loss: bool, want_grad: bool):
    """One pass over vocab blocks for rows a [M, D].

    Full blocks are read in place with dynamic slices; a shorter tail block (when
    block_v does not divide V_local) is one extra step. r [M] scales each row's
    gradient (ignored when want_grad is False).
    Returns (bg rows [M] f32, predicted-positive rows [M] f32, dA [M, D] f32,
    dE [V_local, D] f32, db [V_local] f32 or None); entries not asked for are None.
    """
    opts = p.opts
    m, d = a.shape
    v = e.shape[0]
    bv = p.block_v
    nb, tail = divmod(v, bv)
    cdt = jnp.promote_types(a.dtype, e.dtype)
    cp, cq = opts.background_p, opts.background_q
    count = want_loss and opts.compute_metrics

    def block(carry, e_j, b_j, col0):
        x = jnp.dot(a, e_j.T, preferred_element_type=jnp.float32)       # [M, bv]
        if b_j is not None:
            x = x + b_j.astype(jnp.float32)[None, :]
        val, dval = bernoulli_terms(x, opts, cp, cq, grad=want_grad)
        live = None
        if p.mask:   # columns past the real vocabulary (padding rows of a sharded table)
            live = (col0 + jnp.arange(e_j.shape[0]) + vocab_offset < p.vocab_size)[None, :]
        bg, pred, da = carry
        out = {}
        if want_loss:
            if live is not None:
                val = jnp.where(live, val, 0.0)
            bg = bg + jnp.sum(val, axis=-1)
            if count:
                hit = x > opts.threshold
                pred = pred + jnp.sum(hit if live is None else hit & live, axis=-1, dtype=jnp.float32)
        if want_grad:
            g = dval * r[:, None]
            if live is not None:
                g = jnp.where(live, g, 0.0)
            gc = g.astype(cdt)
            da = da + jnp.dot(gc, e_j, preferred_element_type=jnp.float32)
            out["de"] = jnp.dot(gc.T, a, preferred_element_type=jnp.float32)
            if b_j is not None:
                out["db"] = jnp.sum(g, axis=0)
        return (bg, pred, da), out

    def step(carry, j):
        col0 = j * bv
        e_j = jax.lax.dynamic_slice_in_dim(e, col0, bv)
        b_j = None if b is None else jax.lax.dynamic_slice_in_dim(b, col0, bv)
        return block(carry, e_j, b_j, col0)

    zeros_m = jnp.zeros((m,), jnp.float32)
    carry = (zeros_m, zeros_m, jnp.zeros((m, d) if want_grad else (), jnp.float32))
    carry, outs = jax.lax.scan(step, carry, jnp.arange(nb))
    outs = {k: o.reshape((nb * bv,) + o.shape[2:]) for k, o in outs.items()}
    if tail:
        carry, last = block(carry, e[nb * bv:], None if b is None else b[nb * bv:], nb * bv)
        outs = {k: jnp.concatenate([outs[k], last[k]]) for k in outs}
    bg, pred, da = carry
    return (bg if want_loss else None, pred if count else None, da if want_grad else None,
            outs.get("de"), outs.get("db"))


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
