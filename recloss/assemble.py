"""One shard's loss and metrics, reduced to global values: the step every strategy shares.

`assemble` asks the strategy which positions count (`row_weights`) and how
each is scaled (`row_scale`, e.g. ÷ the global weight sum for 'mean'), calls
its `local_loss` for the (batch, vocab) shard, sums the parts over batch
shards with the shard's reductions (`recloss.shard.VocabShard`: collectives
under shard_map, identity on one device) and has the strategy turn its
per-row counts into `metrics`.
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


def assemble(strategy, hidden, targets, w, shard, *, extras=None) -> LossOutput:
    """Loss and metrics of one shard, reduced to global values by the shard's reductions.

    Args: ``strategy`` (a `recloss.Strategy`), hidden [M, D], targets [M, L] global ids, w [M] f32
    weights, ``shard`` (a `recloss.shard.VocabShard`: the table rows, where they sit in the
    vocabulary, the reductions), extras: the strategy's `prepare` arrays (passed to `local_loss`
    only when not None).
    """
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
