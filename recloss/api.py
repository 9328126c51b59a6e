"""The entry points (`bce_loss`, `softmax_loss`, `sampled_loss`) and the explicit table of built-in strategies.

    objective   strategies                              entry point
    bce         dense_bce, cutbce, cutbce_pallas        recloss.bce_loss
    softmax     dense_ce, cutce, cutce_pallas           recloss.softmax_loss
    sampled     sampled_softmax, gbce                   recloss.sampled_loss (needs a PRNG key)

The table below is the one place a built-in strategy is named; importing this
module registers it in `recloss.registry`, where `register_strategy` adds a
user's own.
"""

from __future__ import annotations

from recloss import registry
from recloss.assemble import LossOutput
from recloss.bce.strategies import CutBCE, CutBCEPallas, DenseBCE
from recloss.registry import available_strategies, get_strategy
from recloss.sampled.strategies import GBCE, SampledSoftmax
from recloss.softmax.strategies import CutCE, CutCEPallas, DenseCE

BUILTIN_STRATEGIES = {
    "dense_bce": DenseBCE,
    "cutbce": CutBCE,
    "cutbce_pallas": CutBCEPallas,
    "dense_ce": DenseCE,
    "cutce": CutCE,
    "cutce_pallas": CutCEPallas,
    "sampled_softmax": SampledSoftmax,
    "gbce": GBCE,
}
for _name, _factory in BUILTIN_STRATEGIES.items():
    registry.register_strategy(_name, _factory)


def bce_loss(hidden, table, targets, weights=None, bias=None, *, strategy: str = "cutbce",
             layout=None, **options) -> LossOutput:
    """Full-vocabulary multi-label binary cross-entropy from hidden states.

    Logits are ``x[..., v] = hidden[...] · table[v] + bias[v]`` (never built
    whole by the blocked strategies; c·tanh(x/c) with ``logit_soft_cap`` c, also for the
    metrics threshold). Per position with target set T (unique
    valid ids of ``targets``), label y_v = [v ∈ T] and soft label
    y' = y(1−ε) + ε/2:

        ℓ = Σ_v [ y'_v·P(x_v) + (1 − y'_v)·Q(x_v) ]      (÷ V if vocab_reduction='mean')

    with P, Q as in `LossOptions`; defaults give ℓ = mean_v BCE-with-logits,
    Keras ``binary_crossentropy(from_logits=True)``.

    Args:
      hidden: [..., D] float32, bfloat16 or float16 (float64 with ``jax_enable_x64``).
        table: [V, D], a floating dtype too. targets: [..., L] int ids (int32, or int64 with x64)
        (``pad_id`` = padding; ids outside [0, V) are ignored and counted in
        ``metrics['invalid_targets']``). weights: [...] float or None (= 1).
        bias: [V] or None.
      strategy: a registered name, see `available_strategies()`.
      layout: a `recloss.MeshLayout` to run sharded under shard_map, or None. Its mesh may have
        Explicit or Auto axes; inputs placed by the strategy's ``partition_specs`` or not are
        laid out by it (`recloss.sharding.place_all`).
      **options: `LossOptions` fields; for 'cutbce_pallas' also ``chip=`` and ``interpret_params=``
        (`recloss.pallas.strategy.PallasStrategy`).
    Returns:
      LossOutput(loss, metrics): loss is Σ w·ℓ / Σ w ('mean'; 0 when Σ w = 0),
      Σ w·ℓ ('sum') or w·ℓ with hidden's leading shape ('none'), float32 whatever the input
      dtypes (float32 accumulation inside, also for float64 inputs under ``jax_enable_x64``).
      Gradients come back in the input dtypes.
    """
    return _for("bce", strategy, options)(hidden, table, targets, weights, bias, layout=layout)


def softmax_loss(hidden, table, targets, weights=None, bias=None, *, strategy: str = "cutce",
                 layout=None, **options) -> LossOutput:
    """Full-catalogue softmax cross-entropy with multi-positive targets, from hidden states.

    Logits are ``x[..., v] = (hidden[...] · table[v] + bias[v]) / τ`` (τ =
    ``temperature``; never built whole by the blocked strategies; the numerator is first
    soft-capped to c·tanh(·/c) with ``logit_soft_cap`` c). Per position
    with target set T (unique valid ids of ``targets``, k = |T|):

        ℓ = Z − Σ_v q_v·x_v + λ·Z²,   Z = logsumexp_v x_v,   q_v = (1 − ε)·[v ∈ T]/k + ε/V

    (ε = ``label_smoothing``, λ = ``z_loss``, V the real vocabulary size): the
    mean over the targets of their cross-entropies. With L = 1 and no options it
    is ``optax.softmax_cross_entropy_with_integer_labels``. A position with no
    valid target contributes 0 and is left out of the mean's denominator.

    Args:
      hidden: [..., D] float32, bfloat16 or float16 (float64 with ``jax_enable_x64``).
        table: [V, D], a floating dtype too. targets: [..., L] int ids (int32, or int64 with x64)
        (``pad_id`` = padding; other ids outside [0, V) are ignored and counted in
        ``metrics['invalid_targets']``). weights: [...] float or None (= 1).
        bias: [V] or None.
      strategy: 'cutce' (blocked, any backend), 'cutce_pallas' (the Mosaic-TPU kernels; CPU
        only in interpret mode), 'dense_ce' (materialises [.., V]).
      layout: a `recloss.MeshLayout` to run sharded under shard_map, or None. Its mesh may have
        Explicit or Auto axes; inputs placed by the strategy's ``partition_specs`` or not are
        laid out by it (`recloss.sharding.place_all`).
      **options: `LossOptions` fields: reduction, label_smoothing, z_loss,
        temperature, logit_soft_cap (not with label_smoothing), pad_id, vocab_size, block_v, block_n
        (blocked strategies), interpret
        (cutce_pallas), compute_metrics; for 'cutce_pallas' also ``chip=`` and ``interpret_params=``.
    Returns:
      LossOutput(loss, metrics): loss is Σ w·ℓ / Σ w over positions with a target
      ('mean'; 0 when that sum is 0), Σ w·ℓ ('sum') or w·ℓ with hidden's leading
      shape ('none'), float32 whatever the input dtypes (float32 accumulation inside,
      also for float64 inputs under ``jax_enable_x64``). metrics (float32): num_targets,
      invalid_targets, weight_sum (of positions with a target) and, with compute_metrics,
      top1 (weighted count of positions whose argmax is a target), mean_lse (weighted
      mean Z) and, with z_loss λ > 0, z_loss (Σ w·λ·Z², the z-loss part of the 'sum'-reduced
      loss). Gradients come back in the input dtypes.
    """
    return _for("softmax", strategy, options)(hidden, table, targets, weights, bias, layout=layout)


def sampled_loss(hidden, table, targets, weights=None, bias=None, *, key=None, strategy: str = "sampled_softmax",
                 log_q=None, layout=None, **options) -> LossOutput:
    """Sampled losses over K negatives drawn per call: the comparators of the exact objectives.

    Logits are ``x[..., v] = (hidden[...] · table[v] + bias[v]) / τ`` for the targets and the
    candidates only. K = ``num_negatives`` ids are drawn once per call from q (``log_q``; None =
    uniform over the real V), i.i.d. *with replacement*, and shared by every position. Per
    position with target set T (unique valid ids, k = |T|):

      sampled_softmax: s_v = x_v − log(K·q_v) for the targets and the negatives (TensorFlow's
        ``sampled_softmax_loss`` with ``subtract_log_q=True``); with ``in_batch_negatives`` the
        batch's B valid targets are negatives too, corrected by −log(B·q_v);

          ℓ = (1/k)·Σ_{t∈T} [ log(exp(s_t) + Σ_{n live} exp(s_n)) − s_t ]

      gbce (gSASRec): ℓ = β·Σ_{t∈T} softplus(−x_t) + Σ_{n live} softplus(x_n),
          β = α·(t·(1 − 1/α) + 1/α),  α = min(1, K/(V − 1)),  t = ``gbce_t``

    "live": a negative equal to one of the position's targets is left out when
    ``remove_accidental_hits`` (default); in-batch negatives never include the position's own
    targets. A position with no valid target contributes 0 and leaves the mean's denominator.
    Cost O(M·(K + L)·D) (plus M·B·D for in-batch negatives); nothing of size M·V.

    Args:
      hidden [..., D], table [V, D], targets [..., L], weights [...], bias [V]: as `softmax_loss`.
      key: a `jax.random` key (required): the same key draws the same negatives on every shard
        and under jit (drawn inside each vocab shard from the proposal's parts; two meshes may
        differ where a uniform lands within float rounding of a CDF step).
      strategy: 'sampled_softmax' or 'gbce'.
      log_q: [V] (or [table rows]) float log proposal probabilities, normalised here; −inf = never
        drawn; NaN/+inf are an error (checked when not traced). `log_q_from_counts` builds it.
        No gradient flows into it. None (uniform) needs no array.
      layout: a `recloss.MeshLayout` to run sharded, or None (as `softmax_loss`; ``log_q`` is
        split over its vocab axis like the table's rows, 4 bytes a row a chip: pass it as
        [table rows], placed so, at large V).
      **options: `LossOptions` fields: num_negatives, remove_accidental_hits, temperature,
        reduction, pad_id, vocab_size, compute_metrics; in_batch_negatives (sampled_softmax),
        gbce_t (gbce).
    Returns:
      LossOutput(loss, metrics) as `softmax_loss` (float32 whatever the input dtypes); metrics:
      num_targets, invalid_targets, weight_sum and, with compute_metrics, top1 (weighted count of positions whose best target
      outscores every live negative, logits x before the logQ correction).
    """
    return _for("sampled", strategy, options)(hidden, table, targets, weights, bias, layout=layout, key=key,
                                              log_q=log_q)


def _for(objective: str, name: str, options):
    """The strategy ``name`` for ``objective``'s entry point; a strategy of another objective is an error."""
    s = get_strategy(name, **options)
    if s.objective and s.objective != objective:
        mine = list(available_strategies(objective))
        raise ValueError(f"strategy {name!r} computes the {s.objective!r} objective: call "
                         f"{s.entry_point}(..., strategy={name!r}); strategies of this entry point: {mine}")
    return s
