"""The Bernoulli loss terms (P, Q) of the multi-label BCE objective, and its sparse target correction.

Every BCE strategy evaluates logits through one `Bernoulli` term (its `value_and_grad`, or at a
kernel tile its `tile`), so the blocked passes, the Pallas kernel and the dense baseline cannot
drift apart in their math. With soft label y' = y(1−ε) + ε/2 the element loss
y'·P + (1−y')·Q is linear in y', so a position's loss is a target-free
background Σ_v [(ε/2)·P + (1−ε/2)·Q] plus `correction` over its targets.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from recloss.options import LossOptions


def background_coefficients(opts: LossOptions):
    """(c_p, c_q) of the dense background Σ_v [c_p·P + c_q·Q]: (ε/2, 1 − ε/2) for label smoothing ε
    (docs/design.md "The BCE objective"); the sparse correction's coefficient is 1 − ε."""
    return opts.label_smoothing / 2.0, 1.0 - opts.label_smoothing / 2.0


class TileOut(NamedTuple):
    """What `Bernoulli.tile` gives for one [rows, bv] logit tile: ``lanes`` [rows, 128] f32 (the value
    summed over the tile's columns, 128 lanes a row; None without ``value``), ``dval`` [rows, bv] f32
    (∂value/∂x; None without ``grad``), ``clean``: dval is already 0 at every dead column, and
    ``positive`` [rows, bv] bool: x > 0 at the live columns, false at the dead ones (the γ = 0 tile's own
    comparison, which the metrics' count at threshold 0 shares; None where the tile has none)."""
    lanes: Any
    dval: Any
    clean: bool
    positive: Any = None


@dataclasses.dataclass(frozen=True)
class Bernoulli:
    """The per-logit term ``cp·P(x) + cq·Q(x)`` of the BCE objective, as one object: its value and
    derivative (`value_and_grad`), the same at a Mosaic kernel tile's least work (`tile`), and what that
    work costs (`transcendentals`, `temporaries`), which the kernel's cost estimate and VMEM tiling read.

    With s = σ(x) and softplus sp, k_p = cp·pos_weight·α, k_q = cq·(1 − α) (α-factors 1 without
    ``focal_alpha``) and γ = ``focal_gamma``:

        value = k_p·(1 − s)^γ·sp(−x) + k_q·s^γ·sp(x)
        γ = 0:  value = k_q·relu(x) + k_p·relu(−x) + (k_q + k_p)·log(1 + e),  e = exp(−|x|)
                d/dx  = k_q·s − k_p·(1 − s),   s = 1/(1 + e) for x > 0, e/(1 + e) else (1 − s the other)

    A kernel tile (γ = 0) takes one exp a logit (e, shared by the value and s), an approximate reciprocal
    refined by Newton steps for s, and the log once per 128 lanes: log Π_g (1 + e_g) over the tile's
    128-column groups g (each factor in (1, 2], so the product of 16 stays below 2^16), as log1p of
    the product less 1, built factor by factor so that small e keep their relative precision.
    """
    kp: float
    kq: float
    gamma: float

    @classmethod
    def of(cls, opts: LossOptions, cp: float, cq: float) -> "Bernoulli":
        alpha = opts.focal_alpha
        kp = cp * opts.pos_weight * (1.0 if alpha is None else alpha)
        kq = cq * (1.0 if alpha is None else 1.0 - alpha)
        return cls(float(kp), float(kq), float(opts.focal_gamma))

    @classmethod
    def background(cls, opts: LossOptions) -> "Bernoulli":
        """The dense background's term, (cp, cq) = `background_coefficients`."""
        return cls.of(opts, *background_coefficients(opts))

    # ------------------------------------------------------------ elementwise, any backend
    def value_and_grad(self, x, *, grad: bool = True):
        """(value, d value/dx or None) elementwise in float32: the sum of `parts` and their derivative."""
        parts, dvalue = self.parts(x, grad=grad)
        return functools.reduce(jnp.add, parts), dvalue

    def parts(self, x, *, grad: bool = True):
        """(parts, d value/dx or None): arrays whose sum is the value, in float32, exact in relative terms
        for either sign of x (x = ±1e4 stays finite: powers are taken as exp(−γ·sp(∓x))). With γ = 0
        (k_q·relu(x), k_p·relu(−x), (k_q + k_p)·log1p(e)), each present only where its coefficient is not
        0: the pure-JAX sweep reduces them one by one, which XLA:CPU runs faster than their sum, and
        σ(±x) is 1/(1 + exp(∓x)) rather than from e, which lets XLA:CPU keep the loss and the gradient in
        separate fusions without materialising e (docs/measurements.md "Measured choices")."""
        x = x.astype(jnp.float32)
        kp, kq, gamma = self.kp, self.kq, self.gamma
        e = jnp.exp(-jnp.abs(x))
        log_term = jnp.log1p(e)
        relu = jnp.maximum(x, 0.0)
        # Terms are added only where present: a zeros_like start would be a materialised tile in
        # XLA:CPU's loop body.
        terms, dterms = [], []
        if gamma == 0.0:
            if kq:
                terms.append(kq * relu)
            if kp:
                terms.append(kp * jnp.maximum(-x, 0.0))
            if kp or kq:
                terms.append((kq + kp) * log_term)
            if grad and kq:
                dterms.append(kq * jax.nn.sigmoid(x))
            if grad and kp:
                dterms.append(-kp * jax.nn.sigmoid(-x))
        else:
            sp_pos = relu + log_term               # softplus(x)
            sp_neg = sp_pos - x                    # softplus(-x)
            inv = 1.0 / (1.0 + e)
            s = jnp.where(x >= 0, inv, e * inv)    # σ(x)
            one_minus_s = jnp.where(x >= 0, e * inv, inv)
            if kq:
                s_pow = jnp.exp(-gamma * sp_neg)   # s^γ
                terms.append(kq * s_pow * sp_pos)
                if grad:
                    dterms.append(kq * s_pow * (gamma * one_minus_s * sp_pos + s))
            if kp:
                t_pow = jnp.exp(-gamma * sp_pos)   # (1−s)^γ
                terms.append(kp * t_pow * sp_neg)
                if grad:
                    dterms.append(-kp * t_pow * (gamma * s * sp_neg + one_minus_s))
        parts = tuple(terms) if terms else (jnp.zeros_like(x),)
        dvalue = None
        if grad:
            dvalue = functools.reduce(jnp.add, dterms) if dterms else jnp.zeros_like(x)
        return parts, dvalue

    # ------------------------------------------------------------ a Mosaic kernel's tile
    def tile(self, x, live, *, value: bool, grad: bool, newton: int = 2) -> TileOut:
        """The term over one [rows, bv] tile of logits ``x`` (f32, bv a multiple of 128) whose live
        columns are ``live`` [1, bv] (None: all): the value summed into 128 lanes a row and the
        derivative, dead columns contributing nothing. γ = 0 at the least work (see the class), the
        approximate reciprocal refined by ``newton`` steps (each doubles its bits: a v5e's and the
        interpreter's are bfloat16-close, ~2⁻⁸; two reach float32's 2⁻²⁴, one 2⁻¹⁶, enough where the
        derivative is rounded to 16 bits before any use, `recloss.bce.kernel.newton_steps`; one left dA
        2e-4 off the float32 sweep on the chip at 'highest' precision); any γ by `value_and_grad`, masked."""
        if self.gamma != 0.0:
            val, dval = self.value_and_grad(x, grad=grad)
            lanes = None
            if value:
                lanes = _lane_fold(val if live is None else jnp.where(live, val, 0.0))
            return TileOut(lanes, dval, live is None)
        from jax.experimental import pallas as pl

        kp, kq = self.kp, self.kq
        if live is not None:     # a dead column: e = 0, 1 + e = 1, relu(x) = 0, σ(x) = 0 (its k_p part is masked)
            x = jnp.where(live, x, -jnp.inf)
        e = jnp.exp(-jnp.abs(x))
        d = 1.0 + e
        pos = x > 0.0
        lanes = dval = None
        if value:
            # (a product by a coefficient of 1 is not left to the compiler: Mosaic keeps it; docs/measurements.md)
            scaled = lambda k, y: y if k == 1.0 else k * y
            lin = scaled(kq, jnp.where(pos, x, 0.0)) if kq else None
            if kp:
                neg = jnp.where(pos, 0.0, -x)
                if live is not None:
                    neg = jnp.where(live, neg, 0.0)
                lin = scaled(kp, neg) if lin is None else lin + scaled(kp, neg)
            # log Π_g (1 + e_g) = log1p(q), q = Π_g (1 + e_g) − 1 taken as q·(1 + e_g) + e_g: relative to its
            # value where every e is small (a trained model's logits), where 1 + e itself would keep e only
            # to 2⁻²⁴ absolute (a lone logit at −10.4 was 1e-3 off)
            ge, gd = _lane_groups(e), _lane_groups(d)
            q = ge[0]
            for e_g, d_g in zip(ge[1:], gd[1:]):
                q = q * d_g + e_g
            lanes = scaled(kq + kp, _log1p(q))
            if lin is not None:
                lanes = lanes + _lane_fold(lin)
        if grad:
            r = pl.reciprocal(d, approx=True)
            for _ in range(newton):
                r = r * (2.0 - d * r)
            er = e * r
            dval = jnp.where(pos, r, er)                  # σ(x); x = 0 gives 1/2 either way
            if kq != 1.0:
                dval = kq * dval
            if kp:                                        # − k_p·(1 − σ(x)), from e: exact for x ≫ 0
                dval = dval - kp * jnp.where(pos, er, r)
        return TileOut(lanes, dval, live is None or kp == 0.0, pos)

    def transcendentals(self, *, value: bool, grad: bool, bv: int) -> float:
        """Transcendental (EUP) operations a logit costs in `tile`: exp, the reciprocal (gradient) and
        the log of the value's lane product and its Newton step's exp, once per bv/128 logits; the focal
        powers with γ ≠ 0."""
        if self.gamma != 0.0:
            return 3 + sum(k != 0.0 for k in (self.kp, self.kq))
        return 1 + (1 if grad else 0) + (2 * 128 / bv if value else 0)

    def temporaries(self, *, value: bool, grad: bool) -> int:
        """[rows, bv] float32 tiles of VMEM `tile` needs beside the logits, for the kernels' tiling. Mosaic
        keeps the elementwise chain in registers a slice at a time: compiled for a v5e, the γ = 0 fused
        tile's least vmem_limit_bytes grew by about 1.5 tiles per tile of bs·bv (bs 512 → 1024, bv 1024 →
        2048 at D = 256); the focal chain holds more."""
        if self.gamma != 0.0:
            return 6 if grad else 4
        return 2 if grad else 1


def _log1p(q):
    """log(1 + q) elementwise for float32 q ≥ 0 (the kernel's lanes): a series below 2⁻⁴ (its first omitted
    term 2⁻²⁴ relative; a few float32 ulps off a chip, exp's error on one), above it the log of 1 + q
    refined by one Newton step (a TPU's float32 log is ~1e-5 off). The step's residual carries exp's
    relative error into y as an absolute one: ~1e-7 off a chip (2e-6 relative at most), up to a v5e's
    8e-6 on one (2.8e-6 measured, 3.2e-5 relative at y = 0.086)."""
    u = 1.0 + q
    y = jnp.log(u)
    y = y + (u * jnp.exp(-y) - 1.0)
    c = 1.0 / 5.0 - q / 6.0
    for k in (4.0, 3.0, 2.0):
        c = 1.0 / k - q * c
    series = q * (1.0 - q * c)
    return jnp.where(q < 2.0 ** -4, series, y)


def _lane_groups(x):
    """The lane-aligned [rows, 128] column groups of ``x`` [rows, k·128], in column order."""
    return [x[:, k * 128:(k + 1) * 128] for k in range(x.shape[1] // 128)]


def _lane_fold(x):
    """[rows, k·128] → [rows, 128] by adding the lane-aligned column groups."""
    groups = _lane_groups(x)
    return functools.reduce(jnp.add, groups)


def bernoulli_terms(x, opts: LossOptions, cp: float, cq: float, *, grad: bool = True):
    """Returns ``(cp·P(x) + cq·Q(x), d/dx of it)`` elementwise, in float32 (`Bernoulli.value_and_grad`)."""
    return Bernoulli.of(opts, cp, cq).value_and_grad(x, grad=grad)


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
