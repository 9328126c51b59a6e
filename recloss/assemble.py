"""One shard's loss and metrics, reduced to global values: the step every strategy shares.

`assemble` asks the strategy which positions count (`row_weights`) and how
each is scaled (`row_scale`, e.g. ÷ the global weight sum for 'mean'), calls
its `local_loss` for the (batch, vocab) shard, sums the parts over batch
shards with a `Reducer` (collectives under shard_map, identity on one device)
and has the strategy turn its per-row counts into `metrics`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, NamedTuple

import jax
import jax.numpy as jnp

from recloss import targets as targets_lib


class LossOutput(NamedTuple):
    """``loss``: float32 scalar ('mean'/'sum') or [...] ('none').
    ``metrics``: dict of float32 scalars (the objective's: `recloss.metrics`)."""
    loss: Any
    metrics: Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Reducer:
    """Combines a shard's partial results: sums over batch shards and over vocab
    shards, and the maximum over vocab shards. Identity outside shard_map."""
    batch: Callable = lambda x: x
    vocab: Callable = lambda x: x
    vocab_max: Callable = lambda x: x


def assemble(strategy, hidden, table, bias, targets, w, *, vocab_offset, vocab_size: int,
             platform: str, reducer: Reducer = Reducer(), extras=None) -> LossOutput:
    """Loss and metrics of one shard, reduced to global values by ``reducer``.

    Args: ``strategy`` (a `recloss.Strategy`), hidden [M, D], table [V_local, D],
    bias [V_local] or None, targets [M, L] global ids, w [M] f32 weights,
    vocab_offset: global id of table row 0, vocab_size: the real V,
    extras: the strategy's `prepare` arrays (passed to `local_loss` only when not None).
    """
    opts = strategy.options
    w = strategy.row_weights(targets, w, vocab_size=vocab_size)
    weight_sum = reducer.batch(jnp.sum(w))
    row_scale = strategy.row_scale(w, weight_sum, vocab_size=vocab_size)
    scalar = opts.reduction != "none"
    loss, counts = strategy.local_loss(hidden, table, bias, targets, row_scale,
                                       vocab_offset=vocab_offset, vocab_size=vocab_size, scalar=scalar,
                                       platform=platform, reducer=reducer,
                                       **({} if extras is None else {"extras": extras}))
    if scalar:
        loss = reducer.batch(loss)
    invalid = reducer.batch(targets_lib.invalid_count(targets, opts.pad_id, vocab_size))
    mets = strategy.metrics(counts, jax.lax.stop_gradient(w), vocab_size=vocab_size, invalid=invalid,
                            weight_sum=jax.lax.stop_gradient(weight_sum), reducer=reducer)
    return LossOutput(loss, mets)
