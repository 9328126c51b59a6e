"""The shared blocked vocabulary sweep, its plan and result, and the custom-VJP shells every blocked
objective plugs into.

`blocked` walks a table shard in blocks of ``block_v`` rows (lax.scan), each
block in row tiles of ``block_n`` rows, and hands every [block_n, block_v]
logit tile to an objective's ``tile`` function; per-row results are combined
across blocks, per-block results (dE_j, db_j) are emitted once, never carried
as a whole [V, D]. `blocks` chooses the sizes.

A *sweep* walks the vocabulary once for rows a [M, D] against a table shard
e [V_local, D] and returns a `SweepOut` (value [M], aux, dA [M, D], dE
[V_local, D], db [V_local]; None where the mode does not produce one): BCE's
value is the background bg_i and its aux the predicted-positive counts,
softmax's value the log-partition lse_i and its aux (row max, argmax id). Modes:

    'loss'   value and aux only                               2·M·V·D flops
    'fused'  value, aux and the gradients scaled by r (BCE)   6·M·V·D
    'grad'   the gradients scaled by r only (recompute)       6·M·V·D (logits again, dA, dE)

A `Plan` is the static (hashable) description of one sweep: the objective's
sweep functions on its backend (`Sweeps`, one per mode: pure JAX on `blocked`, or a Pallas kernel
on `recloss.pallas.grid`) and what they need. On top of any plan, for a `recloss.shard.VocabShard`:

* `sweep_total` (scalar loss Σ_i r_i·value_i): without a gradient it is the
  loss-only sweep; the VJP's forward is the fused sweep, whose gradients are
  kept as residuals, and the backward only scales them by the cotangent.
* `sweep_rows` (per-row values: BCE with reduction='none', the softmax
  log-partition): forward is the loss-only sweep; the backward recomputes with
  r = the cotangent row and the forward's values.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp

from recloss import softcap, targets as targets_lib
from recloss.options import LossOptions

# Default vocab block (a divisor of V_local within a factor 2 below it when one exists).
BLOCK_V = 2048
# Bytes of one float32 logit tile (block_n × block_v). XLA:CPU materialises the
# elementwise passes between the three matmuls, so the tile bounds memory; its
# size trades matmul efficiency (D-deep products want long rows) against cache
# (docs/measurements.md "Measured choices").
TILE_BYTES = 16 << 20


class SweepOut(NamedTuple):
    """What one sweep returns; a field the mode does not produce is None.

    value: [M] f32 per row (BCE: the background bg_i; softmax: the log-partition lse_i, −inf for
      a row with no live column). aux: BCE: predicted-positive counts [M] f32; softmax: (row max
      [M] f32, its global id [M] int32) with compute_metrics. da [M, D] f32, de [V_local, D] (f32,
      or the table's dtype from a kernel whose one row chunk completes the sum), db [V_local] f32.
    """
    value: Any = None
    aux: Any = None
    da: Any = None
    de: Any = None
    db: Any = None


class Sweeps(NamedTuple):
    """An objective's sweep on one backend, one function per mode, each
    ``fn(a, e, b, r, vocab_offset, plan, fwd) -> SweepOut`` (`Plan.sweep` gives the arguments); a
    mode the objective has no use for is None (softmax has no 'fused': its gradient needs the global
    log-partition). Hashable: a module's constant (`recloss.bce.cut.SWEEPS`, `recloss.bce.kernel.SWEEPS`,
    `recloss.softmax.cut.SWEEPS`, `recloss.softmax.kernel.SWEEPS`, the ring's `recloss.ring.SWEEPS`)."""
    loss: Callable
    grad: Callable
    fused: Optional[Callable] = None


class Plan(NamedTuple):
    """Static configuration of one sweep (hashable: a custom-VJP static argument).

    sweeps: the objective's `Sweeps` on its backend (pure JAX on `blocked`, or a Pallas kernel on
      `recloss.pallas.grid`). combine: how two column sets' values merge, 'sum' (BCE) or 'lse'
      (softmax), for a sweep split round a ring (`recloss.ring.Plan`).
    vocab_size: the real V (global); static_offset: the shard's first global id when known at
      trace time, else None. blocks: the pure-JAX block sizes; chip, interpret: a kernel's.
    owner: the strategy's name, for error messages. sparse: the objective's sparse term over its
      targets' logits, ``sparse(x [M, L], valid, opts, grad) -> (value [M], ∂value/∂x [M, L] or
      None)`` (BCE's correction), which `sweep_total` adds on each table piece it sweeps; or None.
    """
    sweeps: Sweeps
    combine: str
    opts: LossOptions
    vocab_size: int
    static_offset: Optional[int]
    blocks: Optional["Blocks"] = None
    chip: Any = None
    interpret: Any = False
    owner: str = ""
    sparse: Optional[Callable] = None

    walks = False      # a plan that walks the table's pieces itself (`recloss.ring.Plan`) is True

    def sweep(self, mode: str, a, e, b, r, vocab_offset, fwd=None) -> SweepOut:
        """One sweep in ``mode`` of rows a [M, D] against e [V_local, D] (b [V_local] or None) whose
        row 0 has global id ``vocab_offset``; r [M] f32 scales the gradient rows (grad modes), ``fwd``
        is the forward's value [M] for a recompute. (The shells call ``plan.sweeps.<mode>`` directly.)"""
        fn = getattr(self.sweeps, mode, None) if mode in Sweeps._fields else None
        if fn is None:
            have = [m for m in Sweeps._fields if getattr(self.sweeps, m) is not None]
            raise ValueError(f"this sweep has modes {have}, got {mode!r}")
        return fn(a, e, b, r, vocab_offset, self, fwd)


class Sparse(NamedTuple):
    """The targets of a sparse term on a table piece: ids [M, L] int32 local to the piece (0 where
    not valid) and valid [M, L] bool (the first occurrence of an id the piece owns)."""
    ids: Any
    valid: Any


class SparsePart(NamedTuple):
    """``plan.sparse`` over the targets of one table piece, computed before the piece's dense sweep
    (`sparse_part`): ``kwargs`` go to the sweep, ``finish`` adds the rest to what it returns.

    x [M, L] f32 the target logits (soft-capped; 0 where not valid), value [M] f32 the term per row;
    in 'fused' mode ids [M, L], g [M, L] f32 = r·∂term/∂x (times the cap's slope; 0 where not valid)
    and da [M, D] f32 = G·e[ids], else None."""
    x: Any
    value: Any
    ids: Any = None
    g: Any = None
    da: Any = None

    @property
    def kwargs(self) -> Dict:
        """For the sweep: ``sparse_de=(ids, G)``, so it adds dE[ids] += G·a and db[ids] += G while its
        dE is float32 (a 16-bit table's gradient is then rounded once); {} without a gradient."""
        return {} if self.g is None else {"sparse_de": (self.ids, self.g)}

    def finish(self, out: SweepOut) -> SweepOut:
        """``out`` (the sweep given `kwargs`) with value += the term, dA += its part; aux becomes (aux, x)."""
        out = out._replace(value=out.value + self.value, aux=(out.aux, self.x))
        return out if self.da is None else out._replace(da=out.da + self.da)


def sparse_part(mode: str, plan: Plan, a, e, b, r, sp: Sparse) -> SparsePart:
    """``plan.sparse`` over the targets ``sp`` of the piece e [R, D] (b [R] or None): x = a·e[ids] +
    b[ids] (soft-capped with ``logit_soft_cap``), its value and, in 'fused' mode, G and dA's part."""
    grad = mode == "fused"
    rows, x = targets_lib.take_logits(a, e, b, sp.ids)                 # rows [M, L, D]
    x, slope = softcap.capped(x, plan.opts.logit_soft_cap, grad=grad)
    x = jnp.where(sp.valid, x, 0.0)
    value, dx = plan.sparse(x, sp.valid, plan.opts, grad)
    if not grad:
        return SparsePart(x, value)
    if slope is not None:
        dx = dx * slope
    g = jnp.where(sp.valid, dx * r[:, None], 0.0)
    da = jnp.einsum("ml,mld->md", g.astype(rows.dtype), rows, preferred_element_type=jnp.float32)
    return SparsePart(x, value, sp.ids, g, da)


def add_sparse_de(a, de, db, sparse_de):
    """(dE, db) of a sweep with ``sparse_de`` = (ids [M, L], G [M, L] f32) added: dE[ids] += G·a,
    db[ids] += G (`recloss.targets.scatter_rows`), in dE's dtype (f32 where a sweep calls it: its one
    rounding to the table's dtype comes after). ``sparse_de`` None: unchanged."""
    if sparse_de is None:
        return de, db
    ids, g = sparse_de
    return targets_lib.scatter_rows(a, g, ids, de.shape[0], db is not None, into=(de, db))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Blocks(NamedTuple):
    """Static block sizes of one blocked sweep (hashable)."""
    vocab_size: int       # real V (global); columns at or past it are inert
    block_v: int
    block_n: int          # rows per logit tile: each vocab block is walked in row tiles
    mask: bool            # whether columns need masking (padding, vocab_size, traced offset)


def blocks(m: int, v_local: int, *, block_v: Optional[int], block_n: Optional[int], vocab_size: int,
           static_offset: Optional[int]) -> Blocks:
    """Block sizes for M rows and a V_local-row table (explicit sizes win).

    The default block_v is ``BLOCK_V`` or a divisor of V_local within a factor 2
    below it, a multiple of 8 where one is: then the emitted f32 dE blocks
    [V_local/block_v, block_v, D] already form [V_local, D], with no copy (on TPU
    only a block of whole (8, 128) tiles reshapes for free).
    Each vocab block is walked in row tiles of block_n so one logit tile is
    ~``TILE_BYTES`` (XLA:CPU materialises the elementwise passes between the
    matmuls; the tile bounds that memory). ``static_offset``: the shard's first
    global id when known at trace time (None: traced), for deciding whether
    columns need masking.
    """
    if not block_v:
        divisors = [c for c in range(BLOCK_V, BLOCK_V // 2, -1) if v_local % c == 0]
        block_v = next((c for c in divisors if c % 8 == 0), divisors[0] if divisors else BLOCK_V)
    block_v = max(1, min(block_v, v_local))
    if not block_n:
        block_n = max(8, TILE_BYTES // (4 * block_v))
        block_n = 1 << (block_n.bit_length() - 1)
    block_n = max(1, min(block_n, m))
    mask = static_offset is None or static_offset + v_local > vocab_size
    return Blocks(vocab_size, block_v, block_n, mask)


def fence(e_j):
    """e_j (a table block) unchanged; a float32 one through a uint32 view behind an optimization barrier.

    TPU matmuls at default precision convert f32 operands to bf16; XLA's bf16 propagation moves
    that convert back through the block's dynamic slice and the loop onto the whole table: a bf16
    [V_local, D] copy in temporaries (512 MiB for either blocked strategy at V = 2^20, D = 256 on
    v5e with libtpu 0.0.42.1; tests/test_tpu_aot.py). An integer view cannot become bf16, so the
    convert stays per block, in the loop. Tile functions call it on their block before any product.
    """
    if e_j.dtype != jnp.float32:
        return e_j
    u = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(e_j, jnp.uint32))
    return jax.lax.bitcast_convert_type(u, jnp.float32)


def _add(old: Dict, new: Dict) -> Dict:
    return {k: old[k] + new[k] for k in new}


def blocked(a, e, b, rows: Dict, vocab_offset, blk: Blocks, *, tile: Callable, init: Dict,
            emit: Dict, combine: Callable = _add):
    """One pass over the vocab blocks of ``e`` [V_local, D] for rows ``a`` [M, D].

    Full blocks are read in place with dynamic slices; a shorter tail block (when
    block_v does not divide V_local) is one extra step.

    Args:
      b: [V_local] or None. rows: per-row inputs {name: [M, ...]}, sliced with
        each row tile (rows past M are zero padding). vocab_offset: global id of
        e's row 0 (int or traced).
      tile: ``tile(a_s, rows_s, e_j, b_j, live, col0) -> (row_out, block_out)``
        for one [rows, bv] tile: a_s [rows, D], rows_s the sliced ``rows``,
        e_j [bv, D], b_j [bv] or None, live [1, bv] bool or None (columns
        before the real vocab_size), col0 the block's first local column.
        row_out: {name: [rows, ...]} combined into the carry; block_out:
        {name: [bv, ...]} summed over row tiles and emitted per block.
      init: {name: (trailing shape, dtype, fill)} of the per-row carries.
      emit: {name: trailing shape} of the f32 per-block outputs ``tile`` returns.
      combine: ``combine(carry_rows, row_out) -> updated`` (default: add), for
        a tile's slice of the carry.
    Returns:
      (per-row carries {name: [M, ...]}, per-block outputs {name: [V_local, ...]}).
    """
    m, d = a.shape
    v = e.shape[0]
    bv = blk.block_v
    nb, tail = divmod(v, bv)
    bn = blk.block_n
    mp = _cdiv(m, bn) * bn
    if mp != m:   # padded rows: zero hidden and row inputs; their results are dropped
        a = jnp.pad(a, ((0, mp - m), (0, 0)))
        rows = {k: jnp.pad(x, ((0, mp - m),) + ((0, 0),) * (x.ndim - 1)) for k, x in rows.items()}

    def block(carry, e_j, b_j, col0):
        live = None
        if blk.mask:   # columns past the real vocabulary (padding rows of a sharded table)
            live = (col0 + jnp.arange(e_j.shape[0]) + vocab_offset < blk.vocab_size)[None, :]
        if bn >= mp:
            row_out, block_out = tile(a, rows, e_j, b_j, live, col0)
            carry = {**carry, **combine(carry, row_out)}
            return carry, block_out

        def sub(c, i):
            a_s = jax.lax.dynamic_slice_in_dim(a, i * bn, bn)
            rows_s = {k: jax.lax.dynamic_slice_in_dim(x, i * bn, bn) for k, x in rows.items()}
            row_out, block_out = tile(a_s, rows_s, e_j, b_j, live, col0)
            c = dict(c)
            old = {k: jax.lax.dynamic_slice_in_dim(c[k], i * bn, bn) for k in row_out}
            for k, x in combine(old, row_out).items():
                c[k] = jax.lax.dynamic_update_slice_in_dim(c[k], x, i * bn, 0)
            for k, x in block_out.items():
                c[k] = c[k] + x
            return c, None

        start = dict(carry)
        for k, shape in emit.items():
            start[k] = jnp.zeros((e_j.shape[0],) + tuple(shape), jnp.float32)
        c, _ = jax.lax.scan(sub, start, jnp.arange(mp // bn))
        return {k: c[k] for k in carry}, {k: c[k] for k in emit}

    def step(carry, j):
        col0 = j * bv
        e_j = jax.lax.dynamic_slice_in_dim(e, col0, bv)
        b_j = None if b is None else jax.lax.dynamic_slice_in_dim(b, col0, bv)
        return block(carry, e_j, b_j, col0)

    carry = {k: jnp.full((mp,) + tuple(shape), fill, dtype) for k, (shape, dtype, fill) in init.items()}
    carry, outs = jax.lax.scan(step, carry, jnp.arange(nb))
    outs = {k: o.reshape((nb * bv,) + o.shape[2:]) for k, o in outs.items()}
    if tail:
        carry, last = block(carry, e[nb * bv:], None if b is None else b[nb * bv:], nb * bv)
        outs = {k: jnp.concatenate([outs[k], last[k]]) for k in outs}
    return {k: x[:m] for k, x in carry.items()}, outs


def cast_grads(a, e, b, da, de, db, scale):
    """(dA, dE, db) · scale, each cast to its primal's dtype (db None without a bias)."""
    return (
        (da * scale).astype(a.dtype),
        (de * scale).astype(e.dtype),
        None if b is None else (db * scale).astype(b.dtype),
    )


# ----------------------------------------------------------------- scalar loss, fused
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def sweep_total(a, shard, r, plan, sparse=None):
    """(Σ_i r_i·value_i f32 scalar, aux) of one sweep of rows ``a`` [M, D] over ``shard``'s columns
    (a `recloss.shard.VocabShard`; ``plan`` from the strategy's ``plan(M, shard)``), with the fused
    VJP: the forward is the 'fused' sweep, whose gradients (scaled by r [M] f32) are the residuals,
    and the backward only scales them by the cotangent. value, aux as `SweepOut`.

    ``sparse``: a `Sparse` of the shard's targets (ids local to the shard): ``plan.sparse`` over
    their logits is added to value on each piece the sweep visits (`sparse_part`; a ring visits the
    slices), so its gradient is in the same residuals; aux is then (aux, target logits [M, L])."""
    kw = {"sparse": sparse} if sparse is not None and plan.walks else {}   # a ring: at each visit
    part = None if sparse is None or kw else sparse_part("loss", plan, a, shard.table, shard.bias, None, sparse)
    out = plan.sweeps.loss(a, shard.table, shard.bias, None, shard.offset, plan, None, **kw)
    if part is not None:
        out = part.finish(out)
    return jnp.sum(r * out.value), out.aux


def _total_fwd(a, shard, r, plan, sparse=None):
    """`sweep_total`'s VJP forward: the 'fused' sweep (and sparse term); its gradients are the
    residuals."""
    kw = {"sparse": sparse} if sparse is not None and plan.walks else {}
    part = None if sparse is None or kw else sparse_part("fused", plan, a, shard.table, shard.bias, r, sparse)
    out = plan.sweeps.fused(a, shard.table, shard.bias, r, shard.offset, plan, None,
                            **(part.kwargs if part is not None else kw))
    if part is not None:
        out = part.finish(out)
    return (jnp.sum(r * out.value), out.aux), (out.value, out.da, out.de, out.db, a, shard)


def _total_bwd(plan, res, cts):
    """`sweep_total`'s VJP backward: the residual gradients scaled by the scalar cotangent."""
    bg, da, de, db, a, shard = res
    g = cts[0]
    ga, ge, gb = cast_grads(a, shard.table, shard.bias, da, de, db, g)
    return ga, shard.cotangent(ge, gb), (g * bg).astype(jnp.float32), None


sweep_total.defvjp(_total_fwd, _total_bwd)


# ----------------------------------------------------------------- per-row values, recompute
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def sweep_rows(a, shard, plan):
    """(value [M] f32, aux) of one sweep of rows ``a`` [M, D] over ``shard``'s columns, differentiable
    in value by recomputation: the forward is the 'loss' sweep, the backward the 'grad' sweep with
    r = the cotangent row and the forward's values. value, aux as `SweepOut`."""
    out = plan.sweeps.loss(a, shard.table, shard.bias, None, shard.offset, plan, None)
    return out.value, out.aux


def _rows_fwd(a, shard, plan):
    """`sweep_rows`' VJP forward: the 'loss' sweep; the residuals are its inputs and values."""
    out = plan.sweeps.loss(a, shard.table, shard.bias, None, shard.offset, plan, None)
    return (out.value, out.aux), (a, shard, out.value)


def _rows_bwd(plan, res, cts):
    """`sweep_rows`' VJP backward: the 'grad' sweep with r = the cotangent row."""
    a, shard, bg = res
    _, _, da, de, db = plan.sweeps.grad(a, shard.table, shard.bias, cts[0].astype(jnp.float32),
                                        shard.offset, plan, bg)
    ga, ge, gb = cast_grads(a, shard.table, shard.bias, da, de, db, 1.0)
    return ga, shard.cotangent(ge, gb)


sweep_rows.defvjp(_rows_fwd, _rows_bwd)
