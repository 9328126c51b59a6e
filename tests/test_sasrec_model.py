"""SASRec backbone: causality, padding isolation, tying, dropout, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recloss_plugins.sasrec.model import SASRec

pytestmark = pytest.mark.tier1


@nnx.jit
def _apply(m, ids, rng=None):
    return m(ids, rng=rng)


def _model(**kw):
    args = dict(vocab_rows=50, max_seq_len=12, emb_dim=16, num_layers=2, num_heads=4, mlp_dim=32,
                dropout=0.2, rngs=nnx.Rngs(0))
    args.update(kw)
    return SASRec(**args)


def test_causal_and_right_padding_never_reaches_real_positions(rng):
    m = _model()
    ids = jnp.asarray(rng.integers(1, 50, size=(3, 12)), jnp.int32)
    ids = ids.at[:, 7:].set(0)                       # 7 real items, then padding
    h = _apply(m, ids)
    changed = ids.at[:, 7:].set(jnp.asarray(rng.integers(1, 50, size=(3, 5)), jnp.int32))
    np.testing.assert_array_equal(np.asarray(_apply(m, changed)[:, :7]), np.asarray(h[:, :7]))
    later = ids.at[:, 4].set((ids[:, 4] % 49) + 1)
    h2 = _apply(m, later)
    np.testing.assert_array_equal(np.asarray(h2[:, :4]), np.asarray(h[:, :4]))
    assert np.abs(np.asarray(h2[:, 4:7] - h[:, 4:7])).max() > 1e-6


def test_tied_and_untied_tables_and_bias():
    tied = _model()
    assert tied.output_table() is not None
    np.testing.assert_array_equal(np.asarray(tied.output_table()), np.asarray(tied.item_emb.embedding[...]))
    assert tied.output_bias() is None
    untied = _model(untie_embeddings=True, use_output_bias=True, output_bias_init=-3.0)
    assert untied.output_table().shape == (50, 16)
    assert not np.array_equal(np.asarray(untied.output_table()), np.asarray(untied.item_emb.embedding[...]))
    np.testing.assert_array_equal(np.asarray(untied.output_bias()), np.full(50, -3.0, np.float32))


def test_dropout_only_with_a_key_and_reproducible(rng):
    m = _model()
    ids = jnp.asarray(rng.integers(1, 50, size=(2, 12)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(_apply(m, ids)), np.asarray(_apply(m, ids)))
    k = jax.random.key(1)
    a, b = _apply(m, ids, k), _apply(m, ids, k)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(np.asarray(a - _apply(m, ids))).max() > 1e-4
    assert np.abs(np.asarray(a - _apply(m, ids, jax.random.key(2)))).max() > 1e-4


def test_bfloat16_compute_keeps_float32_params(rng):
    m = _model(dtype=jnp.bfloat16)
    ids = jnp.asarray(rng.integers(1, 50, size=(2, 12)), jnp.int32)
    out = _apply(m, ids)
    assert out.dtype == jnp.bfloat16
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(m)))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(_apply(_model(), ids)), atol=0.1)
