"""The sampled strategies: `sampled_softmax` (logQ-corrected sampled softmax) and `gbce` (gSASRec's gBCE).

Both draw K negative ids once per call from the key, on every vocab shard alike from the shards'
parts of the proposal (`recloss.sampled.sampler`: no [V] array on any chip), share them between all
positions (one [M, K] product) and cost O(M·(K + L)·D); nothing of size M·V.
They differ only in the per-row math of `recloss.sampled.candidates`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from recloss import metrics as metrics_lib, targets as targets_lib
from recloss.sampled import candidates, sampler
from recloss.strategy import COMMON_OPTIONS, Strategy

SAMPLED_OPTIONS = COMMON_OPTIONS + ("temperature", "num_negatives", "remove_accidental_hits")


class SampledStrategy(Strategy):
    """What the sampled strategies share (see `recloss.sampled_loss`): the draw, the candidate
    logits, accidental-hit masks, the row weights (positions with a target) and the metrics."""

    objective = "sampled"
    entry_point = "recloss.sampled_loss"
    options_supported = SAMPLED_OPTIONS

    def draw_negatives(self, key, proposal, *, vocab_size: int):
        """The negative ids [K] int32 of one call, drawn with replacement from q, the same on every
        shard: ``proposal`` this shard's part of q (`sampler.local`) or None (uniform over the V ids).

        The one place ids are drawn: a test may override it (e.g. to enumerate the catalogue)."""
        k = self.options.num_negatives
        if k > vocab_size:
            raise ValueError(f"num_negatives={k} exceeds the vocabulary size V={vocab_size}: expected "
                             f"1 <= num_negatives <= {vocab_size}")
        return sampler.draw(key, proposal, k, vocab_size=vocab_size)

    def prepare(self, targets, *, rows, vocab_size, key=None, log_q=None, **inputs):
        """Checks the key and lays the proposal out; with in-batch negatives, the batch's targets.

        Returns {"key": the key, "log_q": [rows] f32 (`sampler.masked`; absent when uniform), and with
        ``in_batch_negatives`` "cand": [M·L] int32 (−1 = not a candidate), "cand_count": f32 scalar}.
        ``log_q`` is split over the vocab axis like the table's rows (`extra_specs`); the rest is
        replicated. The negatives are drawn in `local_loss`, where each shard holds its proposal rows.
        """
        if inputs:
            raise TypeError(f"strategy {self.name!r} got unexpected argument(s) {sorted(inputs)}; "
                            "it takes key= and log_q=")
        extras = {"key": sampler.check_key(key)}
        lq = sampler.masked(log_q, rows=rows, vocab_size=vocab_size)
        if lq is not None:
            extras["log_q"] = jax.lax.stop_gradient(lq)
        if self.options.in_batch_negatives:
            gids, gvalid = targets_lib.valid_targets(targets, self.options.pad_id, vocab_size)
            extras.update(cand=jnp.where(gvalid, gids, -1).reshape(-1).astype(jnp.int32),
                          cand_count=jnp.sum(gvalid, dtype=jnp.float32))
        return extras

    def check_manual(self):
        """In-batch negatives are the whole batch's targets, which one device's rows do not hold."""
        if self.options.in_batch_negatives:
            raise ValueError(f"strategy {self.name!r} with in_batch_negatives=True draws its in-batch "
                             f"negatives from the whole batch, which MeshLayout(manual=True) does not "
                             f"see (each device has its own rows); use manual=False, or "
                             f"in_batch_negatives=False")

    def extra_specs(self, layout, extras):
        """The proposal split over the vocab axis like the table's rows (the table's fsdp part is
        gathered: `fsdp_gathers` is 'once' only); the key and in-batch candidates replicated."""
        vocab = P(layout.vocab_axis) if layout.vocab_axis is not None else P()
        return {name: vocab if name == "log_q" else P() for name in extras}

    def _negatives(self, extras, gids, shard):
        """extras plus the drawn "neg" [K] and the proposal's log q of the negatives, of the targets
        gids [M, L] (this shard's rows) and of the in-batch candidates: "neg_log_q" [K],
        "target_log_q" [M, L], "cand_log_q" [C] f32."""
        vocab_size = shard.vocab_size
        proposal = sampler.local(extras.get("log_q"), shard)
        neg = self.draw_negatives(extras["key"], proposal, vocab_size=vocab_size).astype(jnp.int32)
        if proposal is None:
            at = lambda ids: jnp.full(ids.shape, -math.log(vocab_size), jnp.float32)
        else:
            at = proposal.log_q_at
        out = dict(extras, neg=neg, neg_log_q=at(neg), target_log_q=at(jnp.clip(gids, 0, vocab_size - 1)))
        if "cand" in extras:
            out["cand_log_q"] = at(jnp.clip(extras["cand"], 0, vocab_size - 1))
        return out

    def row_weights(self, targets, w, *, vocab_size):
        return targets_lib.rows_with_targets(targets, w, self.options.pad_id, vocab_size)

    def rows(self, xt, valid, xn, live_n, extras, *, vocab_size):
        """ℓ per row [M] from the target logits xt [M, L] and candidate logits xn [M, C]."""
        raise NotImplementedError

    def local_loss(self, hidden, targets, row_scale, shard, *, extras):
        opts = self.options
        inv_t = 1.0 / opts.temperature
        vocab_size = shard.vocab_size
        gids, gvalid = targets_lib.valid_targets(targets, opts.pad_id, vocab_size)
        extras = self._negatives(extras, gids, shard)
        k = jnp.sum(gvalid, axis=-1, dtype=jnp.float32)
        ids, valid = shard.local_targets(targets, opts.pad_id)
        xt = shard.vocab_sum(jnp.where(valid, shard.gather_logits(hidden, ids, valid), 0.0)) * inv_t
        neg = extras["neg"]
        xn = candidates.candidate_logits(hidden, neg, shard) * inv_t
        live = jnp.ones(xn.shape, bool)
        if opts.remove_accidental_hits:
            live = ~candidates.hits(gids, gvalid, neg)
        if opts.in_batch_negatives:
            cand = extras["cand"]
            xc = candidates.candidate_logits(hidden, cand, shard) * inv_t
            # A position's own targets are never its in-batch negatives, whatever remove_accidental_hits says.
            xn = jnp.concatenate([xn, xc], axis=-1)
            live = jnp.concatenate([live, (cand >= 0)[None, :] & ~candidates.hits(gids, gvalid, cand)], axis=-1)
        ell = jnp.where(k > 0, self.rows(xt, gvalid, xn, live, extras, vocab_size=vocab_size), 0.0)
        loss = jnp.sum(row_scale * ell) if opts.reduction != "none" else row_scale * ell
        counts = {"targets": k}
        if opts.compute_metrics:
            counts["top1"] = candidates.top1(xt, gvalid, xn, live).astype(jnp.float32)
        return loss, counts

    def metrics(self, counts, w, *, invalid, weight_sum, shard):
        """num_targets (Σ|T|), invalid_targets, weight_sum (of positions with targets) and, with
        compute_metrics, top1 (Σ w·[the best target outscores every live negative])."""
        return metrics_lib.top1_metrics(counts, w, invalid=invalid, weight_sum=weight_sum,
                                        psum_batch=shard.batch_sum)


class SampledSoftmax(SampledStrategy):
    """Sampled softmax with the logQ correction: every logit, the target's too, is corrected by
    −log(expected count) = −log(K·q) (TensorFlow's ``sampled_softmax_loss``, ``subtract_log_q=True``);
    in-batch negatives by −log(B·q) with B the batch's valid target count. Memory O(M·(K + B)),
    flops 6·M·(K + B + L)·D for loss and gradient."""

    name = "sampled_softmax"
    options_supported = SAMPLED_OPTIONS + ("in_batch_negatives",)

    def rows(self, xt, valid, xn, live, extras, *, vocab_size):
        floor = lambda lq: jnp.maximum(lq, sampler.LOG_Q_FLOOR)
        log_k = math.log(extras["neg"].shape[0])
        st = xt - (log_k + floor(extras["target_log_q"]))
        sc = xn[:, :extras["neg"].shape[0]] - (log_k + floor(extras["neg_log_q"]))[None, :]
        if self.options.in_batch_negatives:
            log_b = jnp.log(jnp.maximum(extras["cand_count"], 1.0))
            sb = xn[:, extras["neg"].shape[0]:] - (log_b + floor(extras["cand_log_q"]))[None, :]
            sc = jnp.concatenate([sc, sb], axis=-1)
        return candidates.softmax_rows(st, valid, sc, live)


class GBCE(SampledStrategy):
    """gSASRec's gBCE: BCE over the targets and K negatives with the positive term raised to β
    (`candidates.gbce_beta`); no logQ correction (a ``log_q`` only changes where negatives are drawn).
    Memory O(M·K), flops 6·M·(K + L)·D for loss and gradient."""

    name = "gbce"
    options_supported = SAMPLED_OPTIONS + ("gbce_t",)

    def rows(self, xt, valid, xn, live, extras, *, vocab_size):
        beta = candidates.gbce_beta(extras["neg"].shape[0], vocab_size, self.options.gbce_t)
        return candidates.gbce_rows(xt, valid, xn, live, beta)
