"""The proposal q of the sampled objectives and the draw of their negatives.

``log_q [V]`` holds log proposal probabilities (any constant offset: it is
normalised over the real V here). Negatives are K ids drawn i.i.d. *with
replacement* from q by inverse CDF (O(V + K·log V), never a [K, V] array);
the same key gives the same ids, under jit and on every shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The correction −log(K·q) of a target whose q is 0 (never drawn) is capped at −log(K·TINY): finite.
LOG_Q_FLOOR = float(np.log(np.finfo(np.float32).tiny))


def log_q_from_counts(counts, alpha: float = 1.0):
    """Log proposal probabilities from item counts: ``log_q_v = log(c_v^α / Σ_u c_u^α)``.

    Args:
      counts: [V] non-negative item counts (the training split's; an id with count 0
        is never drawn). alpha: exponent α ≥ 0 (0 = uniform over the ids with c > 0,
        1 = proportional to counts, the usual logQ of popularity).
    Returns:
      [V] float32 (−inf where c_v = 0).
    """
    c = jnp.asarray(counts)
    if c.ndim != 1 or c.shape[0] == 0:
        raise ValueError(f"counts must have shape [V] with V >= 1, got shape {tuple(c.shape)}")
    if not (jnp.issubdtype(c.dtype, jnp.integer) or jnp.issubdtype(c.dtype, jnp.floating)):
        raise TypeError(f"counts must be numeric, got dtype {c.dtype}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not np.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha={alpha!r} is invalid: expected a finite float >= 0")
    host = _concrete(c)
    if host is not None:
        host = host.astype(np.float64)
        if not np.all(np.isfinite(host)) or np.any(host < 0):
            bad = host[~(np.isfinite(host) & (host >= 0))][0]
            raise ValueError(f"counts must be finite and >= 0, got {float(bad)!r}")
        if not np.any(host > 0):
            raise ValueError("counts are all 0: no item can be drawn")
    c = c.astype(jnp.float32)
    return jax.nn.log_softmax(jnp.where(c > 0, alpha * jnp.log(jnp.where(c > 0, c, 1.0)), -jnp.inf))


def _concrete(x):
    """``x`` as numpy when its values are known (not a tracer under jit), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def proposal(log_q, *, rows: int, vocab_size: int):
    """``log_q`` checked and normalised over the real V: [vocab_size] float32 (None = uniform, −log V).

    Accepts shape [vocab_size] or [rows] (the table's, entries past vocab_size ignored).
    Values are checked when concrete (not under jit): NaN or +inf is an error, −inf means q = 0.
    """
    if log_q is None:
        return jnp.full((vocab_size,), -np.log(vocab_size), jnp.float32)
    if not hasattr(log_q, "shape"):
        log_q = jnp.asarray(log_q)
    shapes = sorted({(vocab_size,), (rows,)})
    if tuple(log_q.shape) not in shapes:
        raise ValueError(f"log_q must have shape {' or '.join(map(str, shapes))} (one log probability per "
                         f"item), got {tuple(log_q.shape)}")
    if not jnp.issubdtype(log_q.dtype, jnp.floating):
        raise TypeError(f"log_q must be a floating array, got dtype {log_q.dtype}")
    log_q = jnp.asarray(log_q)[:vocab_size].astype(jnp.float32)
    host = _concrete(log_q)
    if host is not None:
        if np.any(np.isnan(host)) or np.any(host == np.inf):
            i = int(np.flatnonzero(np.isnan(host) | (host == np.inf))[0])
            raise ValueError(f"log_q[{i}]={float(host[i])!r} is invalid: expected finite log probabilities "
                             "(or -inf for an item never drawn)")
        if np.all(host == -np.inf):
            raise ValueError("log_q is -inf everywhere: no item can be drawn")
    return jax.nn.log_softmax(log_q)


def draw(key, log_q, k: int):
    """K ids [K] int32 drawn with replacement from q = exp(log_q) (log_q [V] normalised)."""
    v = log_q.shape[0]
    cdf = jnp.cumsum(jnp.exp(log_q))
    u = jax.random.uniform(key, (k,), jnp.float32) * cdf[-1]
    # side='right': the first id whose cdf exceeds u, so an id with q = 0 (a flat cdf step) is never drawn.
    ids = jnp.searchsorted(cdf, u, side="right")
    return jnp.clip(ids, 0, v - 1).astype(jnp.int32)


def check_key(key):
    """Raises unless ``key`` is a `jax.random` key (a typed key, or uint32 key data of the default implementation's shape)."""
    if key is None:
        raise ValueError("recloss.sampled_loss needs key=: a jax.random key (e.g. jax.random.key(step)) that "
                         "draws the negatives; the same key gives the same negatives and loss")
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"key must be a single jax.random key, got a key array of shape {key.shape}")
        return key
    # Raw key data has the default PRNG implementation's shape: (2,) for threefry, (4,) for rbg.
    data_shape = tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape)
    if dtype == jnp.uint32 and tuple(key.shape) == data_shape:
        return jax.random.wrap_key_data(key)
    raise TypeError(f"key must be a jax.random key (jax.random.key(seed)) or uint32 key data of shape {data_shape}, "
                    f"got {type(key).__name__} with dtype {dtype} and shape {getattr(key, 'shape', None)}")
