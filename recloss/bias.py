"""How far a sampled loss is from the exact one, on the caller's own model state and batch.

recloss computes the exact softmax (or BCE) loss and the sampled ones through one API, so it can
measure the sampled estimator itself: `sampled_bias` averages the sampled gradient over many draws
of the negatives and compares that expectation with the exact gradient.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from recloss import api
from recloss import targets as targets_lib
from recloss.options import LossOptions
from recloss.registry import get_strategy
from recloss.sampled import sampler

# Options the exact reference shares with the sampled loss (the rest, e.g. num_negatives, are the sampler's).
_SHARED = ("temperature", "pad_id", "vocab_size")


def _cos(a, b) -> float:
    a, b = np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(b, np.float64))
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a @ b / (na * nb)) if na > 0 and nb > 0 else float("nan")


def _norm_ratio(a, b) -> float:
    nb = np.linalg.norm(np.asarray(b, np.float64))
    return float(np.linalg.norm(np.asarray(a, np.float64)) / nb) if nb > 0 else float("nan")


def _target_offset(targets, weights, log_q, k: int, opts: LossOptions, rows: int) -> float:
    """The constant sampled_softmax adds to the exact loss: its targets' own −log(K·q_t) correction
    leaves + log(K·q_t) in ℓ, with no gradient. Reduced over rows as the loss is (mean or sum)."""
    vocab = opts.vocab_size or rows
    lq = np.asarray(jnp.maximum(sampler.proposal(log_q, rows=rows, vocab_size=vocab), sampler.LOG_Q_FLOOR))
    t = np.asarray(targets).reshape(-1, np.shape(targets)[-1])
    ids, valid = (np.asarray(a) for a in targets_lib.valid_targets(jnp.asarray(t), opts.pad_id, vocab))
    k_row = valid.sum(-1)
    per_row = np.where(valid, np.log(k) + lq[np.clip(ids, 0, vocab - 1)], 0.0).sum(-1) / np.maximum(k_row, 1)
    w = np.ones(t.shape[0]) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    w = np.where(k_row > 0, w, 0.0)
    total = float((w * per_row).sum())
    return total / float(w.sum()) if opts.reduction == "mean" and w.sum() > 0 else total


def sampled_bias(hidden, table, targets, weights=None, bias=None, *, key, strategy: str = "sampled_softmax",
                 num_negatives: Sequence[int] = (16, 64, 256, 1024), proposals: Optional[Mapping] = None,
                 draws: int = 32, exact: str = "cutce", log: Optional[Callable] = None, **options):
    """The sampled loss's gradient, averaged over ``draws`` draws of its negatives, against the exact one.

    For each proposal q and K in ``num_negatives``, with g_k the gradient of
    ``sampled_loss(..., strategy, num_negatives=K, log_q=q, key=k_i)`` w.r.t. (hidden, table) on
    draw i and g the gradient of the exact loss (``exact``: a softmax strategy, or a BCE one):

        cos  = cos(mean_i g_i, g)          the bias of the estimator's direction (-> 1 as it is unbiased)
        norm = |mean_i g_i| / |g|          its scale against the exact gradient's
        cos_draw = mean_i cos(g_i, g)      what one step sees (bias and noise together)
        loss_gap = mean_i loss_i - offset - loss    the sampled loss's bias, where offset is the
                   constant + log(K·q_t) that sampled_softmax's correction of its own targets adds
                   (`loss_offset`; it has no gradient; 0 for gbce)

    each for dA (the hidden states' gradient) and dE (the table's).

    Args:
      hidden [..., D], table [V, D], targets [..., L], weights [...], bias [V]: as `sampled_loss`
        (one model state and one batch, e.g. a trainer's current one).
      key: a jax.random key; draw i of every (proposal, K) uses fold_in(key, i).
      strategy: 'sampled_softmax' or 'gbce'.
      num_negatives: the Ks to measure, each >= 1. Unlike `sampled_loss`, K may exceed V here (the
        draws are with replacement), to show where the estimator converges.
      proposals: {name: log_q [V] or None (uniform)}; default {'uniform': None}.
      draws: draws per (proposal, K), >= 2.
      exact: the reference strategy ('cutce' for the softmax; 'cutbce' for gbce's own BCE).
      log: a print-like function for one progress line per (proposal, K) (None: silent).
      **options: `LossOptions` fields of the sampled loss (temperature, remove_accidental_hits,
        gbce_t, ...); temperature, pad_id and vocab_size apply to the exact loss too.
    Returns:
      A list of dicts, one per (proposal, K): proposal, num_negatives, draws, cos_dA, cos_dE,
      norm_dA, norm_dE, cos_draw_dA, cos_draw_dE, loss (mean), loss_std, exact_loss, loss_offset,
      loss_gap, seconds.
    """
    if proposals is None:
        proposals = {"uniform": None}
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 2:
        raise ValueError(f"draws={draws!r} is invalid: expected an int >= 2 (a mean and a spread need two)")
    ks = [int(k) for k in num_negatives]
    if not ks or min(ks) < 1:
        raise ValueError(f"num_negatives={list(num_negatives)!r} is invalid: expected one or more Ks >= 1")
    ref = get_strategy(exact)
    if ref.objective not in ("softmax", "bce"):
        raise ValueError(f"exact={exact!r} computes the {ref.objective!r} objective: expected a softmax "
                         "strategy (e.g. 'cutce') or a BCE one (e.g. 'cutbce')")
    shared = {k: v for k, v in options.items() if k in _SHARED}
    exact_fn = api.softmax_loss if ref.objective == "softmax" else api.bce_loss

    def exact_loss(h, e):
        return exact_fn(h, e, targets, weights, bias, strategy=exact, **shared).loss

    exact_value, (gh, ge) = jax.jit(jax.value_and_grad(exact_loss, argnums=(0, 1)))(hidden, table)
    gh, ge = np.asarray(gh, np.float64), np.asarray(ge, np.float64)
    rows = []
    for name, log_q in proposals.items():
        for k in ks:
            t0 = time.perf_counter()

            loss_fn = api._for("sampled", strategy, dict(options, num_negatives=k))
            # The strategy's one draw, without its K <= V guard (a config check, not a limit of the math).
            loss_fn.draw_negatives = lambda key_i, proposal, vocab_size, k=k: sampler.draw(
                key_i, proposal, k, vocab_size=vocab_size)

            def one(h, e, key_i, log_q=log_q, loss_fn=loss_fn):
                return loss_fn(h, e, targets, weights, bias, key=key_i, log_q=log_q).loss

            step = jax.jit(jax.value_and_grad(one, argnums=(0, 1)))
            losses, sum_h, sum_e, cos_h, cos_e = [], 0.0, 0.0, [], []
            for i in range(draws):
                value, (dh, de) = step(hidden, table, jax.random.fold_in(key, i))
                dh, de = np.asarray(dh, np.float64), np.asarray(de, np.float64)
                losses.append(float(value))
                sum_h, sum_e = sum_h + dh, sum_e + de
                cos_h.append(_cos(dh, gh))
                cos_e.append(_cos(de, ge))
            mh, me = sum_h / draws, sum_e / draws
            row = {"proposal": name, "num_negatives": k, "draws": draws,
                   "cos_dA": _cos(mh, gh), "cos_dE": _cos(me, ge), "norm_dA": _norm_ratio(mh, gh),
                   "norm_dE": _norm_ratio(me, ge), "cos_draw_dA": float(np.mean(cos_h)),
                   "cos_draw_dE": float(np.mean(cos_e)), "loss": float(np.mean(losses)),
                   "loss_std": float(np.std(losses, ddof=1)), "exact_loss": float(exact_value),
                   "seconds": time.perf_counter() - t0}
            offset = (_target_offset(targets, weights, log_q, k, loss_fn.options, table.shape[0])
                       if strategy == "sampled_softmax" else 0.0)
            row.update(loss_offset=offset, loss_gap=row["loss"] - offset - row["exact_loss"])
            rows.append(row)
            if log is not None:
                log(format_row(row))
    return rows


def format_row(row: Dict) -> str:
    """One line of a `sampled_bias` row."""
    return (f"{row['proposal']:>8} K={row['num_negatives']:<6} cos dA {row['cos_dA']:.4f} dE {row['cos_dE']:.4f} "
            f"| norm dA {row['norm_dA']:.3f} dE {row['norm_dE']:.3f} | one draw: cos dA {row['cos_draw_dA']:.3f} "
            f"dE {row['cos_draw_dE']:.3f} | loss {row['loss']:.4f} ± {row['loss_std']:.4f} "
            f"(exact {row['exact_loss']:.4f}, gap {row['loss_gap']:+.4f} after the offset "
            f"{row['loss_offset']:+.4f}) | {row['draws']} draws, "
            f"{row['seconds']:.1f}s")
