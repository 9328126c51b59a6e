"""The sampled objective (`recloss.sampled_loss`): both strategies against the float64 oracle given the
drawn negatives, determinism per key, accidental hits, logQ, the gBCE full-catalogue limit (= cutbce),
sharded = single device, no [M, V] array, the sampler's distribution, and bad input.

Cases are odd shapes (M = 3·7, D = 13, V = 201 in 256 table rows) with padding, repeats, invalid ids,
an all-padding row, zero weights and bias; K is large against V so accidental hits occur.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recloss
from helpers import assert_close, CANCEL_FLOOR, make_inputs, make_layout, make_sampled_case, rel, strategies
from oracle import f64, sampled_oracle
from recloss.sampled import sampler

# `stack` (docs/development.md): the draws follow jax's PRNG implementation and its sharded form, which
# change between jax versions; the newest-stack leg runs this module.
pytestmark = [pytest.mark.tier1, pytest.mark.stack]

STRATEGIES = ("sampled_softmax", "gbce")


def negatives(strategy, key, opts, *, rows, log_q=None):
    """The ids `sampled_loss` draws for ``key`` (the strategy's own draw, with the same proposal)."""
    s = recloss.get_strategy(strategy, **opts)
    v = opts.get("vocab_size") or rows
    return np.asarray(s.draw_negatives(key, sampler.local(sampler.masked(log_q, rows=rows, vocab_size=v)),
                                       vocab_size=v))


def run(case, key, opts, *, cot=None, log_q=None, layout=None):
    names = ("hidden", "table", "bias", "weights")

    def f(args):
        kw = dict(zip(names, args))
        out = recloss.sampled_loss(kw["hidden"], kw["table"], case["targets"], kw["weights"], kw["bias"],
                                   key=key, log_q=log_q, layout=layout, **opts)
        return (out.loss if cot is None else jnp.vdot(out.loss, cot)), out

    (_, out), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(tuple(case[n] for n in names))
    return out, dict(zip(names, grads))


def check(case, opts, rng, *, log_q=None, tol_loss=1e-5, tol_grad=1e-4):
    none = opts.get("reduction") == "none"
    lead = case["hidden"].shape[:-1]
    cot = jnp.asarray(rng.normal(size=lead), jnp.float32) if none else None
    key = jax.random.key(int(rng.integers(1 << 30)))
    neg = negatives(opts["strategy"], key, {k: v for k, v in opts.items() if k != "strategy"},
                    rows=case["table"].shape[0], log_q=log_q)
    out, grads = run(case, key, opts, cot=cot, log_q=log_q)
    ref = sampled_oracle(**case, negatives=neg, cotangent=cot, log_q=None if log_q is None else f64(log_q), **opts)
    assert out.loss.dtype == jnp.float32 and out.loss.shape == (lead if none else ())
    assert_close(out.loss, ref.loss, tol_loss, "loss", CANCEL_FLOOR * np.linalg.norm(
        np.ravel(ref.loss_scale)) * 1e-3)
    for name, g in grads.items():
        assert g.dtype == case[name].dtype, (name, g.dtype)
        floor = CANCEL_FLOOR * 1e-3 * np.linalg.norm(ref.grad_scale[name].ravel())
        assert float(np.max(np.abs(ref.grads[name]))) > 0, name
        assert_close(g, ref.grads[name], tol_grad, f"d/d{name}", floor)
    v = opts.get("vocab_size")
    if v is not None:
        assert np.all(f64(grads["table"])[v:] == 0.0) and np.all(f64(grads["bias"])[v:] == 0.0)
    for k in ("num_targets", "invalid_targets"):
        assert float(out.metrics[k]) == ref.metrics[k], (k, float(out.metrics[k]), ref.metrics[k])
    np.testing.assert_allclose(float(out.metrics["weight_sum"]), ref.metrics["weight_sum"], rtol=1e-6)
    assert abs(float(out.metrics["top1"]) - ref.metrics["top1"]) <= ref.metric_slack + 1e-5
    return out, grads, ref, neg


CASES = [
    dict(strategy="sampled_softmax", num_negatives=64),
    dict(strategy="sampled_softmax", num_negatives=37, in_batch_negatives=True, temperature=0.7,
         reduction="none", vocab_size=201),
    dict(strategy="sampled_softmax", num_negatives=50, remove_accidental_hits=False, reduction="sum"),
    dict(strategy="gbce", num_negatives=29, gbce_t=0.3, temperature=1.3, reduction="none"),
    dict(strategy="gbce", num_negatives=40, gbce_t=1.0, remove_accidental_hits=False, reduction="sum"),
]


@pytest.mark.parametrize("opts", CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_matches_oracle(opts, rng):
    case = make_sampled_case(rng)
    _, _, _, neg = check(case, opts, rng)
    t = np.asarray(case["targets"]).reshape(-1, 4)
    # K is large against V: some drawn negative is some row's target, so the hit masks are exercised.
    assert any(np.isin(neg, row[row >= 0]).any() for row in t)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_and_logits_near_1e4(strategy, rng):
    case = make_sampled_case(rng, scale=3e3, dtype=jnp.bfloat16)
    x = f64(case["hidden"]).reshape(-1, 13) @ f64(case["table"]).T
    assert np.max(np.abs(x)) > 5e3
    # Gradients come back in bf16: its rounding (2^-9 relative) bounds their agreement.
    check(case, dict(strategy=strategy, num_negatives=48, vocab_size=201), rng, tol_loss=1e-5, tol_grad=8e-3)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_log_q_with_mass_on_a_few_ids(strategy, rng):
    """q on 5 ids: every negative is one of them and the corrected loss matches the oracle (targets
    outside the support have q = 0: their correction is capped, finite)."""
    support = rng.choice(201, size=5, replace=False)
    log_q = np.full(256, -np.inf, np.float32)
    log_q[support] = np.log(rng.uniform(0.1, 1.0, size=5))
    log_q = jnp.asarray(log_q)
    case = make_sampled_case(rng)
    # Half the rows get a target in the support; the others' targets (q = 0) dominate their negatives
    # by e^80 and give ~1e-35 losses, which float32 rounds to 0.
    t = np.asarray(case["targets"]).reshape(-1, 4).copy()
    t[::2, 0] = rng.choice(support, size=t[::2].shape[0])
    case["targets"] = jnp.asarray(t.reshape(case["targets"].shape))
    _, _, _, neg = check(case, dict(strategy=strategy, num_negatives=40), rng, log_q=log_q)
    assert set(neg.tolist()) <= set(support.tolist())
    loss = jax.jit(lambda lq: recloss.sampled_loss(case["hidden"], case["table"], case["targets"], case["weights"],
                                                   case["bias"], key=jax.random.key(3), strategy=strategy,
                                                   num_negatives=40, log_q=lq).loss)
    assert float(loss(log_q)) != float(loss(jnp.zeros(256)))   # q matters (a traced log_q is not value-checked)


def test_log_q_from_counts():
    counts = np.array([0, 1, 3, 0, 6], np.int64)
    lq = np.asarray(recloss.log_q_from_counts(counts))
    np.testing.assert_allclose(np.exp(lq), counts / 10.0, rtol=1e-6, atol=0)
    lq2 = np.asarray(recloss.log_q_from_counts(counts, alpha=0.5))
    np.testing.assert_allclose(np.exp(lq2), np.sqrt(counts) / np.sqrt(counts).sum(), rtol=1e-6)
    with pytest.raises(ValueError, match=r"counts must be finite and >= 0, got -1.0"):
        recloss.log_q_from_counts(np.array([1, -1]))
    with pytest.raises(ValueError, match=r"alpha=-1.0 is invalid"):
        recloss.log_q_from_counts(counts, alpha=-1.0)


def _frequencies_match(ids, q):
    freq = np.bincount(ids, minlength=q.size) / ids.size
    assert freq[q == 0].sum() == 0.0 and ids.max() < q.size
    se = np.sqrt(q * (1 - q) / ids.size)
    assert np.all(np.abs(freq - q) <= 4 * se + 1e-6), np.max(np.abs(freq - q) / (se + 1e-12))


def _zipfish_q(seed, v):
    q = np.random.default_rng(seed).uniform(size=v) ** 3
    q[[3, 17, v - 1]] = 0.0
    return q / q.sum()


def test_sampler_draws_from_q_with_replacement():
    """200k draws over V = 50: frequencies within 4 standard errors of q; ids with q = 0 never drawn."""
    q = _zipfish_q(0, 50)
    lq = jnp.log(jnp.asarray(q, jnp.float32))
    _frequencies_match(np.asarray(sampler.draw(jax.random.key(11), sampler.local(sampler.masked(
        lq, rows=50, vocab_size=50)), 200_000, vocab_size=50)), q)
    uniform = np.asarray(sampler.draw(jax.random.key(12), None, 200_000, vocab_size=50))
    _frequencies_match(uniform, np.full(50, 1 / 50))


def test_sharded_draw_is_q_and_the_same_on_every_shard():
    """The proposal split over 8 vocab shards (V = 50 in 64 rows, 8 a shard; shard 6 holds only
    ids of q = 0 or past V): 200k draws from q, every shard returning the same ids, and the log q
    each shard reads for any id equal to the whole proposal's."""
    from jax.sharding import PartitionSpec as P

    from recloss import _compat
    from recloss.shard import VocabShard

    q = _zipfish_q(1, 50)
    q[48:] = 0.0
    q /= q.sum()
    lq = sampler.masked(jnp.log(jnp.asarray(q, jnp.float32)), rows=64, vocab_size=50)
    mesh = jax.make_mesh((8,), ("vocab",))
    probe = jnp.arange(-1, 66, dtype=jnp.int32)

    def body(lq_local):
        shard = VocabShard(jnp.zeros((8, 1)), None, jax.lax.axis_index("vocab") * 8, 50, "cpu",
                           vocab_axes=("vocab",))
        proposal = sampler.local(lq_local, shard)
        ids = sampler.draw(jax.random.key(5), proposal, 200_000, vocab_size=50)
        return ids[None], proposal.log_q_at(jnp.clip(probe, 0, 49))[None]

    ids, at = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=P("vocab"), out_specs=P("vocab"),
                                        check_vma=False))(_compat.place(lq, mesh, P("vocab")))
    ids, at = np.asarray(ids), np.asarray(at)
    assert all(np.array_equal(ids[0], row) for row in ids) and all(np.array_equal(at[0], row) for row in at)
    _frequencies_match(ids[0], q)
    whole = np.asarray(sampler.proposal(lq, rows=64, vocab_size=50))[np.clip(np.asarray(probe), 0, 49)]
    np.testing.assert_allclose(at[0], whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_same_key_same_loss_other_key_other_negatives(strategy, rng):
    case = make_sampled_case(rng)
    args = (case["hidden"], case["table"], case["bias"])

    @jax.jit
    def f(key, args):
        loss = lambda a: recloss.sampled_loss(a[0], a[1], case["targets"], case["weights"], a[2], key=key,
                                              strategy=strategy, num_negatives=32).loss
        return jax.value_and_grad(loss)(args)

    (la, ga), (lb, gb), (lc, _) = f(jax.random.key(5), args), f(jax.random.key(5), args), f(jax.random.key(6), args)
    assert np.asarray(la).tobytes() == np.asarray(lb).tobytes()
    for x, y in zip(ga, gb):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    n5 = negatives(strategy, jax.random.key(5), {"num_negatives": 32}, rows=256)
    n6 = negatives(strategy, jax.random.key(6), {"num_negatives": 32}, rows=256)
    assert not np.array_equal(n5, n6) and float(la) != float(lc)
    # Raw uint32 key data is the same key; eager equals jit.
    eager = recloss.sampled_loss(case["hidden"], case["table"], case["targets"], case["weights"], case["bias"],
                                 key=jax.random.key_data(jax.random.key(5)), strategy=strategy, num_negatives=32)
    np.testing.assert_allclose(float(eager.loss), float(la), rtol=1e-6)


class _Fixed:
    """Test hook: negatives given up front instead of drawn."""
    ids = None

    def draw_negatives(self, key, proposal, *, vocab_size):
        return jnp.asarray(self.ids, jnp.int32)


class FixedSoftmax(_Fixed, recloss.sampled.SampledSoftmax):
    pass


class FixedGBCE(_Fixed, recloss.sampled.GBCE):
    pass


@pytest.mark.parametrize("cls", [FixedSoftmax, FixedGBCE])
def test_accidental_hits_never_enter_the_denominator(cls, rng):
    """Row 0's targets {a, b}; negatives [a, a, b, c]. Removed hits leave only c for row 0: the loss
    equals the oracle's and differs from the one that keeps them; with negatives [a, b] alone row 0's
    sampled softmax is exactly 0 (nothing to compete with)."""
    case = make_sampled_case(rng, lead=(4,), V=60, rows=64)
    a, b, c = 5, 9, 17
    targets = np.asarray(case["targets"]).copy()
    targets[0] = [a, b, -1, a]
    targets[2:] = -1
    case["targets"] = jnp.asarray(targets)
    case["weights"] = jnp.ones(4, jnp.float32)
    strat = cls(recloss.LossOptions(reduction="none", vocab_size=60))
    strat.ids = [a, a, b, c]
    keep = cls(recloss.LossOptions(reduction="none", vocab_size=60, remove_accidental_hits=False))
    keep.ids = strat.ids
    args = (case["hidden"], case["table"], case["targets"], case["weights"], case["bias"])
    out = jax.jit(lambda *a: strat(*a, key=jax.random.key(0)))(*args)
    kept = jax.jit(lambda *a: keep(*a, key=jax.random.key(0)))(*args)
    name = "sampled_softmax" if cls is FixedSoftmax else "gbce"
    ref = sampled_oracle(**case, negatives=strat.ids, strategy=name, reduction="none", vocab_size=60)
    assert_close(out.loss, ref.loss, 1e-5, "loss")
    assert float(out.loss[0]) != float(kept.loss[0])
    if cls is FixedSoftmax:
        strat.ids = [a, b]
        assert float(jax.jit(lambda *a: strat(*a, key=jax.random.key(0)))(*args).loss[0]) == 0.0


class EveryId(recloss.sampled.GBCE):
    """Test hook: the 'negatives' are the whole catalogue; each row's targets are then its accidental
    hits, so every row sees exactly its V − |T| non-target ids (α = 1, β = 1)."""

    def draw_negatives(self, key, proposal, *, vocab_size):
        return jnp.arange(vocab_size, dtype=jnp.int32)


def test_gbce_covering_the_catalogue_is_cutbce_with_vocab_sum(rng):
    case = make_sampled_case(rng, V=201, rows=256)
    has = np.any(np.isin(np.asarray(case["targets"]), np.arange(201)), axis=-1)
    case["weights"] = jnp.where(jnp.asarray(has), case["weights"], 0.0)   # cutbce counts rows without targets
    names = ("hidden", "table", "bias")
    gbce = EveryId(recloss.LossOptions(num_negatives=201, vocab_size=201))
    assert gbce.options.gbce_t == 0.75

    def f(strategy):
        def loss(args):
            h, e, b = args
            if strategy is gbce:
                return gbce(h, e, case["targets"], case["weights"], b, key=jax.random.key(0)).loss
            return recloss.bce_loss(h, e, case["targets"], case["weights"], b, strategy="cutbce",
                                    vocab_reduction="sum", vocab_size=201).loss
        return jax.jit(jax.value_and_grad(loss))(tuple(case[n] for n in names))

    (lg, gg), (lb, gb) = f(gbce), f("cutbce")
    assert_close(lg, lb, 2e-6, "loss")
    for n, x, y in zip(names, gg, gb):
        assert_close(x, y, 2e-5, f"d/d{n}")


MESHES = [(1, 1, 8), (2, 2, 2), (8, 1, 1)]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("opts", [dict(strategy="sampled_softmax", num_negatives=48, in_batch_negatives=True),
                                  dict(strategy="gbce", num_negatives=48, gbce_t=0.5)],
                         ids=lambda o: o["strategy"])
def test_sharded_equals_single_device(shape, opts, rng):
    """V = 1000 in 1024 rows; the negatives come from the same key on every shard ('none' on 2x2x2).

    q is uniform on a random 95% of the ids: its weights are 0 and 1, so every CDF sum is exact and
    the sharded draw equals the single-device one bitwise (for general weights the two may differ
    where a uniform lands within float rounding of a step: about 1 call in 600 at K = 48,
    measured; `test_sharded_draw_is_q_and_the_same_on_every_shard` checks such a q's draw)."""
    layout = make_layout(shape)
    inputs = make_inputs(rng, V=1000, rows=1024)
    log_q = jnp.asarray(np.where(rng.uniform(size=1000) < 0.95, 0.0, -np.inf), jnp.float32)
    for reduction in (("none",) if shape == (2, 2, 2) else ("mean",)):
        o = dict(opts, vocab_size=1000, reduction=reduction)
        cot = jnp.asarray(rng.normal(size=(2, 8)), jnp.float32) if reduction == "none" else None
        ref, ref_g = run(inputs, jax.random.key(9), o, cot=cot, log_q=log_q)
        out, g = run(inputs, jax.random.key(9), o, cot=cot, log_q=log_q, layout=layout)
        assert out.loss.shape == ref.loss.shape
        assert rel(out.loss, ref.loss) <= 1e-5
        for k in ref.metrics:
            assert rel(out.metrics[k], ref.metrics[k]) <= 1e-5, k
        for n in ("hidden", "table", "bias"):
            assert float(jnp.max(jnp.abs(ref_g[n]))) > 0
            assert rel(g[n], ref_g[n]) <= 1e-4, (n, rel(g[n], ref_g[n]))


def _big_vars(jaxpr, limit):
    """Shapes of the values in ``jaxpr`` (nested ones too) with at least ``limit`` elements."""
    out = []
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            shape = getattr(var.aval, "shape", ())
            if int(np.prod(shape)) >= limit:
                out.append((eqn.primitive.name, shape))
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _big_vars(inner, limit)
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_array_of_size_m_times_v(strategy, rng):
    """M = 64, V = 4096, D = 8, K = 32 (in-batch: 256 more): no value of the loss and gradient,
    single device or sharded, has M·V elements; the table (V·D) is the largest."""
    m, v, d = 64, 4096, 8
    h = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(v, d)), jnp.float32)
    t = jnp.asarray(rng.integers(0, v, size=(m, 4)), jnp.int32)
    opts = dict(num_negatives=32, in_batch_negatives=strategy == "sampled_softmax")
    for layout in (None, make_layout((2, 2, 2))):
        f = lambda h, e: recloss.sampled_loss(h, e, t, key=jax.random.key(0), strategy=strategy,
                                              layout=layout, **opts).loss
        jaxpr = jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1)))(h, e).jaxpr
        assert _big_vars(jaxpr, v * d) and not _big_vars(jaxpr, m * v), _big_vars(jaxpr, m * v)


# ------------------------------------------------------------------------- bad input
def _args(rng):
    case = make_sampled_case(rng, lead=(5,), V=40, rows=40)
    return case["hidden"], case["table"], case["targets"], case["weights"], case["bias"]


@pytest.mark.parametrize("kwargs,error,fragment", [
    (dict(), ValueError, "needs key="),
    (dict(key=3), TypeError, "key must be a jax.random key"),
    (dict(key=jax.random.key(0), num_negatives=0), ValueError, "num_negatives=0 is invalid: expected an int >= 1"),
    (dict(key=jax.random.key(0), num_negatives=41), ValueError,
     "num_negatives=41 exceeds the vocabulary size V=40"),
    (dict(key=jax.random.key(0), log_q=jnp.zeros(39)), ValueError, "log_q must have shape (40,)"),
    (dict(key=jax.random.key(0), log_q=jnp.zeros(40).at[7].set(jnp.nan)), ValueError, "log_q[7]=nan is invalid"),
    (dict(key=jax.random.key(0), log_q=jnp.zeros(40).at[3].set(jnp.inf)), ValueError, "log_q[3]=inf is invalid"),
    (dict(key=jax.random.key(0), log_q=jnp.full(40, -jnp.inf)), ValueError, "-inf everywhere"),
    (dict(key=jax.random.key(0), strategy="gbce", gbce_t=1.5), ValueError, "gbce_t=1.5 is invalid: expected a float in [0, 1]"),
    (dict(key=jax.random.key(0), strategy="gbce", in_batch_negatives=True), ValueError,
     "strategy 'gbce' (sampled objective) does not take the option(s) in_batch_negatives=True"),
    (dict(key=jax.random.key(0), strategy="cutce"), ValueError, "call recloss.softmax_loss"),
    (dict(key=jax.random.key(0), label_smoothing=0.1), ValueError, "does not take the option(s) label_smoothing"),
])
def test_bad_input_is_a_named_error(kwargs, error, fragment, rng):
    with pytest.raises(error) as info:
        recloss.sampled_loss(*_args(rng), **kwargs)
    assert fragment in str(info.value), str(info.value)


def test_other_entry_points_refuse_sampled_strategies_and_keys(rng):
    args = _args(rng)
    with pytest.raises(ValueError, match=r"call recloss.sampled_loss"):
        recloss.softmax_loss(*args, strategy="sampled_softmax")
    with pytest.raises(TypeError, match=r"takes no argument\(s\) \['key'\]"):
        recloss.get_strategy("cutbce")(*args, key=jax.random.key(0))
    assert recloss.available_strategies("sampled") == ("gbce", "sampled_softmax")
