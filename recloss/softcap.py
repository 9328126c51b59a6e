"""The logit soft cap (`LossOptions.logit_soft_cap`): every logit x = a·e + b becomes c·tanh(x/c)
before anything else reads it, and its gradient picks up the factor 1 − tanh²(x/c).

`capped` gives the value and that factor, for the sweeps and kernels that write their gradient by
hand; `soft_cap` is the same value with that derivative for autodiff (the dense baselines, the
gathered target logits). With ``cap=None`` both return x itself: nothing is traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def capped(x, cap, *, grad: bool = False):
    """(y, dy/dx) of f32 logits x (any shape): y = c·tanh(x/c), dy/dx = (1 − t)(1 + t) with
    t = tanh(x/c), None without ``grad``; (x, None) when ``cap`` is None."""
    if cap is None:
        return x, None
    t = jnp.tanh(x * (1.0 / cap))
    return cap * t, ((1.0 - t) * (1.0 + t) if grad else None)


def soft_cap(x, cap):
    """c·tanh(x/c) of f32 logits x (any shape), differentiable with the derivative of `capped`;
    x itself when ``cap`` is None."""
    if cap is None:
        return x
    return _soft_cap(x, float(cap))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _soft_cap(x, cap):
    return capped(x, cap)[0]


@_soft_cap.defjvp
def _soft_cap_jvp(cap, primals, tangents):
    y, dy = capped(primals[0], cap, grad=True)
    return y, dy * tangents[0]
