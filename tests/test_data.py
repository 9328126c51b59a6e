"""Data: the paper's splits on hand-made logs, batching, popularity and the synthetic generator
(file loaders: test_data_readers.py)."""

import numpy as np
import pytest

from recloss_plugins.sasrec import data as D

pytestmark = pytest.mark.tier1


def _seqs(lengths):
    """Users whose items encode (user, position): item = 1 + offset + position, all distinct."""
    seqs, start = [], 0
    for n in lengths:
        seqs.append(np.arange(start + 1, start + n + 1))
        start += n
    return D.Sequences.from_lists(seqs, start)


def test_paper_splits_on_a_hand_made_sequence():
    s = D.Sequences.from_lists([list(range(1, 41))], 40)          # n = 40, items 1..40 in order
    test = D.make_eval_split(s, "test", max_seq_len=64, num_labels=8)
    dev = D.make_eval_split(s, "dev", max_seq_len=64, num_labels=8)
    train = D.make_train_split(s, max_seq_len=64, num_labels=8)
    # test: first n-8 = 32 items in, last 8 out.
    assert test.lengths.tolist() == [32]
    assert test.inputs[0, :32].tolist() == list(range(1, 33)) and not test.inputs[0, 32:].any()
    assert test.targets[0].tolist() == list(range(33, 41))
    # dev: first n-17 = 23 items in, the following 8 out.
    assert dev.lengths.tolist() == [23]
    assert dev.inputs[0, :23].tolist() == list(range(1, 24))
    assert dev.targets[0].tolist() == list(range(24, 32))
    # train: first n-26 = 14 items in; position j (item j+1) targets items j+2..j+9.
    assert train.inputs[0, :14].tolist() == list(range(1, 15)) and not train.inputs[0, 14:].any()
    for j in range(14):
        assert train.targets[0, j].tolist() == list(range(j + 2, j + 10))
    assert not train.targets[0, 14:].any()
    # The last train target (item 22) comes before the last dev input (23) and every dev target.
    assert train.targets.max() == 22 < dev.targets.min()


def test_truncation_keeps_the_most_recent_items():
    s = D.Sequences.from_lists([list(range(1, 41))], 40)
    test = D.make_eval_split(s, "test", max_seq_len=10, num_labels=8)
    assert test.inputs[0].tolist() == list(range(23, 33)) and test.lengths.tolist() == [10]
    train = D.make_train_split(s, max_seq_len=5, num_labels=8)
    assert train.inputs[0].tolist() == [10, 11, 12, 13, 14]
    assert train.targets[0, 0].tolist() == list(range(11, 19))
    assert train.targets[0, 4].tolist() == list(range(15, 23))


def test_short_users_leave_the_splits_they_cannot_fill():
    # n = 8: nothing; 9: test only; 18: dev+test; 26: still no train; 27: all three.
    s = _seqs([8, 9, 18, 26, 27])
    kw = dict(max_seq_len=16, num_labels=8)
    assert D.make_eval_split(s, "test", **kw).users.tolist() == [1, 2, 3, 4]
    assert D.make_eval_split(s, "dev", **kw).users.tolist() == [2, 3, 4]
    train = D.make_train_split(s, **kw)
    assert train.users.tolist() == [4]
    assert (train.inputs[0] != 0).sum() == 1


@pytest.mark.parametrize("L", [1, 2, 3, 8])
def test_splits_never_leak_across_for_any_L(L, rng):
    lengths = rng.integers(1, 80, size=30)
    s = _seqs(lengths)
    kw = dict(max_seq_len=int(rng.integers(1, 40)), num_labels=L)
    tr, dv, te = D.make_train_split(s, **kw), D.make_eval_split(s, "dev", **kw), D.make_eval_split(s, "test", **kw)
    dev_row = {u: r for r, u in enumerate(dv.users)}
    test_row = {u: r for r, u in enumerate(te.users)}
    for r, u in enumerate(tr.users):
        used = tr.targets[r][tr.targets[r] > 0]
        # Every train target precedes every dev and test target of that user.
        assert used.max() < dv.targets[dev_row[u]].min()
        assert used.max() < te.targets[test_row[u]].min()
        # Non-padding positions have a full row of L targets.
        assert (tr.targets[r][tr.inputs[r] > 0] > 0).all()
    for r, u in enumerate(dv.users):
        n = lengths[u]
        base = s.offsets[u]
        assert dv.targets[r].tolist() == list(range(base + n - 2 * L, base + n - L))
        assert te.targets[test_row[u]].tolist() == list(range(base + n - L + 1, base + n + 1))


def test_train_batches_are_deterministic_epoch_permutations(rng):
    s = _seqs(rng.integers(27, 40, size=13))
    split = D.make_train_split(s, max_seq_len=8, num_labels=2)
    b1 = D.TrainBatches(split, batch_size=5, seed=3)
    b2 = D.TrainBatches(split, batch_size=5, seed=3)
    stream = np.concatenate([b1.indices(p) for p in range(0, 26, 5)])[:26]
    # Every user exactly once per epoch of 13, and epochs differ.
    assert sorted(stream[:13]) == list(range(13)) and sorted(stream[13:26]) == list(range(13))
    assert not np.array_equal(stream[:13], stream[13:26])
    # Any position reproduces the same rows (what resuming relies on).
    for p in (0, 7, 12, 25, 1000):
        assert np.array_equal(b1.indices(p), b2.indices(p))
    other = D.TrainBatches(split, batch_size=5, seed=4)
    assert not np.array_equal(b1.indices(0), other.indices(0)) or not np.array_equal(b1.indices(5), other.indices(5))
    batch = b1.batch(3)
    rows = b1.indices(3)
    assert np.array_equal(batch["inputs"], split.inputs[rows])
    assert np.array_equal(batch["targets"], split.targets[rows])
    assert np.array_equal(batch["weights"], (split.inputs[rows] > 0).astype(np.float32))
    assert batch["weights"].dtype == np.float32


def test_popularity_counts_only_the_training_region():
    s = D.Sequences.from_lists([[1] * 20 + [2] * 10, [3] * 27], 3)   # L = 1: region = first n-4
    counts = D.popularity(s, num_labels=1)
    assert counts.tolist() == [0, 20, 6, 23]


def test_synthetic_is_seeded_power_law_and_sequential():
    kw = dict(num_users=400, num_items=300, min_len=30, max_len=50, num_intents=6, intents_per_user=2,
              zipf_exponent=1.0, follow_prob=0.8, switch_prob=0.05)
    a, b, c = D.synthetic(seed=1, **kw), D.synthetic(seed=1, **kw), D.synthetic(seed=2, **kw)
    assert np.array_equal(a.items, b.items) and np.array_equal(a.offsets, b.offsets)
    assert not np.array_equal(a.items[:200], c.items[:200])
    assert a.num_users == 400 and a.vocab_size == 301
    assert a.lengths.min() >= 30 and a.lengths.max() <= 50
    assert a.items.min() >= 1 and a.items.max() <= 300
    counts = np.sort(np.bincount(a.items, minlength=301)[1:])[::-1]
    assert counts[0] > 10 * np.median(counts)          # heavy head
    # Sequential structure: the most common successor of an item explains most transitions.
    prev = np.concatenate([a.user(u)[:-1] for u in range(a.num_users)])
    nxt = np.concatenate([a.user(u)[1:] for u in range(a.num_users)])
    top_share = np.mean([np.bincount(nxt[prev == i]).max() / (prev == i).sum()
                         for i in np.unique(prev) if (prev == i).sum() >= 20])
    assert top_share > 0.6
