"""The softmax objective (`recloss.softmax_loss`): every strategy against the float64 oracle, optax,
each other, and the memory bound; bad input.

Cases are odd shapes (N=130, V=1000, D=123), with padding, repeats, invalid
ids, rows without a target, zero weights, ±1e4 logits, bias and bf16 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import recloss
from helpers import assert_close, CANCEL_FLOOR, make_case, options_for, strategies
from oracle import f64, labels_and_invalid, logsumexp, softmax_oracle

pytestmark = pytest.mark.tier1

STRATEGIES = strategies("softmax")


def run(strategy, case, opts, cot=None):
    """(LossOutput of value_and_grad, grads dict, LossOutput of a gradient-free jit)."""
    names = [n for n in ("hidden", "table", "bias", "weights") if case[n] is not None]

    def call(args, targets):
        kw = dict(zip(names, args))
        return recloss.softmax_loss(kw["hidden"], kw["table"], targets, kw.get("weights"), kw.get("bias"),
                                    strategy=strategy, **options_for(strategy, opts))

    def objective(args, targets):
        out = call(args, targets)
        return (jnp.vdot(out.loss, cot) if opts.get("reduction") == "none" else out.loss), out

    args = tuple(case[n] for n in names)
    (_, out), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(args, case["targets"])
    evaluated = jax.jit(call)(args, case["targets"])
    return out, dict(zip(names, grads)), evaluated


def check(strategy, case, opts, rng, *, tol_loss=1e-5, tol_grad=1e-4):
    opts = dict(opts)
    none = opts.get("reduction") == "none"
    lead = case["hidden"].shape[:-1]
    cot = jnp.asarray(rng.normal(size=lead), jnp.float32) if none else None
    out, grads, evaluated = run(strategy, case, opts, cot)
    ref = softmax_oracle(**case, cotangent=cot, **opts)

    assert out.loss.dtype == jnp.float32 and out.loss.shape == (lead if none else ())
    floor = CANCEL_FLOOR * np.linalg.norm(np.ravel(ref.loss_scale))
    assert_close(out.loss, ref.loss, tol_loss, "loss", floor)
    assert_close(evaluated.loss, out.loss, 2e-6, "eval-only loss vs value_and_grad loss")
    wsum = ref.metrics["weight_sum"]
    for name, g in grads.items():
        assert g.dtype == case[name].dtype, (name, g.dtype)
        if name == "weights" and opts.get("reduction", "mean") == "mean" and wsum == 0:
            assert np.all(np.isfinite(f64(g)))
            continue
        gfloor = CANCEL_FLOOR * np.linalg.norm(ref.grad_scale[name].ravel())
        assert_close(g, ref.grads[name], tol_grad, f"d/d{name}", gfloor)
    if opts.get("vocab_size") is not None:      # padding rows of the table are inert
        assert np.all(f64(grads["table"])[opts["vocab_size"]:] == 0.0)
        if "bias" in grads:
            assert np.all(f64(grads["bias"])[opts["vocab_size"]:] == 0.0)

    for mets in (out.metrics, evaluated.metrics):
        for k in ("num_targets", "invalid_targets"):
            assert float(mets[k]) == ref.metrics[k], (k, float(mets[k]), ref.metrics[k])
        np.testing.assert_allclose(float(mets["weight_sum"]), wsum, rtol=1e-6)
        if opts.get("compute_metrics", True):
            assert abs(float(mets["top1"]) - ref.metrics["top1"]) <= ref.metric_slack + 1e-4 * max(1.0, wsum)
            np.testing.assert_allclose(float(mets["mean_lse"]), ref.metrics["mean_lse"], rtol=1e-5, atol=1e-4)
        else:
            assert "top1" not in mets
    return out, grads, ref


SCENARIOS = {
    "unaligned": (dict(lead=(1, 130), V=1000, D=123, L=8), {}),
    "L1": (dict(lead=(2, 65), V=1000, D=48, L=1), {}),
    "L64_many_repeats": (dict(lead=(3, 21), V=300, D=40, L=64, p_dup=0.4), {}),
    "pad_id_0": (dict(lead=(2, 65), V=500, D=33, L=8, pad_id=0), dict(pad_id=0)),
    "weights_and_rows_without_targets": (dict(weights="random", all_pad_rows=7), {}),
    "bias": (dict(lead=(2, 65), V=1000, D=64, bias=True), {}),
    "logits_1e4": (dict(D=64, huge=1e4, bias=True), {}),
    "label_smoothing": (dict(D=64), dict(label_smoothing=0.1)),
    "z_loss": (dict(D=64, bias=True), dict(z_loss=1e-2)),
    "temperature": (dict(D=64), dict(temperature=0.07)),
    "vocab_size_lt_rows": (dict(V=1000, rows=1100, D=64, bias=True), dict(vocab_size=1000)),
    "no_metrics": (dict(D=40), dict(compute_metrics=False)),
    "reduction_sum": (dict(D=64, weights="random"), dict(reduction="sum")),
    "reduction_none": (dict(D=64, weights="random", bias=True), dict(reduction="none")),
    "all_options_mean": (dict(V=900, rows=1000, D=50, bias=True, weights="random"),
                         dict(label_smoothing=0.2, z_loss=1e-3, temperature=0.5, vocab_size=900)),
    "all_options_none": (dict(V=900, rows=1000, D=50, bias=True, weights="random"),
                         dict(reduction="none", label_smoothing=0.05, z_loss=1e-2, temperature=2.0,
                              vocab_size=900, block_v=128, block_n=40)),
    "small_blocks": (dict(lead=(2, 65), V=1000, D=40, bias=True, weights="random"), dict(block_v=256, block_n=40)),
    "small_blocks_sum_vocab_lt_rows": (dict(lead=(3, 43), V=700, rows=1000, D=24),
                                       dict(block_v=128, block_n=32, reduction="sum", vocab_size=700)),
    "lead_3_none": (dict(lead=(2, 5, 13), V=1000, D=32), dict(reduction="none")),
}
BF16 = {
    "bf16": (dict(D=64, dtype=jnp.bfloat16), {}),
    "bf16_bias_weights_none": (dict(D=64, dtype=jnp.bfloat16, bias=True, weights="random"),
                               dict(reduction="none", label_smoothing=0.1, z_loss=1e-3)),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_oracle(strategy, scenario, rng):
    case_kw, opts = SCENARIOS[scenario]
    # Softmax gradients are probabilities exp(x − Z): an absolute error δ in a float32 logit is a
    # relative error δ in them. Logits of size 1e4 carry δ ≈ 2⁻²⁴·1e4 ≈ 6e-4 in any float32
    # implementation (dense included), so the gradient is judged at a few times that.
    tol_grad = max(1e-4, 4 * 2.0 ** -24 * case_kw.get("huge", 0.0))
    check(strategy, make_case(rng, **case_kw), opts, rng, tol_grad=tol_grad)


@pytest.mark.parametrize("scenario", list(BF16))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_matches_oracle_on_rounded_inputs(strategy, scenario, rng):
    case_kw, opts = BF16[scenario]
    case = make_case(rng, **case_kw)
    assert case["hidden"].dtype == jnp.bfloat16
    check(strategy, case, opts, rng, tol_loss=2e-2, tol_grad=2e-2)


# ------------------------------------------------------------------------- logit soft cap
# LossOptions.logit_soft_cap c: x = c·tanh((a·e + b)/c)/τ. Caps of 2-4 bend the logits in use;
# Gemma's 30 against ±1e4 logits saturates them, which also makes their gradient well-conditioned:
# the default 1e-4 tolerance holds, not test_matches_oracle's allowance for raw 1e4 logits.
SOFT_CAP = {
    "unaligned": (dict(lead=(1, 130), V=1000, D=123, L=8), dict(logit_soft_cap=3.0)),
    "logits_1e4_z_loss_temperature": (dict(D=64, huge=1e4, bias=True),
                                      dict(logit_soft_cap=30.0, z_loss=1e-3, temperature=0.5)),
    "none_small_blocks_vocab_lt_rows": (dict(V=900, rows=1000, D=50, bias=True, weights="random"),
                                        dict(logit_soft_cap=2.0, reduction="none", temperature=2.0, z_loss=1e-2,
                                             vocab_size=900, block_v=128, block_n=40)),
    "bf16": (dict(D=64, dtype=jnp.bfloat16, bias=True, weights="random"),
             dict(logit_soft_cap=4.0, z_loss=1e-3, reduction="sum")),
}


@pytest.mark.parametrize("scenario", list(SOFT_CAP))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_logit_soft_cap_matches_oracle(strategy, scenario, rng):
    case_kw, opts = SOFT_CAP[scenario]
    case = make_case(rng, **case_kw)
    tol = dict(tol_loss=2e-2, tol_grad=2e-2) if case["hidden"].dtype == jnp.bfloat16 else {}
    _, grads, ref = check(strategy, case, opts, rng, **tol)
    uncapped = softmax_oracle(**case, **{**opts, "logit_soft_cap": None})
    assert np.max(np.abs(ref.loss - uncapped.loss)) > 1e-3 * np.max(np.abs(uncapped.loss))   # the cap matters
    assert np.abs(ref.logits).max() <= opts["logit_soft_cap"] / opts.get("temperature", 1.0)
    for g in grads.values():
        assert np.all(np.isfinite(f64(g)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_logit_soft_cap_single_label_equals_optax_on_capped_logits(strategy, rng):
    """L = 1: optax's CE of c·tanh(x/c) (MaxText's final_logits_soft_cap, then its cross-entropy)."""
    h = jnp.asarray(rng.normal(size=(3, 37, 40)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(777, 40)) * 0.5, jnp.float32)
    t = jnp.asarray(rng.integers(0, 777, size=(3, 37, 1)), jnp.int32)

    def ours(h, e):
        return recloss.softmax_loss(h, e, t, strategy=strategy, logit_soft_cap=2.5,
                                    **options_for(strategy, dict(block_v=128, block_n=24))).loss

    def theirs(h, e):
        return optax.softmax_cross_entropy_with_integer_labels(2.5 * jnp.tanh(h @ e.T / 2.5), t[..., 0]).mean()

    np.testing.assert_allclose(float(jax.jit(ours)(h, e)), float(theirs(h, e)), rtol=1e-6)
    for g, r in zip(jax.grad(ours, argnums=(0, 1))(h, e), jax.grad(theirs, argnums=(0, 1))(h, e)):
        assert_close(g, r, 1e-5, "grad vs optax")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_label_smoothing_with_a_soft_cap_is_an_error_naming_both(strategy):
    with pytest.raises(ValueError) as info:
        recloss.get_strategy(strategy, label_smoothing=0.1, logit_soft_cap=30.0)
    msg = str(info.value)
    assert repr(strategy) in msg and "label_smoothing=0.1" in msg and "logit_soft_cap=30.0" in msg, msg


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_z_loss_metric_is_the_weighted_z_loss_sum(strategy, reduction, rng):
    """metrics['z_loss'] = Σ w·λ·Z² over positions with a target (float64 Z of the capped logits),
    which is also the loss it adds ('sum'); absent when λ = 0."""
    case = make_case(rng, lead=(2, 33), V=500, D=32, weights="random", bias=True)
    args = (case["hidden"], case["table"], case["targets"], case["weights"], case["bias"])
    opts = dict(z_loss=1e-2, temperature=0.7, logit_soft_cap=3.0, reduction=reduction)
    out = recloss.softmax_loss(*args, strategy=strategy, **opts)
    ref = softmax_oracle(**case, **opts)
    y, _ = labels_and_invalid(np.asarray(case["targets"]).reshape(66, -1), 500, 500)
    wp = f64(case["weights"]).reshape(-1) * (y.sum(1) > 0)
    z = logsumexp(ref.logits)
    np.testing.assert_allclose(float(out.metrics["z_loss"]), float(np.sum(wp * 1e-2 * z * z)), rtol=1e-5)
    if reduction == "sum":
        without = recloss.softmax_loss(*args, strategy=strategy, **{**opts, "z_loss": 0.0})
        assert "z_loss" not in without.metrics
        np.testing.assert_allclose(float(out.loss - without.loss), float(out.metrics["z_loss"]), rtol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_all_weights_zero(strategy, reduction, rng):
    case = make_case(rng, lead=(2, 33), V=500, D=32, weights="zeros", bias=True)
    out, grads, ref = check(strategy, case, dict(reduction=reduction), rng)
    assert np.all(f64(out.loss) == 0.0)
    for name, g in grads.items():
        assert np.all(np.isfinite(f64(g))), name
        if name != "weights":
            assert np.all(f64(g) == 0.0), name
    assert float(out.metrics["weight_sum"]) == 0.0 and float(out.metrics["top1"]) == 0.0
    assert float(out.metrics["num_targets"]) == ref.metrics["num_targets"] > 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_positions_without_targets_leave_the_mean(strategy, rng):
    """mean = Σ w·ℓ / Σ w over positions with a target: padding-only rows change neither part."""
    case = make_case(rng, lead=(40,), V=400, D=24, L=4, p_pad=0.0, p_invalid=0.0, all_pad_rows=0)
    args = (case["hidden"], case["table"], case["targets"])
    base = recloss.softmax_loss(*args, strategy=strategy)
    padded_t = jnp.concatenate([case["targets"], jnp.full((9, 4), -1, jnp.int32)])
    padded_h = jnp.concatenate([case["hidden"], jnp.asarray(rng.normal(size=(9, 24)), jnp.float32)])
    more = recloss.softmax_loss(padded_h, case["table"], padded_t, strategy=strategy)
    np.testing.assert_allclose(float(more.loss), float(base.loss), rtol=1e-6)
    assert float(more.metrics["weight_sum"]) == float(base.metrics["weight_sum"]) == 40.0
    rows = recloss.softmax_loss(padded_h, case["table"], padded_t, strategy=strategy, reduction="none").loss
    assert np.all(f64(rows)[40:] == 0.0) and np.all(f64(rows)[:40] > 0.0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_single_label_equals_optax(strategy, rng):
    """L = 1 and no options: optax.softmax_cross_entropy_with_integer_labels on the dense logits."""
    h = jnp.asarray(rng.normal(size=(3, 37, 40)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(777, 40)) * 0.3, jnp.float32)
    b = jnp.asarray(rng.normal(size=(777,)), jnp.float32)
    t = jnp.asarray(rng.integers(0, 777, size=(3, 37, 1)), jnp.int32)

    def ours(h, e, b):
        return recloss.softmax_loss(h, e, t, bias=b, strategy=strategy,
                                    **options_for(strategy, dict(block_v=128, block_n=24))).loss

    def theirs(h, e, b):
        return optax.softmax_cross_entropy_with_integer_labels(h @ e.T + b, t[..., 0]).mean()

    np.testing.assert_allclose(float(jax.jit(ours)(h, e, b)), float(theirs(h, e, b)), rtol=1e-6)
    for g, r in zip(jax.grad(ours, argnums=(0, 1, 2))(h, e, b), jax.grad(theirs, argnums=(0, 1, 2))(h, e, b)):
        assert_close(g, r, 1e-5, "grad vs optax")


def test_strategies_agree_with_each_other(rng):
    case = make_case(rng, lead=(2, 33), V=600, D=32, weights="random", bias=True)
    args = (case["hidden"], case["table"], case["targets"], case["weights"], case["bias"])
    opts = dict(label_smoothing=0.1, z_loss=1e-3, temperature=0.8)
    outs = [recloss.softmax_loss(*args, strategy=s, **opts) for s in STRATEGIES]
    assert len(outs) >= 2
    for o in outs[1:]:
        np.testing.assert_allclose(float(o.loss), float(outs[0].loss), rtol=1e-5)
        for k in outs[0].metrics:
            np.testing.assert_allclose(float(o.metrics[k]), float(outs[0].metrics[k]), rtol=1e-5, err_msg=k)


# Fresh problems every run, a few a run (as tests/test_bce.py's random search); on the newest stack too.
@pytest.mark.stack
@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 70), v=st.integers(2, 400), d=st.integers(1, 40), l=st.integers(1, 9),
       eps=st.sampled_from([0.0, 0.3]), lam=st.sampled_from([0.0, 0.05]), tau=st.sampled_from([1.0, 0.3]),
       reduction=st.sampled_from(["mean", "sum", "none"]), bias=st.booleans(),
       block_v=st.sampled_from([None, 64, 130]), seed=st.integers(0, 2**31 - 1))
def test_random_problems_match_oracle(m, v, d, l, eps, lam, tau, reduction, bias, block_v, seed):
    rng = np.random.default_rng(seed)
    case = make_case(rng, lead=(m,), V=v, D=d, L=l, bias=bias, weights="random")
    opts = dict(label_smoothing=eps, z_loss=lam, temperature=tau, reduction=reduction, block_v=block_v,
                block_n=16)
    check("cutce", case, opts, rng)


# ------------------------------------------------------------------------- memory
def test_cutce_gradient_holds_no_bn_by_v_buffer():
    """The compiled loss+grad's temporaries stay far below one [M, V] float32 array."""
    m, v, d = 4096, 50_000, 64
    s = jax.ShapeDtypeStruct
    args = (s((m, d), jnp.float32), s((v, d), jnp.float32), s((m, 8), jnp.int32))

    def temp(strategy):
        f = jax.value_and_grad(lambda h, e, t: recloss.softmax_loss(h, e, t, strategy=strategy).loss, (0, 1))
        return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

    bn_v = 4 * m * v
    cut, dense = temp("cutce"), temp("dense_ce")
    assert dense >= bn_v              # the baseline really materialises [M, V]
    assert cut < bn_v / 10, (cut, bn_v)


# ------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("name,value", [("temperature", 0.0), ("temperature", -1.0), ("z_loss", -0.1),
                                        ("label_smoothing", 1.0), ("label_smoothing", -0.1),
                                        ("temperature", float("nan")), ("logit_soft_cap", 0.0),
                                        ("logit_soft_cap", -30.0), ("logit_soft_cap", float("inf"))])
def test_bad_option_values_name_the_value(name, value, rng):
    case = make_case(rng, lead=(4,), V=50, D=8, L=2)
    with pytest.raises(ValueError) as info:
        recloss.softmax_loss(case["hidden"], case["table"], case["targets"], **{name: value})
    assert name in str(info.value) and repr(value) in str(info.value), str(info.value)


@pytest.mark.parametrize("name,value", [("pos_weight", 2.0), ("focal_gamma", 1.0), ("focal_alpha", 0.25),
                                        ("vocab_reduction", "sum"), ("threshold", 0.5)])
def test_bce_only_options_are_an_error_for_softmax(name, value):
    for strategy in STRATEGIES:
        with pytest.raises(ValueError) as info:
            recloss.get_strategy(strategy, **{name: value})
        msg = str(info.value)
        assert f"{name}={value!r}" in msg and repr(strategy) in msg, msg


@pytest.mark.parametrize("name,value", [("z_loss", 0.1), ("temperature", 0.5)])
def test_softmax_only_options_are_an_error_for_bce(name, value):
    for strategy in strategies("bce"):
        with pytest.raises(ValueError) as info:
            recloss.get_strategy(strategy, **{name: value})
        msg = str(info.value)
        assert f"{name}={value!r}" in msg and repr(strategy) in msg, msg


def test_entry_points_refuse_the_other_objective(rng):
    case = make_case(rng, lead=(4,), V=50, D=8, L=2)
    args = (case["hidden"], case["table"], case["targets"])
    with pytest.raises(ValueError) as info:
        recloss.bce_loss(*args, strategy="cutce")
    assert "recloss.softmax_loss" in str(info.value) and "'cutce'" in str(info.value)
    with pytest.raises(ValueError) as info:
        recloss.softmax_loss(*args, strategy="cutbce")
    assert "recloss.bce_loss" in str(info.value) and "'cutbce'" in str(info.value)
    with pytest.raises(ValueError) as info:
        recloss.softmax_loss(*args, strategy="cutse")
    assert "'cutse'" in str(info.value) and "did you mean 'cutce'" in str(info.value)


def test_strategies_say_their_objective():
    assert {recloss.get_strategy(s).objective for s in STRATEGIES} == {"softmax"}
    assert recloss.available_strategies("softmax") == ("cutce", "cutce_pallas", "dense_ce")
    assert recloss.available_strategies("bce") == ("cutbce", "cutbce_pallas", "dense_bce")
    assert recloss.available_strategies("no such objective") == ()
    assert set(recloss.available_strategies()) >= set(STRATEGIES) | set(strategies("bce"))


def test_log_partition_corrects_a_coarse_log_to_exps_accuracy(rng, monkeypatch):
    # A TPU v5e's float32 log is off by ~1e-5 absolute where exp is within ~1e-6 relative; every
    # softmax probability exp(x − Z) inherits Z's absolute error. Stand in a log with a 1e-5 error of
    # random sign: partition.log's Newton step must bring it back within a few float32 ulps.
    from recloss.softmax import partition
    s = np.exp(rng.uniform(-5.0, 17.0, size=4096)).astype(np.float32)     # sums of 1 .. 2e7 columns
    exact = np.log(s.astype(np.float64))
    sign = jnp.asarray(rng.choice([-1.0, 1.0], size=s.shape), jnp.float32)

    class CoarseLog:
        def __getattr__(self, name):
            return getattr(jnp, name)

        @staticmethod
        def log(x):
            return jnp.log(x) + 1e-5 * sign

    assert np.max(np.abs(f64(jnp.log(s) + 1e-5 * sign) - exact)) > 9e-6     # the stand-in is coarse
    monkeypatch.setattr(partition, "jnp", CoarseLog())
    got = f64(partition.log(jnp.asarray(s)))
    tol = 4 * np.finfo(np.float32).eps * np.maximum(np.abs(exact), 1.0)
    assert np.all(np.abs(got - exact) <= tol), np.max(np.abs(got - exact) / np.maximum(np.abs(exact), 1.0))
