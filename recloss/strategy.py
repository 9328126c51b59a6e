"""The strategy protocol: what every implementation of an objective is, and how it is called.

A `Strategy` validates the arrays it is called with, flattens the leading
dims to M positions, checks its platform, and runs `recloss.assemble` (which runs its
`local_loss` on a `recloss.shard.VocabShard`): on one device with the whole table, or as the
body of shard_map with each chip's shard (`recloss.sharding.mapped`). Objectives subclass
it (`recloss.bce.strategies`); `recloss.api` names them. `BlockedStrategy` is
what the blocked ones add: the plan of their vocabulary sweep.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from recloss import registry, sharding, sweep
from recloss.assemble import LossOutput, assemble
from recloss.options import LossOptions
from recloss.shard import VocabShard


# Options every strategy takes; an objective adds its own (`Strategy.options_supported`), a blocked
# strategy its block sizes (`BLOCK_OPTIONS`), a Pallas one ``interpret``.
COMMON_OPTIONS = ("reduction", "pad_id", "compute_metrics", "vocab_size")
BLOCK_OPTIONS = ("block_v", "block_n")


class Strategy:
    """A named implementation of an objective. Call it like the objective's entry point.

    Class attributes: ``name``, ``objective`` ('bce', 'softmax', 'sampled'), ``entry_point``
    (the function users call, e.g. 'recloss.bce_loss'), ``platforms``,
    ``options_supported`` (LossOptions fields it honours; any other field set
    to a non-default value is an error at construction), ``fsdp_gathers`` (the
    `MeshLayout.fsdp_gather` values it runs under; `recloss.check_fsdp_gather` checks a choice).
    `xla_partitions` says whether it needs a layout to run over several devices.

    An objective's base class implements `local_loss` for one (batch, vocab)
    shard, and may override `row_weights`, `row_scale` and `metrics`.
    """

    name: str = ""
    objective: str = ""
    entry_point: str = ""
    platforms: tuple = ("cpu", "gpu", "tpu")
    options_supported: tuple = COMMON_OPTIONS
    fsdp_gathers: tuple = ("once",)

    def __init__(self, options: LossOptions):
        unsupported = [f for f in options.non_default() if f not in self.options_supported]
        if unsupported:
            given = ", ".join(f"{f}={getattr(options, f)!r}" for f in unsupported)
            raise ValueError(f"strategy {self.name!r} ({self.objective or 'custom'} objective) does not "
                             f"take the option(s) {given}; its options are {self.options_supported}")
        self.options = options

    def __repr__(self):
        return f"{type(self).__name__}(name={self.name!r}, options={self.options})"

    def supported_on(self, platform: str) -> bool:
        return platform in self.platforms

    def check_platform(self, platform: str):
        """Raises a ValueError naming the registered strategies that do run on ``platform``."""
        if not self.supported_on(platform):
            raise ValueError(f"strategy {self.name!r} does not run on platform {platform!r}; "
                             f"strategies that do: {registry.strategies_on(platform)}")

    def xla_partitions(self, platform: str) -> bool:
        """Whether XLA can partition this strategy's program over several devices of ``platform`` by
        itself, with no `recloss.MeshLayout`: true of pure-JAX strategies. A Mosaic kernel is one XLA
        cannot split, so a Pallas strategy compiling its kernel needs a layout (its shard_map) there."""
        return True

    def grad_partials(self, layout) -> int:
        """How many partial sums of dA per row the strategy keeps before adding them (a Pallas kernel
        keeps one per TensorCore of a two-core chip); `recloss.choose_fsdp_gather` counts them."""
        return 1

    def partition_specs(self, layout) -> sharding.Specs:
        """PartitionSpecs of the loss's arrays under ``layout`` (a `recloss.MeshLayout`)."""
        return sharding.default_specs(layout)

    # ------------------------------------------------------------ what an objective supplies
    def row_weights(self, targets, w, *, vocab_size: int):
        """The weights [M] f32 of the positions that count (default: ``w``)."""
        return w

    def row_scale(self, w, weight_sum, *, vocab_size: int):
        """Each position's factor in the reduced loss [M] f32: w / Σw for 'mean' (0 when Σw = 0), else w."""
        if self.options.reduction == "mean":
            return w / jnp.where(weight_sum > 0, weight_sum, 1.0)
        return w

    def local_loss(self, hidden, targets, row_scale, shard: VocabShard):
        """One shard's loss and per-row counts, summed over the vocab shards (``shard.vocab_sum``).

        Args: hidden [M, D], targets [M, L] global ids, row_scale [M] f32 (from `row_scale`),
        shard: the `recloss.shard.VocabShard` to compute on (its table rows, their place in the
        vocabulary, the reductions). A strategy whose `prepare` returns arrays also gets them as
        ``extras=`` (this shard's part).
        Returns: (Σ_i row_scale_i·ℓ_i, or row_scale·ℓ [M] for reduction='none'; counts dict of [M] f32).
        """
        raise NotImplementedError

    def metrics(self, counts, w, *, invalid, weight_sum, shard: VocabShard):
        """Global metrics (dict of f32 scalars) from `local_loss`'s counts; w, weight_sum from `row_weights`."""
        raise NotImplementedError

    def prepare(self, targets, *, rows: int, vocab_size: int, **inputs):
        """Arrays a strategy computes once per call, outside any shard_map, from its extra call
        inputs (a sampled strategy's ``key`` and ``log_q``): a dict handed to every shard's
        `local_loss` as ``extras`` (laid out by `extra_specs`), or None (the default: no extra input).

        Args: targets [M, L] global ids, rows: table rows, vocab_size: the real V,
        **inputs: the keywords the strategy was called with besides ``layout``.
        """
        if inputs:
            raise TypeError(f"strategy {self.name!r} ({self.objective or 'custom'} objective) takes no "
                            f"argument(s) {sorted(inputs)}; only the sampled objective's strategies "
                            "(recloss.sampled_loss) take key and log_q")
        return None

    def check_manual(self):
        """Raises when the strategy cannot run on one device's rows inside the caller's shard_map
        (`recloss.MeshLayout` ``manual``); every strategy can unless it overrides this."""

    def extra_specs(self, layout, extras) -> dict:
        """PartitionSpecs of `prepare`'s arrays under ``layout`` (a dict with the same keys)."""
        raise NotImplementedError(f"strategy {self.name!r} prepares extras but declares no extra_specs")

    def __call__(self, hidden, table, targets, weights=None, bias=None, *, layout=None, **inputs) -> LossOutput:
        """The loss of hidden [..., D] against table [V, D] for targets [..., L] (weights [...],
        bias [V] optional), as the objective's entry point documents it; ``layout`` (a
        `recloss.MeshLayout`) runs it under shard_map. The path from here is docs/design.md's
        "The call path, and the shard": `recloss.assemble.assemble`, then `local_loss`."""
        hidden, table, targets, weights, bias = _validate(hidden, table, targets, weights, bias)
        platform = _platform(layout)
        self.check_platform(platform)
        lead = hidden.shape[:-1]
        h2 = hidden.reshape(-1, hidden.shape[-1])
        t2 = targets.reshape(-1, targets.shape[-1])
        w = (jnp.ones(h2.shape[:1], jnp.float32) if weights is None
             else weights.reshape(-1).astype(jnp.float32))
        vocab_size = _vocab_size(self.options, table.shape[0])
        extras = self.prepare(t2, rows=table.shape[0], vocab_size=vocab_size, **inputs)
        args = (h2, table, t2, w, bias, extras)
        if layout is not None and layout.manual:
            self.check_manual()
        if layout is None or layout.manual:   # one device, or inside the caller's shard_map
            axes = () if layout is None else tuple(a for a in layout.batch_axes if layout.axis_size(a) > 1)
            out = assemble(self, *args, shard_of=functools.partial(VocabShard.whole, vocab_size=vocab_size,
                                                                   platform=platform, batch_axes=axes))
        else:   # the same assemble, as the body of shard_map, on the inputs laid out by their specs
            specs = None if extras is None else self.extra_specs(layout, extras)
            mapped, placed = sharding.mapped(self, *args, layout=layout, vocab_size=vocab_size,
                                             extra_specs=specs)
            out = mapped(*placed)
        if self.options.reduction == "none":
            out = LossOutput(out.loss.reshape(lead), out.metrics)
        return out


class BlockedStrategy(Strategy):
    """A strategy whose dense part is one blocked sweep of the vocabulary (`recloss.sweep`).

    ``cut_sweeps`` is its objective's pure-JAX `recloss.sweep.Sweeps`, ``combine`` how two column
    sets' values merge ('sum' or 'lse'). Runs under every `MeshLayout.fsdp_gather`."""

    cut_sweeps = None
    combine: str = "sum"
    sparse_term = None      # the objective's `recloss.sweep.Plan.sparse` (BCE: its correction)
    fsdp_gathers = ("once", "ring", "rows")

    def plan(self, m: int, shard: VocabShard) -> sweep.Plan:
        """The static plan of the sweep for M rows on ``shard``, as the shard runs it
        (`recloss.shard.VocabShard.planned`): block sizes from `recloss.sweep.blocks`
        (``block_v``/``block_n`` win when set) for the table the chip holds."""
        opts = self.options
        blocks = sweep.blocks(m, shard.table.shape[0], block_v=opts.block_v, block_n=opts.block_n,
                              vocab_size=shard.vocab_size, static_offset=shard.static_offset)
        return shard.planned(sweep.Plan(self.cut_sweeps, self.combine, opts, shard.vocab_size,
                                        shard.static_offset, blocks=blocks, sparse=self.sparse_term))


# ------------------------------------------------------------------------- validation
def _as_array(name, x):
    if isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "shape") and hasattr(x, "dtype"):
        return x
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from err


def _validate(hidden, table, targets, weights, bias):
    hidden, table, targets = (_as_array(n, x) for n, x in
                              (("hidden", hidden), ("table", table), ("targets", targets)))
    for name, x in (("hidden", hidden), ("table", table)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating array (float32, bfloat16, float16, or float64 "
                            f"with jax_enable_x64), got dtype {x.dtype}")
    if hidden.ndim < 1:
        raise ValueError(f"hidden must have shape [..., D], got a scalar")
    if table.ndim != 2:
        raise ValueError(f"table must have shape [V, D], got shape {tuple(table.shape)}")
    if table.shape[1] != hidden.shape[-1]:
        raise ValueError(f"table has D={table.shape[1]} (shape {tuple(table.shape)}) but hidden has "
                         f"D={hidden.shape[-1]} (shape {tuple(hidden.shape)}); they must match")
    if table.shape[0] == 0:
        raise ValueError("table must have at least one row, got shape "f"{tuple(table.shape)}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must be an integer array of ids, got dtype {targets.dtype}")
    if targets.ndim != hidden.ndim or targets.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1]) + ('L',)} to match hidden "
                         f"{tuple(hidden.shape)}, got {tuple(targets.shape)}")
    if targets.shape[-1] == 0:
        raise ValueError(f"targets must have L >= 1 ids per position, got shape {tuple(targets.shape)}")
    if weights is not None:
        weights = _as_array("weights", weights)
        if tuple(weights.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(f"weights must have shape {tuple(hidden.shape[:-1])} (hidden's leading "
                             f"dims), got {tuple(weights.shape)}")
        if not (jnp.issubdtype(weights.dtype, jnp.floating) or jnp.issubdtype(weights.dtype, jnp.integer)
                or weights.dtype == jnp.bool_):
            raise TypeError(f"weights must be numeric, got dtype {weights.dtype}")
    if bias is not None:
        bias = _as_array("bias", bias)
        if tuple(bias.shape) != (table.shape[0],):
            raise ValueError(f"bias must have shape ({table.shape[0]},) (one per table row), "
                             f"got {tuple(bias.shape)}")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must be a floating array, got dtype {bias.dtype}")
    return hidden, table, targets, weights, bias


def _vocab_size(opts: LossOptions, rows: int) -> int:
    v = opts.vocab_size or rows
    if v > rows:
        raise ValueError(f"vocab_size={v} exceeds the table's {rows} rows; vocab_size must be <= rows "
                         "(rows past vocab_size are padding)")
    return v


def _platform(layout) -> str:
    """Platform of the layout's mesh, else of the ambient mesh (`jax.set_mesh`), else the default
    backend. A TPU topology compiled ahead of time on a CPU host is 'tpu' either way, so a Pallas
    strategy compiles its Mosaic kernel there, not its interpret-mode stand-in."""
    if layout is not None:
        return layout.platform
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None:
        return device.platform
    return jax.default_backend()
