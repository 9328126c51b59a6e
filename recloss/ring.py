"""FSDP without gathering the table: the table slices travel round the fsdp axis (``fsdp_gather='ring'``).

Inside `jax.shard_map` chip i of an fsdp axis of size F holds table slice i
([R, D], R = V_local/F rows, first global id ``vocab_offset + i·R``). For
steps s = 0 … F−1 it holds slice k = (i − s) mod F: it starts the `ppermute`
of that slice to chip i+1 and, while the bytes move, sweeps its own rows
against it (the double buffer: the slice it computes on and the one
arriving). A slice's gradient accumulator travels one step behind the slice:
at step s chip i receives slice k's accumulator from chip i−1 (sent at the
start of the step, so it also overlaps the sweep), adds its own dE_k and
holds it for the next step; one last permute brings every accumulator home.
So a chip never holds more than two table slices and a few dE slices, the
all-gather and the reduce-scatter of `fsdp_gather='once'` become F neighbour
exchanges each, and the work per chip is the same F·R-row sweep.

Per-row results stay home (the rows never move) and are combined across the
slices a chip sees: sums for BCE's background and dA, (max, Σexp) merges and
the tie-to-smallest-id argmax for the softmax log-partition. The softmax
gradient needs the global Z, so softmax runs two rings: the forward one for Z
(only the table travels), and the backward recompute with travelling dE.

`Plan` wraps any plan of `recloss.sweep` (it is itself one), so the custom-VJP
shells `sweep.background_total` / `background_rows` run the ring unchanged and
save only the chip's own slice and its own dE as residuals; autodiff through a
scan of ppermutes would instead save every slice that visited as a residual.
`gather_logits` is the ring form of `recloss.targets.gather_logits` (the
target correction), with its own VJP.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from recloss import targets as targets_lib
from recloss.assemble import Reducer

GATHERS = ("once", "ring")


class Ring(NamedTuple):
    """The fsdp axis the slices travel on (hashable: part of a static plan)."""
    axis: str
    size: int     # F, the axis size (> 1)
    rows: int     # R, rows of one table slice

    def index(self):
        return jax.lax.axis_index(self.axis)

    def shift(self, x):
        """x sent from chip i to chip i+1 (mod F); None stays None."""
        if x is None:
            return None
        return jax.lax.ppermute(x, self.axis, perm=[(i, (i + 1) % self.size) for i in range(self.size)])

    def psum(self, x):
        """Σ over the ring's chips (for small per-slice reductions, e.g. a [D] column sum)."""
        return jax.lax.psum(x, self.axis)

    def held(self, s):
        """Which chip's slice this chip holds at step s: (i − s) mod F."""
        return (self.index() - s) % self.size


class RingReducer(Reducer):
    """A `recloss.assemble.Reducer` that also says the table arrives as a travelling slice."""

    def __init__(self, ring: Ring, **kw):
        super().__init__(**kw)
        object.__setattr__(self, "ring", ring)


def with_ring(reducer: Reducer, ring: Ring) -> RingReducer:
    """``reducer`` (all its fields kept) marked as running under ``ring``."""
    return RingReducer(ring, **{f.name: getattr(reducer, f.name) for f in dataclasses.fields(reducer)})


def ring_of(reducer) -> Optional[Ring]:
    """The `Ring` of a reducer under ``fsdp_gather='ring'`` (None otherwise)."""
    return getattr(reducer, "ring", None)


def _add(x, y):
    return None if x is None else x + y


def _merge_lse(old, new):
    """(lse, (row max, argmax id) or None) of two column sets as one; ties to the smallest id."""
    lse = jnp.logaddexp(old[0], new[0])
    if old[1] is None:
        return lse, None
    (m0, i0), (m1, i1) = old[1], new[1]
    take = (m1 > m0) | ((m1 == m0) & (i1 < i0))
    return lse, (jnp.maximum(m0, m1), jnp.where(take, i1, i0))


def _merge_sum(old, new):
    return _add(old[0], new[0]), _add(old[1], new[1])


class Plan(NamedTuple):
    """A `recloss.sweep` plan over the ring: ``inner`` sweeps one slice, the ring walks them.

    combine: 'sum' (BCE: background and counts add) or 'lse' (softmax: log-partitions merge).
    The ``vocab_offset`` handed to `sweep` is the first global id of the vocab shard (slice 0).
    """
    inner: object
    ring: Ring
    combine: str = "sum"

    def sweep(self, mode: str, a, e, b, r, vocab_offset, fwd=None):
        ring, rows = self.ring, self.ring.rows
        merge = _merge_lse if self.combine == "lse" else _merge_sum
        grad = mode in ("fused", "grad")
        base = jnp.asarray(vocab_offset, jnp.int32)

        def run(s, e_k, b_k):
            return self.inner.sweep(mode, a, e_k, b_k, r, base + ring.held(s) * rows, fwd)

        # Step 0: the chip's own slice; its send to the neighbour starts first. (Starting the loop at
        # step 0 instead, to trace the inner sweep once, copies the own slice into the loop carry and
        # measured +1 slice of temporaries.)
        e_next, b_next = ring.shift(e), ring.shift(b)
        head, da, de, db = (lambda o: (o[:2], o[2], o[3], o[4]))(run(0, e, b))

        def body(s, c):
            e_k, b_k, head, da, de, db = c
            e_nxt, b_nxt = ring.shift(e_k), ring.shift(b_k)       # the next slice: overlaps the sweep
            de_in, db_in = ring.shift(de), ring.shift(db)         # slice k's accumulator from chip i−1
            o = run(s, e_k, b_k)
            if head[0] is not None:
                head = merge(head, o[:2])
            if grad:
                da, de, db = da + o[2], de_in + o[3], _add(db_in, o[4])
            return e_nxt, b_nxt, head, da, de, db

        c = jax.lax.fori_loop(1, ring.size, body, (e_next, b_next, head, da, de, db))
        head, da, de, db = c[2:]
        if grad:   # after F steps chip i holds slice i+1's full dE: one more step brings it home
            de, db = ring.shift(de), ring.shift(db)
        return head[0], head[1], da, de, db


def _slice_ids(ids, valid, k, rows):
    """ids [M, L] local to the vocab shard → (ids in slice k, mask of the ids slice k owns)."""
    loc = ids - k * rows
    own = valid & (loc >= 0) & (loc < rows)
    return jnp.where(own, loc, 0), own


def gather_logits(hidden, e, b, ids, valid, ring: Ring):
    """`recloss.targets.gather_logits` when the chip holds only its table slice.

    hidden [M, D], e [R, D] / b [R] or None (this chip's slice), ids [M, L]
    local to the vocab shard (0 where not ``valid``). Returns x [M, L] f32 with
    x = hidden·E[ids] + b[ids] at valid ids (0 elsewhere). Forward: one ring of
    the slices, each owning chip gathering its ids. VJP: another ring whose dE
    accumulators travel as in `Plan` (``targets.scatter_rows`` per slice).
    """
    return _ring_gather(hidden, e, b, ids, valid, ring)


def _gather_forward(hidden, e, b, ids, valid, ring):
    def one(s, e_k, b_k):
        loc, own = _slice_ids(ids, valid, ring.held(s), ring.rows)
        return jnp.where(own, targets_lib.gather_logits(hidden, e_k, b_k, loc), 0.0)

    x = one(0, e, b)

    def body(s, c):
        e_k, b_k, x = c
        return ring.shift(e_k), ring.shift(b_k), x + one(s, e_k, b_k)

    return jax.lax.fori_loop(1, ring.size, body, (ring.shift(e), ring.shift(b), x))[2]


def _ring_gather(hidden, e, b, ids, valid, ring):
    return _ring_gather_vjp(hidden, e, b, ids, valid, ring)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring_gather_vjp(hidden, e, b, ids, valid, ring):
    return _gather_forward(hidden, e, b, ids, valid, ring)


def _rg_fwd(hidden, e, b, ids, valid, ring):
    return _gather_forward(hidden, e, b, ids, valid, ring), (hidden, e, b, ids, valid)


def _rg_bwd(ring, res, g):
    hidden, e, b, ids, valid = res
    g = g.astype(jnp.float32)
    with_b = b is not None

    def one(s, e_k):
        loc, own = _slice_ids(ids, valid, ring.held(s), ring.rows)
        gk = jnp.where(own, g, 0.0)
        rows = jnp.take(e_k, loc, axis=0)
        dh = jnp.einsum("ml,mld->md", gk.astype(rows.dtype), rows, preferred_element_type=jnp.float32)
        de, db = targets_lib.scatter_rows(hidden, gk, loc, ring.rows, with_b)
        return dh, de, db

    dh, de, db = one(0, e)

    def body(s, c):
        e_k, dh, de, db = c
        e_nxt, de_in, db_in = ring.shift(e_k), ring.shift(de), ring.shift(db)
        dh_s, de_s, db_s = one(s, e_k)
        return e_nxt, dh + dh_s, de_in + de_s, _add(db_in, db_s)

    _, dh, de, db = jax.lax.fori_loop(1, ring.size, body, (ring.shift(e), dh, de, db))
    de, db = ring.shift(de), ring.shift(db)
    return (dh.astype(hidden.dtype), de.astype(e.dtype), None if b is None else db.astype(b.dtype),
            None, None)


_ring_gather_vjp.defvjp(_rg_fwd, _rg_bwd)
