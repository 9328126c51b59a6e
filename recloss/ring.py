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

Every walk round the ring is `Ring.walk`. `Plan` wraps any plan of
`recloss.sweep` (it is itself one), so the custom-VJP shells
`sweep.sweep_total` / `sweep_rows` run the ring unchanged and
save only the chip's own slice and its own dE as residuals; autodiff through a
scan of ppermutes would instead save every slice that visited as a residual.
`gather_logits` is the ring form of `recloss.targets.gather_logits` (the
target correction), with its own VJP.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from recloss import targets as targets_lib
from recloss.sweep import Sparse, Sweeps, SweepOut, sparse_part

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

    def walk(self, e, b, visit, merge):
        """Visits every slice of the ring once, each chip starting from its own.

        ``visit(s, e_k, b_k) -> (stay, de_k, db_k)`` for the slice held at step s: ``stay`` is
        this chip's own result (rows that never move), merged over the steps with
        ``merge(old, new)``; de_k / db_k (or None) are the held slice's gradient contributions,
        accumulated on the slice's travelling accumulator. While a step runs, the next slice and
        the last step's accumulators are already on their way (ppermutes issued first). Returns
        (stay, dE, db) with dE / db this chip's own slice's full sums, home after one last shift.
        """
        # Step 0: the chip's own slice, outside the loop (inside, the own slice would be copied into
        # the loop carry: docs/measurements.md "Measured choices"); its send to the neighbour starts first.
        e_next, b_next = self.shift(e), self.shift(b)
        stay, de, db = visit(0, e, b)

        def body(s, c):
            e_k, b_k, stay, de, db = c
            e_nxt, b_nxt = self.shift(e_k), self.shift(b_k)     # the next slice: overlaps the visit
            de_in, db_in = self.shift(de), self.shift(db)       # slice k's accumulator from chip i−1
            st, de_s, db_s = visit(s, e_k, b_k)
            return e_nxt, b_nxt, merge(stay, st), _add(de_in, de_s), _add(db_in, db_s)

        stay, de, db = jax.lax.fori_loop(1, self.size, body, (e_next, b_next, stay, de, db))[2:]
        # After F steps chip i holds slice i+1's full dE: one more step brings it home. The barrier ties
        # that last exchange to the per-row results: without it XLA's scheduler lets a backward ring's
        # exchange run under the whole decoder backward (which needs only dA), and its send and receive
        # buffers (two dE slices) sit in that peak (gemma-2b, v5p-8, 8×4096: docs/maxtext.md).
        return jax.lax.optimization_barrier((stay, self.shift(de), self.shift(db)))


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
    return _add(old[0], new[0]), jax.tree_util.tree_map(jnp.add, old[1], new[1])


_MERGES = {"sum": _merge_sum, "lse": _merge_lse}


def _ring_sweep(mode: str, a, e, b, r, vocab_offset, plan: "Plan", fwd=None, sparse=None) -> SweepOut:
    """One mode of `SWEEPS`: the inner plan's sweep of each slice as it passes, merged per row; with
    ``sparse`` (a `recloss.sweep.Sparse`, ids local to the vocab shard) the inner plan's sparse term
    on the targets each slice owns, at the same visit (`recloss.sweep.sparse_part`)."""
    ring, rows, inner = plan.ring, plan.ring.rows, plan.inner
    run = getattr(inner.sweeps, mode)
    merge = _MERGES[inner.combine]
    grad = mode in ("fused", "grad")
    base = jnp.asarray(vocab_offset, jnp.int32)

    def visit(s, e_k, b_k):
        part = None if sparse is None else sparse_part(mode, inner, a, e_k, b_k, r,
                                                       Sparse(*_slice_ids(*sparse, ring.held(s), rows)))
        o = run(a, e_k, b_k, r, base + ring.held(s) * rows, inner, fwd, **(part.kwargs if part else {}))
        if part is not None:
            o = part.finish(o)
        return ((o.value, o.aux), o.da), o.de, o.db

    def merge_all(old, new):
        head = old[0] if old[0][0] is None else merge(old[0], new[0])
        return head, (_add(old[1], new[1]) if grad else old[1])

    (head, da), de, db = ring.walk(e, b, visit, merge_all)
    return SweepOut(head[0], head[1], da, de, db)


# The ring plan's `recloss.sweep.Sweeps`: every mode walks the ring with the inner plan's sweep of it.
SWEEPS = Sweeps(loss=functools.partial(_ring_sweep, "loss"), grad=functools.partial(_ring_sweep, "grad"),
                fused=functools.partial(_ring_sweep, "fused"))


class Plan(NamedTuple):
    """A `recloss.sweep.Plan` walked round the ring: ``inner`` sweeps one slice, the ring walks them,
    merging the slices' values by ``inner.combine`` ('sum' for BCE's background and counts, 'lse' for
    the softmax log-partitions). The ``vocab_offset`` its sweeps are handed is the first global id of
    the vocab shard (slice 0). Hashable, so a custom-VJP static argument like the plans it wraps."""
    inner: object
    ring: Ring
    sweeps = SWEEPS
    walks = True


def _slice_ids(ids, valid, k, rows):
    """ids [M, L] local to the vocab shard → (ids in slice k, mask of the ids slice k owns)."""
    loc = ids - k * rows
    own = valid & (loc >= 0) & (loc < rows)
    return jnp.where(own, loc, 0), own


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def gather_logits(hidden, e, b, ids, valid, ring: Ring):
    """`recloss.targets.gather_logits` when the chip holds only its table slice.

    hidden [M, D], e [R, D] / b [R] or None (this chip's slice), ids [M, L]
    local to the vocab shard (0 where not ``valid``). Returns x [M, L] f32 with
    x = hidden·E[ids] + b[ids] at valid ids (0 elsewhere). Forward: one ring of
    the slices, each owning chip gathering its ids. VJP: another ring whose dE
    accumulators travel as in `Plan` (``targets.scatter_rows`` per slice).
    """
    return _gather_forward(hidden, e, b, ids, valid, ring)


def _gather_forward(hidden, e, b, ids, valid, ring):
    def visit(s, e_k, b_k):
        loc, own = _slice_ids(ids, valid, ring.held(s), ring.rows)
        return jnp.where(own, targets_lib.gather_logits(hidden, e_k, b_k, loc), 0.0), None, None

    return ring.walk(e, b, visit, jnp.add)[0]


def _rg_fwd(hidden, e, b, ids, valid, ring):
    return _gather_forward(hidden, e, b, ids, valid, ring), (hidden, e, b, ids, valid)


def _rg_bwd(ring, res, g):
    hidden, e, b, ids, valid = res
    g = g.astype(jnp.float32)
    with_b = b is not None

    def visit(s, e_k, _):
        loc, own = _slice_ids(ids, valid, ring.held(s), ring.rows)
        gk = jnp.where(own, g, 0.0)
        rows = jnp.take(e_k, loc, axis=0)
        dh = jnp.einsum("ml,mld->md", gk.astype(rows.dtype), rows, preferred_element_type=jnp.float32)
        de, db = targets_lib.scatter_rows(hidden, gk, loc, ring.rows, with_b)
        return dh, de, db

    dh, de, db = ring.walk(e, None, visit, jnp.add)
    return (dh.astype(hidden.dtype), de.astype(e.dtype), None if b is None else db.astype(b.dtype),
            None, None)


gather_logits.defvjp(_rg_fwd, _rg_bwd)
