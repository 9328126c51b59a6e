"""Sharded loss: mesh-axis roles, partition specs and the shard_map wrapper.

Storage layout (M = flattened positions, V = table rows):

    hidden  [M, D]  P(batch_axes, None)       table [V, D]  P((vocab_axis, fsdp_axis), None)
    targets [M, L]  P(batch_axes, None)       bias  [V]     P((vocab_axis, fsdp_axis))
    weights [M]     P(batch_axes)

Inside `jax.shard_map` each device holds rows of the batch and a slice of the
table. The table slice is all-gathered over ``fsdp_axis`` once (outside any
block loop), giving the vocab shard's ``[V/|vocab|, D]`` rows whose first
global id is ``vocab_offset = axis_index(vocab_axis)·V/|vocab|``. The strategy
computes that shard's loss part; partial losses, weight sums and metrics are
psum'ed over the batch axes and the vocab axis.

Gradients come from autodiff of the collectives and of shard_map itself
(run with check_vma=False, see `mapped`): the cotangent of an input is psum'ed
over the mesh axes its spec leaves out, and the all-gather transposes to a
reduce-scatter. So

    dA = psum_vocab(dA_local),   dE = psum_data(psum_scatter_fsdp(dE_local)),

with the data-axis sum taken on the already scattered [V/(|vocab|·|fsdp|), D] slice.

With ``MeshLayout(fsdp_gather='ring')`` the table is not gathered: each chip
keeps its [V/(|vocab|·|fsdp|), D] slice and the blocked strategies walk the
fsdp axis with `recloss.ring` (ppermute of the slices, their dE travelling
with them), so dE comes back already summed over fsdp and in storage layout;
only the data-axis psum of shard_map's autodiff remains.

With ``MeshLayout(fsdp_gather='rows')`` the table does not move at all: the
rows of the fsdp group (hidden, targets, weights: [|fsdp|·M_chip, ·]) are
all-gathered instead, and each chip computes its own [V/(|vocab|·|fsdp|), D]
slice's part for all of them, as a vocab shard would (the fsdp axis joins the
vocab axis in the per-row sums and leaves the batch sums). dE is the chip's
own slice's, written once; dA comes back through the gather's transpose, a
reduce-scatter of [|fsdp|·M_chip, D]. It moves |fsdp|·M_chip·D numbers where
the table moves V/|vocab|·D: the cheaper choice whenever the fsdp group's
rows are fewer than the vocab shard's.

Meshes: with Explicit axes (`jax.make_mesh`'s default in current JAX) an array's sharding is
part of its type and shard_map requires each input's to equal its in_spec; with Auto axes
(`jax.sharding.Mesh(devices, names)`) shard_map reshards what it is given. `mapped` lays out every
input by its spec first (`place_all`: `jax.sharding.reshard` on Explicit axes, a sharding
constraint on Auto ones), so both kinds take plain arrays and arrays already placed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from recloss import _compat, ring as ring_lib
from recloss.assemble import LossOutput, assemble
from recloss.pallas.tiling import LANES
from recloss.shard import RingShard, VocabShard


#: The values of `MeshLayout.fsdp_gather`: gather the table slices once, pass them round the fsdp axis,
#: or leave them home and gather the fsdp group's rows instead. A strategy says which it takes
#: (``Strategy.fsdp_gathers``); `check_fsdp_gather` is the one check, for the library and the plugins.
FSDP_GATHERS = ("once", "ring", "rows")
_GATHER_WORDS = ("'once': all-gather the table slices once; 'ring': pass them round the fsdp axis; "
                 "'rows': all-gather the rows instead")


def check_fsdp_gather(gather, strategy=None, *, key: str = "MeshLayout.fsdp_gather"):
    """Raises ValueError, naming ``key`` (how the caller spells the setting) and the value, unless
    ``gather`` is one of `FSDP_GATHERS` and ``strategy`` (a `recloss.Strategy`, or None for the value
    alone) takes it. A gather that changes nothing ('ring', 'rows' without an fsdp axis) is the
    caller's to skip."""
    if not isinstance(gather, str) or gather not in FSDP_GATHERS:
        raise ValueError(f"{key}={gather!r}: expected one of {', '.join(map(repr, FSDP_GATHERS))} "
                         f"({_GATHER_WORDS})")
    if strategy is not None and gather not in strategy.fsdp_gathers:
        from recloss.registry import available_strategies, get_strategy   # registry imports this module
        takers = ", ".join(n for n in available_strategies() if gather in get_strategy(n).fsdp_gathers)
        raise ValueError(f"{key}={gather!r}: strategy {strategy.name!r} does not take it (it needs the vocab "
                         f"shard's whole table on each chip); set {key}='once', or use a blocked strategy: "
                         f"{takers}")


@dataclasses.dataclass(frozen=True)
class GatherChoice:
    """What `choose_fsdp_gather` picked: ``mode`` (one of `FSDP_GATHERS`) and ``bytes``, the estimate
    behind it per candidate mode (per chip; {} when the strategy or the mesh left no choice)."""
    mode: str
    bytes: Any
    why: str

    def describe(self) -> str:
        """One line for a run log: the mode, and the estimate it was picked by."""
        if not self.bytes:
            return f"loss_fsdp_gather=auto: {self.mode!r} ({self.why})"
        sizes = ", ".join(f"{m} {_size(b)}" for m, b in self.bytes.items())
        return f"loss_fsdp_gather=auto: {self.mode!r} ({self.why}; per chip: {sizes})"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def choose_fsdp_gather(strategy, layout: "MeshLayout", *, rows: int, vocab_size: int, features: int,
                       itemsize: int) -> GatherChoice:
    """The `MeshLayout.fsdp_gather` that holds the least on a chip, from the shapes (``auto``).

    With F = |fsdp|, S = the rows of a chip's table slice (padded V / (|vocab|·F)), M = ``rows``
    (positions per chip after the batch split), D = ``features`` and b = ``itemsize`` (the table's
    bytes per number), the buffers a mode adds beyond what every mode holds (the chip's own slice
    and its rows' dA) are estimated as::

        once  F·S·D·(b + 4)      the gathered vocab shard and its float32 gradient before the reduce-scatter
        ring  S·D·(2·b + 12)     the slice computed on and the one arriving, and three float32 gradient
                                 slices (the one travelling in, the one going out, the chip's own)
        rows  F·M·D·(b + 4·c)    the fsdp group's rows (hidden) and their float32 gradient, c partials
                                 of it (`Strategy.grad_partials`: a Pallas kernel's per TensorCore)

    and the least is picked, ties in the order once, ring, rows (fewer collectives first). For a
    bfloat16 table (b = 2) 'ring' beats 'once' when F > 2⅔, and 'rows' beats 'ring' when the group's
    rows F·M are fewer than 8·S/3 (c = 1) or 1.6·S (c = 2).
    'once' when the strategy takes nothing else (`Strategy.fsdp_gathers`) or F = 1.
    """
    for name, value in (("rows", rows), ("vocab_size", vocab_size), ("features", features),
                        ("itemsize", itemsize)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"choose_fsdp_gather: {name}={value!r}, expected an int >= 1")
    f = layout.fsdp_shards
    if f == 1:
        return GatherChoice("once", {}, "no fsdp axis to gather over")
    if tuple(strategy.fsdp_gathers) == ("once",):
        return GatherChoice("once", {}, f"strategy {strategy.name!r} takes only 'once'")
    s = padded_vocab_size(vocab_size, layout) // layout.table_shards
    per = features * (itemsize + 4)
    partials = strategy.grad_partials(layout)
    estimate = {"once": f * s * per, "ring": s * features * (2 * itemsize + 12),
                "rows": f * rows * features * (itemsize + 4 * partials)}
    estimate = {m: b for m, b in estimate.items() if m in strategy.fsdp_gathers}
    mode = min(estimate, key=lambda m: (estimate[m], FSDP_GATHERS.index(m)))
    return GatherChoice(mode, estimate, f"fsdp {f}, {s:,} table rows a slice, {rows:,} positions a chip")


def _axes_tuple(name, value) -> Tuple[str, ...]:
    """``value`` (None, an axis name or a sequence of names) as a tuple; ``name`` says what it is in
    the error (e.g. 'MeshLayout.batch_axes')."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(a, str) for a in value):
        return tuple(value)
    raise TypeError(f"{name} must be a mesh axis name, a tuple of names or None, "
                    f"got {value!r}")


def _spec_entry(axes: Tuple[str, ...]):
    """One PartitionSpec entry: None (replicated), a name, or a tuple of names (major first)."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """Roles of the axes of a device mesh for the sharded loss.

    Attributes:
      mesh: a `jax.sharding.Mesh` (devices may be a TPU topology's, for
        ahead-of-time compilation).
      batch_axes: axes the positions (rows of hidden/targets/weights) are split
        over; must include ``fsdp_axis`` when that is set.
      fsdp_axis: axis the table's storage is additionally split over (gathered
        inside the op, gradient reduce-scattered back), or None.
      vocab_axis: axis the vocabulary is split over (each shard computes its
        own columns), or None.
      fsdp_gather: how a chip meets the table slices of its fsdp axis.
        'once' (default): all-gathered once per call, gradient reduce-scattered
        back; each chip holds the vocab shard's whole [V/|vocab|, D] and its dE.
        'ring': the slices travel round the axis with `ppermute` and their dE
        with them (`recloss.ring`): no all-gather or reduce-scatter, at most two
        slices live. 'rows': the slices stay home and the fsdp group's rows
        (hidden, targets, weights) are all-gathered instead; each chip sweeps
        its own slice for all of them and holds one slice-sized dE (moves
        |fsdp|·M_chip·D numbers, not the table). With no fsdp axis (None or
        size 1) 'ring' and 'rows' are allowed and change nothing. Only the
        blocked strategies (cutbce, cutbce_pallas, cutce, cutce_pallas) take
        'ring' and 'rows'; the dense ones need 'once'.
      manual: the loss is called inside the caller's own ``jax.shard_map`` over
        ``batch_axes`` (a data-parallel train step written by hand): hidden,
        targets and weights are this device's rows, the table and bias whole
        (the vocab and fsdp axes must be None or of size 1). The loss and
        metrics are still global (psum over ``batch_axes``), and the gradients
        taken inside the shard_map are each device's own contribution: sum them
        over ``batch_axes`` (`psum_in_place` for the table: no second
        table-sized buffer). False (default): the loss runs its own shard_map.
    A role may be None (the mesh lacks that axis) or an axis of size 1 (free).
    """

    mesh: Any
    batch_axes: Tuple[str, ...] = ("data", "fsdp")
    fsdp_axis: Optional[str] = "fsdp"
    vocab_axis: Optional[str] = "vocab"
    fsdp_gather: str = "once"
    manual: bool = False

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"MeshLayout.mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")
        object.__setattr__(self, "batch_axes", _axes_tuple("MeshLayout.batch_axes", self.batch_axes))
        for role in ("fsdp_axis", "vocab_axis"):
            value = getattr(self, role)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"MeshLayout.{role} must be a mesh axis name or None, got {value!r}")
        names = tuple(self.mesh.axis_names)
        for role, axes in (("batch_axes", self.batch_axes), ("fsdp_axis", _axes_tuple("", self.fsdp_axis)),
                           ("vocab_axis", _axes_tuple("", self.vocab_axis))):
            for a in axes:
                if a not in names:
                    raise ValueError(f"MeshLayout.{role} names axis {a!r}, which the mesh does not have; "
                                     f"the mesh's axes are {names} (use None for a missing role)")
        if len(set(self.batch_axes)) != len(self.batch_axes):
            raise ValueError(f"MeshLayout.batch_axes={self.batch_axes} repeats an axis")
        check_fsdp_gather(self.fsdp_gather)
        if self.fsdp_axis is not None and self.fsdp_axis not in self.batch_axes:
            raise ValueError(f"MeshLayout.fsdp_axis={self.fsdp_axis!r} must also be one of batch_axes="
                             f"{self.batch_axes}: FSDP shards split the batch and gather the table")
        if self.vocab_axis is not None and self.vocab_axis in self.batch_axes:
            raise ValueError(f"MeshLayout.vocab_axis={self.vocab_axis!r} cannot also be a batch axis "
                             f"(batch_axes={self.batch_axes})")
        if not isinstance(self.manual, bool):
            raise TypeError(f"MeshLayout.manual must be True or False, got {self.manual!r}")
        if self.manual and self.table_shards > 1:
            raise ValueError(f"MeshLayout(manual=True) takes the whole table on each device, but the "
                             f"table is split {self.table_shards} ways (vocab_axis {self.vocab_axis!r} × "
                             f"fsdp_axis {self.fsdp_axis!r}); use manual=False, where the loss runs its "
                             f"own shard_map, or a mesh whose vocab and fsdp axes have size 1")

    # ---------------------------------------------------------------- sizes
    def axis_size(self, axis: Optional[str]) -> int:
        """Size of a mesh axis; 1 for None."""
        return 1 if axis is None else int(self.mesh.shape[axis])

    @property
    def platform(self) -> str:
        """Platform of the mesh's devices ('cpu', 'gpu', 'tpu')."""
        return self.mesh.devices.flat[0].platform

    @property
    def batch_shards(self) -> int:
        """How many pieces the rows are split into (product of the batch axes)."""
        return math.prod(self.axis_size(a) for a in self.batch_axes)

    @property
    def vocab_shards(self) -> int:
        return self.axis_size(self.vocab_axis)

    @property
    def fsdp_shards(self) -> int:
        return self.axis_size(self.fsdp_axis)

    @property
    def table_axes(self) -> Tuple[str, ...]:
        """Axes the table's rows are stored over, major first: (vocab_axis, fsdp_axis)."""
        return tuple(a for a in (self.vocab_axis, self.fsdp_axis) if a is not None)

    @property
    def table_shards(self) -> int:
        return self.vocab_shards * self.fsdp_shards

    def batch_spec(self, ndim: int) -> P:
        """P(batch_axes, None, ...) for an array of ``ndim`` dims split on its leading dim."""
        if ndim < 1:
            raise ValueError(f"batch_spec needs ndim >= 1, got {ndim}")
        return P(_spec_entry(self.batch_axes), *([None] * (ndim - 1)))

    # ---------------------------------------------------------------- checks
    def check_rows(self, m: int):
        """Raises unless ``m`` flattened positions split evenly over the batch shards."""
        if m % self.batch_shards:
            sizes = tuple(self.axis_size(a) for a in self.batch_axes)
            raise ValueError(f"the batch has M={m} positions (hidden's leading dims flattened), which does "
                             f"not divide into {self.batch_shards} batch shards (mesh axes {self.batch_axes} "
                             f"of sizes {sizes}); use a batch that is a multiple of {self.batch_shards}")

    def check_table(self, rows: int):
        """Raises unless ``rows`` table rows split evenly over vocab × fsdp shards."""
        if rows % self.table_shards:
            raise ValueError(f"the table has {rows} rows, which does not divide into {self.table_shards} "
                             f"shards (vocab_axis {self.vocab_axis!r} × fsdp_axis {self.fsdp_axis!r}); "
                             f"allocate recloss.padded_vocab_size({rows}, layout)="
                             f"{padded_vocab_size(rows, self)} rows and pass vocab_size={rows}")


# Rows per chunk of `psum_in_place` are sized to about this many bytes: large enough that the
# per-chunk collective latency is amortised, small beside any table worth reducing in place.
PSUM_CHUNK_BYTES = 64 << 20


def psum_in_place(x, axes, *, chunk_bytes: int = PSUM_CHUNK_BYTES):
    """``jax.lax.psum(x, axes)`` written back over ``x`` chunk by chunk, inside shard_map.

    x [R, ...]: reduced in row chunks of about ``chunk_bytes`` (a fori_loop of dynamic_slice, psum,
    dynamic_update_slice on the loop carry), so XLA keeps one x-sized buffer and one chunk where a
    whole-array all-reduce holds its operand and its result (two x-sized buffers: XLA's all-reduce is
    not in place). For a replicated table's gradient in a hand-written data-parallel step
    (`MeshLayout` ``manual``). Arrays of at most one chunk take the plain psum.
    """
    axes = _axes_tuple("psum_in_place's axes", axes)
    if not axes:
        return x
    if x.ndim == 0:
        return jax.lax.psum(x, axes)
    row_bytes = max(1, x.size // max(1, x.shape[0])) * x.dtype.itemsize
    chunk = max(1, chunk_bytes // row_bytes)
    n = x.shape[0]
    if n <= chunk:
        return jax.lax.psum(x, axes)
    whole, rest = divmod(n, chunk)

    def body(i, acc):
        part = jax.lax.dynamic_slice_in_dim(acc, i * chunk, chunk, 0)
        return jax.lax.dynamic_update_slice_in_dim(acc, jax.lax.psum(part, axes), i * chunk, 0)

    x = jax.lax.fori_loop(0, whole, body, x)
    if rest:
        x = jax.lax.dynamic_update_slice_in_dim(x, jax.lax.psum(x[whole * chunk:], axes), whole * chunk, 0)
    return x


def padded_vocab_size(vocab_size: int, layout: Optional[MeshLayout] = None) -> int:
    """Rows to allocate for a ``vocab_size``-item table under ``layout``.

    The smallest multiple of vocab shards × fsdp shards × 128 that is ≥
    vocab_size (128 alone without a layout). Pass ``vocab_size=`` the real V to
    the loss: rows past it are inert (no loss, no metrics, zero gradient).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    unit = LANES * (1 if layout is None else layout.table_shards)
    return -(-vocab_size // unit) * unit


@dataclasses.dataclass(frozen=True)
class Specs:
    """PartitionSpecs of the loss's arrays under a layout.

    Inputs (storage, flattened): hidden [M, D], targets [M, L], weights [M],
    table [V, D], bias [V]. Outputs: row_loss [M] (reduction='none'), loss
    (scalar), metrics (each a scalar).
    """

    hidden: P
    targets: P
    weights: P
    table: P
    bias: P
    row_loss: P
    loss: P
    metrics: P


def default_specs(layout: MeshLayout) -> Specs:
    """Specs of docs/design.md "Sharding": batch over batch_axes, table rows over (vocab, fsdp)."""
    b = _spec_entry(layout.batch_axes)
    t = _spec_entry(layout.table_axes)
    return Specs(hidden=P(b, None), targets=P(b, None), weights=P(b), table=P(t, None), bias=P(t),
                 row_loss=P(b), loss=P(), metrics=P())


def mapped(strategy, hidden, table, targets, w, bias, extras, *, layout: MeshLayout, vocab_size: int,
           extra_specs=None):
    """`recloss.assemble` under shard_map for ``strategy`` on ``layout``, and its arguments laid out
    (called by `recloss.Strategy.__call__`, which calls the one with the other).

    Args:
      hidden [M, D], table [V, D], targets [M, L] global ids, w [M] float32 weights, bias [V] or
      None; vocab_size: the real V (≤ V; rows past it inert). extras: a dict of the strategy's
      per-call arrays (`recloss.Strategy.prepare`) laid out by ``extra_specs`` (a dict of
      PartitionSpecs), or None. Every array, the user's (placed or not) and those the library made,
      is laid out by the strategy's `partition_specs` (`place_all`), on Explicit and Auto meshes alike.
    Returns:
      (fn, args): ``fn(*args)`` is the LossOutput with global values: loss scalar (or [M] rows split
      over the batch axes for reduction='none') and metrics scalars.
    """
    if not isinstance(layout, MeshLayout):
        raise TypeError(f"layout must be a recloss.MeshLayout, got {type(layout).__name__}")
    layout.check_rows(hidden.shape[0])
    layout.check_table(table.shape[0])
    specs = strategy.partition_specs(layout)
    body = functools.partial(assemble, strategy, shard_of=_shard_builder(strategy, layout, table.shape[0],
                                                                         vocab_size))
    args = (hidden, table, targets, w, bias, extras)
    in_specs = (specs.hidden, specs.table, specs.targets, specs.weights,
                None if bias is None else specs.bias, extra_specs)
    if _gather(layout) == "rows":
        body = _on_group_rows(body, layout.fsdp_axis, in_specs, strategy.options.reduction == "none")
    loss_spec = specs.row_loss if strategy.options.reduction == "none" else specs.loss
    # check_vma=False: strategies keep untyped scan carries (bce/cut.py's zeros
    # init) and pallas_call out_shapes, which check_vma=True rejects. Gradients
    # stay exact: shard_map divides an output's cotangent by the size of the
    # axes its spec leaves out and psums an input's cotangent over the axes
    # its spec leaves out (hidden: vocab_axis; table and bias: the data axes);
    # psum transposes to psum, all_gather to psum_scatter.
    fn = _compat.shard_map(body, mesh=layout.mesh, in_specs=in_specs,
                           out_specs=LossOutput(loss_spec, specs.metrics), check_vma=False)
    return fn, place_all(layout, args, in_specs)


def _gather(layout: MeshLayout) -> str:
    """The layout's ``fsdp_gather`` where it does something: 'once' without an fsdp axis of size > 1."""
    return layout.fsdp_gather if layout.fsdp_shards > 1 else "once"


def _shard_builder(strategy, layout: MeshLayout, rows: int, vocab_size: int):
    """``shard_of(e, b) -> VocabShard``, called inside shard_map on the chip's table storage slice:
    all-gathered over the fsdp axis into the vocab shard (``fsdp_gather='once'``), kept as the
    chip's slice of a `RingShard` (``'ring'``), or kept as a vocab shard of its own whose fsdp axis
    sums the rows' parts with the vocab axis (``'rows'``, the rows gathered by `_on_group_rows`)."""
    v_local = rows // layout.vocab_shards
    vocab_axis, fsdp_axis = layout.vocab_axis, layout.fsdp_axis
    gather = _gather(layout)
    check_fsdp_gather(gather, strategy)
    live = lambda axes: tuple(a for a in axes if layout.axis_size(a) > 1)
    # Sums over axes of size 1 are skipped: they would still appear as collectives.
    batch_axes, vocab_axes = live(layout.batch_axes), live((vocab_axis,))
    if gather == "rows":   # the fsdp group's rows are on every chip of it; its slices split the vocab
        batch_axes, vocab_axes = tuple(a for a in batch_axes if a != fsdp_axis), vocab_axes + (fsdp_axis,)
    kw = dict(vocab_size=vocab_size, platform=layout.platform, batch_axes=batch_axes, vocab_axes=vocab_axes)
    slice_rows = v_local // layout.fsdp_shards
    ring = ring_lib.Ring(fsdp_axis, layout.fsdp_shards, slice_rows) if gather == "ring" else None

    def shard_of(e, b):
        if fsdp_axis is not None and gather == "once":
            e = jax.lax.all_gather(e, fsdp_axis, axis=0, tiled=True)
            if b is not None:
                b = jax.lax.all_gather(b, fsdp_axis, axis=0, tiled=True)
        offset = 0 if vocab_axis is None else jax.lax.axis_index(vocab_axis) * v_local
        if ring is not None:   # e, b stay this chip's slice; gathers and sweeps walk the ring
            return RingShard(e, b, offset, ring=ring, **kw)
        if gather == "rows":   # this chip's slice is its own vocab shard
            offset = offset + jax.lax.axis_index(fsdp_axis) * slice_rows
        return VocabShard(e, b, offset, **kw)

    return shard_of


def _on_group_rows(body, axis: str, in_specs, per_row: bool):
    """``body`` (`assemble`'s arguments) run on the rows of ``axis``'s whole group: every row input
    split over ``axis`` on its leading dim (hidden, targets, weights, per-row extras) is all-gathered
    first (tiled, in axis order); a per-row loss (``per_row``: reduction='none') is cut back to this
    chip's rows. The gathers' transposes, reduce-scatters, sum each row's gradient over the group."""
    def split(spec):
        head = spec[0] if spec is not None and len(spec) else None
        return axis == head or (isinstance(head, tuple) and axis in head)

    gather = lambda tree, specs: jax.tree_util.tree_map(
        lambda x, s: jax.lax.all_gather(x, axis, axis=0, tiled=True) if split(s) else x, tree, specs)

    def run(hidden, table, targets, w, bias, extras):
        m = hidden.shape[0]
        rows = gather((hidden, targets, w), (in_specs[0], in_specs[2], in_specs[3]))
        extras = None if extras is None else gather(extras, in_specs[5])
        out = body(rows[0], table, rows[1], rows[2], bias, extras)
        if per_row:
            out = LossOutput(jax.lax.dynamic_slice_in_dim(out.loss, jax.lax.axis_index(axis) * m, m), out.metrics)
        return out

    return run


def place_all(layout: MeshLayout, arrays, specs):
    """``arrays`` (a pytree) each laid out by its PartitionSpec in ``specs`` (the same tree of
    specs) on the layout's mesh (`recloss._compat.place`): the user's arrays whether already
    placed or not, and those the library makes (default weights, drawn negatives, extras).

    On a mesh with Explicit axes shard_map requires every input's type to carry its in_spec;
    on an Auto mesh this is a sharding constraint, which shard_map would impose anyway.
    """
    leaves, tree = jax.tree_util.tree_flatten(arrays)
    spec_leaves = tree.flatten_up_to(specs)
    return jax.tree_util.tree_unflatten(tree, [_compat.place(x, layout.mesh, s)
                                               for x, s in zip(leaves, spec_leaves)])
