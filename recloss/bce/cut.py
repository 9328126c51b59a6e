"""Blocked pure-JAX sweep of the BCE background over the vocabulary (the `cutbce` plan).

The dense, target-free background of every position,

    bg_i = Σ_v [ (ε/2)·P(x_iv) + (1 − ε/2)·Q(x_iv) ],   x_iv = a_i·e_v + b_v,

is computed by walking the vocabulary in blocks of ``block_v`` rows of the
table (lax.scan), each block in row tiles of ``block_n``, never holding more
than ``block_n × block_v`` logits. `Plan.sweep` implements the modes of
`recloss.sweep` ('loss', 'fused', 'grad'), which supplies the custom VJPs.

dE blocks are emitted by the scan (one write each), never a carried [V, D].
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from recloss.options import LossOptions
from recloss.bce.bernoulli import bernoulli_parts

# Default vocab block (a divisor of V_local within a factor 2 below it when one exists).
_BLOCK_V = 2048
# Bytes of one float32 logit tile (block_n × block_v). XLA:CPU materialises the
# elementwise passes between the three matmuls, so the tile bounds memory; its
# size trades matmul efficiency (D-deep products want long rows) against cache.
# Measured on 2 cores at D=128: 2000×2048 tiles ran the fused pass ~8% faster
# than 1000×512 ones (recloss-bench; README).
_TILE_BYTES = 16 << 20


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_MODES = {"loss": (True, False), "fused": (True, True), "grad": (False, True)}   # (want_loss, want_grad)


class Plan(NamedTuple):
    """Static configuration of one blocked sweep (hashable: a custom-VJP static argument)."""
    opts: LossOptions
    vocab_size: int       # real V (global); columns at or past it are inert
    block_v: int
    block_n: int          # rows per logit tile: each vocab block is walked in row tiles
    mask: bool            # whether columns need masking (padding, vocab_size, traced offset)

    def sweep(self, mode: str, a, e, b, r, vocab_offset):
        """One sweep in ``mode`` ('loss', 'fused', 'grad'); see `recloss.sweep` for the contract."""
        want_loss, want_grad = _MODES[mode]
        return _sweep(a, e, b, r, vocab_offset, self, want_loss=want_loss, want_grad=want_grad)


def plan(m: int, v_local: int, opts: LossOptions, *, vocab_size: int, static_offset: Optional[int]) -> Plan:
    """Chooses block sizes for M rows and a V_local-row table (explicit options win).

    The default block_v is ``_BLOCK_V`` or a divisor of V_local within a factor 2
    below it: then the emitted dE blocks already form [V_local, D], with no copy.
    Each vocab block is walked in row tiles of block_n so one logit tile is
    ~``_TILE_BYTES`` (XLA:CPU materialises the elementwise passes between the
    matmuls; the tile bounds that memory).
    """
    if opts.block_v:
        block_v = opts.block_v
    else:
        block_v = next((c for c in range(_BLOCK_V, _BLOCK_V // 2, -1) if v_local % c == 0), _BLOCK_V)
    block_v = max(1, min(block_v, v_local))
    if opts.block_n:
        block_n = opts.block_n
    else:
        block_n = max(8, _TILE_BYTES // (4 * block_v))
        block_n = 1 << (block_n.bit_length() - 1)
    block_n = max(1, min(block_n, m))
    mask = static_offset is None or static_offset + v_local > vocab_size
    return Plan(opts, vocab_size, block_v, block_n, mask)


def _sweep(a, e, b, r, vocab_offset, p: Plan, *, want_loss: bool, want_grad: bool):
    """One pass over vocab blocks for rows a [M, D].

    Full blocks are read in place with dynamic slices; a shorter tail block (when
    block_v does not divide V_local) is one extra step. r [M] scales each row's
    gradient (unused, and may be None, when want_grad is False).
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
    bn = p.block_n
    mp = _cdiv(m, bn) * bn
    if mp != m:   # padded rows: zero hidden, zero scale; their sums are dropped
        a = jnp.pad(a, ((0, mp - m), (0, 0)))
        r = None if r is None else jnp.pad(r, (0, mp - m))

    def tile(a_s, r_s, e_j, b_j, live):
        """Loss/count row sums, dA rows, dE_j and db_j contributions of one [rows, bv] logit tile."""
        x = jnp.dot(a_s, e_j.T, preferred_element_type=jnp.float32)
        if b_j is not None:
            x = x + b_j.astype(jnp.float32)[None, :]
        parts, dval = bernoulli_parts(x, opts, cp, cq, grad=want_grad)
        out = {}
        if want_loss:
            if live is not None:
                parts = [jnp.where(live, v, 0.0) for v in parts]
            out["bg"] = functools.reduce(jnp.add, [jnp.sum(v, axis=-1) for v in parts])
            if count:
                hit = x > opts.threshold
                out["pred"] = jnp.sum(hit if live is None else hit & live, axis=-1, dtype=jnp.float32)
        if want_grad:
            g = dval * r_s[:, None]
            if live is not None:
                g = jnp.where(live, g, 0.0)
            gc = g.astype(cdt)
            out["da"] = jnp.dot(gc, e_j, preferred_element_type=jnp.float32)
            out["de"] = jnp.dot(gc.T, a_s, preferred_element_type=jnp.float32)
            if b_j is not None:
                out["db"] = jnp.sum(g, axis=0)
        return out

    row_keys = ("bg", "pred", "da")

    def block(carry, e_j, b_j, col0):
        live = None
        if p.mask:   # columns past the real vocabulary (padding rows of a sharded table)
            live = (col0 + jnp.arange(e_j.shape[0]) + vocab_offset < p.vocab_size)[None, :]
        if bn >= mp:
            t = tile(a, r, e_j, b_j, live)
            carry = {k: carry[k] + t[k] if k in t else carry[k] for k in carry}
            return carry, {k: t[k] for k in ("de", "db") if k in t}

        def sub(c, i):
            a_s = jax.lax.dynamic_slice_in_dim(a, i * bn, bn)
            r_s = None if r is None else jax.lax.dynamic_slice_in_dim(r, i * bn, bn)
            t = tile(a_s, r_s, e_j, b_j, live)
            c = dict(c)
            for k in row_keys:
                if k in t:
                    old = jax.lax.dynamic_slice_in_dim(c[k], i * bn, bn)
                    c[k] = jax.lax.dynamic_update_slice_in_dim(c[k], old + t[k], i * bn, 0)
            for k in ("de", "db"):
                if k in t:
                    c[k] = c[k] + t[k]
            return c, None

        init = dict(carry)
        if want_grad:
            init["de"] = jnp.zeros((e_j.shape[0], d), jnp.float32)
            if b_j is not None:
                init["db"] = jnp.zeros((e_j.shape[0],), jnp.float32)
        c, _ = jax.lax.scan(sub, init, jnp.arange(mp // bn))
        return {k: c[k] for k in carry}, {k: c[k] for k in ("de", "db") if k in c}

    def step(carry, j):
        col0 = j * bv
        e_j = jax.lax.dynamic_slice_in_dim(e, col0, bv)
        b_j = None if b is None else jax.lax.dynamic_slice_in_dim(b, col0, bv)
        return block(carry, e_j, b_j, col0)

    carry = {}
    if want_loss:
        carry["bg"] = jnp.zeros((mp,), jnp.float32)
        if count:
            carry["pred"] = jnp.zeros((mp,), jnp.float32)
    if want_grad:
        carry["da"] = jnp.zeros((mp, d), jnp.float32)
    carry, outs = jax.lax.scan(step, carry, jnp.arange(nb))
    outs = {k: o.reshape((nb * bv,) + o.shape[2:]) for k, o in outs.items()}
    if tail:
        carry, last = block(carry, e[nb * bv:], None if b is None else b[nb * bv:], nb * bv)
        outs = {k: jnp.concatenate([outs[k], last[k]]) for k in outs}
    rows = lambda k: carry[k][:m] if k in carry else None
    return rows("bg"), rows("pred"), rows("da"), outs.get("de"), outs.get("db")
