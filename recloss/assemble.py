"""One shard's loss and metrics, reduced to global values: the step every strategy shares.

`assemble` is what `recloss.Strategy.__call__` runs: directly on one device, or as the body of
`jax.shard_map` (`recloss.sharding.mapped`) on each chip's arrays. It builds the shard (the
`recloss.shard.VocabShard` of the arrays' table rows: collectives under shard_map, identity
reductions on one device), asks the strategy which positions count (`row_weights`) and how each
is scaled (`row_scale`, e.g. ÷ the global weight sum for 'mean'), calls its `local_loss` on the
shard, sums the parts over the batch shards and has the strategy turn its per-row counts into
`metrics`.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

import jax
import jax.numpy as jnp

from recloss import targets as targets_lib


class LossOutput(NamedTuple):
    """``loss``: float32 scalar ('mean'/'sum') or [...] ('none').
    ``metrics``: dict of float32 scalars (the objective's: `recloss.metrics`)."""
    loss: Any
    metrics: Dict[str, Any]


def assemble(strategy, hidden, table, targets, w, bias, extras, *, shard_of) -> LossOutput:
    """Loss and metrics of one shard, reduced to global values by the shard's reductions.

    Args: ``strategy`` (a `recloss.Strategy`), hidden [M, D], table [V_rows, D]: the rows this
    device holds, targets [M, L] global ids, w [M] f32 weights, bias [V_rows] or None, extras: the
    strategy's `prepare` arrays (passed to `local_loss` only when not None; all positional, as
    shard_map passes them). ``shard_of(table, bias)`` builds the `recloss.shard.VocabShard` (the
    table rows, where they sit in the vocabulary, the reductions).
    """
    shard = shard_of(table, bias)
    opts = strategy.options
    vocab_size = shard.vocab_size
    w = strategy.row_weights(targets, w, vocab_size=vocab_size)
    weight_sum = shard.batch_sum(jnp.sum(w))
    row_scale = strategy.row_scale(w, weight_sum, vocab_size=vocab_size)
    loss, counts = strategy.local_loss(hidden, targets, row_scale, shard,
                                       **({} if extras is None else {"extras": extras}))
    if opts.reduction != "none":
        loss = shard.batch_sum(loss)
    invalid = shard.batch_sum(targets_lib.invalid_count(targets, opts.pad_id, vocab_size))
    mets = strategy.metrics(counts, jax.lax.stop_gradient(w), invalid=invalid,
                            weight_sum=jax.lax.stop_gradient(weight_sum), shard=shard)
    return LossOutput(loss, mets)
