"""The softmax strategies: `dense_ce` (baseline), `cutce` (blocked pure JAX), `cutce_pallas` (Mosaic TPU).

All three share the loss assembly (`SoftmaxStrategy.target_terms`, `cross_entropy`): the global
log-partition Z from the shards' log-partitions, the O(L·D) target term, the
ε/V column sum, z-loss and the metrics. They differ only in how one shard's
log-partition and its gradient are computed (their `local_loss`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from recloss import metrics as metrics_lib, softcap, sweep, targets as targets_lib
from recloss.pallas.strategy import PallasStrategy
from recloss.softmax import cut, dense, kernel, partition
from recloss.strategy import BLOCK_OPTIONS, COMMON_OPTIONS, BlockedStrategy, Strategy

SOFTMAX_OPTIONS = ("label_smoothing", "z_loss", "temperature", "logit_soft_cap")


class TargetTerms(NamedTuple):
    """`SoftmaxStrategy.target_terms`: gids, gvalid [M, L] (the valid global targets), k [M] f32
    (|T| per row), target_sum [M] f32 (Σ_{t ∈ T} x_t/τ, summed over the vocab shards; x_t soft-capped
    with logit_soft_cap)."""
    gids: Any
    gvalid: Any
    k: Any
    target_sum: Any


class SoftmaxStrategy(Strategy):
    """Full-catalogue softmax cross-entropy with multi-positive targets (see `recloss.softmax_loss`).

    Positions without a valid target contribute 0 and leave the mean's denominator.
    """

    objective = "softmax"
    entry_point = "recloss.softmax_loss"
    options_supported = COMMON_OPTIONS + SOFTMAX_OPTIONS

    def __init__(self, options):
        """As `Strategy`; also refuses label_smoothing with logit_soft_cap, naming both (the ε/V·Σ_v x_v
        term is `VocabShard.column_sum`, linear in the logits)."""
        super().__init__(options)
        if options.logit_soft_cap is not None and options.label_smoothing:
            raise ValueError(
                f"strategy {self.name!r} (softmax objective) does not take label_smoothing="
                f"{options.label_smoothing!r} together with logit_soft_cap={options.logit_soft_cap!r}: its "
                "ε/V·Σ_v x_v term is one column sum of the uncapped logits; set one of them to its default")

    def row_weights(self, targets, w, *, vocab_size):
        return targets_lib.rows_with_targets(targets, w, self.options.pad_id, vocab_size)

    def target_terms(self, hidden, targets, shard) -> "TargetTerms":
        """What the loss takes of the targets ([M, L] global ids): which are valid, how many per row,
        and the sum of their logits x_t/τ over the vocab shards (an O(L·D) gather, never [M, V])."""
        opts = self.options
        gids, gvalid = targets_lib.valid_targets(targets, opts.pad_id, shard.vocab_size)
        k = jnp.sum(gvalid, axis=-1, dtype=jnp.float32)            # |T| per row, over the whole vocab
        ids, valid = shard.local_targets(targets, opts.pad_id)
        xt = softcap.soft_cap(shard.gather_logits(hidden, ids, valid), opts.logit_soft_cap)
        if opts.temperature != 1.0:
            xt = xt * (1.0 / opts.temperature)
        target_sum = shard.vocab_sum(jnp.sum(jnp.where(valid, xt, 0.0), axis=-1))
        return TargetTerms(gids, gvalid, k, target_sum)

    def cross_entropy(self, hidden, row_scale, shard, terms: "TargetTerms", log_partition):
        """`local_loss` from the `target_terms` and the shard's ``log_partition`` = (lse [M] f32,
        differentiable; (row max [M], argmax id [M]) or None): Z = the vocab shards' lse combined,
        ℓ = Z − (1−ε)·mean target logit (+ z_loss·Z², − ε/V·Σ_v x_v), 0 for rows without targets;
        and the per-row counts."""
        opts = self.options
        inv_t = 1.0 / opts.temperature
        f32 = jnp.float32
        vocab_size = shard.vocab_size
        gids, gvalid, k, target_sum = terms
        lse_local, aux = log_partition
        z = partition.global_lse(lse_local, shard)
        ell = z - (1.0 - opts.label_smoothing) * target_sum / jnp.maximum(k, 1.0)
        if opts.z_loss:
            ell = ell + opts.z_loss * z * z
        if opts.label_smoothing:
            ell = ell - (opts.label_smoothing / vocab_size) * shard.vocab_sum(shard.column_sum(hidden) * inv_t)
        ell = jnp.where(k > 0, ell, 0.0)
        loss = jnp.sum(row_scale * ell) if opts.reduction != "none" else row_scale * ell

        counts = {"targets": k}
        if opts.compute_metrics:
            top = partition.global_argmax(aux[0], aux[1], shard)
            hit = jnp.any(gvalid & (gids == top[:, None]), axis=-1)
            counts.update(top1=hit.astype(f32), lse=jax.lax.stop_gradient(z))
        return loss, counts

    def metrics(self, counts, w, *, invalid, weight_sum, shard):
        """num_targets (Σ|T|), invalid_targets, weight_sum (of positions with targets) and, with
        compute_metrics, top1 (Σ w·[argmax ∈ T]), mean_lse (Σ w·Z / Σ w) and, when z_loss λ > 0,
        z_loss (Σ w·λ·Z²: the z-loss part of the 'sum'-reduced loss, from the same Z)."""
        out = metrics_lib.top1_metrics(counts, w, invalid=invalid, weight_sum=weight_sum,
                                       psum_batch=shard.batch_sum)
        if "lse" in counts:
            out["mean_lse"] = shard.batch_sum(jnp.sum(w * counts["lse"])) / jnp.where(weight_sum > 0,
                                                                                     weight_sum, 1.0)
            if self.options.z_loss:
                z = counts["lse"]
                out["z_loss"] = shard.batch_sum(jnp.sum(w * (self.options.z_loss * z * z)))
        return out


class DenseCE(SoftmaxStrategy):
    """Materialises logits [M, V]; autodiff gradients. The baseline a user writes today; memory O(M·V)."""

    name = "dense_ce"

    def local_loss(self, hidden, targets, row_scale, shard):
        """The `target_terms`, the shard's log-partition from its dense logits [M, V_local]
        (autodiff), then `cross_entropy`."""
        terms = self.target_terms(hidden, targets, shard)
        lse = dense.dense_lse(hidden, shard.table, shard.bias, temperature=self.options.temperature,
                              vocab_offset=shard.offset, vocab_size=shard.vocab_size,
                              argmax=self.options.compute_metrics, soft_cap=self.options.logit_soft_cap)
        return self.cross_entropy(hidden, row_scale, shard, terms, lse)


class CutCE(BlockedStrategy, SoftmaxStrategy):
    """Pure-JAX blocked log-partition: a loss-only forward sweep (2·M·V·D flops) and a recomputing
    backward sweep (6·M·V·D) that emits dE blocks; memory O(block_n·block_v + V·D). Under
    ``fsdp_gather='ring'`` it runs two rings, Z forward and dE backward."""

    name = "cutce"
    options_supported = SoftmaxStrategy.options_supported + BLOCK_OPTIONS
    cut_sweeps = cut.SWEEPS
    combine = "lse"

    def local_loss(self, hidden, targets, row_scale, shard):
        """The `target_terms`, the shard's log-partition as one sweep over it
        (`recloss.sweep.sweep_rows`: loss-only forward, recomputing backward), then `cross_entropy`."""
        terms = self.target_terms(hidden, targets, shard)
        lse = sweep.sweep_rows(hidden, shard, self.plan(hidden.shape[0], shard))
        return self.cross_entropy(hidden, row_scale, shard, terms, lse)


class CutCEPallas(PallasStrategy, CutCE):
    """CutCE with the log-partition as Mosaic-TPU Pallas kernels: a loss-only forward sweep
    (2·M·V·D flops; running max, sum-exp and argmax lanes resident in VMEM) and a recomputing
    backward sweep (6·M·V·D) that writes each dE block once. Memory O(bn·D + bv·D) VMEM per core,
    O(V·D) HBM for dE. Runs on TPU; on CPU only in Pallas interpret mode (for tests); on GPU use
    'cutce'.

    Args as `recloss.pallas.strategy.PallasStrategy`; ``block_n``/``block_v``
    map to the kernel's row tile and vocab block.
    """

    name = "cutce_pallas"
    options_supported = CutCE.options_supported + ("interpret",)
    fallback = "cutce"
    kernel_sweeps = kernel.SWEEPS
