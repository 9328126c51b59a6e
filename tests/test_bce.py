"""The BCE objective: every strategy against the float64 oracle: loss, gradients, metrics, options,
shapes, dtypes.

Criteria: relative error ‖got − ref‖/‖ref‖ ≤ 1e-5 (loss) and ≤ 1e-4 (gradients)
in float32, ≤ 2e-2 for bfloat16 inputs (against the oracle evaluated on the
bf16-rounded inputs). A result that cancels to near zero is judged against 1%
of the magnitude of its terms instead (see `CANCEL_FLOOR`). Metric counts are
exact up to logits the oracle finds within 1e-4 of the threshold
(`OracleResult.metric_slack`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import recloss
from helpers import (BV, CANCEL_FLOOR, assert_close, block_edges, cancel_floor, make_case, make_targets,
                     options_for, planted_case, strategies)
from oracle import bce_oracle, f64, labels_and_invalid, pq_terms

pytestmark = pytest.mark.tier1

STRATEGIES = strategies()
COUNTS = ("tp", "fp", "fn", "tn")


# ------------------------------------------------------------------------- inputs

# ------------------------------------------------------------------------- running
def _diff_names(case):
    return [n for n in ("hidden", "table", "bias", "weights") if case[n] is not None]


def run_loss(strategy, case, opts, cot=None, *, evaluate=True):
    """(value_and_grad output, eval-only output) of bce_loss for ``case``, both jitted.

    The differentiated objective is the loss ('mean'/'sum') or ⟨loss, cot⟩ ('none').
    Returns (objective, LossOutput from the grad pass, grads dict, LossOutput from a
    plain jit of the loss, or None when ``evaluate`` is False).
    """
    names = _diff_names(case)

    def call(args, targets):
        kw = dict(zip(names, args))
        return recloss.bce_loss(kw["hidden"], kw["table"], targets, kw.get("weights"), kw.get("bias"),
                                strategy=strategy, **options_for(strategy, opts))

    def objective(args, targets):
        out = call(args, targets)
        obj = jnp.vdot(out.loss, cot) if opts.get("reduction") == "none" else out.loss
        return obj, out

    args = tuple(case[n] for n in names)
    (obj, out), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(args, case["targets"])
    evaluated = jax.jit(call)(args, case["targets"]) if evaluate else None
    return obj, out, dict(zip(names, grads)), evaluated


def assert_metrics(mets, ref, *, exact_counts: bool, rtol=1e-5):
    for k in ("num_targets", "invalid_targets"):
        assert float(mets[k]) == ref.metrics[k], (k, float(mets[k]), ref.metrics[k])
    if exact_counts:
        assert float(mets["weight_sum"]) == ref.metrics["weight_sum"]
    else:
        np.testing.assert_allclose(float(mets["weight_sum"]), ref.metrics["weight_sum"], rtol=rtol)
    for k in COUNTS:
        got, want = float(mets[k]), ref.metrics[k]
        # tn is Σw·V − tp − fp − fn (recloss.metrics): its float32 error scales with Σw·V, not with tn
        scale = max(1.0, abs(want), abs(ref.metrics["weight_sum"]) * ref.logits.shape[-1] if k == "tn" else 0.0)
        tol = ref.metric_slack + (0.0 if exact_counts else rtol * scale)
        assert abs(got - want) <= tol, f"metric {k}: got {got}, oracle {want} (slack {ref.metric_slack})"


def check_against_oracle(strategy, case, opts, rng, *, tol_loss=1e-5, tol_grad=1e-4, evaluate=False):
    """Loss, gradients (hidden, table, bias, weights), metrics (and the eval path) vs the oracle.

    ``evaluate``: also compile the loss without gradients (the custom-VJP primal, a
    different code path from the fused forward) and compare it; costs a compile.
    """
    opts = dict(opts)
    none = opts.get("reduction") == "none"
    lead = case["hidden"].shape[:-1]
    cot = jnp.asarray(rng.normal(size=lead), jnp.float32) if none else None
    obj, out, grads, evaluated = run_loss(strategy, case, opts, cot, evaluate=evaluate)
    ref = bce_oracle(**case, cotangent=cot, **opts)

    assert out.loss.dtype == jnp.float32
    assert out.loss.shape == (lead if none else ())
    loss_floor = cancel_floor(ref.loss_scale, tol_loss)
    assert_close(out.loss, ref.loss, tol_loss, "loss", loss_floor)
    wsum = ref.metrics["weight_sum"]
    for name, g in grads.items():
        assert g.dtype == case[name].dtype, (name, g.dtype)
        if name == "weights" and opts.get("reduction", "mean") == "mean" and wsum == 0:
            assert np.all(np.isfinite(f64(g)))
            continue
        floor = CANCEL_FLOOR * np.linalg.norm(ref.grad_scale[name].ravel())
        assert_close(g, ref.grads[name], tol_grad, f"d/d{name}", floor)

    vocab_size = opts.get("vocab_size")
    if vocab_size is not None:      # rows past vocab_size are inert: exactly zero gradient
        assert np.all(f64(grads["table"])[vocab_size:] == 0.0)
        if "bias" in grads:
            assert np.all(f64(grads["bias"])[vocab_size:] == 0.0)

    exact = case["weights"] is None
    assert_metrics(out.metrics, ref, exact_counts=exact)
    if evaluate:   # evaluation (no gradient) takes the loss-only path; it must agree with the fused one
        assert_close(evaluated.loss, out.loss, 2e-6, "eval-only loss vs value_and_grad loss")
        assert_metrics(evaluated.metrics, ref, exact_counts=exact)
    return out, grads, ref


# ------------------------------------------------------------------------- scenarios
# name -> (make_case keywords, loss options)
SCENARIOS = {
    "unaligned": (dict(lead=(2, 65), V=1000, D=123, L=8), {}),
    "L1": (dict(lead=(2, 130), V=1000, D=48, L=1), {}),
    "L64_many_repeats": (dict(lead=(3, 21), V=300, D=40, L=64, p_dup=0.4), {}),
    "pad_id_0": (dict(lead=(2, 65), V=500, D=33, L=8, pad_id=0), dict(pad_id=0)),
    "weights_zero_rows_all_pad_rows": (dict(weights="random", all_pad_rows=5), {}),
    "bias": (dict(lead=(2, 65), V=1000, D=64, bias=True), {}),
    "logits_1e4": (dict(D=64, huge=1e4, bias=True), {}),
    "logits_1e4_focal": (dict(D=64, huge=1e4, bias=True),
                         dict(focal_gamma=2.0, focal_alpha=0.25, label_smoothing=0.1)),
    "label_smoothing": (dict(D=64), dict(label_smoothing=0.1)),
    "pos_weight": (dict(D=64), dict(pos_weight=3.5)),
    "focal_gamma": (dict(D=64), dict(focal_gamma=2.0)),
    "focal_gamma_fractional": (dict(D=64), dict(focal_gamma=0.5)),
    "focal_alpha": (dict(D=64), dict(focal_alpha=0.25)),
    "threshold": (dict(D=64), dict(threshold=0.7)),
    "vocab_reduction_sum": (dict(D=64), dict(vocab_reduction="sum")),
    "vocab_size_lt_rows": (dict(V=1000, rows=1100, D=64, bias=True), dict(vocab_size=1000)),
    "reduction_sum": (dict(D=64, weights="random"), dict(reduction="sum")),
    "reduction_none": (dict(D=64, weights="random", bias=True), dict(reduction="none")),
    "all_options_mean": (
        dict(V=900, rows=1000, D=50, bias=True, weights="random"),
        dict(label_smoothing=0.2, pos_weight=2.0, focal_gamma=1.5, focal_alpha=0.3, threshold=-0.5,
             vocab_reduction="sum", vocab_size=900)),
    "all_options_none": (
        dict(V=900, rows=1000, D=50, bias=True, weights="random"),
        dict(reduction="none", label_smoothing=0.05, pos_weight=0.5, focal_gamma=2.0, focal_alpha=0.8,
             threshold=0.3, vocab_size=900)),
    "small_blocks": (dict(lead=(2, 65), V=1000, D=40, bias=True, weights="random"),
                     dict(block_v=256, block_n=40)),
    "small_blocks_none": (dict(lead=(2, 65), V=1000, D=40, bias=True),
                          dict(block_v=128, block_n=48, reduction="none")),
    "small_blocks_sum_vocab_lt_rows": (dict(lead=(3, 43), V=700, rows=1000, D=24),
                                       dict(block_v=128, block_n=32, reduction="sum", vocab_size=700)),
    "lead_1": (dict(lead=(130,), V=1000, D=32), {}),
    "lead_3": (dict(lead=(2, 5, 13), V=1000, D=32, weights="random"), {}),
    "lead_3_none": (dict(lead=(2, 5, 13), V=1000, D=32), dict(reduction="none")),
}
# Scenarios that also compare the gradient-free evaluation with value_and_grad.
EVAL_SCENARIOS = {"unaligned", "weights_zero_rows_all_pad_rows", "reduction_none", "all_options_mean",
                  "small_blocks", "small_blocks_none", "lead_3_none"}

BF16_SCENARIOS = {
    "bf16": (dict(D=64, dtype=jnp.bfloat16), {}),
    "bf16_bias_weights_none": (dict(D=64, dtype=jnp.bfloat16, bias=True, weights="random"),
                               dict(reduction="none", label_smoothing=0.1)),
    "bf16_focal_blocks": (dict(lead=(2, 65), D=64, dtype=jnp.bfloat16),
                          dict(focal_gamma=2.0, block_v=256, block_n=48)),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_oracle(strategy, scenario, rng):
    case_kw, opts = SCENARIOS[scenario]
    case = make_case(rng, **case_kw)
    check_against_oracle(strategy, case, opts, rng, evaluate=scenario in EVAL_SCENARIOS)


@pytest.mark.parametrize("scenario", list(BF16_SCENARIOS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_matches_oracle_on_rounded_inputs(strategy, scenario, rng):
    case_kw, opts = BF16_SCENARIOS[scenario]
    case = make_case(rng, **case_kw)
    assert case["hidden"].dtype == jnp.bfloat16
    check_against_oracle(strategy, case, opts, rng, tol_loss=2e-2, tol_grad=2e-2,
                         evaluate=scenario == "bf16")


# ------------------------------------------------------------------------- logit soft cap
# LossOptions.logit_soft_cap c: every logit x becomes c·tanh(x/c). Caps of 2-4 bend the logits in
# use (x ≈ N(0, 4)); Gemma's 30 against ±1e4 logits saturates them (their gradient is then ~0, not
# ill-conditioned). make_case's targets have padding, repeats, invalid ids and an all-padding row.
SOFT_CAP_SCENARIOS = {
    "unaligned": (dict(lead=(2, 65), V=1000, D=123, L=8), dict(logit_soft_cap=3.0)),
    "logits_1e4_focal_threshold": (dict(D=64, huge=1e4, bias=True),
                                   dict(logit_soft_cap=30.0, focal_gamma=2.0, focal_alpha=0.25,
                                        label_smoothing=0.1, threshold=29.0)),
    "none_small_blocks_vocab_lt_rows": (dict(lead=(2, 65), V=1000, rows=1100, D=40, bias=True, weights="random"),
                                        dict(logit_soft_cap=2.0, reduction="none", block_v=256, block_n=48,
                                             vocab_size=1000, threshold=1.5, pos_weight=2.0)),
    "bf16": (dict(D=64, dtype=jnp.bfloat16, bias=True, weights="random"),
             dict(logit_soft_cap=4.0, label_smoothing=0.1, reduction="sum")),
}


@pytest.mark.parametrize("scenario", list(SOFT_CAP_SCENARIOS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_logit_soft_cap_matches_oracle(strategy, scenario, rng):
    case_kw, opts = SOFT_CAP_SCENARIOS[scenario]
    case = make_case(rng, **case_kw)
    tol = dict(tol_loss=2e-2, tol_grad=2e-2) if case["hidden"].dtype == jnp.bfloat16 else {}
    _, grads, ref = check_against_oracle(strategy, case, opts, rng, evaluate=scenario == "unaligned", **tol)
    uncapped = bce_oracle(**case, **{**opts, "logit_soft_cap": None})
    assert np.max(np.abs(ref.loss - uncapped.loss)) > 1e-3 * np.max(np.abs(uncapped.loss))   # the cap matters
    assert np.abs(ref.logits).max() <= opts["logit_soft_cap"]
    for g in grads.values():
        assert np.all(np.isfinite(f64(g)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reductions_agree_with_each_other(strategy, rng):
    """mean = sum / Σw and sum = Σ none, on the same inputs (beyond agreeing with the oracle)."""
    case = make_case(rng, lead=(2, 33), V=600, D=32, weights="random", bias=True)
    args = (case["hidden"], case["table"], case["targets"], case["weights"], case["bias"])
    out = {r: recloss.bce_loss(*args, strategy=strategy, reduction=r).loss for r in ("mean", "sum", "none")}
    wsum = float(jnp.sum(case["weights"]))
    np.testing.assert_allclose(float(out["sum"]), float(jnp.sum(out["none"])), rtol=1e-5)
    np.testing.assert_allclose(float(out["mean"]), float(out["sum"]) / wsum, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_all_weights_zero(strategy, reduction, rng):
    case = make_case(rng, lead=(2, 33), V=500, D=32, weights="zeros", bias=True)
    out, grads, ref = check_against_oracle(strategy, case, dict(reduction=reduction), rng)
    assert np.all(f64(out.loss) == 0.0)
    for name, g in grads.items():
        assert np.all(np.isfinite(f64(g))), name
        if name != "weights":
            assert np.all(f64(g) == 0.0), name
    assert float(out.metrics["weight_sum"]) == 0.0
    assert all(float(out.metrics[k]) == 0.0 for k in COUNTS)
    assert float(out.metrics["num_targets"]) == ref.metrics["num_targets"] > 0


def dyadic_case(rng, lead=(2, 37), V=300, D=24, L=6):
    """Inputs in multiples of 1/8: every logit is exact in float32 and many are exactly 0.

    A third of the table rows are zero with zero bias (like a zeroed padding row
    or freshly zero-initialised items), so about a third of targets have logit 0.
    """
    h = rng.integers(-2, 3, size=lead + (D,)) / 4.0
    e = rng.integers(-2, 3, size=(V, D)) / 4.0
    b = rng.integers(-4, 5, size=(V,)) / 8.0
    b[rng.random(V) < 0.5] = 0.0
    zero = rng.random(V) < 1 / 3
    e[zero], b[zero] = 0.0, 0.0
    return {"hidden": jnp.asarray(h, jnp.float32), "table": jnp.asarray(e, jnp.float32),
            "bias": jnp.asarray(b, jnp.float32), "weights": None,
            "targets": jnp.asarray(make_targets(rng, lead, L, V))}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_metrics_exact_with_ties_at_threshold(strategy, rng):
    """x == threshold is a negative prediction; counts must match the oracle exactly."""
    case = dyadic_case(rng)
    m, v = case["targets"].shape[0] * case["targets"].shape[1], case["table"].shape[0]
    for threshold in (0.0, 0.5, -0.375):
        out = recloss.bce_loss(case["hidden"], case["table"], case["targets"], bias=case["bias"],
                               strategy=strategy, threshold=threshold)
        ref = bce_oracle(**case, threshold=threshold)
        assert np.sum(ref.logits == threshold) > 50      # ties really occur
        for k in COUNTS + ("num_targets", "invalid_targets", "weight_sum"):
            assert float(out.metrics[k]) == ref.metrics[k], (threshold, k, float(out.metrics[k]),
                                                             ref.metrics[k])
        assert float(sum(out.metrics[k] for k in COUNTS)) == m * v


@pytest.mark.parametrize("opts", [dict(), dict(pos_weight=3.0), dict(focal_gamma=2.0, focal_alpha=0.25)],
                         ids=["plain", "pos_weight", "focal_alpha"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_at_logits_exactly_zero(strategy, opts, rng):
    """softplus'(0) = 1/2 and σ(0) = 1/2 must hold where logits are exactly 0.

    Exact zeros are common in practice: zero-initialised bias with a zero
    padding row of the table, or zeroed hidden states.
    """
    case = dyadic_case(rng)
    assert np.mean(bce_oracle(**case).logits == 0.0) > 0.2
    check_against_oracle(strategy, case, opts, rng)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_all_logits_zero_minimal(strategy):
    """One position, V = 3, target 0, all logits 0: dℓ/dx = pos_weight·(σ(0) − 1)/V for the
    target and σ(0)/V for the others, so dhidden = (−1.5 + 0.5 + 0.5)/3 per unit table entry."""
    hidden, table, targets = jnp.zeros((1, 4)), jnp.ones((3, 4)), jnp.array([[0]])
    g = jax.grad(lambda h: recloss.bce_loss(h, table, targets, strategy=strategy, pos_weight=3.0).loss)(
        hidden)
    np.testing.assert_allclose(np.asarray(g), np.full((1, 4), (-1.5 + 0.5 + 0.5) / 3), rtol=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compute_metrics_false(strategy, rng):
    case = make_case(rng, lead=(2, 33), V=500, D=32)
    args = (case["hidden"], case["table"], case["targets"])
    on = recloss.bce_loss(*args, strategy=strategy)
    off = recloss.bce_loss(*args, strategy=strategy, compute_metrics=False)
    assert not set(COUNTS) & set(off.metrics)
    for k in ("num_targets", "invalid_targets", "weight_sum"):
        assert float(off.metrics[k]) == float(on.metrics[k])
    np.testing.assert_allclose(float(off.loss), float(on.loss), rtol=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_invalid_ids_counted_per_occurrence(strategy, rng):
    """Hand-written targets: repeats of an invalid id count each time; pad never counts."""
    V = 200
    case = make_case(rng, lead=(2, 3), V=V, D=16, L=5, p_pad=0.0, p_dup=0.0, p_invalid=0.0,
                     all_pad_rows=0)
    t = np.array([[[3, 3, 3, -1, -1], [V, V, -7, 5, 199], [0, -1, 0, V + 1, 2]],
                  [[-1, -1, -1, -1, -1], [-2, -2, 10, 11, 10], [1, 2, 3, 4, 5]]], np.int32)
    case["targets"] = jnp.asarray(t)
    out = recloss.bce_loss(case["hidden"], case["table"], case["targets"], strategy=strategy)
    assert float(out.metrics["invalid_targets"]) == 6.0
    assert float(out.metrics["num_targets"]) == 1 + 2 + 2 + 0 + 2 + 5
    ref = bce_oracle(**case)
    assert ref.metrics["invalid_targets"] == 6.0
    assert_close(out.loss, ref.loss, 1e-5, "loss")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_of_weights_matches_finite_differences(strategy, rng):
    """d loss / d weights for 'mean' against float64 central differences of the oracle."""
    case = make_case(rng, lead=(2, 9), V=300, D=16, weights="random", bias=True)
    w = f64(case["weights"])
    _, _, grads, _ = run_loss(strategy, case, {})

    def oracle_loss(wv):
        return bce_oracle(**{**case, "weights": wv}).loss

    fd = np.zeros_like(w)
    step = 1e-6
    for idx in np.ndindex(w.shape):
        up, dn = w.copy(), w.copy()
        up[idx] += step
        dn[idx] -= step
        fd[idx] = (oracle_loss(up) - oracle_loss(dn)) / (2 * step)
    assert_close(grads["weights"], fd, 1e-4, "d/dweights vs finite differences")


# ------------------------------------------------------------------------- the oracle itself
def test_oracle_default_is_mean_bce_with_logits(rng):
    """Defaults: ℓ = mean_v −[y log σ(x) + (1 − y) log(1 − σ(x))], Keras from_logits."""
    case = make_case(rng, lead=(3, 5), V=40, D=7, L=4)
    ref = bce_oracle(**case, reduction="none")
    x = ref.logits
    y, _ = labels_and_invalid(np.asarray(case["targets"]).reshape(15, -1), 40, 40)
    sig = 1.0 / (1.0 + np.exp(-x))
    naive = -(y * np.log(sig) + (1 - y) * np.log1p(-sig)).mean(axis=1)
    np.testing.assert_allclose(f64(ref.loss).ravel(), naive, rtol=1e-10)


def test_oracle_focal_terms_match_textbook_formula(rng):
    x = rng.normal(scale=3.0, size=200)
    sig = 1.0 / (1.0 + np.exp(-x))
    a, g, pw = 0.3, 1.7, 2.5
    p, q, _, _ = pq_terms(x, pos_weight=pw, focal_gamma=g, focal_alpha=a)
    textbook_p = -pw * a * (1 - sig) ** g * np.log(sig)
    # The textbook p as written loses digits where sig -> 1: sig carries ~2 eps, so 1 - sig and log(sig)
    # (~ -(1 - sig)) each carry ~2 eps / (1 - sig) relative, (1 - sig)^g g times that (seed 1320457096:
    # 4.7e-10 at 1 - sig = 1.3e-6). The oracle keeps full precision there; the tolerance is the formula's own.
    own = 1e-10 + 4 * (g + 1) * np.finfo(np.float64).eps * (1.0 + np.exp(x))
    bad = np.abs(p - textbook_p) > own * np.abs(textbook_p)
    assert not bad.any(), (x[bad], p[bad], textbook_p[bad])
    np.testing.assert_allclose(q, -(1 - a) * sig ** g * np.log1p(-sig), rtol=1e-10)


def _central_differences(f, base, h=1e-6):
    """∂f/∂base by central differences in float64, one element at a time (f: array -> scalar)."""
    fd = np.zeros_like(base)
    for idx in np.ndindex(base.shape):
        up, dn = base.copy(), base.copy()
        up[idx] += h
        dn[idx] -= h
        fd[idx] = (f(up) - f(dn)) / (2 * h)
    return fd


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_oracle_gradients_match_finite_differences(reduction, rng):
    """The oracle's analytic gradients are checked against central differences in float64."""
    opts = dict(reduction=reduction, label_smoothing=0.1, pos_weight=1.7, focal_gamma=1.5,
                focal_alpha=0.4, vocab_size=9, vocab_reduction="sum")
    case = make_case(rng, lead=(2, 3), V=9, rows=11, D=5, L=3, bias=True, weights="random",
                     dtype=jnp.float32)
    case = {k: (None if v is None else np.asarray(v)) for k, v in case.items()}
    for k in ("hidden", "table", "bias", "weights"):
        case[k] = case[k].astype(np.float64)
    case["weights"][0, 0] = 0.7      # Σw > 0
    cot = rng.normal(size=(2, 3)) if reduction == "none" else None
    ref = bce_oracle(**case, cotangent=cot, **opts)

    def objective(**changed):
        loss = bce_oracle(**{**case, **changed}, cotangent=cot, **opts).loss
        return float(np.sum(loss * cot)) if reduction == "none" else loss

    for name in ("hidden", "table", "bias", "weights"):
        fd = _central_differences(lambda x: objective(**{name: x}), case[name])
        np.testing.assert_allclose(ref.grads[name], fd, rtol=1e-5, atol=1e-8, err_msg=name)
    assert np.all(ref.grads["table"][9:] == 0.0) and np.all(ref.grads["bias"][9:] == 0.0)


def test_oracle_soft_cap_gradients_match_finite_differences(rng):
    """The oracle's soft-capped logits and their gradient chain, against central differences."""
    opts = dict(label_smoothing=0.1, pos_weight=1.7, focal_gamma=1.5, logit_soft_cap=1.5, vocab_reduction="sum")
    case = make_case(rng, lead=(2, 3), V=9, D=5, L=3, bias=True, logit_scale=3.0)
    case = {k: (None if v is None else np.asarray(v, np.float64 if k != "targets" else None)) for k, v in case.items()}
    ref = bce_oracle(**case, **opts)
    for name in ("hidden", "table", "bias"):
        fd = _central_differences(lambda x: bce_oracle(**{**case, name: x}, **opts).loss, case[name])
        np.testing.assert_allclose(ref.grads[name], fd, rtol=1e-5, atol=1e-8, err_msg=name)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_well_predicted_target_cancels_within_the_floor(strategy, rng):
    # V = 1, D = 1 and every row's one target predicted at x in [4, 8): the background Q(x) ≈ x and the
    # correction P − Q ≈ −x cancel to softplus(−x) < 0.02. The case a random draw found failing on a v5e
    # (the chip's float32 exp/log1p): judged against `cancel_floor`, the chip's transcendentals allowed on
    # it. Off TPU the float32 work (softplus of x, its correction, their sum: a few roundings of terms of size
    # x) is within 8·2⁻²⁴ of the terms' size S; at tol 1e-5 the floor 1e-2·S allows 1e-7·S, and the kernel
    # measured 0.8 of that once, so the loss is held to 2e-4: 2e-6·S, four times the bound.
    x = rng.uniform(4.0, 8.0, size=(6, 1))
    case = dict(hidden=jnp.asarray(x, jnp.float32), table=jnp.ones((1, 1), jnp.float32),
                targets=jnp.zeros((6, 1), jnp.int32), weights=None, bias=None)
    check_against_oracle(strategy, case, {}, rng, tol_loss=2e-4)


# A 16-bit table's gradient must be rounded once: the background's dE and the target correction's are summed
# in float32 and cast after. The inputs make a second rounding show by far more than its bound: every row's
# planted target has logit ≈ +20 (σ = 1 in float32), every other row ≈ −20 at that column, plain BCE summed
# (row scale 1), so at a target row the background's dE is Σ_rows a (its own rows) and the correction's
# −Σ_rows a: the float64 gradient is ~1e-9·S. A result rounded once is then within u·|g₆₄| plus the float32
# work, (2M + 2)·2⁻²⁴·S; one that rounds the background first is off by its rounding, up to u/2 of Σ_rows a.
# G is exactly representable in every dtype (±1, or σ(−20) ≈ 2e-9 in float32), so the Mosaic kernel's 16-bit
# products add no rounding of their own here.
@pytest.mark.parametrize("block_n", [None, 16], ids=["one-row-tile", "row-chunks"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("strategy", ["cutbce", "cutbce_pallas"])
def test_a_16_bit_tables_gradient_is_rounded_once(strategy, dtype, block_n, rng):
    # M = 96 rows, V = 300 (three blocks of 128, the last partial), D = 16; block_n=16 makes the kernel walk
    # its rows in chunks (an f32 dE across them), one tile keeps a 16-bit dE in the kernel (the correction
    # added in its f32 accumulator).
    m, u = 96, {jnp.bfloat16: 2.0 ** -8, jnp.float16: 2.0 ** -11}[dtype]
    plant = block_edges(300)
    case = planted_case(rng, m=m, v=300, rows=300, plant=plant, bias=False, dtype=dtype, plant_logit=20.0,
                        other_logit=-20.0)
    case["weights"] = None
    opts = dict(reduction="sum", vocab_reduction="sum", block_v=BV, block_n=block_n)
    _, _, g, _ = run_loss(strategy, case, opts, evaluate=False)
    assert g["table"].dtype == dtype
    ref = bce_oracle(**case, **opts)
    got, want, s = f64(g["table"])[plant], ref.grads["table"][plant], ref.grad_scale["table"][plant]
    assert np.max(np.abs(want)) < 1e-6 * np.max(s)                 # the cancellation the test relies on
    bound = u * np.abs(want) + (2 * m + 2) * 2.0 ** -24 * s
    ratio = np.abs(got - want) / bound
    at = np.unravel_index(np.argmax(ratio), ratio.shape)
    print(f"{strategy} {jnp.dtype(dtype).name}: worst |dE − dE64| at the targets {ratio[at]:.3g}x its bound")
    assert ratio[at] <= 1.0, (f"dE at target row {plant[at[0]]}, lane {at[1]}: {ratio[at]:.3g}x the bound of one "
                              f"rounding ({np.abs(got - want)[at]:.3g} > {bound[at]:.3g}; S {s[at]:.3g})")
    assert_close(g["table"], ref.grads["table"], 4 * u, "dE", CANCEL_FLOOR * np.linalg.norm(ref.grad_scale["table"]))


# ------------------------------------------------------------------------- random search
@st.composite
def _random_problem(draw):
    lead = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    rows = draw(st.integers(1, 300))
    vocab_size = draw(st.one_of(st.none(), st.integers(1, rows)))
    opts = dict(
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        vocab_reduction=draw(st.sampled_from(["mean", "sum"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.15])),
        pos_weight=draw(st.sampled_from([1.0, 0.3, 4.0])),
        focal_gamma=draw(st.sampled_from([0.0, 1.0, 2.5])),
        focal_alpha=draw(st.sampled_from([None, 0.25])),
        threshold=draw(st.sampled_from([0.0, -1.0, 0.8])),
        block_v=draw(st.sampled_from([None, 128])),
        block_n=draw(st.sampled_from([None, 8, 16])),
    )
    if vocab_size is not None:
        opts["vocab_size"] = vocab_size
    case_kw = dict(lead=lead, V=vocab_size or rows, rows=rows, D=draw(st.integers(1, 40)),
                   L=draw(st.integers(1, 10)), bias=draw(st.booleans()),
                   weights=draw(st.sampled_from([None, "random"])))
    return case_kw, opts, draw(st.integers(0, 2**32 - 1))


# Hypothesis draws fresh problems every run (a failing one is replayed from .hypothesis/, or with
# RECLOSS_TEST_SEED), so a few a run cover the space over many runs.
@pytest.mark.stack     # every strategy against the oracle on the newest stack too (docs/development.md)
@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=8, deadline=None)
@given(problem=_random_problem())
def test_random_problems_match_oracle(strategy, problem):
    case_kw, opts, seed = problem
    rng = np.random.default_rng(seed)
    case = make_case(rng, **case_kw)
    check_against_oracle(strategy, case, opts, rng)


@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("name", ["cutbce", "cutbce_pallas"])
def test_sparse_term_in_the_fused_sweep_equals_the_separate_correction(name, cap, rng):
    # recloss.sweep.sweep_total with the correction as its sparse term (what a ring runs at each
    # slice's visit) against the background sweep plus the correction through targets.gather_logits,
    # on a whole shard: value, target logits and the gradients in hidden, table, bias and r; with a
    # soft cap, the separate path caps the gathered logits by autodiff (softcap.soft_cap), the fused
    # one by hand (softcap.capped).
    from recloss import softcap, sweep
    from recloss.bce import bernoulli
    from recloss.shard import VocabShard

    opts = recloss.LossOptions(label_smoothing=0.1, pos_weight=2.0, vocab_size=190, block_v=128, block_n=8,
                               logit_soft_cap=cap)
    strategy = recloss.get_strategy(name, opts)
    case = make_case(rng, lead=(37,), V=190, rows=200, D=24, L=5, bias=True)
    h, e, b, t = case["hidden"], case["table"], case["bias"], case["targets"]
    r = jnp.asarray(rng.uniform(0.0, 1.0, size=(37,)), jnp.float32)

    def parts(h, e, b, r):
        shard = VocabShard.whole(e, b, vocab_size=190, platform="cpu")
        ids, valid = shard.local_targets(t, -1)
        return shard, ids, valid, strategy.plan(h.shape[0], shard)

    def fused(h, e, b, r):
        shard, ids, valid, plan = parts(h, e, b, r)
        total, (_, x) = sweep.sweep_total(h, shard, r, plan, sweep.Sparse(ids, valid))
        return total, x

    def separate(h, e, b, r):
        shard, ids, valid, plan = parts(h, e, b, r)
        x = softcap.soft_cap(shard.gather_logits(h, ids, valid), cap)
        bg, _ = sweep.sweep_total(h, shard, r, plan)
        return bg + jnp.sum(r * bernoulli.correction(x, valid, opts)), jnp.where(valid, x, 0.0)

    (v1, x1), g1 = jax.value_and_grad(fused, argnums=(0, 1, 2, 3), has_aux=True)(h, e, b, r)
    (v2, x2), g2 = jax.value_and_grad(separate, argnums=(0, 1, 2, 3), has_aux=True)(h, e, b, r)
    assert_close(v1, v2, 1e-5, "value")
    assert_close(x1, x2, 1e-5, "target logits")
    for what, a, c in zip(("dhidden", "dtable", "dbias", "drow_scale"), g1, g2):
        assert_close(a, c, 1e-5, what)
