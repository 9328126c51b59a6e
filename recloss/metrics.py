"""Cut metrics: TP/FP/FN/TN from per-row counts of the same pass, no [M, V] array."""

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
    out = {
        "num_targets": psum_batch(jnp.sum(counts["targets"])),
        "invalid_targets": invalid,
        "weight_sum": weight_sum,
    }
    if "predicted" in counts and counts["predicted"] is not None:
        tp = psum_batch(jnp.sum(w * counts["tp"]))
        fp = psum_batch(jnp.sum(w * (counts["predicted"] - counts["tp"])))
        fn = psum_batch(jnp.sum(w * (counts["targets"] - counts["tp"])))
        out.update(tp=tp, fp=fp, fn=fn, tn=weight_sum * float(vocab_size) - tp - fp - fn)
    return out


def precision_recall(metrics, eps: float = 1e-12):
    """Precision and recall at the threshold from `cut_metrics` output."""
    tp, fp, fn = metrics["tp"], metrics["fp"], metrics["fn"]
    return tp / jnp.maximum(tp + fp, eps), tp / jnp.maximum(tp + fn, eps)
