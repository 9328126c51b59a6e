"""recloss.metrics from per-row counts, against the confusion matrix of a dense prediction."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from recloss import metrics
from recloss_plugins.sasrec.logging_utils import precision_recall

pytestmark = pytest.mark.tier1


def _dense_case(seed=0, m=37, v=53, l=6):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((m, v))
    labels = np.zeros((m, v), bool)
    for i in range(m):
        labels[i, rng.choice(v, size=rng.integers(0, l + 1), replace=False)] = True
    w = rng.random(m) * (rng.random(m) > 0.2)     # some zero weights
    return logits, labels, w


def test_cut_metrics_equal_the_dense_confusion_counts():
    logits, labels, w = _dense_case()
    threshold = 0.3
    pred = logits > threshold
    counts = {"targets": jnp.asarray(labels.sum(-1), jnp.float32),
              "predicted": jnp.asarray(pred.sum(-1), jnp.float32),
              "tp": jnp.asarray((pred & labels).sum(-1), jnp.float32)}
    out = metrics.cut_metrics(counts, jnp.asarray(w, jnp.float32), vocab_size=logits.shape[1], invalid=3.0,
                              weight_sum=jnp.float32(w.sum()))
    ww = w[:, None]
    want = dict(tp=(ww * (pred & labels)).sum(), fp=(ww * (pred & ~labels)).sum(),
                fn=(ww * (~pred & labels)).sum(), tn=(ww * (~pred & ~labels)).sum())
    for k, v in want.items():
        np.testing.assert_allclose(float(out[k]), v, rtol=1e-5, atol=1e-4, err_msg=k)
    assert float(out["num_targets"]) == labels.sum()
    assert float(out["invalid_targets"]) == 3.0
    np.testing.assert_allclose(float(out["weight_sum"]), w.sum(), rtol=1e-6)

    precision, recall = precision_recall({k: float(out[k]) for k in ("tp", "fp", "fn")})
    np.testing.assert_allclose(float(precision), want["tp"] / (want["tp"] + want["fp"]), rtol=1e-5)
    np.testing.assert_allclose(float(recall), want["tp"] / (want["tp"] + want["fn"]), rtol=1e-5)


def test_cut_metrics_without_prediction_counts_report_only_the_target_counts():
    _, labels, w = _dense_case(1)
    out = metrics.cut_metrics({"targets": jnp.asarray(labels.sum(-1), jnp.float32), "predicted": None},
                              jnp.asarray(w), vocab_size=53, invalid=0.0, weight_sum=jnp.float32(w.sum()))
    assert set(out) == {"num_targets", "invalid_targets", "weight_sum"}


def test_cut_metrics_sum_over_batch_shards_with_the_given_psum():
    logits, labels, w = _dense_case(2)
    pred = logits > 0.0
    counts = {"targets": jnp.asarray(labels.sum(-1), jnp.float32),
              "predicted": jnp.asarray(pred.sum(-1), jnp.float32),
              "tp": jnp.asarray((pred & labels).sum(-1), jnp.float32)}
    one = metrics.cut_metrics(counts, jnp.asarray(w), vocab_size=53, invalid=0.0, weight_sum=jnp.float32(w.sum()))
    two = metrics.cut_metrics(counts, jnp.asarray(w), vocab_size=53, invalid=0.0,
                              weight_sum=jnp.float32(2 * w.sum()), psum_batch=lambda x: 2 * x)
    for k in ("tp", "fp", "fn", "tn", "num_targets"):
        np.testing.assert_allclose(float(two[k]), 2 * float(one[k]), rtol=1e-5, err_msg=k)


def test_precision_recall_of_no_positives_is_zero_not_nan():
    zero = {"tp": 0.0, "fp": 0.0, "fn": 0.0}
    p, r = precision_recall(zero)
    assert float(p) == 0.0 and float(r) == 0.0
