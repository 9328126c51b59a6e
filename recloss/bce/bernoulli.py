"""The Bernoulli loss terms (P, Q) of the multi-label BCE objective, and its sparse target correction.

Every BCE strategy evaluates logits through `bernoulli_parts`/`bernoulli_terms`,
so the blocked passes, the Pallas kernel and the dense baseline cannot drift
apart in their math. With soft label y' = y(1−ε) + ε/2 the element loss
y'·P + (1−y')·Q is linear in y', so a position's loss is a target-free
background Σ_v [(ε/2)·P + (1−ε/2)·Q] plus `correction` over its targets.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from recloss.options import LossOptions


def background_coefficients(opts: LossOptions):
    """(c_p, c_q) of the dense background Σ_v [c_p·P + c_q·Q]: (ε/2, 1 − ε/2) for label smoothing ε
    (docs/design.md "The BCE objective"); the sparse correction's coefficient is 1 − ε."""
    return opts.label_smoothing / 2.0, 1.0 - opts.label_smoothing / 2.0


def bernoulli_terms(x, opts: LossOptions, cp: float, cq: float, *, grad: bool = True):
    """Returns ``(cp·P(x) + cq·Q(x), d/dx of it)`` elementwise, in float32.

    The value is the sum of `bernoulli_parts`; see there for the formula.
    """
    parts, dvalue = bernoulli_parts(x, opts, cp, cq, grad=grad)
    return functools.reduce(jnp.add, parts), dvalue


def bernoulli_parts(x, opts: LossOptions, cp: float, cq: float, *, grad: bool = True):
    """Returns ``(parts, d/dx)``: arrays whose sum is ``cp·P(x) + cq·Q(x)``, in float32.

    With s = σ(x), sp = softplus:
        P  = pos_weight·α·(1−s)^γ·sp(−x),   P' = −pos_weight·α·(1−s)^γ·(γ·s·sp(−x) + (1−s))
        Q  = (1−α)·s^γ·sp(x),                Q' = (1−α)·s^γ·(γ·(1−s)·sp(x) + s)
    Powers are taken as exp(−γ·sp(∓x)) so x = ±1e4 stays finite. Terms whose
    coefficient is 0 are skipped at trace time. The gradient is None when
    ``grad=False``. With γ = 0 the value comes in parts (kq·relu(x),
    kp·relu(−x), (kq + kp)·log1p(exp(−|x|))): a blocked pass reduces each part
    on its own, which XLA:CPU runs faster than reducing their sum (loss-only sweep; docs/design.md
    "Measured choices").
    """
    x = x.astype(jnp.float32)
    gamma = float(opts.focal_gamma)
    alpha = opts.focal_alpha
    kp = cp * opts.pos_weight * (1.0 if alpha is None else alpha)
    kq = cq * (1.0 if alpha is None else 1.0 - alpha)
    use_p, use_q = kp != 0.0, kq != 0.0

    e = jnp.exp(-jnp.abs(x))
    log_term = jnp.log1p(e)
    relu = jnp.maximum(x, 0.0)
    # Terms are added only where present: a zeros_like start would be a
    # materialised tile in XLA:CPU's loop body.
    terms, dterms = [], []
    if gamma == 0.0:
        # sp(x) = relu(x) + log_term and sp(−x) = relu(−x) + log_term.
        if use_q:
            terms.append(kq * relu)
        if use_p:
            terms.append(kp * jnp.maximum(-x, 0.0))
        if use_p or use_q:
            terms.append((kq + kp) * log_term)
        # σ(±x) = 1/(1 + exp(∓x)) rather than from `e`: not sharing exp(−|x|)
        # lets XLA:CPU keep the loss and the gradient in separate fusions
        # without materialising `e` (docs/design.md "Measured choices").
        # Both are exact in relative terms for either sign of x.
        if grad and use_q:
            dterms.append(kq * jax.nn.sigmoid(x))
        if grad and use_p:
            dterms.append(-kp * jax.nn.sigmoid(-x))
    else:
        sp_pos = relu + log_term               # softplus(x)
        sp_neg = sp_pos - x                    # softplus(-x)
        inv = 1.0 / (1.0 + e)
        s = jnp.where(x >= 0, inv, e * inv)    # σ(x)
        one_minus_s = jnp.where(x >= 0, e * inv, inv)
        if use_q:
            s_pow = jnp.exp(-gamma * sp_neg)   # s^γ
            terms.append(kq * s_pow * sp_pos)
            if grad:
                dterms.append(kq * s_pow * (gamma * one_minus_s * sp_pos + s))
        if use_p:
            t_pow = jnp.exp(-gamma * sp_pos)   # (1−s)^γ
            terms.append(kp * t_pow * sp_neg)
            if grad:
                dterms.append(-kp * t_pow * (gamma * s * sp_neg + one_minus_s))
    parts = tuple(terms) if terms else (jnp.zeros_like(x),)
    dvalue = None
    if grad:
        dvalue = functools.reduce(jnp.add, dterms) if dterms else jnp.zeros_like(x)
    return parts, dvalue


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def bernoulli_value(x, opts: LossOptions, cp: float, cq: float):
    """``cp·P(x) + cq·Q(x)`` whose derivative is the analytic one of `bernoulli_terms`.

    Autodiff through the stable formula would rebuild 1 − σ(x) as
    softplus'(x) − 1 and lose it to cancellation at large |x|.
    """
    return bernoulli_terms(x, opts, cp, cq, grad=False)[0]


@bernoulli_value.defjvp
def _bernoulli_value_jvp(opts, cp, cq, primals, tangents):
    value, dvalue = bernoulli_terms(primals[0], opts, cp, cq, grad=True)
    return value, dvalue * tangents[0]


def elementwise_loss(x, y, opts: LossOptions):
    """Per-logit loss y'·P(x) + (1 − y')·Q(x) for a hard label y ∈ {0, 1} (float)."""
    ysoft = y * (1.0 - opts.label_smoothing) + opts.label_smoothing / 2.0
    return ysoft * bernoulli_value(x, opts, 1.0, 0.0) + (1.0 - ysoft) * bernoulli_value(x, opts, 0.0, 1.0)


def correction(target_logits, valid, opts: LossOptions):
    """The sparse part of the loss: Σ_{t∈T} (1 − ε)·[P(x_t) − Q(x_t)] per row.

    Args:
      target_logits: [M, L] float32 logits of the target ids (`targets.gather_logits`).
      valid: [M, L] bool, from `targets.local_targets`.
    Returns:
      correction [M] float32, differentiable through ``target_logits``.
    """
    c = 1.0 - opts.label_smoothing
    value = bernoulli_value(target_logits, opts, c, -c)
    return jnp.sum(jnp.where(valid, value, 0.0), axis=-1)


def correction_terms(target_logits, valid, opts: LossOptions, grad: bool):
    """(`correction` [M] f32, its derivative in each target logit [M, L] f32 or None without
    ``grad``): the sparse term as the fused sweep takes it (`recloss.sweep.Plan.sparse`)."""
    if not grad:
        return correction(target_logits, valid, opts), None
    value, vjp = jax.vjp(lambda x: correction(x, valid, opts), target_logits)
    return value, vjp(jnp.ones_like(value))[0]


def target_counts(target_logits, valid, threshold: float):
    """Per-row (true positives, number of targets) from the target logits [M, L]."""
    hit = valid & (target_logits > threshold)
    return jnp.sum(hit, axis=-1, dtype=jnp.float32), jnp.sum(valid, axis=-1, dtype=jnp.float32)
