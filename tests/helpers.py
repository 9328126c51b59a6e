"""What several test modules share: the strategies under test, random inputs with the awkward cases
(padding, repeats, invalid ids, all-padding rows, zero weights), mesh layouts, comparisons, the sharded
loss-and-gradient runner, and readers of compiled HLO and of the Pallas calls in a jaxpr.

Test modules import from here (and the float64 oracles from `oracle`), never from one another.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

import recloss
from oracle import f64
from recloss import sharding


def strategies(objective: str = "bce"):
    """Every registered strategy of ``objective``; Pallas ones run in interpret mode on CPU."""
    return recloss.available_strategies(objective)


# Options only some strategies take (an error elsewhere): the blocked ones' block sizes, the Pallas
# ones' interpret mode. A case written once for every strategy of an objective passes them through this.
_MECHANICS = ("block_v", "block_n", "interpret")


def options_for(strategy: str, opts: Dict) -> Dict:
    """``opts`` without the block sizes and interpret mode when ``strategy`` does not take them (the
    dense baselines); every other option is kept, so a misdirected one is still an error."""
    takes = recloss.get_strategy(strategy).options_supported
    return {k: v for k, v in opts.items() if k not in _MECHANICS or k in takes}


# ------------------------------------------------------------------------- inputs
def make_targets(rng, lead, L, V, *, pad_id=-1, p_pad=0.25, p_dup=0.15, p_invalid=0.05,
                 all_pad_rows=1):
    """Random ids in [0, V) (pad_id excluded) with padding, repeats, invalid ids and all-pad rows."""
    m = int(np.prod(lead))
    low = 1 if pad_id == 0 else 0
    t = rng.integers(low, max(V, low + 1), size=(m, L))
    u = rng.random((m, L))
    if L > 1:
        t[:, 1:] = np.where(u[:, 1:] < p_dup, t[:, :-1], t[:, 1:])
    bad = (u >= p_dup) & (u < p_dup + p_invalid)
    above = V + rng.integers(0, 150, size=(m, L))
    below = (-2 if pad_id == -1 else -1) - rng.integers(0, 50, size=(m, L))   # never pad_id
    t = np.where(bad, np.where(rng.random((m, L)) < 0.5, above, below), t)
    t = np.where(u > 1.0 - p_pad, pad_id, t)
    if all_pad_rows and m > 1:
        t[rng.choice(m, size=min(all_pad_rows, m - 1), replace=False)] = pad_id
    return t.reshape(tuple(lead) + (L,)).astype(np.int32)


def make_case(rng, *, lead=(2, 65), V=1000, D=123, L=8, rows=None, bias=False, weights=None,
              logit_scale=2.0, huge=0.0, dtype=jnp.float32, **target_kw):
    """Inputs with logits x ≈ N(0, logit_scale²) (+ bias ≈ N(−0.5, 1)).

    weights: None, 'random' (uniform [0, 2) with ~20% zeros) or 'zeros'.
    rows: table rows (≥ V); targets use V as the vocabulary.
    huge: if > 0, 80% of the columns get a logit offset of ±[huge/2, huge] through
      hidden[..., 0] = 1, so those logits are saturated (far from the σ transition,
      where float32 rounding of x would make the gradient ill-conditioned).
    """
    rows = rows or V
    lead = tuple(lead)
    h = rng.normal(size=lead + (D,))
    e = rng.normal(size=(rows, D)) * (logit_scale / np.sqrt(D))
    if huge:
        h[..., 0] = 1.0
        e[:, 0] = rng.choice([-1.0, 0.0, 1.0], p=[0.4, 0.2, 0.4], size=rows) * rng.uniform(
            huge / 2, huge, size=rows)
    case = {
        "hidden": jnp.asarray(h, dtype),
        "table": jnp.asarray(e, dtype),
        "targets": jnp.asarray(make_targets(rng, lead, L, V, **target_kw)),
        "weights": None,
        "bias": None,
    }
    if bias:
        case["bias"] = jnp.asarray(rng.normal(-0.5, 1.0, size=(rows,)), dtype)
    if weights == "random":
        w = rng.uniform(0.0, 2.0, size=lead)
        w[rng.random(lead) < 0.2] = 0.0
        case["weights"] = jnp.asarray(w, jnp.float32)
    elif weights == "zeros":
        case["weights"] = jnp.zeros(lead, jnp.float32)
    return case


def rel_err(got, ref, floor=0.0):
    """‖got − ref‖ / max(‖ref‖, floor) (absolute error when both are 0)."""
    got, ref = f64(got), f64(ref)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    den = max(np.linalg.norm(ref.ravel()), floor)
    num = np.linalg.norm((got - ref).ravel())
    return num / den if den > 0 else num


# RECLOSS_TEST_MARGINS=PATH: every `assert_close` and entry-wise oracle check appends (test, what, error,
# tolerance) to PATH as a JSON line, so a run of the suite shows which checks sit near their tolerance.
MARGINS_ENV = "RECLOSS_TEST_MARGINS"


def note_margin(what: str, err: float, tol: float):
    """Appends one check's error and tolerance to $RECLOSS_TEST_MARGINS (when set)."""
    path = os.environ.get(MARGINS_ENV)
    if path:
        import json
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        with open(path, "a") as f:
            f.write(json.dumps(dict(test=test, what=what, err=float(err), tol=float(tol))) + "\n")


def assert_close(got, ref, tol, what, floor=0.0):
    assert np.all(np.isfinite(f64(got))), f"{what}: non-finite values"
    err = rel_err(got, ref, floor)
    note_margin(what, err, tol)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


# A result that cancels to (near) zero is judged against 1% of the size of its
# terms (`OracleResult.loss_scale`, `.grad_scale`): float32 rounding is relative
# to those. For realistic V the floor is far below the result and plays no role.
CANCEL_FLOOR = 1e-2

# On a TPU backend (`make test-tpu`) the chip's float32 transcendentals are coarser than a CPU's: exp
# within 8e-6 relative, log about 1e-5 absolute near a log-partition (docs/measurements.md). A loss that
# cancels (V = 1, D = 1: background and correction of one target) keeps that error in absolute terms,
# so there the floor allows this much per unit of its terms' size. Off TPU it is 0: nothing loosens.
TPU_TRANSCENDENTAL_ERR = 3e-5


def cancel_floor(scale, tol: float) -> float:
    """The denominator floor of a relative-error check of a result whose terms have size ``scale``
    (`OracleResult.loss_scale`): `CANCEL_FLOOR`·|scale|, and on a TPU backend at least enough that an
    absolute error of `TPU_TRANSCENDENTAL_ERR`·|scale| passes at ``tol``."""
    factor = CANCEL_FLOOR
    if jax.default_backend() == "tpu":
        factor = max(factor, TPU_TRANSCENDENTAL_ERR / tol)
    return factor * float(np.linalg.norm(np.ravel(scale)))


# ------------------------------------------------------------------------- inputs with planted boundaries
BV = 128             # block_v of the boundary cases: the kernels' least vocab block
PAD_LOGIT = 6.0      # every row's logit at every padding row (twice that with a bias: the bias is PAD_LOGIT too)
PLANT_LOGIT = 4.0    # a row's logit at its planted target


def block_edges(v: int, bv: int = BV, lo: int = 0):
    """The first and last live id of every block of ``bv`` ids in [lo, v) (and v − 1)."""
    ids = set()
    for start in range(lo, v, bv):
        ids.update((start, min(start + bv, v) - 1))
    return sorted(ids)


def twins_of(plant, v: int, offsets):
    """(c, (c + offset) mod v) for each planted column c, the offsets taken in turn, where that id is not
    planted and not taken yet: the column pairs whose logits `planted_case` makes tie exactly."""
    out, taken = [], set(plant)
    for i, c in enumerate(plant):
        twin = (c + offsets[i % len(offsets)]) % v
        if twin not in taken:
            out.append((c, twin))
            taken.add(twin)
    return out


def planted_case(rng, *, m, v, rows, plant, d=16, l=6, bias=True, dtype=jnp.float32, pad_id=-1,
                 plant_logit=PLANT_LOGIT, other_logit=None, twins=()):
    """hidden [m, d], table [rows, d], targets [m, l], weights [m] (multiples of 1/4, row 1 zero), bias.

    Coordinate 0 is 1 in every hidden row and ``PAD_LOGIT`` in every padding row (ids ≥ v) of the table;
    coordinate 1 + j belongs to planted column ``plant[j]``: rows i ≥ 1 with i − 1 ≡ j (mod len(plant))
    have 1 there and the table row ``plant[j]`` has ``plant_logit`` (with ``other_logit``, every other row
    has other_logit / plant_logit there: the column is then strongly negative for the rows not planted on
    it; a planted column has no noise and no bias, so its own rows' logit is exactly ``plant_logit``,
    their argmax). The other coordinates are noise (logits ≈ N(0, 0.25)). Targets per row: its planted column, a
    live id that is not planted, an invalid id (v: a padding row when rows > v; rows; −2), the planted
    column again (a duplicate two places later), a live id that is not planted, pad_id; row 0 is all
    padding and planted on no column. ``twins``: (c, c′) pairs (`twins_of`): table row and bias c′ are
    copies of c's, so every row's logits tie exactly there (the softmax argmax takes the smaller id).
    """
    k = len(plant)
    noise = d - 1 - k
    assert noise >= 4, (d, k)
    h = np.zeros((m, d))
    h[:, 0] = 1.0
    h[:, 1 + k:] = rng.normal(size=(m, noise))
    e = np.zeros((rows, d))
    e[:, 1 + k:] = rng.normal(size=(rows, noise)) * (0.5 / np.sqrt(noise))
    e[v:, 0] = PAD_LOGIT
    own = np.where(np.arange(m) == 0, -1, (np.arange(m) - 1) % k)
    for j, c in enumerate(plant):
        assert 0 <= c < v, (c, v)
        e[c, 1 + k:] = 0.0                 # its logit is exactly plant_logit (or other_logit): no noise
        e[c, 1 + j] = plant_logit
        h[:, 1 + j] = 0.0 if other_logit is None else other_logit / plant_logit
        h[own == j, 1 + j] = 1.0
    invalid = np.array([v, rows, -2 if pad_id != -2 else -3])
    for c, twin in twins:
        assert 0 <= twin < v and twin not in plant, (c, twin)
        e[twin] = e[c]
    unplanted = np.setdiff1d(np.arange(v), list(plant) + [t for _, t in twins])
    live = lambda: rng.choice(unplanted, size=m)
    t = np.stack([np.asarray(plant)[own], live(), invalid[np.arange(m) % 3], np.asarray(plant)[own], live(),
                  np.full(m, pad_id)], axis=1)[:, :l]
    t[0] = pad_id
    w = rng.choice([0.25, 0.5, 1.0, 1.5, 2.0], size=m)
    w[1] = 0.0
    b = None
    if bias:
        b = rng.normal(-0.5, 0.5, size=rows)
        b[v:] = PAD_LOGIT
        b[list(plant)] = 0.0
        for c, twin in twins:
            b[twin] = b[c]
    # Multiples of 2⁻⁶: every product and partial sum of a logit is exact in float32, in any order, so twins
    # tie bit for bit whichever block, lane or shard computes them.
    cast = lambda x: None if x is None else jnp.asarray(np.round(np.asarray(x) * 64) / 64, dtype)
    return dict(hidden=cast(h), table=cast(e), targets=jnp.asarray(t, jnp.int32),
                weights=jnp.asarray(w, jnp.float32), bias=cast(b))


# ------------------------------------------------------------------------- the float64 oracle, entry by entry
def oracle_of(strategy: str):
    """The float64 oracle of ``strategy``'s objective (`oracle.bce_oracle` or `oracle.softmax_oracle`)."""
    from oracle import bce_oracle, softmax_oracle
    objective = recloss.get_strategy(strategy).objective
    return {"bce": bce_oracle, "softmax": softmax_oracle}[objective]


# The float32 work of a strategy on these sizes: each gradient entry is a sum of at most a few thousand
# float32 terms, within (terms)·2⁻²⁴ of its sum of absolute terms S; 1e-4·S leaves a factor of ten.
F32_ENTRY_TOL = 1e-4


def oracle_check(strategy, case, opts, rng, *, layout=None, evaluate=False, tol_loss=1e-5, tol_grad=1e-4,
                 entry_tol=F32_ENTRY_TOL, entry_bound=None, exact_counts=None, exact_ties=False):
    """``strategy`` (a BCE or softmax one) on ``case`` (hidden, table, targets, weights, bias) with
    options ``opts`` (under ``layout`` when given) against its float64 oracle. Returns (out, grads, ref).

    The differentiated objective is c·loss with a scalar c ≠ 1 drawn from ``rng`` (so a backward that
    ignores its cotangent shows), or ⟨loss, cot⟩ for reduction='none'. Checked:

    * the loss, relative error ≤ ``tol_loss`` (`cancel_floor` for a loss that cancels);
    * every gradient (hidden, table, bias, weights), relative error ≤ ``tol_grad`` over the whole
      array, and entry by entry |g − g₆₄| ≤ ``entry_tol``·S + tiny, S the entry's sum of absolute
      terms (`oracle.OracleResult.grad_scale`): a defect in one column, row or shard edge moves an
      entry, whatever the norm of the rest; ``entry_bound(name, S, g₆₄)`` replaces that bound (16-bit
      dtypes: docs/sharding.md "16-bit gradients");
    * table and bias rows at or past ``vocab_size`` exactly 0;
    * the metrics: exact where the weights make them so (``exact_counts``; default: no weights or
      weights in multiples of 1/4), else within float32 rounding and the oracle's slack;
    * with ``evaluate``, the loss without a gradient (the custom-VJP primal) equals it.

    ``exact_ties``: the case's only near-ties of the argmax are exact ones (`planted_case`'s twins), which
    the smallest id must win: top1 is then held to the oracle's with no slack.
    """
    opts = dict(opts)
    objective = recloss.get_strategy(strategy).objective
    entry = {"bce": recloss.bce_loss, "softmax": recloss.softmax_loss}[objective]
    names = [n for n in ("hidden", "table", "bias", "weights") if case[n] is not None]
    none = opts.get("reduction") == "none"
    lead = case["hidden"].shape[:-1]
    cot = (jnp.asarray(rng.normal(size=lead), jnp.float32) if none
           else float(rng.choice([-2.5, -1.5, 1.75, 3.0])))

    def call(args, targets):
        kw = dict(zip(names, args))
        return entry(kw["hidden"], kw["table"], targets, kw.get("weights"), kw.get("bias"), strategy=strategy,
                     layout=layout, **options_for(strategy, opts))

    def objective_fn(args, targets):
        out = call(args, targets)
        return (jnp.vdot(out.loss, cot) if none else cot * out.loss), out

    args = tuple(case[n] for n in names)
    (_, out), grads = jax.jit(jax.value_and_grad(objective_fn, has_aux=True))(args, case["targets"])
    grads = dict(zip(names, grads))
    ref = oracle_of(strategy)(**case, cotangent=cot if none else None, **opts)
    scale = 1.0 if none else cot

    assert out.loss.dtype == jnp.float32 and out.loss.shape == (lead if none else ())
    assert_close(out.loss, ref.loss, tol_loss, "loss", cancel_floor(ref.loss_scale, tol_loss))
    wsum = ref.metrics["weight_sum"]
    for name, g in grads.items():
        assert g.dtype == case[name].dtype and g.shape == case[name].shape, (name, g.dtype, g.shape)
        if name == "weights" and opts.get("reduction", "mean") == "mean" and wsum == 0:
            assert np.all(np.isfinite(f64(g)))
            continue
        want, s = ref.grads[name] * scale, np.abs(ref.grad_scale[name] * scale)
        err = np.abs(f64(g) - want)
        bound = entry_bound(name, s, want) if entry_bound else entry_tol * s + 1e-30
        ratio = err / bound
        note_margin(f"d/d{name} entries", float(np.max(ratio)), 1.0)
        if np.any(ratio > 1):
            at = np.unravel_index(np.argmax(ratio), ratio.shape)
            raise AssertionError(f"d/d{name}: {int(np.sum(ratio > 1))} entries past their bound, the worst "
                                 f"{ratio[at]:.3g}x its bound at {tuple(map(int, at))}: |g - g64| = {err[at]:.3g} "
                                 f"(oracle {want[at]:.3g}, S {s[at]:.3g})")
        assert_close(g, want, tol_grad, f"d/d{name}", CANCEL_FLOOR * float(np.linalg.norm(s.ravel())))
    v = opts.get("vocab_size")
    if v is not None:
        for name in ("table", "bias"):
            if name in grads:
                assert np.all(f64(grads[name])[v:] == 0.0), f"d/d{name}: rows at or past vocab_size={v} not 0"

    if exact_counts is None:
        w = case["weights"]
        exact_counts = w is None or bool(np.all(f64(w) * 4 == np.round(f64(w) * 4)))
    slack = 0.0 if exact_ties else ref.metric_slack
    _check_metrics(objective, out.metrics, ref, opts, exact_counts, slack)
    if evaluate:
        evaluated = jax.jit(call)(args, case["targets"])
        assert_close(evaluated.loss, out.loss, 2e-6, "eval-only loss vs value_and_grad loss")
        _check_metrics(objective, evaluated.metrics, ref, opts, exact_counts, slack)
    return out, grads, ref


def _check_metrics(objective, mets, ref, opts, exact: bool, slack: float):
    """The strategy's metrics against the oracle's: counts exact (up to ``slack``, the oracle's for logits
    at the threshold or a near-tied argmax) when ``exact``, else within float32 rounding of a weighted sum."""
    for k in ("num_targets", "invalid_targets"):
        assert float(mets[k]) == ref.metrics[k], (k, float(mets[k]), ref.metrics[k])
    wsum = ref.metrics["weight_sum"]
    rtol = 0.0 if exact else 1e-5
    assert abs(float(mets["weight_sum"]) - wsum) <= rtol * abs(wsum), ("weight_sum", float(mets["weight_sum"]), wsum)
    counts = ("tp", "fp", "fn", "tn") if objective == "bce" else ("top1",)
    if not opts.get("compute_metrics", True):
        assert not set(counts) & set(mets), sorted(mets)
        return
    for k in counts:
        got, want = float(mets[k]), ref.metrics[k]
        tol = (ref.metric_slack if objective == "bce" else slack) + rtol * max(1.0, abs(want))
        assert abs(got - want) <= tol, f"metric {k}: got {got}, oracle {want} (slack {tol})"
    if objective == "softmax":
        np.testing.assert_allclose(float(mets["mean_lse"]), ref.metrics["mean_lse"], rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------- meshes
AXES = ("data", "fsdp", "vocab")


def make_layout(shape, names=AXES, **roles):
    mesh = Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)
    return recloss.MeshLayout(mesh, **roles)


def rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def make_inputs(rng, *, lead=(2, 8), D=16, V=1000, rows=1024, L=4, bias=True):
    """hidden [*lead, D], table [rows, D] (rows ≥ V: padding), targets with pad ids (−1),
    repeats and invalid ids (≥ V, including ids that fall in the padding rows), weights with zeros."""
    m = int(np.prod(lead))
    t = rng.integers(0, V, size=(m, L))
    u = rng.random((m, L))
    t[:, 1:] = np.where(u[:, 1:] < 0.2, t[:, :-1], t[:, 1:])               # repeats
    t = np.where((u > 0.2) & (u < 0.3), V + rng.integers(0, rows - V + 40, size=(m, L)), t)
    t = np.where(u > 0.75, -1, t)                                           # padding
    t[0] = -1                                                               # an all-padding row
    t[1, 0], t[2, -1] = V, rows + 7                                         # invalid ids on every seed
    w = rng.uniform(0.0, 2.0, size=(m,))
    w[rng.random(m) < 0.2] = 0.0
    out = dict(
        hidden=jnp.asarray(rng.normal(size=lead + (D,)), jnp.float32),
        table=jnp.asarray(rng.normal(size=(rows, D)) * (2.0 / np.sqrt(D)), jnp.float32),
        targets=jnp.asarray(t.reshape(lead + (L,)), jnp.int32),
        weights=jnp.asarray(w.reshape(lead), jnp.float32),
        bias=jnp.asarray(rng.normal(-0.5, 1.0, size=(rows,)), jnp.float32) if bias else None,
    )
    return out


def make_sampled_case(rng, *, lead=(3, 7), D=13, V=201, rows=256, L=4, scale=1.0, dtype=jnp.float32):
    """The sampled objectives' inputs: hidden [*lead, D] (× ``scale``), table [rows, D], targets with
    repeats, invalid ids, padding and an all-padding row, weights with zeros, bias [rows]."""
    m = int(np.prod(lead))
    t = rng.integers(0, V, size=(m, L))
    u = rng.random((m, L))
    t[:, 1:] = np.where(u[:, 1:] < 0.2, t[:, :-1], t[:, 1:])                  # repeats
    t = np.where((u > 0.2) & (u < 0.3), V + rng.integers(0, rows - V + 20, size=(m, L)), t)   # invalid
    t = np.where(u > 0.8, -1, t)                                              # padding
    t[1] = -1                                                                 # an all-padding row
    w = rng.uniform(0.1, 2.0, size=m)
    w[rng.random(m) < 0.2] = 0.0
    return dict(hidden=jnp.asarray(rng.normal(size=lead + (D,)) * scale, dtype),
                table=jnp.asarray(rng.normal(size=(rows, D)) / np.sqrt(D), dtype),
                targets=jnp.asarray(t.reshape(lead + (L,)), jnp.int32),
                weights=jnp.asarray(w.reshape(lead), jnp.float32),
                bias=jnp.asarray(rng.normal(-0.3, 0.5, size=rows), dtype))


# ------------------------------------------------------------------------- sharded runs
# Every softmax option at a non-default value, with small blocks (sharded and ring tests).
SOFTMAX_OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, temperature=0.7, block_v=128, block_n=8)


def loss_and_grads(strategy, inputs, layout, cot=None, **opts):
    """(loss, metrics, grads of hidden/table[/bias]) of the strategy's entry point on `make_inputs`'s
    ``inputs``, jitted; for reduction='none' the gradient is of Σ cot·loss.

    Every array is an argument of the jitted function, so the tests that run one strategy with the same
    options and shapes (the single-device reference of each mesh, above all) share one compile."""
    fn = _loss_and_grads_fn(strategy, layout, cot is not None, inputs["bias"] is not None,
                            tuple(sorted(opts.items())))
    (_, out), grads = fn(inputs["hidden"], inputs["table"], inputs["bias"], inputs["targets"], inputs["weights"],
                         cot)
    return out.loss, out.metrics, grads


@functools.lru_cache(maxsize=None)
def _loss_and_grads_fn(strategy, layout, with_cot: bool, with_bias: bool, opts: tuple):
    entry = recloss.softmax_loss if recloss.get_strategy(strategy).objective == "softmax" else recloss.bce_loss
    opts = options_for(strategy, dict(opts))

    def f(h, e, b, targets, weights, cot):
        out = entry(h, e, targets, weights, b, strategy=strategy, layout=layout, **opts)
        return (out.loss if not with_cot else jnp.sum(out.loss * cot)), out

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2) if with_bias else (0, 1), has_aux=True))


def assert_matches(strategy, inputs, layout, cot=None, **opts):
    """The loss, metrics and gradients under ``layout`` equal the single-device ones (and the
    gradients are not all zero, so the comparison means something)."""
    ref_loss, ref_m, ref_g = loss_and_grads(strategy, inputs, None, cot, **opts)
    loss, mets, grads = loss_and_grads(strategy, inputs, layout, cot, **opts)
    assert loss.shape == ref_loss.shape
    note_margin("sharded loss", rel(loss, ref_loss), 1e-5)
    assert rel(loss, ref_loss) <= 1e-5, (loss, ref_loss)
    assert set(mets) == set(ref_m)
    for k in ref_m:
        assert rel(mets[k], ref_m[k]) <= 1e-5, (k, mets[k], ref_m[k])
    for name, g, rg in zip(("hidden", "table", "bias"), grads, ref_g):
        assert g.shape == rg.shape and g.dtype == rg.dtype
        assert float(jnp.max(jnp.abs(rg))) > 0, name
        note_margin(f"sharded d/d{name}", rel(g, rg), 1e-4)
        assert rel(g, rg) <= 1e-4, (name, rel(g, rg))
    return loss, mets, grads


# ------------------------------------------------------------------------- compiled programs
def compiled_loss_grad(strategy, layout, *, M, V, D, L=4, **opts):
    """Compiled jit(value_and_grad) of the loss w.r.t. hidden and table, from shapes only."""

    def f(h, e, t):
        return recloss.bce_loss(h, e, t, strategy=strategy, layout=layout, **opts).loss

    shapes = ((M, D), (V, D), (M, L))
    dtypes = (jnp.float32, jnp.float32, jnp.int32)
    if layout is None:
        args = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes)]
    else:
        specs = sharding.default_specs(layout)
        args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(layout.mesh, p))
                for s, d, p in zip(shapes, dtypes, (specs.hidden, specs.table, specs.targets))]
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(*args).compile()


def hlo_computations(hlo: str):
    """{computation name: body text} of an HLO module's text."""
    comps, name, lines = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            name, lines = m.group(1), []
            if line.startswith("ENTRY"):
                comps["__entry__"] = name
        elif line.startswith("}") and name:
            comps[name] = "\n".join(lines)
            name = None
        elif name:
            lines.append(line)
    return comps


def loop_computations(comps):
    """Names of every computation reachable from a while loop's body or condition."""
    called = lambda text: set(re.findall(r"(?:body|condition|to_apply|calls|branch_computations)="
                                         r"\{?%?([\w.\-]+)", text))
    todo = set()
    for text in comps.values():
        if isinstance(text, str):
            todo |= set(re.findall(r"\bbody=%?([\w.\-]+)", text))
            todo |= set(re.findall(r"\bcondition=%?([\w.\-]+)", text))
    seen = set()
    while todo:
        n = todo.pop()
        if n in seen or n not in comps:
            continue
        seen.add(n)
        todo |= called(comps[n])
    return seen


def v6e8_layout(shape):
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x4", chip_config_name="default",
                                        chips_per_host_bounds=(2, 2, 1), num_slices=1)
    mesh = Mesh(np.array(topo.devices).reshape(shape), AXES)
    return recloss.MeshLayout(mesh)


# ------------------------------------------------------------------------- Pallas calls
def pallas_calls(jaxpr):
    """(name, cost estimate) of the pallas_calls in a jaxpr, in order, looking inside nested jaxprs."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append((eqn.params["name"], eqn.params["cost_estimate"]))
            continue
        stack = list(eqn.params.values())
        while stack:
            p = stack.pop(0)
            if isinstance(p, (tuple, list)):
                stack.extend(p)
            elif hasattr(p, "eqns"):
                names += pallas_calls(p)
            elif hasattr(getattr(p, "jaxpr", None), "eqns"):
                names += pallas_calls(p.jaxpr)
    return names


def count_vocab_loss_calls(monkeypatch):
    """A list that records the strategy name of every call of the MaxText plugin's vocab_loss (its
    hook, traced inside MaxText's own steps) while the test runs."""
    from recloss_plugins.maxtext import loss as rm_loss

    calls = []
    real = rm_loss.vocab_loss

    def counting(*args, **kwargs):
        calls.append(args[3].loss)
        return real(*args, **kwargs)

    monkeypatch.setattr(rm_loss, "vocab_loss", counting)
    return calls


# ```python blocks of a Markdown page, at any indentation (a block inside a list item is indented).
_PYTHON_BLOCK = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def python_blocks(text: str):
    """The ```python fenced blocks of ``text``, in order, their indentation removed."""
    out = []
    for m in _PYTHON_BLOCK.finditer(text):
        indent = len(m.group("indent"))
        out.append("".join(line[indent:] if line[:indent].strip() == "" else line
                           for line in m.group("body").splitlines(keepends=True)))
    return out
