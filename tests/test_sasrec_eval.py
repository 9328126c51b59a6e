"""Blocked top-K against a dense argsort, ranking metrics against hand computation."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from recloss_plugins.sasrec import eval as E

pytestmark = pytest.mark.tier1


def _dense_top_k(h, e, b, k, vocab_size, pad_id=0):
    s = h.astype(np.float64) @ e.astype(np.float64).T
    if b is not None:
        s = s + b
    s[:, pad_id] = -np.inf
    s[:, vocab_size:] = -np.inf
    return np.argsort(-s, axis=1, kind="stable")[:, :k], np.sort(s, axis=1)[:, ::-1][:, :k]


@pytest.mark.parametrize("rows, vocab, block_v, k, bias", [
    (507, 507, 64, 8, False),      # blocks do not divide V
    (512, 501, 128, 10, True),     # padded table rows past V are never returned
    (300, 300, 1000, 5, False),    # one block larger than the table
    (97, 97, 7, 12, True),         # K larger than the block
])
def test_blocked_top_k_matches_dense(rng, rows, vocab, block_v, k, bias):
    u, d = 23, 16
    h = rng.normal(size=(u, d)).astype(np.float32)
    e = rng.normal(size=(rows, d)).astype(np.float32)
    b = rng.normal(size=rows).astype(np.float32) if bias else None
    e[0] = 10 * h.mean(0)          # the padding row would win everywhere if it were allowed
    scores, ids = E.blocked_top_k(jnp.asarray(h), jnp.asarray(e), None if b is None else jnp.asarray(b),
                                  k=k, block_v=block_v, vocab_size=vocab)
    ref_ids, ref_scores = _dense_top_k(h, e, b, k, vocab)
    np.testing.assert_allclose(np.asarray(scores), ref_scores, rtol=1e-4, atol=1e-4)
    # Ids agree wherever scores are not tied within float32 noise.
    gaps = np.diff(ref_scores, axis=1)
    clear = np.ones_like(ref_ids, bool)
    clear[:, 1:] &= np.abs(gaps) > 1e-3
    clear[:, :-1] &= np.abs(gaps) > 1e-3
    assert np.array_equal(np.asarray(ids)[clear], ref_ids[clear])
    assert not (np.asarray(ids) == 0).any() and (np.asarray(ids) < vocab).all()


def test_blocked_top_k_with_fewer_items_than_k():
    h = jnp.ones((2, 4))
    e = jnp.arange(24, dtype=jnp.float32).reshape(6, 4)
    scores, ids = E.blocked_top_k(h, e, k=8, block_v=4, vocab_size=4)   # real items: 1, 2, 3
    assert np.asarray(ids)[0].tolist() == [3, 2, 1, -1, -1, -1, -1, -1]
    assert np.isneginf(np.asarray(scores)[0, 3:]).all()


def test_ranking_metrics_by_hand():
    top = np.array([[5, 3, 9, 1],      # targets {3, 1, 7}: hits at ranks 1 and 3
                    [2, 4, 6, 8],      # targets {1}: miss
                    [7, 1, 2, 3],      # targets {7, 7, pad}: one unique target, hit at rank 0
                    [1, 2, 3, 4]])     # no valid targets: excluded
    targets = np.array([[3, 1, 7, 0], [1, 0, 0, 0], [7, 7, 0, 0], [0, 0, 0, 0]])
    m = E.ranking_metrics(top, targets)
    d = [1 / math.log2(r + 2) for r in range(4)]
    np.testing.assert_allclose(np.asarray(m["hit"]), [1, 0, 1, 0])
    np.testing.assert_allclose(np.asarray(m["recall"]), [2 / 3, 0, 1, 0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(m["ndcg"]), [(d[1] + d[3]) / (d[0] + d[1] + d[2]), 0, 1, 0],
                               rtol=1e-6)
    assert np.asarray(m["valid"]).tolist() == [True, True, True, False]
    s = E.summarize(m, 4)
    assert s["users"] == 3 and s["hit@4"] == pytest.approx(2 / 3)


def test_popularity_top_k_never_returns_padding():
    counts = np.array([100, 5, 9, 9, 0, 7])
    assert E.popularity_top_k(counts, 3).tolist() == [2, 3, 5]    # ties: smaller id first
    assert E.popularity_top_k(counts, 7).tolist() == [2, 3, 5, 1, 4, -1, -1]


def test_popularity_top_k_in_chunks_is_the_whole_sort(rng, tmp_path):
    """Chunked (as a memory-mapped popularity.npy at 10^9 items is read) = one lexsort of the whole
    array, on heavy ties, for chunks smaller than K, around K and past V."""
    counts = rng.integers(0, 6, size=1000).astype(np.int64)
    np.save(tmp_path / "popularity.npy", counts)
    mapped = np.load(tmp_path / "popularity.npy", mmap_mode="r")
    for pad in (0, 7):
        c = counts.astype(np.float64)
        c[pad] = -np.inf
        order = np.lexsort((np.arange(c.size), -c))
        for k in (1, 10, 999, 1200):
            want = order[np.isfinite(c[order])][:k].tolist()
            want += [-1] * (k - len(want))
            for chunk in (3, 64, 1000, 4096):
                got = E.popularity_top_k(mapped, k, pad_id=pad, chunk=chunk)
                assert got.tolist() == want, (pad, k, chunk)


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 8, 1), (1, 1, 8), (4, 1, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_sharded_top_k_equals_one_chips_and_never_gathers_the_table(rng, shape, bias):
    """The table's rows split over vocab × fsdp (users over data): the same scores and ids as
    `blocked_top_k` on the whole table (ties included: duplicated rows across shards), padding rows
    never returned, and no collective in the program moves a table-sized array."""
    import jax
    import recloss
    from helpers import make_layout

    u, d, vocab, rows, k = 24, 16, 1000, 1024, 10
    h = rng.normal(size=(u, d)).astype(np.float32)
    e = rng.normal(size=(rows, d)).astype(np.float32)
    e[0] = 10 * h.mean(0)                                   # padding id 0 would win everywhere
    e[700] = e[100]                                         # a tie across two shards: the smaller id first
    b = rng.normal(size=rows).astype(np.float32) if bias else None
    if bias:
        b[700] = b[100]
    args = (jnp.asarray(h), jnp.asarray(e), None if b is None else jnp.asarray(b))
    want = E.blocked_top_k(*args, k=k, block_v=100, vocab_size=vocab)
    layout = make_layout(shape)
    fn = jax.jit(lambda h, e, b: E.sharded_top_k(h, e, b, layout=layout, k=k, block_v=100, vocab_size=vocab))
    got = fn(*args)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert (np.asarray(got[1]) > 0).all() and (np.asarray(got[1]) < vocab).all()
    hlo = fn.lower(*args).compile().as_text()
    gathers = [line for line in hlo.splitlines() if "all-gather" in line and "=" in line]
    assert gathers and all(f"{rows},{d}" not in line and f"{rows // 2},{d}" not in line for line in gathers), gathers
