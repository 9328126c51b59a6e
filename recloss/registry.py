"""Strategies by name, input validation, and the shared assembly of loss and metrics."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from recloss import cut, metrics as metrics_lib, reference, targets as targets_lib
from recloss.options import LossOptions


class LossOutput(NamedTuple):
    """``loss``: float32 scalar ('mean'/'sum') or [...] ('none').
    ``metrics``: dict of float32 scalars (see `recloss.metrics.cut_metrics`)."""
    loss: Any
    metrics: Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Reducer:
    """Sums a shard's partial results: over batch shards and over vocab shards.
    Identity outside shard_map."""
    batch: Callable = lambda x: x
    vocab: Callable = lambda x: x


class Strategy:
    """A named implementation of the loss. Call it like `recloss.bce_loss`.

    Subclasses implement `local_loss` for one (batch, vocab) shard.
    """

    name: str = ""
    platforms: tuple = ("cpu", "gpu", "tpu")

    def __init__(self, options: LossOptions):
        self.options = options

    def __repr__(self):
        return f"{type(self).__name__}(name={self.name!r}, options={self.options})"

    def supported_on(self, platform: str) -> bool:
        return platform in self.platforms

    def check_platform(self, platform: str):
        if not self.supported_on(platform):
            others = [n for n in available_strategies() if get_strategy(n).supported_on(platform)]
            raise ValueError(f"strategy {self.name!r} does not run on platform {platform!r}; "
                             f"strategies that do: {others}")

    def partition_specs(self, layout):
        from recloss import sharding
        return sharding.default_specs(layout, self.options)

    def local_loss(self, hidden, table, bias, targets, row_scale, *, vocab_offset, vocab_size: int,
                   scalar: bool, platform: str):
        """One shard's loss part and per-row counts.

        Args: hidden [M, D], table [V_local, D], bias [V_local] or None, targets
        [M, L] global ids, row_scale [M] f32 (weight·vocab scale / normaliser),
        vocab_offset: global id of table row 0 (int or traced scalar),
        platform: where the computation will run ('cpu', 'gpu', 'tpu').
        Returns: (Σ_i row_scale_i·ℓ_i if scalar else row_scale·ℓ [M], counts dict of [M] f32).
        """
        raise NotImplementedError

    def __call__(self, hidden, table, targets, weights=None, bias=None, *, layout=None) -> LossOutput:
        hidden, table, targets, weights, bias = _validate(hidden, table, targets, weights, bias)
        platform = _platform(layout)
        self.check_platform(platform)
        lead = hidden.shape[:-1]
        h2 = hidden.reshape(-1, hidden.shape[-1])
        t2 = targets.reshape(-1, targets.shape[-1])
        w = (jnp.ones(h2.shape[:1], jnp.float32) if weights is None
             else weights.reshape(-1).astype(jnp.float32))
        vocab_size = _vocab_size(self.options, table.shape[0], layout)
        if layout is not None:
            from recloss import sharding
            out = sharding.run(self, h2, table, bias, t2, w, layout=layout, vocab_size=vocab_size)
        else:
            out = assemble(self, h2, table, bias, t2, w, vocab_offset=0, vocab_size=vocab_size,
                           platform=platform)
        if self.options.reduction == "none":
            out = LossOutput(out.loss.reshape(lead), out.metrics)
        return out


def assemble(strategy: Strategy, hidden, table, bias, targets, w, *, vocab_offset, vocab_size: int,
             platform: str, reducer: Reducer = Reducer()) -> LossOutput:
    """Loss and metrics of one shard, reduced to global values by ``reducer``."""
    opts = strategy.options
    weight_sum = reducer.batch(jnp.sum(w))
    vscale = 1.0 / vocab_size if opts.vocab_reduction == "mean" else 1.0
    row_scale = w * vscale
    if opts.reduction == "mean":
        row_scale = row_scale / jnp.where(weight_sum > 0, weight_sum, 1.0)
    scalar = opts.reduction != "none"
    loss, counts = strategy.local_loss(hidden, table, bias, targets, row_scale,
                                       vocab_offset=vocab_offset, vocab_size=vocab_size, scalar=scalar,
                                       platform=platform)
    loss = reducer.vocab(loss)
    if scalar:
        loss = reducer.batch(loss)
    counts = {k: reducer.vocab(v) for k, v in counts.items() if v is not None}
    invalid = reducer.batch(targets_lib.invalid_count(targets, opts.pad_id, vocab_size))
    mets = metrics_lib.cut_metrics(counts, jax.lax.stop_gradient(w), vocab_size=vocab_size,
                                   invalid=invalid, weight_sum=jax.lax.stop_gradient(weight_sum),
                                   psum_batch=reducer.batch)
    return LossOutput(loss, mets)


# ------------------------------------------------------------------------- strategies
class DenseBCE(Strategy):
    """Materialises logits [M, V] and a multi-hot label matrix; autodiff gradients.

    The baseline a user writes today; memory O(M·V)."""

    name = "dense_bce"

    def local_loss(self, hidden, table, bias, targets, row_scale, *, vocab_offset, vocab_size, scalar,
                   platform):
        rows, counts = reference.dense_bce(hidden, table, bias, targets, row_scale, self.options,
                                           vocab_offset=vocab_offset, vocab_size=vocab_size)
        if not self.options.compute_metrics:
            counts = {"targets": counts["targets"]}
        return (jnp.sum(rows) if scalar else rows), counts


class CutBCE(Strategy):
    """Pure-JAX blocked pass (lax.scan over vocab blocks) with a fused single-pass VJP.

    Memory O(block_n·block_v + V·D); 6·M·V·D flops for loss+grad of a scalar loss."""

    name = "cutbce"

    def background(self, hidden, table, bias, row_scale, vocab_offset, *, vocab_size, scalar, platform):
        """(Σ r·bg or bg rows [M], predicted counts [M] or None): the dense part of the loss.

        Subclasses (other kernels) override this; the sparse correction is shared."""
        static = vocab_offset if isinstance(vocab_offset, int) else None
        p = cut.plan(hidden.shape[0], table.shape[0], self.options, vocab_size=vocab_size,
                     static_offset=static)
        if scalar:
            return cut.background_total(hidden, table, bias, row_scale, vocab_offset, p)
        return cut.background_rows(hidden, table, bias, vocab_offset, p)

    def local_loss(self, hidden, table, bias, targets, row_scale, *, vocab_offset, vocab_size, scalar,
                   platform):
        opts = self.options
        ids, valid = targets_lib.local_targets(targets, opts.pad_id, vocab_offset, table.shape[0],
                                               vocab_size)
        corr, target_logits = targets_lib.correction(hidden, table, bias, ids, valid, opts)
        bg, predicted = self.background(hidden, table, bias, row_scale, vocab_offset,
                                        vocab_size=vocab_size, scalar=scalar, platform=platform)
        loss = bg + jnp.sum(row_scale * corr) if scalar else row_scale * (bg + corr)
        tp, n = targets_lib.target_counts(target_logits, valid, opts.threshold)
        counts = {"targets": n}
        if opts.compute_metrics:
            counts.update(predicted=predicted, tp=tp)
        return loss, counts


_REGISTRY: Dict[str, Callable[[LossOptions], Strategy]] = {}


def register_strategy(name: str, factory: Callable[[LossOptions], Strategy]):
    """Registers ``factory(options) -> Strategy`` under ``name`` (replacing any previous one)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"strategy name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory for strategy {name!r} must be callable, got {factory!r}")
    _REGISTRY[name] = factory


def available_strategies() -> tuple:
    """Names of the registered strategies, sorted."""
    return tuple(sorted(_REGISTRY))


def get_strategy(name: str, options: Optional[LossOptions] = None, **kwargs) -> Strategy:
    """The strategy ``name`` with ``options`` (a LossOptions) and/or option keywords."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown strategy {name!r}: available are {available_strategies()}{hint}")
    unknown = [k for k in kwargs if k not in LossOptions.field_names()]
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(
            k, LossOptions.field_names(), n=1)) else "") for k in unknown]
        raise TypeError(f"unknown loss option(s) {', '.join(hints)}; valid options: "
                        f"{LossOptions.field_names()}")
    if options is not None and not isinstance(options, LossOptions):
        raise TypeError(f"options must be a recloss.LossOptions, got {type(options).__name__}")
    options = (options or LossOptions()).replace(**kwargs) if kwargs else (options or LossOptions())
    return _REGISTRY[name](options)


def bce_loss(hidden, table, targets, weights=None, bias=None, *, strategy: str = "cutbce",
             layout=None, **options) -> LossOutput:
    """Full-vocabulary multi-label binary cross-entropy from hidden states.

    Logits are ``x[..., v] = hidden[...] · table[v] + bias[v]`` (never built
    whole by the blocked strategies). Per position with target set T (unique
    valid ids of ``targets``), label y_v = [v ∈ T] and soft label
    y' = y(1−ε) + ε/2:

        ℓ = Σ_v [ y'_v·P(x_v) + (1 − y'_v)·Q(x_v) ]      (÷ V if vocab_reduction='mean')

    with P, Q as in `LossOptions`; defaults give ℓ = mean_v BCE-with-logits,
    Keras ``binary_crossentropy(from_logits=True)``.

    Args:
      hidden: [..., D] float32/bfloat16. table: [V, D]. targets: [..., L] int ids
        (``pad_id`` = padding; ids outside [0, V) are ignored and counted in
        ``metrics['invalid_targets']``). weights: [...] float or None (= 1).
        bias: [V] or None.
      strategy: a registered name, see `available_strategies()`.
      layout: a `recloss.MeshLayout` to run sharded under shard_map, or None.
      **options: `LossOptions` fields.
    Returns:
      LossOutput(loss, metrics): loss is Σ w·ℓ / Σ w ('mean'; 0 when Σ w = 0),
      Σ w·ℓ ('sum') or w·ℓ with hidden's leading shape ('none'), float32.
      Gradients come back in the input dtypes.
    """
    return get_strategy(strategy, **options)(hidden, table, targets, weights, bias, layout=layout)


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
            raise TypeError(f"{name} must be a floating array (float32 or bfloat16), got dtype {x.dtype}")
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


def _vocab_size(opts: LossOptions, rows: int, layout) -> int:
    v = opts.vocab_size or rows
    if v > rows:
        raise ValueError(f"vocab_size={v} exceeds the table's {rows} rows; vocab_size must be <= rows "
                         "(rows past vocab_size are padding)")
    return v


def _platform(layout) -> str:
    """Platform of the layout's mesh (TPU when compiling for a TPU topology), else the default backend."""
    if layout is not None:
        return layout.platform
    return jax.default_backend()


register_strategy("dense_bce", DenseBCE)
register_strategy("cutbce", CutBCE)
