"""The proposal q of the sampled objectives and the draw of their negatives.

``log_q`` holds log proposal weights, one per table row (any constant offset: it is normalised
over the real V). The proposal lives where the table does: each vocab shard holds the entries of
its own rows (`masked` lays them out; 4 bytes a row), and the draw and the log q of any id are
computed from those shards with collectives of K or of the ids' size, never a [V] array on one
chip. ``log_q=None`` is uniform over the V ids and needs no array at all.

Negatives are K ids drawn i.i.d. *with replacement* from q by inverse CDF in two levels (which
shard, from the shards' masses; which row, from that shard's cumulative weights): O(V/S + K·log V)
per shard, never a [K, V] array. The same key gives the same ids on every shard and under jit; the
ids may differ between meshes where a uniform lands within float rounding of a CDF step.
"""

from __future__ import annotations

from typing import Optional

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
    A host-side reference (`recloss.bias`); the loss itself keeps the proposal sharded (`masked`, `Local`).

    Accepts shape [vocab_size] or [rows] (the table's, entries past vocab_size ignored).
    Values are checked when concrete (not under jit): NaN or +inf is an error, −inf means q = 0.
    """
    if log_q is None:
        return jnp.full((vocab_size,), -np.log(vocab_size), jnp.float32)
    return jax.nn.log_softmax(_checked(log_q, rows=rows, vocab_size=vocab_size)[:vocab_size])


def _checked(log_q, *, rows: int, vocab_size: int):
    """``log_q`` as float32 of shape [vocab_size] or [rows], its shape, dtype and (when concrete) values checked."""
    if not hasattr(log_q, "shape"):
        log_q = jnp.asarray(log_q)
    shapes = sorted({(vocab_size,), (rows,)})
    if tuple(log_q.shape) not in shapes:
        raise ValueError(f"log_q must have shape {' or '.join(map(str, shapes))} (one log probability per "
                         f"item), got {tuple(log_q.shape)}")
    if not jnp.issubdtype(log_q.dtype, jnp.floating):
        raise TypeError(f"log_q must be a floating array, got dtype {log_q.dtype}")
    log_q = jnp.asarray(log_q).astype(jnp.float32)
    host = _concrete(log_q[:vocab_size])
    if host is not None:
        if np.any(np.isnan(host)) or np.any(host == np.inf):
            i = int(np.flatnonzero(np.isnan(host) | (host == np.inf))[0])
            raise ValueError(f"log_q[{i}]={float(host[i])!r} is invalid: expected finite log probabilities "
                             "(or -inf for an item never drawn)")
        if np.all(host == -np.inf):
            raise ValueError("log_q is -inf everywhere: no item can be drawn")
    return log_q


def masked(log_q, *, rows: int, vocab_size: int):
    """``log_q`` (checked by `proposal` when concrete) as the [rows] float32 weights the shards hold:
    entries at or past vocab_size are −inf (never drawn); None stays None (uniform)."""
    if log_q is None:
        return None
    log_q = _checked(log_q, rows=rows, vocab_size=vocab_size)
    if log_q.shape[0] < rows:
        log_q = jnp.pad(log_q, (0, rows - log_q.shape[0]), constant_values=-np.inf)
    return jnp.where(jnp.arange(rows) < vocab_size, log_q, -np.inf)


class Local:
    """The proposal as one vocab shard sees it: ``shifted`` [V_local] = log_q − max (the global max),
    ``log_mass`` the global log Σ exp(shifted); log q_v = shifted_v − log_mass. ``shard`` (a
    `recloss.shard.VocabShard`, or None for the whole table on one device) says which rows are here
    and sums over the vocab shards."""

    def __init__(self, log_q, shard=None):
        self.shard = shard
        vmax = (lambda x: x) if shard is None else shard.vocab_max
        top = vmax(jnp.max(log_q))
        self.shifted = log_q - top
        self.weights = jnp.exp(self.shifted)
        self.log_mass = jnp.log(self._vocab_sum(jnp.sum(self.weights)))

    def _vocab_sum(self, x):
        return x if self.shard is None else self.shard.vocab_sum(x)

    @property
    def offset(self):
        return 0 if self.shard is None else self.shard.offset

    def log_q_at(self, ids):
        """log q of global ``ids`` (any shape) float32: each shard reads the ids it owns."""
        local = ids - self.offset
        own = (local >= 0) & (local < self.shifted.shape[0])
        x = jnp.take(self.shifted, jnp.where(own, local, 0), axis=0)
        return self._vocab_sum(jnp.where(own, x, 0.0)) - self.log_mass

    def draw(self, key, k: int):
        """K global ids [K] int32 from q, the same on every shard (see the module docstring)."""
        n = self.shifted.shape[0]
        cdf = jnp.cumsum(self.weights)
        if self.shard is None or not self.shard.vocab_axes:
            index, count = 0, 1
        else:
            index, count = self.offset // n, jax.lax.psum(1, self.shard.vocab_axes)
        masses = self._vocab_sum(jnp.zeros((count,), jnp.float32).at[index].set(cdf[-1]))   # [S], shard order
        cum = jnp.cumsum(masses)
        u = jax.random.uniform(key, (k,), jnp.float32) * cum[-1]
        # side='right' everywhere: an empty step (a shard or an id of weight 0) is never chosen; the
        # clips to the last shard / row of weight > 0 catch u rounding onto the top of the CDF.
        last = lambda w: jnp.max(jnp.where(w > 0, jnp.arange(w.shape[0]), 0))
        which = jnp.minimum(jnp.searchsorted(cum, u, side="right"), last(masses))
        start = cum[index] - masses[index]
        local = jnp.minimum(jnp.searchsorted(cdf, u - start, side="right"), last(self.weights))
        return self._vocab_sum(jnp.where(which == index, self.offset + local, 0)).astype(jnp.int32)


def local(log_q, shard=None) -> Optional[Local]:
    """`Local` of this shard's [V_local] weights ``log_q`` (`masked`; the whole [rows] with ``shard``
    None, on one device), or None (uniform) for None."""
    return None if log_q is None else Local(log_q, shard)


def draw(key, proposal: Optional[Local], k: int, *, vocab_size: int):
    """K ids [K] int32 drawn with replacement from the shard's ``proposal`` (`local`), or uniformly
    over [0, vocab_size) for None."""
    if proposal is None:
        return jax.random.randint(key, (k,), 0, vocab_size, jnp.int32)
    return proposal.draw(key, k)


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
