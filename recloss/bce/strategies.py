"""The BCE strategies: `dense_bce` (baseline), `cutbce` (blocked pure JAX), `cutbce_pallas` (Mosaic TPU).

The blocked strategies share the sparse target correction and the metrics;
they differ only in the plan their dense background is swept with
(`recloss.bce.cut.SWEEPS` or `recloss.bce.kernel.SWEEPS`), both run over the shard
(`recloss.shard.VocabShard`) by the custom-VJP shells of `recloss.sweep`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from recloss import metrics as metrics_lib, softcap, sweep
from recloss.bce import bernoulli, cut, dense, kernel
from recloss.pallas.strategy import PallasStrategy
from recloss.strategy import BLOCK_OPTIONS, COMMON_OPTIONS, BlockedStrategy, Strategy


BCE_OPTIONS = ("label_smoothing", "vocab_reduction", "pos_weight", "focal_gamma", "focal_alpha", "threshold",
               "logit_soft_cap")


class BCEStrategy(Strategy):
    """What the BCE strategies share: the options, the row scale (÷ V for vocab_reduction='mean')
    and the cut metrics (TP/FP/FN/TN at ``threshold``)."""

    objective = "bce"
    entry_point = "recloss.bce_loss"
    options_supported = COMMON_OPTIONS + BCE_OPTIONS

    def row_scale(self, w, weight_sum, *, vocab_size):
        vscale = 1.0 / vocab_size if self.options.vocab_reduction == "mean" else 1.0
        return super().row_scale(w * vscale, weight_sum, vocab_size=vocab_size)

    def metrics(self, counts, w, *, invalid, weight_sum, shard):
        return metrics_lib.cut_metrics(counts, w, vocab_size=shard.vocab_size, invalid=invalid,
                                       weight_sum=weight_sum, psum_batch=shard.batch_sum)


class DenseBCE(BCEStrategy):
    """Materialises logits [M, V] and a multi-hot label matrix; autodiff gradients.

    The baseline a user writes today; memory O(M·V)."""

    name = "dense_bce"

    def local_loss(self, hidden, targets, row_scale, shard):
        rows, counts = dense.dense_bce(hidden, shard.table, shard.bias, targets, row_scale, self.options,
                                       vocab_offset=shard.offset, vocab_size=shard.vocab_size)
        if not self.options.compute_metrics:
            counts = {"targets": counts["targets"]}
        return _vocab_sum(jnp.sum(rows) if self.options.reduction != "none" else rows, counts, shard)


def _vocab_sum(loss, counts, shard):
    return shard.vocab_sum(loss), {k: shard.vocab_sum(v) for k, v in counts.items() if v is not None}


class CutBCE(BlockedStrategy, BCEStrategy):
    """Pure-JAX blocked pass (lax.scan over vocab blocks) with a fused single-pass VJP.

    Memory O(block_n·block_v + V·D); 6·M·V·D flops for loss+grad of a scalar loss."""

    name = "cutbce"
    options_supported = BCEStrategy.options_supported + BLOCK_OPTIONS
    cut_sweeps = cut.SWEEPS
    combine = "sum"
    sparse_term = staticmethod(bernoulli.correction_terms)

    def local_loss(self, hidden, targets, row_scale, shard):
        """The dense background as one sweep over the shard (`recloss.sweep.sweep_total`: fused VJP,
        or `sweep_rows` for reduction='none') plus the sparse correction of the shard's own targets
        (`recloss.bce.bernoulli.correction`), and the per-row counts; summed over the vocab shards.

        A scalar loss's correction is the sweep's sparse term (`recloss.sweep.sparse_part`) on a ring and
        for a 16-bit table. On a ring it is computed at each slice's visit, so the table travels once per
        step, not three times (the sweep, the target gather and its VJP); with a 16-bit table its
        gradient joins the background's while that is still float32, so the table's gradient is rounded
        once. A float32 table's gathered shard takes the correction through its own gather, whose
        scatters XLA applies to the background's dE in place (docs/measurements.md "Measured choices").
        reduction='none' always does."""
        opts = self.options
        scalar = opts.reduction != "none"
        ids, valid = shard.local_targets(targets, opts.pad_id)
        plan = self.plan(hidden.shape[0], shard)
        if scalar and (plan.walks or jnp.dtype(shard.table.dtype).itemsize < 4):
            loss, (predicted, x) = sweep.sweep_total(hidden, shard, row_scale, plan, sweep.Sparse(ids, valid))
        else:
            x = softcap.soft_cap(shard.gather_logits(hidden, ids, valid), opts.logit_soft_cap)
            corr = bernoulli.correction(x, valid, opts)
            if scalar:
                bg, predicted = sweep.sweep_total(hidden, shard, row_scale, plan)
                loss = bg + jnp.sum(row_scale * corr)
            else:
                bg, predicted = sweep.sweep_rows(hidden, shard, plan)
                loss = row_scale * (bg + corr)
        tp, n = bernoulli.target_counts(jax.lax.stop_gradient(x), valid, opts.threshold)
        counts = {"targets": n}
        if opts.compute_metrics:
            counts.update(predicted=predicted, tp=tp)
        return _vocab_sum(loss, counts, shard)


class CutBCEPallas(PallasStrategy, CutBCE):
    """CutBCE with the background as one fused Pallas (Mosaic-TPU) sweep.

    Same sparse target correction and metrics as `CutBCE`. Memory O(bn·D + bv·D)
    VMEM per core and O(V·D) HBM for dE; 6·M·V·D flops for loss+grad of a scalar
    loss (loss-only: 2·M·V·D; reduction='none' backward recomputes with 6·M·V·D).
    Runs on TPU; on CPU only in Pallas interpret mode (for tests); on GPU use 'cutbce'.

    Args as `recloss.pallas.strategy.PallasStrategy`; ``block_n``/``block_v``
    map to the kernel's row tile and vocab block.
    """

    name = "cutbce_pallas"
    options_supported = CutBCE.options_supported + ("interpret",)
    fallback = "cutbce"
    fallback_note = "blocked pure JAX, same math and fused gradient"
    kernel_sweeps = kernel.SWEEPS
