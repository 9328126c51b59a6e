"""SASRec with a GPT-2-style causal transformer backbone (Flax NNX).

    h_0 = E_item[ids] + E_pos[0..N-1]
    h_l = h_{l-1} + Attn(LN(h_{l-1}));  h_l = h_l + MLP(LN(h_l))     (pre-LN, causal)
    A   = LN_f(h_layers)                                              [B, N, D]

The output table is E_item itself (tied, default) or a separate [V, D] table.
Inputs are right-padded with id 0, so causal attention alone keeps padding out
of every real position. Dropout takes an explicit key (no RNG state in the
module), so the parameters are the module's only state.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(name: str):
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def _dropout(x, rate: float, keep):
    """Inverted dropout with a precomputed keep mask (None = off)."""
    if keep is None:
        return x
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


class Block(nnx.Module):
    """Pre-LN transformer block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, dropout: float, num_layers: int, dtype,
                 *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        # GPT-2: residual projections scaled by 1/sqrt(2·layers).
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * num_layers))
        self.heads, self.dropout = heads, dropout
        self.ln1 = nnx.LayerNorm(dim, epsilon=1e-5, dtype=dtype, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, kernel_init=init, dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, kernel_init=out_init, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, epsilon=1e-5, dtype=dtype, rngs=rngs)
        self.fc = nnx.Linear(dim, mlp_dim, kernel_init=init, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(mlp_dim, dim, kernel_init=out_init, dtype=dtype, rngs=rngs)

    def __call__(self, x, keep_attn=None, keep_mlp=None):
        b, n, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        shape = (b, n, self.heads, d // self.heads)
        att = jax.nn.dot_product_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape),
                                           is_causal=True)
        x = x + _dropout(self.proj(att.reshape(b, n, d)), self.dropout, keep_attn)
        h = self.out(jax.nn.gelu(self.fc(self.ln2(x))))
        return x + _dropout(h, self.dropout, keep_mlp)


class SASRec(nnx.Module):
    """Causal sequential recommender producing hidden states for a full-catalogue loss head (BCE or softmax).

    Args:
      vocab_rows: rows of the item table (real V, or V padded for even sharding;
        id 0 = padding).
      max_seq_len: N (learned positions). emb_dim: D. num_layers, num_heads,
        mlp_dim, dropout: backbone sizes.
      dtype: compute dtype (parameters are float32, but the item tables).
      table_dtype: the item tables' parameter dtype (float32, or bfloat16: half the table's HBM; the
        trainer rounds their updates stochastically, `optim.stochastic_round`).
      untie_embeddings: separate output table instead of the input embedding.
      use_output_bias: a learned [V] logit bias, initialised to
        ``output_bias_init`` (e.g. the base-rate logit log(p/(1-p)), p = L/V, so
        BCE training starts at the loss of the base rate instead of log 2; a
        constant bias does not change a softmax loss).
    """

    def __init__(self, *, vocab_rows: int, max_seq_len: int, emb_dim: int, num_layers: int,
                 num_heads: int, mlp_dim: int, dropout: float = 0.0, dtype=jnp.float32,
                 untie_embeddings: bool = False, use_output_bias: bool = False, output_bias_init: float = 0.0,
                 table_dtype=jnp.float32, rngs: nnx.Rngs):
        if emb_dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide emb_dim={emb_dim}")
        init = nnx.initializers.normal(0.02)
        self.dtype, self.dropout = dtype, dropout
        self.item_emb = nnx.Embed(vocab_rows, emb_dim, embedding_init=init, param_dtype=table_dtype, rngs=rngs)
        self.pos_emb = nnx.Embed(max_seq_len, emb_dim, embedding_init=init, rngs=rngs)
        self.blocks = nnx.List([Block(emb_dim, num_heads, mlp_dim, dropout, num_layers, dtype, rngs=rngs)
                                for _ in range(num_layers)])
        self.ln_f = nnx.LayerNorm(emb_dim, epsilon=1e-5, dtype=dtype, rngs=rngs)
        self.out_table = (nnx.Param(init(rngs.params(), (vocab_rows, emb_dim), table_dtype))
                          if untie_embeddings else None)
        self.out_bias = nnx.Param(jnp.full((vocab_rows,), output_bias_init, jnp.float32)) if use_output_bias else None

    def dropout_keep(self, rng: Optional[jax.Array], batch_shape):
        """The keep masks of one step's dropout: bool [1 + 2·layers, B, N, D] drawn from ``rng`` for
        ids of ``batch_shape`` (B, N), or None (no key, or dropout 0). One draw for every dropout
        site: a single RNG kernel compiles and runs much faster than one per site."""
        if rng is None or self.dropout <= 0:
            return None
        sites = 1 + 2 * len(self.blocks)
        return jax.random.bernoulli(rng, 1.0 - self.dropout,
                                    (sites, *batch_shape, self.item_emb.embedding.shape[1]))

    def __call__(self, ids, *, rng: Optional[jax.Array] = None, keep=None, item_vectors=None):
        """ids [B, N] int (0 = padding, right-padded) -> hidden [B, N, D] in the compute dtype.

        ``rng``: a key enables dropout (training); None = deterministic. ``keep``: the masks
        `dropout_keep` draws, given instead of ``rng`` (a step that draws them for the whole batch
        and runs the model on a part). ``item_vectors`` [B, N, D]: the item embeddings of ``ids``
        when the caller has looked them up (`tied_lookup`)."""
        n = ids.shape[1]
        if n > self.pos_emb.num_embeddings:
            raise ValueError(f"sequence length {n} exceeds max_seq_len={self.pos_emb.num_embeddings}")
        items = self.item_emb(ids) if item_vectors is None else item_vectors
        x = (items + self.pos_emb(jnp.arange(n))[None]).astype(self.dtype)
        if keep is None:
            keep = self.dropout_keep(rng, ids.shape)
        if keep is None:
            keep = [None] * (1 + 2 * len(self.blocks))
        x = _dropout(x, self.dropout, keep[0])
        for layer, block in enumerate(self.blocks):
            x = block(x, keep[1 + 2 * layer], keep[2 + 2 * layer])
        return self.ln_f(x)

    def output_table(self):
        """[V, D] table (its parameter dtype) of the logits x = A·tableᵀ (+ bias)."""
        return self.item_emb.embedding[...] if self.out_table is None else self.out_table[...]

    def output_bias(self):
        """[V] float32 or None."""
        return None if self.out_bias is None else self.out_bias[...]


@jax.custom_vjp
def tied_lookup(table, ids):
    """(table, table[ids]): a tied table and its rows at ids [B, N], whose gradient is written once.

    The backward scatter-adds the rows' cotangent into the table's own cotangent (the output
    layer's dE) in place, so the step holds one table-sized gradient where autodiff of two uses
    sums two (the lookup's scatter into zeros, and dE)."""
    return table, jnp.take(table, ids, axis=0)


def _tied_lookup_fwd(table, ids):
    return tied_lookup(table, ids), ids


def _tied_lookup_bwd(ids, cts):
    de, dx = cts
    rows = dx.reshape(-1, dx.shape[-1]).astype(de.dtype)
    return de.at[ids.reshape(-1)].add(rows), None


tied_lookup.defvjp(_tied_lookup_fwd, _tied_lookup_bwd)
