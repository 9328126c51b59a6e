"""recloss.targets against plain-Python/numpy references on random ids: dedup, padding, invalid ids,
vocab offsets, and the gather of target logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recloss import targets

pytestmark = pytest.mark.tier1


def _random_ids(rng, m, l, v, pad_id=-1):
    """[m, l] ids with duplicates, padding and out-of-range ids mixed in."""
    ids = rng.integers(0, v, size=(m, l))
    ids[rng.random((m, l)) < 0.2] = pad_id
    ids[rng.random((m, l)) < 0.1] = v + rng.integers(0, 5)           # too large
    ids[rng.random((m, l)) < 0.05] = -7 if pad_id != -7 else -8      # negative, not padding
    dup = rng.random((m, l)) < 0.2
    ids[:, 1:][dup[:, 1:]] = ids[:, :-1][dup[:, 1:]]                  # repeat the previous id
    ids[0] = pad_id                                                   # an all-padding row
    return ids


def _expected_sets(ids, pad_id, vocab_size, lo, hi):
    """Per row, the set of valid ids owned by the shard [lo, hi)."""
    return [{int(t) for t in row if t != pad_id and 0 <= t < vocab_size and lo <= t < hi} for row in ids]


@pytest.mark.parametrize("pad_id", [-1, 0])
@pytest.mark.parametrize("offset,v_local", [(0, 37), (20, 17), (30, 16)])
def test_local_targets_keep_each_owned_valid_id_once(pad_id, offset, v_local):
    rng = np.random.default_rng(offset + v_local + pad_id)
    vocab_size = 43   # the last shard's rows past 43 are padding rows
    ids = _random_ids(rng, 29, 9, vocab_size, pad_id)
    local, valid = targets.local_targets(jnp.asarray(ids), pad_id, offset, v_local, vocab_size)
    local, valid = np.asarray(local), np.asarray(valid)
    want = _expected_sets(ids, pad_id, vocab_size, offset, offset + v_local)
    for i, row in enumerate(want):
        got = [int(x) + offset for x, ok in zip(local[i], valid[i]) if ok]
        assert sorted(got) == sorted(row), (i, ids[i])
        assert len(got) == len(set(got))                           # duplicates count once
    assert np.all(local[~valid] == 0) and np.all((local >= 0) & (local < v_local))
    assert not valid[0].any()                                       # the all-padding row


def test_local_targets_with_a_traced_offset_match_a_static_one():
    rng = np.random.default_rng(1)
    ids = jnp.asarray(_random_ids(rng, 16, 6, 50))
    static = targets.local_targets(ids, -1, 25, 25, 50)
    traced = jax.jit(lambda off: targets.local_targets(ids, -1, off, 25, 50))(jnp.int32(25))
    for a, b in zip(static, traced):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unique_sorted_marks_first_occurrences():
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 6, size=(40, 7))
    srt, first = map(np.asarray, targets.unique_sorted(jnp.asarray(ids)))
    np.testing.assert_array_equal(srt, np.sort(ids, axis=-1))
    for row, mask in zip(srt, first):
        assert list(row[mask]) == sorted(set(row.tolist()))


@pytest.mark.parametrize("pad_id", [-1, 3])
def test_invalid_count_counts_every_non_pad_out_of_range_entry(pad_id):
    rng = np.random.default_rng(3)
    ids = _random_ids(rng, 31, 8, 40, pad_id)
    want = sum(1 for t in ids.ravel() if t != pad_id and not 0 <= t < 40)
    assert want > 0
    assert float(targets.invalid_count(jnp.asarray(ids), pad_id, 40)) == want


@pytest.mark.parametrize("with_bias", [False, True])
def test_gather_logits_equals_the_dense_logits_at_the_ids(with_bias):
    rng = np.random.default_rng(4)
    m, l, v, d = 13, 5, 61, 23
    hidden = rng.standard_normal((m, d)).astype(np.float32)
    table = rng.standard_normal((v, d)).astype(np.float32)
    bias = rng.standard_normal(v).astype(np.float32) if with_bias else None
    ids = rng.integers(0, v, size=(m, l))
    got = np.asarray(targets.gather_logits(jnp.asarray(hidden), jnp.asarray(table),
                                           None if bias is None else jnp.asarray(bias), jnp.asarray(ids)))
    dense = hidden.astype(np.float64) @ table.astype(np.float64).T + (0.0 if bias is None else bias)
    np.testing.assert_allclose(got, np.take_along_axis(dense, ids, axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunked", [False, True], ids=["one_scatter", "chunks"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gather_logits_vjp_equals_autodiff(chunked, dtype, monkeypatch):
    # The own VJP (one scatter, or a chain of chunk scatters with a shorter last chunk) against
    # autodiff of the plain gather, with repeated ids across chunks, in the table's dtype.
    if chunked:
        monkeypatch.setattr(targets, "SCATTER_ONE_ROWS", 8)
        monkeypatch.setattr(targets, "SCATTER_ROWS", 6)
    rng = np.random.default_rng(5)
    m, l, v, d = 29, 4, 11, 16
    hidden = jnp.asarray(rng.standard_normal((m, d)), dtype)
    table = jnp.asarray(rng.standard_normal((v, d)), dtype)
    bias = jnp.asarray(rng.standard_normal(v), dtype)
    ids = jnp.asarray(rng.integers(0, v, size=(m, l)))
    ct = jnp.asarray(rng.standard_normal((m, l)), jnp.float32)
    _, vjp = jax.vjp(lambda h, e, b: targets.gather_logits(h, e, b, ids), hidden, table, bias)
    # Autodiff of the plain forward (jnp.take, einsum) is the reference for the hand-written VJP.
    plain = lambda h, e, b: (jnp.einsum("md,mld->ml", h, jnp.take(e, ids, axis=0),
                                        preferred_element_type=jnp.float32)
                             + jnp.take(b, ids, axis=0).astype(jnp.float32))
    _, ref = jax.vjp(plain, hidden, table, bias)
    tol = 1e-5 if dtype == jnp.float32 else 5e-2
    for got, want in zip(vjp(ct), ref(ct)):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol * 4)
