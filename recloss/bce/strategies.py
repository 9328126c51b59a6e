"""The BCE strategies: `dense_bce` (baseline), `cutbce` (blocked pure JAX), `cutbce_pallas` (Mosaic TPU).

The blocked strategies share the sparse target correction and the metrics;
they differ only in the plan their dense background is swept with
(`recloss.bce.cut.Plan` or `recloss.bce.kernel.Plan`), both run through the
custom-VJP shells of `recloss.sweep`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from recloss import metrics as metrics_lib, ring as ring_lib, sweep, targets as targets_lib
from recloss.bce import bernoulli, cut, dense, kernel
from recloss.pallas.strategy import PallasStrategy
from recloss.strategy import COMMON_OPTIONS, Strategy


BCE_OPTIONS = ("vocab_reduction", "pos_weight", "focal_gamma", "focal_alpha", "threshold")


class BCEStrategy(Strategy):
    """What the BCE strategies share: the options, the row scale (÷ V for vocab_reduction='mean')
    and the cut metrics (TP/FP/FN/TN at ``threshold``)."""

    objective = "bce"
    entry_point = "recloss.bce_loss"
    options_supported = COMMON_OPTIONS + BCE_OPTIONS

    def row_scale(self, w, weight_sum, *, vocab_size):
        vscale = 1.0 / vocab_size if self.options.vocab_reduction == "mean" else 1.0
        return super().row_scale(w * vscale, weight_sum, vocab_size=vocab_size)

    def metrics(self, counts, w, *, vocab_size, invalid, weight_sum, reducer):
        return metrics_lib.cut_metrics(counts, w, vocab_size=vocab_size, invalid=invalid, weight_sum=weight_sum,
                                       psum_batch=reducer.batch)


class DenseBCE(BCEStrategy):
    """Materialises logits [M, V] and a multi-hot label matrix; autodiff gradients.

    The baseline a user writes today; memory O(M·V)."""

    name = "dense_bce"

    def local_loss(self, hidden, table, bias, targets, row_scale, *, vocab_offset, vocab_size, scalar,
                   platform, reducer):
        rows, counts = dense.dense_bce(hidden, table, bias, targets, row_scale, self.options,
                                       vocab_offset=vocab_offset, vocab_size=vocab_size)
        if not self.options.compute_metrics:
            counts = {"targets": counts["targets"]}
        return _vocab_sum(jnp.sum(rows) if scalar else rows, counts, reducer)


def _vocab_sum(loss, counts, reducer):
    return reducer.vocab(loss), {k: reducer.vocab(v) for k, v in counts.items() if v is not None}


class CutBCE(BCEStrategy):
    """Pure-JAX blocked pass (lax.scan over vocab blocks) with a fused single-pass VJP.

    Memory O(block_n·block_v + V·D); 6·M·V·D flops for loss+grad of a scalar loss."""

    name = "cutbce"
    supports_ring = True     # MeshLayout(fsdp_gather='ring'): the sweep and the gather walk the slices

    def plan(self, m: int, v_local: int, vocab_offset, *, vocab_size: int, platform: str):
        """(plan, offset): the static plan of the background sweep (`recloss.sweep`) for M rows and a
        V_local-row table, and the vocab offset in the form that plan takes. Subclasses swap the kernel."""
        static = vocab_offset if isinstance(vocab_offset, int) else None
        return cut.plan(m, v_local, self.options, vocab_size=vocab_size, static_offset=static), vocab_offset

    def background(self, hidden, table, bias, row_scale, vocab_offset, *, vocab_size, scalar, platform,
                   ring=None):
        """(Σ r·bg or bg rows [M], predicted counts [M] or None): the dense part of the loss.

        With a `recloss.ring.Ring`, ``table``/``bias`` are this chip's slice and the sweep walks the ring."""
        if ring is not None:   # the slices' offsets are traced: the plan masks by the real vocab_size
            vocab_offset = jnp.asarray(vocab_offset, jnp.int32)
        p, vocab_offset = self.plan(hidden.shape[0], table.shape[0], vocab_offset, vocab_size=vocab_size,
                                    platform=platform)
        if ring is not None:
            p = ring_lib.Plan(p, ring, "sum")
        if scalar:
            return sweep.background_total(hidden, table, bias, row_scale, vocab_offset, p)
        return sweep.background_rows(hidden, table, bias, vocab_offset, p)

    def local_loss(self, hidden, table, bias, targets, row_scale, *, vocab_offset, vocab_size, scalar,
                   platform, reducer):
        opts = self.options
        ring = ring_lib.ring_of(reducer)
        v_local = table.shape[0] if ring is None else ring.rows * ring.size
        ids, valid = targets_lib.local_targets(targets, opts.pad_id, vocab_offset, v_local, vocab_size)
        if ring is None:
            x = targets_lib.gather_logits(hidden, table, bias, ids)
        else:
            x = ring_lib.gather_logits(hidden, table, bias, ids, valid, ring)
        corr = bernoulli.correction(x, valid, opts)
        target_logits = jax.lax.stop_gradient(x)
        bg, predicted = self.background(hidden, table, bias, row_scale, vocab_offset,
                                        vocab_size=vocab_size, scalar=scalar, platform=platform, ring=ring)
        loss = bg + jnp.sum(row_scale * corr) if scalar else row_scale * (bg + corr)
        tp, n = bernoulli.target_counts(target_logits, valid, opts.threshold)
        counts = {"targets": n}
        if opts.compute_metrics:
            counts.update(predicted=predicted, tp=tp)
        return _vocab_sum(loss, counts, reducer)


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
    fallback = "cutbce"
    fallback_note = "blocked pure JAX, same math and fused gradient"

    def plan(self, m: int, v_local: int, vocab_offset, *, vocab_size: int, platform: str):
        if m == 0:   # no rows: nothing for a kernel grid to walk; the pure-JAX sweep gives the empty sums
            return super().plan(m, v_local, vocab_offset, vocab_size=vocab_size, platform=platform)
        chip, mode = self.kernel_config(platform)
        static = vocab_offset if isinstance(vocab_offset, int) else None
        p = kernel.Plan(self.options, int(vocab_size), static, chip, mode)
        return p, jnp.asarray(vocab_offset, jnp.int32)
