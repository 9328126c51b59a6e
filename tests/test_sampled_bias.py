"""recloss.sampled_bias: the sampled gradient's expectation against the exact softmax gradient.

The estimator converges as K grows (cosine above 0.99 at K = 16·V on a small catalogue, with
accidental hits kept, which is the consistent form); the tool's per-draw numbers are those of
`sampled_loss` itself; the loss offset of the target correction is log(K·q_t).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

import recloss
from helpers import make_sampled_case

V = 29


def _case(rng):
    # Padding, duplicate and invalid ids, an all-padding row and zero weights, as the sampled tests draw.
    return make_sampled_case(rng, lead=(4, 5), D=7, V=V, rows=32, L=3)


def _rows(case, seed, **kw):
    return recloss.sampled_bias(case["hidden"], case["table"], case["targets"], case["weights"], case["bias"],
                                key=jax.random.key(seed), vocab_size=V, **kw)


@pytest.mark.tier1
def test_the_estimator_converges_as_k_grows(rng, seed):
    case = _case(rng)
    rows = _rows(case, seed, num_negatives=(2, V, 16 * V), draws=32, remove_accidental_hits=False)
    small, mid, big = rows
    for g in ("dA", "dE"):
        assert big[f"cos_{g}"] > 0.99, big
        assert small[f"cos_{g}"] < big[f"cos_{g}"] and mid[f"cos_{g}"] < big[f"cos_{g}"], rows
        assert abs(big[f"norm_{g}"] - 1.0) < 0.05, big
    # The loss, less its target-correction offset, approaches the exact one (Jensen's gap of log Ẑ): at
    # K = 16·V what is left is the mean's noise (within 3.4 standard errors over 40 seeds). At small K the
    # gap's sign varies, so |gap| can come out near 0 there: the spread of the draws is what shrinks.
    se = big["loss_std"] / math.sqrt(big["draws"])
    assert abs(big["loss_gap"]) < 0.002 + 6 * se, (big, se)
    assert small["loss_std"] > 2 * big["loss_std"], rows
    assert all(r["exact_loss"] == rows[0]["exact_loss"] > 0 for r in rows)


@pytest.mark.tier1
def test_removing_accidental_hits_leaves_a_bias_that_no_k_removes(rng, seed):
    """With hits removed, each target's partition misses the mass of the row's targets, and its own
    term is exp(x_t)/(K·q_t) -> 0: the limit is not the softmax gradient (docs/choosing-a-loss.md)."""
    case = _case(rng)
    kept = _rows(case, seed, num_negatives=(16 * V,), draws=16, remove_accidental_hits=False)[0]
    removed = _rows(case, seed, num_negatives=(16 * V,), draws=16, remove_accidental_hits=True)[0]
    assert removed["cos_dA"] < kept["cos_dA"] and removed["cos_dE"] < kept["cos_dE"], (removed, kept)


@pytest.mark.tier1
def test_per_draw_figures_are_sampled_losss_own(rng, seed):
    case = _case(rng)
    key, k = jax.random.key(seed), 11
    counts = rng.uniform(0.5, 3.0, V)
    log_q = np.log(counts)
    (row,) = recloss.sampled_bias(case["hidden"], case["table"], case["targets"], case["weights"], case["bias"],
                                  key=key, vocab_size=V, num_negatives=(k,), proposals={"counts": log_q}, draws=2)

    def grads(key_i, strategy):
        f = lambda h, e: recloss.sampled_loss(h, e, case["targets"], case["weights"], case["bias"], key=key_i,  # noqa: E731
                                              strategy=strategy, num_negatives=k, log_q=log_q,
                                              vocab_size=V).loss
        return jax.value_and_grad(f, argnums=(0, 1))(case["hidden"], case["table"])

    exact, (gh, ge) = jax.value_and_grad(
        lambda h, e: recloss.softmax_loss(h, e, case["targets"], case["weights"], case["bias"], vocab_size=V).loss,
        argnums=(0, 1))(case["hidden"], case["table"])
    cos = lambda a, b: float(np.vdot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))  # noqa: E731
    draws = [grads(jax.random.fold_in(key, i), "sampled_softmax") for i in range(2)]
    assert row["proposal"] == "counts" and row["num_negatives"] == k and row["draws"] == 2
    assert row["exact_loss"] == pytest.approx(float(exact), rel=1e-6)
    assert row["loss"] == pytest.approx(np.mean([float(v) for v, _ in draws]), rel=1e-6)
    assert row["cos_draw_dA"] == pytest.approx(np.mean([cos(d[1][0], gh) for d in draws]), abs=1e-5)
    mean_de = (np.asarray(draws[0][1][1], np.float64) + np.asarray(draws[1][1][1], np.float64)) / 2
    assert row["cos_dE"] == pytest.approx(cos(mean_de, ge), abs=1e-5)
    # The offset is the weighted mean over rows of each row's mean log(K·q_t) over its targets.
    q = counts / counts.sum()
    t = np.asarray(case["targets"]).reshape(-1, 3)
    w = np.asarray(case["weights"]).reshape(-1)
    per_row, weight = [], []
    for ids, wm in zip(t, w):
        valid = sorted({int(i) for i in ids if 0 <= i < V})
        if valid:
            per_row.append(np.mean([math.log(k * q[i]) for i in valid]))
            weight.append(wm)
    assert row["loss_offset"] == pytest.approx(np.dot(per_row, weight) / np.sum(weight), rel=1e-5)
    assert row["loss_gap"] == pytest.approx(row["loss"] - row["loss_offset"] - row["exact_loss"], abs=1e-9)
    (g,) = recloss.sampled_bias(case["hidden"], case["table"], case["targets"], case["weights"], case["bias"],
                                key=key, vocab_size=V, strategy="gbce", num_negatives=(k,), draws=2)
    assert g["loss_offset"] == 0.0 and g["loss_gap"] == g["loss"] - g["exact_loss"]


@pytest.mark.tier1
@pytest.mark.parametrize("kwargs, fragment", [
    (dict(draws=1), "draws=1 is invalid: expected an int >= 2"),
    (dict(num_negatives=(4, 0)), "num_negatives=[4, 0] is invalid: expected one or more Ks >= 1"),
    (dict(exact="gbce"), "exact='gbce' computes the 'sampled' objective"),
])
def test_bad_input_is_a_named_error(rng, kwargs, fragment):
    case = _case(rng)
    with pytest.raises(ValueError) as info:
        recloss.sampled_bias(case["hidden"], case["table"], case["targets"], key=jax.random.key(0), **kwargs)
    assert fragment in str(info.value), str(info.value)


@pytest.mark.tier2
def test_the_trainer_command_measures_its_own_trained_model(tmp_path, capsys):
    """`python -m tools.sampled_bias CONFIG ...`: train, then both proposals and both
    hit rules for each K on the trained SASRec's first batch, printed as recloss-bench's table."""
    import json

    from recloss.bench.sampled_bias import format_table
    from recloss_plugins.config import default_config_path
    from tools import sampled_bias as T

    tiny = ["synthetic_num_users=48", "synthetic_num_items=255", "synthetic_min_len=20", "synthetic_max_len=30",
            "num_labels=4", "max_seq_len=8", "global_batch_size=16", "emb_dim=16", "num_layers=1", "num_heads=2",
            "mlp_dim=32", "steps=3", "log_period=1", "eval_batch_size=64", "eval_block_v=128", "loss=cutce",
            f"base_output_directory={tmp_path / 'runs'}"]
    out = tmp_path / "bias.json"
    assert T.main([str(default_config_path()), *tiny, "--ks", "4,64", "--draws", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert capsys.readouterr().out.strip() == format_table(data)
    assert [(r["proposal"], r["hits_removed"], r["num_negatives"]) for r in data["rows"]] == [
        (p, h, k) for h in (True, False) for p in ("uniform", "counts") for k in (4, 64)]
    assert data["info"]["vocab"] == 255 and "after 3 steps of loss=cutce" in data["info"]["state"]
    assert all(-1 <= r["cos_dE"] <= 1 and np.isfinite(r["loss_gap"]) for r in data["rows"])
    with pytest.raises(SystemExit):
        T.main([str(default_config_path()), "--draws", "1"])
