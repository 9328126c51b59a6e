"""The vocab shard a strategy computes on: its table rows, where they sit in the vocabulary, and the
reductions that make its partial results global.

One is built where the computation starts, by `recloss.assemble`: `VocabShard.whole` on one device,
`recloss.sharding`'s builder inside `jax.shard_map` (a `VocabShard` of the gathered [V/|vocab|, D]
rows, or a `RingShard` of the chip's [V/(|vocab|·|fsdp|), D] slice when ``fsdp_gather='ring'``).
A strategy only asks it:

    ids, valid = shard.local_targets(targets, pad_id)     # the targets this shard owns
    x = shard.gather_logits(hidden, ids, valid)            # their logits [M, L]
    s = shard.column_sum(hidden)                           # Σ_v x_v per row [M], one [D] column sum
    shard.vocab_sum(x), shard.vocab_max(x), shard.batch_sum(x)

and it is what the sweep shells sweep: ``recloss.sweep.sweep_total(hidden, shard, row_scale, plan)``
with ``plan = shard.planned(...)`` (a strategy's ``plan(M, shard)``). So whether the table is whole or
a travelling ring slice is decided once, here. Both kinds are pytrees (table, bias and offset the
leaves), so the shells' custom VJPs take them whole.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp

from recloss import ring as ring_lib, sweep as sweep_lib, targets as targets_lib


def _psum(x, axes):
    return jax.lax.psum(x, axes) if axes else x


def _pmax(x, axes):
    return jax.lax.pmax(x, axes) if axes else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _psum_own_grad(x, axes):
    """psum(x, axes) whose gradient is each device's own: the cotangent passes back unsummed.

    Under the caller's shard_map (`MeshLayout(manual=True)`) the loss L(Σ_d x_d) is differentiated
    on each device: ∂L/∂x_d is the cotangent itself, so the gradients a device gets are its own
    contribution and their sum over the batch axes is the gradient of the replicated parameters.
    (psum's own transpose, a psum, would count every device's cotangent |batch| times.)"""
    return jax.lax.psum(x, axes)


def _psum_own_grad_fwd(x, axes):
    return jax.lax.psum(x, axes), None


def _psum_own_grad_bwd(axes, _, ct):
    return (ct,)


_psum_own_grad.defvjp(_psum_own_grad_fwd, _psum_own_grad_bwd)


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """The whole vocab shard on this chip: table [V_local, D] and bias [V_local] or None.

    Attributes:
      table, bias: the shard's rows (global ids ``offset`` … ``offset + rows − 1``).
      offset: global id of the shard's first row: a Python int when known at trace time (one
        device, or no vocab axis), else a traced int32 scalar (``axis_index(vocab)·V_local``).
      vocab_size: the real V (global); rows at or past it are inert.
      platform: where the computation runs ('cpu', 'gpu', 'tpu').
      batch_axes, vocab_axes: mesh axes the rows and the vocabulary are split over (the
        reductions' psum/pmax axes; empty on one device or where an axis has size 1).
      own_grads: the batch sums pass each device's own gradient back (`_psum_own_grad`): the
        caller's shard_map differentiates the loss itself (`recloss.MeshLayout` ``manual``).
    """

    table: Any
    bias: Any
    offset: Any
    vocab_size: int
    platform: str
    batch_axes: Tuple[str, ...] = ()
    vocab_axes: Tuple[str, ...] = ()
    own_grads: bool = False

    @classmethod
    def whole(cls, table, bias, *, vocab_size: int, platform: str, batch_axes: Tuple[str, ...] = ()
              ) -> "VocabShard":
        """The whole table on this device (offset 0). With ``batch_axes`` (the call is inside the
        caller's shard_map over them) the batch sums are psums passing each device's own gradient
        back; without, every reduction is the identity (one device)."""
        return cls(table, bias, 0, vocab_size, platform, batch_axes=tuple(batch_axes),
                   own_grads=bool(batch_axes))

    # ------------------------------------------------------------ where the shard sits
    @property
    def rows(self) -> int:
        """V_local: rows of the vocab shard (ids it owns)."""
        return self.table.shape[0]

    @property
    def static_offset(self) -> Optional[int]:
        """``offset`` when it is known at trace time, else None."""
        return self.offset if isinstance(self.offset, int) else None

    # ------------------------------------------------------------ reductions
    def batch_sum(self, x):
        """Σ over the batch shards (positions split over the batch axes)."""
        if self.own_grads and self.batch_axes:
            return _psum_own_grad(x, self.batch_axes)
        return _psum(x, self.batch_axes)

    def vocab_sum(self, x):
        """Σ over the vocab shards."""
        return _psum(x, self.vocab_axes)

    def vocab_max(self, x):
        """max over the vocab shards (no gradient)."""
        return _pmax(x, self.vocab_axes)

    # ------------------------------------------------------------ what objectives ask
    def local_targets(self, targets, pad_id: int):
        """(ids [M, L] int32 local to the shard, valid [M, L]) of the global ``targets`` [M, L]: valid
        marks the first occurrence of an id that is not ``pad_id``, is < vocab_size and is owned here."""
        return targets_lib.local_targets(targets, pad_id, self.offset, self.rows, self.vocab_size)

    def gather_logits(self, hidden, ids, valid):
        """x [M, L] f32 = hidden·E[ids] + b[ids] of the local ``ids`` (garbage where not ``valid``;
        mask with it), differentiable in hidden, table and bias (`recloss.targets.gather_logits`)."""
        return targets_lib.gather_logits(hidden, self.table, self.bias, ids)

    def column_sum(self, hidden):
        """Σ_v (h·e_v + b_v) over the shard's live rows, per row [M] f32: one [D] column sum, not [M, V]."""
        return _column_sum(hidden, self.table, self.bias, self.offset, self.vocab_size)

    def planned(self, plan: sweep_lib.Plan):
        """``plan`` as a sweep over this shard runs it (itself here; walked round the ring for a
        `RingShard`). A strategy's ``plan(M, shard)`` returns it, for `recloss.sweep.sweep_total` /
        `sweep_rows`."""
        return plan

    def cotangent(self, table, bias):
        """This shard's cotangent in a custom VJP: ``table`` [V_local, D] and ``bias`` (or None) the
        gradients, no gradient for the offset."""
        return dataclasses.replace(self, table=table, bias=bias, offset=None)


@dataclasses.dataclass(frozen=True)
class RingShard(VocabShard):
    """The vocab shard as slices travelling round the fsdp axis (``MeshLayout(fsdp_gather='ring')``):
    ``table`` [R, D] / ``bias`` [R] are this chip's slice, R = V_local/F; the shard's first global id
    is ``offset`` (slice 0's) and chip i's slice starts at ``offset + i·R``. Gathers, sweeps and column
    sums walk the ring (`recloss.ring`); ``offset`` is always traced here."""

    ring: Optional[ring_lib.Ring] = None

    @property
    def rows(self) -> int:
        return self.ring.rows * self.ring.size

    @property
    def static_offset(self) -> Optional[int]:
        return None    # each slice's offset is traced: the plan masks columns by the real vocab_size

    def gather_logits(self, hidden, ids, valid):
        return ring_lib.gather_logits(hidden, self.table, self.bias, ids, valid, self.ring)

    def column_sum(self, hidden):
        # This chip's slice; its [D] column sum summed round the ring (no table moves).
        return _column_sum(hidden, self.table, self.bias, self.offset + self.ring.index() * self.ring.rows,
                           self.vocab_size, total=self.ring.psum)

    def planned(self, plan):
        return ring_lib.Plan(plan, self.ring)


_DATA = ["table", "bias", "offset"]
_META = ["vocab_size", "platform", "batch_axes", "vocab_axes", "own_grads"]
# Pytrees, so the sweep shells' custom VJPs take a shard: its arrays are primal inputs, the rest static.
jax.tree_util.register_dataclass(VocabShard, data_fields=_DATA, meta_fields=_META)
jax.tree_util.register_dataclass(RingShard, data_fields=_DATA, meta_fields=_META + ["ring"])


def _column_sum(hidden, table, bias, vocab_offset, vocab_size, total=lambda x: x):
    """Σ_v (h·e_v + b_v) over ``table``'s live rows, per row [M] f32. ``total`` sums the [D] column
    sum (and the bias sum) over the chips holding the shard's slices."""
    live = (jnp.arange(table.shape[0]) + vocab_offset < vocab_size)[:, None]
    col = total(jnp.sum(jnp.where(live, table, 0), axis=0, dtype=jnp.float32))
    out = jnp.dot(hidden.astype(jnp.float32), col)
    if bias is not None:
        out = out + total(jnp.sum(jnp.where(live[:, 0], bias, 0), dtype=jnp.float32))
    return out
