"""One shard's loss and metrics, reduced to global values: the step every strategy shares.

`assemble` turns position weights into row scales (weight × 1/V for
vocab_reduction='mean', ÷ the global weight sum for reduction='mean'), calls
the strategy's `local_loss` for its (batch, vocab) shard and sums the parts
with a `Reducer` (psums under shard_map, identity on one device).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, NamedTuple

import jax
import jax.numpy as jnp

from recloss import metrics as metrics_lib, targets as targets_lib


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


def assemble(strategy, hidden, table, bias, targets, w, *, vocab_offset, vocab_size: int,
             platform: str, reducer: Reducer = Reducer()) -> LossOutput:
    """Loss and metrics of one shard, reduced to global values by ``reducer``.

    Args: ``strategy`` (a `recloss.Strategy`), hidden [M, D], table [V_local, D],
    bias [V_local] or None, targets [M, L] global ids, w [M] f32 weights,
    vocab_offset: global id of table row 0, vocab_size: the real V.
    """
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
