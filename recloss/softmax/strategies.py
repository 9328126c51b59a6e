"""The softmax strategies: `dense_ce` (baseline), `cutce` (blocked pure JAX), `cutce_pallas` (Mosaic TPU).

All three share the loss assembly (`SoftmaxStrategy.local_loss`): the global
log-partition Z from the shards' log-partitions, the O(L·D) target term, the
ε/V column sum, z-loss and the metrics. They differ only in how one shard's
log-partition and its gradient are computed (`log_partition`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from recloss import ring as ring_lib, sweep, targets as targets_lib
from recloss.pallas.strategy import PallasStrategy
from recloss.softmax import cut, dense, kernel, partition
from recloss.strategy import COMMON_OPTIONS, Strategy

SOFTMAX_OPTIONS = ("z_loss", "temperature")


class SoftmaxStrategy(Strategy):
    """Full-catalogue softmax cross-entropy with multi-positive targets (see `recloss.softmax_loss`).

    Positions without a valid target contribute 0 and leave the mean's denominator.
    """

    objective = "softmax"
    entry_point = "recloss.softmax_loss"
    options_supported = COMMON_OPTIONS + SOFTMAX_OPTIONS

    def log_partition(self, hidden, table, bias, vocab_offset, *, vocab_size: int, platform: str,
                      ring=None):
        """This shard's (lse [M] f32, differentiable; (row max [M], argmax id [M]) or None).

        With a `recloss.ring.Ring` (``supports_ring``), table/bias are this chip's slice of the vocab
        shard, whose first id is ``vocab_offset``, and the sweep walks the ring."""
        raise NotImplementedError

    def row_weights(self, targets, w, *, vocab_size):
        _, valid = targets_lib.valid_targets(targets, self.options.pad_id, vocab_size)
        return jnp.where(jnp.any(valid, axis=-1), w, 0.0)

    def local_loss(self, hidden, table, bias, targets, row_scale, *, vocab_offset, vocab_size, scalar,
                   platform, reducer):
        opts = self.options
        inv_t = 1.0 / opts.temperature
        f32 = jnp.float32
        ring = ring_lib.ring_of(reducer)
        v_local = table.shape[0] if ring is None else ring.rows * ring.size
        gids, gvalid = targets_lib.valid_targets(targets, opts.pad_id, vocab_size)
        k = jnp.sum(gvalid, axis=-1, dtype=f32)                     # |T| per row, over the whole vocab
        ids, valid = targets_lib.local_targets(targets, opts.pad_id, vocab_offset, v_local, vocab_size)
        if ring is None:
            xt = targets_lib.gather_logits(hidden, table, bias, ids)
        else:
            xt = ring_lib.gather_logits(hidden, table, bias, ids, valid, ring)
        if inv_t != 1.0:
            xt = xt * inv_t
        target_sum = reducer.vocab(jnp.sum(jnp.where(valid, xt, 0.0), axis=-1))

        lse_local, aux = self.log_partition(hidden, table, bias, vocab_offset, vocab_size=vocab_size,
                                            platform=platform, **({} if ring is None else {"ring": ring}))
        z = partition.global_lse(lse_local, reducer)
        ell = z - (1.0 - opts.label_smoothing) * target_sum / jnp.maximum(k, 1.0)
        if opts.z_loss:
            ell = ell + opts.z_loss * z * z
        if opts.label_smoothing:
            if ring is None:
                colsum = _column_sum(hidden, table, bias, vocab_offset, vocab_size)
            else:   # this chip's slice, its [D] column sum summed round the ring (no table moves)
                colsum = _column_sum(hidden, table, bias, vocab_offset + ring.index() * ring.rows,
                                     vocab_size, total=ring.psum)
            ell = ell - (opts.label_smoothing / vocab_size) * reducer.vocab(colsum * inv_t)
        ell = jnp.where(k > 0, ell, 0.0)
        loss = jnp.sum(row_scale * ell) if scalar else row_scale * ell

        counts = {"targets": k}
        if opts.compute_metrics:
            top = partition.global_argmax(aux[0], aux[1], reducer)
            hit = jnp.any(gvalid & (gids == top[:, None]), axis=-1)
            counts.update(top1=hit.astype(f32), lse=jax.lax.stop_gradient(z))
        return loss, counts

    def metrics(self, counts, w, *, vocab_size, invalid, weight_sum, reducer):
        """num_targets (Σ|T|), invalid_targets, weight_sum (of positions with targets) and, with
        compute_metrics, top1 (Σ w·[argmax ∈ T]) and mean_lse (Σ w·Z / Σ w)."""
        out = {"num_targets": reducer.batch(jnp.sum(counts["targets"])), "invalid_targets": invalid,
               "weight_sum": weight_sum}
        if "top1" in counts:
            out["top1"] = reducer.batch(jnp.sum(w * counts["top1"]))
            out["mean_lse"] = reducer.batch(jnp.sum(w * counts["lse"])) / jnp.where(weight_sum > 0,
                                                                                    weight_sum, 1.0)
        return out


def _column_sum(hidden, table, bias, vocab_offset, vocab_size, total=lambda x: x):
    """Σ_v (h·e_v + b_v) over the shard's live rows, per row [M] f32: one [D] column sum, not [M, V].
    ``total`` sums the [D] column sum (and the bias sum) over the chips holding the shard's slices."""
    live = (jnp.arange(table.shape[0]) + vocab_offset < vocab_size)[:, None]
    col = total(jnp.sum(jnp.where(live, table, 0), axis=0, dtype=jnp.float32))
    out = jnp.dot(hidden.astype(jnp.float32), col)
    if bias is not None:
        out = out + total(jnp.sum(jnp.where(live[:, 0], bias, 0), dtype=jnp.float32))
    return out


class DenseCE(SoftmaxStrategy):
    """Materialises logits [M, V]; autodiff gradients. The baseline a user writes today; memory O(M·V)."""

    name = "dense_ce"

    def log_partition(self, hidden, table, bias, vocab_offset, *, vocab_size, platform):
        return dense.dense_lse(hidden, table, bias, temperature=self.options.temperature,
                               vocab_offset=vocab_offset, vocab_size=vocab_size,
                               argmax=self.options.compute_metrics)


class CutCE(SoftmaxStrategy):
    """Pure-JAX blocked log-partition: a loss-only forward sweep (2·M·V·D flops) and a recomputing
    backward sweep (6·M·V·D) that emits dE blocks; memory O(block_n·block_v + V·D)."""

    name = "cutce"
    supports_ring = True     # MeshLayout(fsdp_gather='ring'): two rings, Z forward and dE backward

    def log_partition(self, hidden, table, bias, vocab_offset, *, vocab_size, platform, ring=None):
        static = vocab_offset if isinstance(vocab_offset, int) and ring is None else None
        p = cut.plan(hidden.shape[0], table.shape[0], self.options, vocab_size=vocab_size, static_offset=static)
        return sweep.background_rows(hidden, table, bias, vocab_offset, _ringed(p, ring))


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
    fallback = "cutce"

    def log_partition(self, hidden, table, bias, vocab_offset, *, vocab_size, platform, ring=None):
        if hidden.shape[0] == 0:   # no rows: nothing for a kernel grid to walk; the pure-JAX sweep
            return super().log_partition(hidden, table, bias, vocab_offset, vocab_size=vocab_size,
                                         platform=platform, ring=ring)
        chip, mode = self.kernel_config(platform)
        static = vocab_offset if isinstance(vocab_offset, int) and ring is None else None
        p = kernel.Plan(self.options, int(vocab_size), static, chip, mode)
        return sweep.background_rows(hidden, table, bias, jnp.asarray(vocab_offset, jnp.int32),
                                     _ringed(p, ring))


def _ringed(plan, ring):
    """``plan`` walked round ``ring`` (the slices' log-partitions merged per row), or as is without one."""
    return plan if ring is None else ring_lib.Plan(plan, ring, "lse")
