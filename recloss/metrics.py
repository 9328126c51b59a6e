"""Training metrics from per-row counts of the same pass, no [M, V] array: BCE's cut metrics
(TP/FP/FN/TN at a threshold) and the softmax and sampled objectives' top-1 counts."""

from __future__ import annotations

import jax.numpy as jnp


def cut_metrics(counts, w, *, vocab_size: int, invalid, weight_sum, psum_batch=lambda x: x):
    """Weighted confusion counts over every (position, item) pair.

    Args:
      counts: per-row dict with 'targets' (|T_i|), and when metrics are on
        'predicted' (#{v: x_iv > threshold}) and 'tp' (#{t ∈ T_i: x_it > threshold}), [M] f32,
        already summed over vocab shards.
      w: [M] position weights. vocab_size: real V. invalid: scalar count of
        invalid ids. weight_sum: Σ w over all positions (global).
      psum_batch: sums a local scalar over batch shards.
    Returns:
      dict of float32 scalars: tp, fp, fn, tn = Σ_i w_i·count_i (tn = Σw·V − tp − fp − fn),
      num_targets (unweighted Σ_i |T_i|), invalid_targets, weight_sum.
    """
    w = w.astype(jnp.float32)
    out = _target_metrics(counts, invalid, weight_sum, psum_batch)
    if "predicted" in counts and counts["predicted"] is not None:
        tp = psum_batch(jnp.sum(w * counts["tp"]))
        fp = psum_batch(jnp.sum(w * (counts["predicted"] - counts["tp"])))
        fn = psum_batch(jnp.sum(w * (counts["targets"] - counts["tp"])))
        out.update(tp=tp, fp=fp, fn=fn, tn=weight_sum * float(vocab_size) - tp - fp - fn)
    return out


def top1_metrics(counts, w, *, invalid, weight_sum, psum_batch=lambda x: x):
    """num_targets (Σ_i |T_i|), invalid_targets, weight_sum and, when ``counts`` has 'top1' (a [M]
    0/1 row flag), top1 = Σ_i w_i·top1_i; ``psum_batch`` sums a local scalar over batch shards."""
    out = _target_metrics(counts, invalid, weight_sum, psum_batch)
    if "top1" in counts:
        out["top1"] = psum_batch(jnp.sum(w * counts["top1"]))
    return out


def _target_metrics(counts, invalid, weight_sum, psum_batch):
    """What every objective reports: num_targets (Σ_i |T_i|), invalid_targets, weight_sum."""
    return {"num_targets": psum_batch(jnp.sum(counts["targets"])), "invalid_targets": invalid,
            "weight_sum": weight_sum}
