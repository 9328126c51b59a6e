"""Flax plugin: NNX and linen MultiLabelHead, make_loss_fn, config errors; BCE and softmax strategies."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import recloss
from helpers import strategies
from recloss_plugins.flax import LinenMultiLabelHead, MultiLabelHead, make_loss_fn, resolve_config

# `stack` (docs/development.md): Flax (linen and nnx) moves with jax; the newest-stack leg runs this module.
pytestmark = [pytest.mark.tier1, pytest.mark.stack]


try:
    import ml_collections
except ImportError:  # pragma: no cover - ml-collections is a project dependency
    ml_collections = None

TIGHT = dict(rtol=1e-6, atol=1e-7)


def _inputs(rng, b=3, n=5, d=8, v=67, num_labels=3, pad_frac=0.3):
    hidden = jnp.asarray(rng.standard_normal((b, n, d)), jnp.float32)
    targets = rng.integers(0, v, (b, n, num_labels))
    targets = np.where(rng.random(targets.shape) < pad_frac, -1, targets)
    weights = jnp.asarray(rng.uniform(0.2, 2.0, (b, n)), jnp.float32)
    return hidden, jnp.asarray(targets, jnp.int32), weights


def _assert_tree_close(got, want, **tol):
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tol), got, want)


# ------------------------------------------------------------------ training
def _memorise_data(rng, v, b=8, n=10, num_labels=3):
    items = rng.integers(0, v, (b, n))
    targets = (5 * items[..., None] + np.arange(1, num_labels + 1)) % v
    return jnp.asarray(items), jnp.asarray(targets, jnp.int32), jnp.ones((b, n), jnp.float32)


def _recall(metrics):
    return float(metrics["tp"] / (metrics["tp"] + metrics["fn"]))


class _NnxModel(nnx.Module):
    def __init__(self, v, d, *, tied, rngs):
        self.embed = nnx.Embed(v, d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.head = MultiLabelHead(v, d, strategy="cutbce", tied=tied, use_bias=True, block_v=32, rngs=rngs)

    def __call__(self, items, targets, weights):
        hidden = self.proj(jax.nn.gelu(self.embed(items)))
        table = self.embed.embedding if self.head.tied else None
        return self.head(hidden, targets, weights, table=table)


def _train_nnx(model, items, targets, weights, steps=150):
    """Adam(3e-2) on ``model(items, targets, weights).loss``: (the losses, the last step's metrics)."""
    opt = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        def loss_fn(m):
            out = m(items, targets, weights)
            return out.loss, out.metrics
        (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        opt.update(model, grads)
        return loss, metrics

    losses = []
    for _ in range(steps):
        loss, metrics = step(model, opt)
        losses.append(float(loss))
    return losses, metrics


@pytest.mark.parametrize("tied", [False, True])
def test_nnx_model_trains(rng, tied):
    v, d = 96, 16
    items, targets, weights = _memorise_data(rng, v)
    model = _NnxModel(v, d, tied=tied, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    losses, metrics = _train_nnx(model, items, targets, weights)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])
    assert _recall(metrics) > 0.9, _recall(metrics)


class _LinenModel(nn.Module):
    v: int
    d: int

    @nn.compact
    def __call__(self, items, targets, weights):
        hidden = nn.Dense(self.d)(jax.nn.gelu(nn.Embed(self.v, self.d)(items)))
        return LinenMultiLabelHead(num_items=self.v, features=self.d, use_bias=True,
                                   options={"block_v": 32})(hidden, targets, weights)


def test_linen_model_trains(rng):
    v, d = 96, 16
    items, targets, weights = _memorise_data(rng, v)
    model = _LinenModel(v, d)
    params = model.init(jax.random.key(int(rng.integers(1 << 30))), items, targets, weights)["params"]
    assert params["MultiLabelHead_0"]["table"].shape == (v, d)
    tx = optax.adam(3e-2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        def loss_fn(p):
            out = model.apply({"params": p}, items, targets, weights)
            return out.loss, out.metrics
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    losses = []
    for _ in range(150):
        params, opt_state, loss, metrics = step(params, opt_state)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])
    assert _recall(metrics) > 0.9, _recall(metrics)


# ------------------------------------------------------------------ gradients equal bce_loss
HEAD_CASES = [
    ("cutbce", dict(block_v=16)),
    ("cutbce", dict(block_v=32, label_smoothing=0.1, pos_weight=2.0, reduction="sum")),
    ("dense_bce", dict(focal_gamma=2.0, focal_alpha=0.25)),
]


@pytest.mark.parametrize("strategy,opts", HEAD_CASES)
def test_nnx_head_grads_equal_bce_loss(rng, strategy, opts):
    hidden, targets, weights = _inputs(rng)
    head = MultiLabelHead(67, 8, strategy=strategy, use_bias=True, rngs=nnx.Rngs(int(rng.integers(99))),
                          **opts)
    head.bias[...] = jnp.asarray(rng.standard_normal(67), jnp.float32)  # non-zero bias gradient path

    def via_head(head, hidden):
        out = head(hidden, targets, weights)
        return out.loss, out.metrics

    (loss, metrics), (g_head, g_hidden) = nnx.jit(nnx.value_and_grad(via_head, argnums=(0, 1), has_aux=True))(
        head, hidden)

    def direct(table, bias, hidden):
        out = recloss.bce_loss(hidden, table, targets, weights, bias, strategy=strategy, **opts)
        return out.loss, out.metrics

    (want_loss, want_metrics), want = jax.jit(jax.value_and_grad(direct, argnums=(0, 1, 2), has_aux=True))(
        head.table[...], head.bias[...], hidden)
    np.testing.assert_allclose(loss, want_loss, **TIGHT)
    _assert_tree_close(metrics, want_metrics, **TIGHT)
    _assert_tree_close((g_head.table[...], g_head.bias[...], g_hidden), want, **TIGHT)
    assert float(jnp.abs(want[0]).sum()) > 0 and float(jnp.abs(want[1]).sum()) > 0


def test_nnx_head_grads_equal_bce_loss_pallas(rng):
    # The head forwards to whatever strategy it was given; one Pallas case (interpret mode on CPU).
    hidden, targets, weights = _inputs(rng, b=2, n=4, v=128)
    head = MultiLabelHead(128, 8, strategy="cutbce_pallas", rngs=nnx.Rngs(3))
    g_head, g_hidden = nnx.jit(nnx.grad(lambda m, h: m(h, targets, weights).loss, argnums=(0, 1)))(head, hidden)
    want = jax.jit(jax.grad(lambda e, h: recloss.bce_loss(h, e, targets, weights, strategy="cutbce_pallas").loss,
                            argnums=(0, 1)))(head.table[...], hidden)
    _assert_tree_close((g_head.table[...], g_hidden), want, **TIGHT)


@pytest.mark.parametrize("strategy,opts", HEAD_CASES[1:2])
def test_linen_head_grads_equal_bce_loss(rng, strategy, opts):
    hidden, targets, weights = _inputs(rng)
    head = LinenMultiLabelHead(num_items=67, features=8, strategy=strategy, options=opts, use_bias=True)
    params = head.init(jax.random.key(int(rng.integers(99))), hidden, targets)["params"]
    params = {**params, "bias": jnp.asarray(rng.standard_normal(67), jnp.float32)}

    def via_head(p, hidden):
        out = head.apply({"params": p}, hidden, targets, weights)
        return out.loss, out.metrics

    (loss, metrics), (g_params, g_hidden) = jax.jit(jax.value_and_grad(via_head, argnums=(0, 1), has_aux=True))(
        params, hidden)

    def direct(table, bias, hidden):
        out = recloss.bce_loss(hidden, table, targets, weights, bias, strategy=strategy, **opts)
        return out.loss, out.metrics

    (want_loss, want_metrics), want = jax.jit(jax.value_and_grad(direct, argnums=(0, 1, 2), has_aux=True))(
        params["table"], params["bias"], hidden)
    np.testing.assert_allclose(loss, want_loss, **TIGHT)
    _assert_tree_close(metrics, want_metrics, **TIGHT)
    _assert_tree_close((g_params["table"], g_params["bias"], g_hidden), want, **TIGHT)


def test_head_built_from_loss_options(rng):
    hidden, targets, weights = _inputs(rng)
    options = recloss.LossOptions(label_smoothing=0.2, reduction="none", block_v=16)
    head = MultiLabelHead(67, 8, options=options, rngs=nnx.Rngs(0))
    assert head.options == options
    want = recloss.bce_loss(hidden, head.table[...], targets, weights, label_smoothing=0.2,
                            reduction="none", block_v=16).loss
    got = head(hidden, targets, weights).loss
    assert got.shape == hidden.shape[:-1]
    np.testing.assert_allclose(got, want, **TIGHT)
    # Keyword options override the LossOptions; a ready Strategy is accepted as is.
    assert MultiLabelHead(67, 8, options=options, pos_weight=3.0, rngs=nnx.Rngs(0)).options == \
        options.replace(pos_weight=3.0)
    strat = recloss.get_strategy("cutbce", options)
    assert MultiLabelHead(67, 8, strategy=strat, rngs=nnx.Rngs(0)).strategy is strat
    linen_head = LinenMultiLabelHead(num_items=67, features=8, options=options)
    assert linen_head.loss_strategy.options == options


# ------------------------------------------------------------------ softmax strategies: equal softmax_loss
SOFTMAX_HEAD_CASES = [
    ("cutce", dict(block_v=16)),
    ("cutce", dict(block_v=32, label_smoothing=0.1, z_loss=1e-3, temperature=0.5, reduction="sum")),
    ("dense_ce", dict(temperature=2.0, z_loss=1e-4)),
] + [(name, dict(z_loss=1e-4)) for name in strategies("softmax") if name not in ("cutce", "dense_ce")]


def _softmax_direct(targets, weights, strategy, opts):
    def direct(table, bias, hidden):
        out = recloss.softmax_loss(hidden, table, targets, weights, bias, strategy=strategy, **opts)
        return out.loss, out.metrics
    return jax.jit(jax.value_and_grad(direct, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("strategy,opts", SOFTMAX_HEAD_CASES)
def test_nnx_head_with_a_softmax_strategy_equals_softmax_loss(rng, strategy, opts):
    hidden, targets, weights = _inputs(rng, v=128)
    head = MultiLabelHead(128, 8, strategy=strategy, use_bias=True, rngs=nnx.Rngs(int(rng.integers(99))),
                          **opts)
    assert head.strategy.objective == "softmax" and head.strategy.name == strategy
    head.bias[...] = jnp.asarray(rng.standard_normal(128), jnp.float32)

    def via_head(head, hidden):
        out = head(hidden, targets, weights)
        return out.loss, out.metrics

    (loss, metrics), (g_head, g_hidden) = nnx.jit(nnx.value_and_grad(via_head, argnums=(0, 1), has_aux=True))(
        head, hidden)
    (want_loss, want_metrics), want = _softmax_direct(targets, weights, strategy, opts)(
        head.table[...], head.bias[...], hidden)
    np.testing.assert_allclose(loss, want_loss, **TIGHT)
    assert {"top1", "mean_lse", "weight_sum", "num_targets"} <= set(metrics) and "tp" not in metrics
    _assert_tree_close(metrics, want_metrics, **TIGHT)
    _assert_tree_close((g_head.table[...], g_head.bias[...], g_hidden), want, **TIGHT)
    assert float(jnp.abs(want[0]).sum()) > 0 and float(jnp.abs(want[1]).sum()) > 0


@pytest.mark.parametrize("strategy,opts", SOFTMAX_HEAD_CASES[1:2])
def test_linen_head_with_a_softmax_strategy_equals_softmax_loss(rng, strategy, opts):
    hidden, targets, weights = _inputs(rng, v=128)
    head = LinenMultiLabelHead(num_items=128, features=8, strategy=strategy, options=opts, use_bias=True)
    assert head.loss_strategy.objective == "softmax"
    params = head.init(jax.random.key(int(rng.integers(99))), hidden, targets)["params"]
    params = {**params, "bias": jnp.asarray(rng.standard_normal(128), jnp.float32)}

    def via_head(p, hidden):
        out = head.apply({"params": p}, hidden, targets, weights)
        return out.loss, out.metrics

    (loss, metrics), (g_params, g_hidden) = jax.jit(jax.value_and_grad(via_head, argnums=(0, 1), has_aux=True))(
        params, hidden)
    (want_loss, want_metrics), want = _softmax_direct(targets, weights, strategy, opts)(
        params["table"], params["bias"], hidden)
    np.testing.assert_allclose(loss, want_loss, **TIGHT)
    _assert_tree_close(metrics, want_metrics, **TIGHT)
    _assert_tree_close((g_params["table"], g_params["bias"], g_hidden), want, **TIGHT)


def test_nnx_model_trains_with_a_softmax_head(rng):
    # Each position has L=3 targets sharing the softmax mass: the loss falls towards log 3 and the
    # argmax lands on a target (metrics top1 / weight_sum).
    v, d = 96, 16
    items, targets, weights = _memorise_data(rng, v)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(v, d, rngs=rngs)
            self.proj = nnx.Linear(d, d, rngs=rngs)
            self.head = MultiLabelHead(v, d, strategy="cutce", tied=True, block_v=32, z_loss=1e-4)

        def __call__(self, items, targets, weights):
            hidden = self.proj(jax.nn.gelu(self.embed(items)))
            return self.head(hidden, targets, weights, table=self.embed.embedding)

    model = Model(nnx.Rngs(int(rng.integers(1 << 30))))
    losses, metrics = _train_nnx(model, items, targets, weights)
    assert np.all(np.isfinite(losses))
    assert losses[0] > np.log(v) - 1 and losses[-1] < np.log(3) + 0.3, (losses[0], losses[-1])
    assert float(metrics["top1"] / metrics["weight_sum"]) > 0.9


def test_softmax_head_option_errors_and_scores(rng):
    with pytest.raises(ValueError, match=r"strategy 'cutce' \(softmax objective\).*pos_weight=2.0"):
        MultiLabelHead(10, 4, strategy="cutce", pos_weight=2.0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"strategy 'cutbce' \(bce objective\).*z_loss=0.001"):
        MultiLabelHead(10, 4, strategy="cutbce", z_loss=1e-3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"strategy 'dense_ce'.*focal_gamma=2.0"):
        LinenMultiLabelHead(num_items=10, features=4, strategy="dense_ce", options={"focal_gamma": 2.0})
    with pytest.raises(ValueError, match="temperature=0.0"):
        MultiLabelHead(10, 4, strategy="cutce", temperature=0.0, rngs=nnx.Rngs(0))
    # BCE options at their defaults are fine for a softmax strategy.
    assert MultiLabelHead(10, 4, strategy="cutce", pos_weight=1.0, rngs=nnx.Rngs(0)).strategy.name == "cutce"
    # scores are the logits the softmax loss sees: divided by the temperature.
    hidden, _, _ = _inputs(rng)
    head = MultiLabelHead(67, 8, strategy="cutce", temperature=0.5, rngs=nnx.Rngs(1))
    want = np.einsum("bnd,vd->bnv", np.asarray(hidden, np.float64), np.asarray(head.table[...], np.float64)) / 0.5
    np.testing.assert_allclose(head.scores(hidden), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ tied embeddings
class _TiedNnx(nnx.Module):
    def __init__(self, v, d, rngs):
        self.embed = nnx.Embed(v, d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.head = MultiLabelHead(None, d, tied=True, block_v=16)

    def __call__(self, items, targets, weights):
        return self.head(self.proj(self.embed(items)), targets, weights, table=self.embed.embedding)


def test_nnx_tied_head_borrows_embedding(rng):
    v, d = 67, 8
    items = jnp.asarray(rng.integers(0, v, (3, 5)))
    _, targets, weights = _inputs(rng, d=d, v=v)
    model = _TiedNnx(v, d, nnx.Rngs(int(rng.integers(99))))
    assert model.head.table is None and len(nnx.state(model.head, nnx.Param)) == 0
    grads = nnx.jit(nnx.grad(lambda m: m(items, targets, weights).loss))(model)

    def reference(emb, kernel, bias):
        hidden = emb[items] @ kernel + bias
        return recloss.bce_loss(hidden, emb, targets, weights, block_v=16).loss

    want = jax.jit(jax.grad(reference, argnums=(0, 1, 2)))(model.embed.embedding[...], model.proj.kernel[...],
                                                  model.proj.bias[...])
    _assert_tree_close((grads.embed.embedding[...], grads.proj.kernel[...], grads.proj.bias[...]), want,
                       **TIGHT)
    # The borrowed table gets the loss's item-table gradient too, not just the looked-up rows'.
    untouched = np.setdiff1d(np.arange(v), np.asarray(items))
    assert np.abs(np.asarray(grads.embed.embedding[...])[untouched]).sum() > 0
    # A plain array works as the borrowed table too.
    hidden, _, _ = _inputs(rng, d=d, v=v)
    table = jnp.asarray(rng.standard_normal((v, d)), jnp.float32)
    np.testing.assert_allclose(model.head(hidden, targets, weights, table=table).loss,
                               recloss.bce_loss(hidden, table, targets, weights, block_v=16).loss, **TIGHT)


class _TiedLinen(nn.Module):
    v: int
    d: int

    def setup(self):
        self.embed = nn.Embed(self.v, self.d)
        self.proj = nn.Dense(self.d)
        self.head = LinenMultiLabelHead(num_items=None, features=self.d, tied=True, options={"block_v": 16})

    def __call__(self, items, targets, weights):
        return self.head(self.proj(self.embed(items)), targets, weights, table=self.embed.embedding)


def test_linen_tied_head_borrows_embedding(rng):
    v, d = 67, 8
    items = jnp.asarray(rng.integers(0, v, (3, 5)))
    _, targets, weights = _inputs(rng, d=d, v=v)
    model = _TiedLinen(v, d)
    params = model.init(jax.random.key(int(rng.integers(99))), items, targets, weights)["params"]
    assert "head" not in params  # the tied head owns nothing
    grads = jax.jit(jax.grad(lambda p: model.apply({"params": p}, items, targets, weights).loss))(params)

    def reference(emb, kernel, bias):
        return recloss.bce_loss(emb[items] @ kernel + bias, emb, targets, weights, block_v=16).loss

    want = jax.jit(jax.grad(reference, argnums=(0, 1, 2)))(params["embed"]["embedding"], params["proj"]["kernel"],
                                                  params["proj"]["bias"])
    _assert_tree_close((grads["embed"]["embedding"], grads["proj"]["kernel"], grads["proj"]["bias"]),
                       want, **TIGHT)


def test_table_argument_errors(rng):
    hidden, targets, weights = _inputs(rng, d=8, v=67)
    tied = MultiLabelHead(67, 8, tied=True)
    with pytest.raises(ValueError, match="tied=True.*pass the shared"):
        tied(hidden, targets, weights)
    with pytest.raises(ValueError, match=r"shape \[V, 8\]"):
        tied(hidden, targets, weights, table=jnp.ones((67, 4)))
    with pytest.raises(ValueError, match="67 rows|num_items=67"):
        tied(hidden, targets, weights, table=jnp.ones((50, 8)))
    owned = MultiLabelHead(67, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="owns its table"):
        owned(hidden, targets, weights, table=jnp.ones((67, 8)))
    linen_tied = LinenMultiLabelHead(num_items=None, features=8, tied=True)
    with pytest.raises(ValueError, match="tied=True.*pass the shared"):
        linen_tied.init(jax.random.key(0), hidden, targets)


def test_construction_errors():
    with pytest.raises(ValueError, match="unknown strategy 'cutbse'.*did you mean 'cutbce'"):
        MultiLabelHead(10, 4, strategy="cutbse", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="unknown loss option.*'blockv'.*did you mean 'block_v'"):
        MultiLabelHead(10, 4, blockv=8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="label_smoothing=1.5"):
        MultiLabelHead(10, 4, label_smoothing=1.5, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="options must be a recloss.LossOptions"):
        MultiLabelHead(10, 4, options=0.1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="already a recloss.Strategy"):
        MultiLabelHead(10, 4, strategy=recloss.get_strategy("cutbce"), block_v=8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_items is needed"):
        MultiLabelHead(None, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rngs"):
        MultiLabelHead(10, 4)
    with pytest.raises(ValueError, match="features must be a positive int"):
        MultiLabelHead(10, 0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="layout must be a recloss.MeshLayout"):
        MultiLabelHead(10, 4, layout="data", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        LinenMultiLabelHead(num_items=10, features=4, strategy="nope")
    with pytest.raises(TypeError, match="unknown loss option"):
        LinenMultiLabelHead(num_items=10, features=4, options={"threshhold": 0.5})
    with pytest.raises(ValueError, match="num_items is needed"):
        LinenMultiLabelHead(num_items=None, features=4, use_bias=True, tied=True)


# ------------------------------------------------------------------ scores, specs, layout
def test_scores_are_dense_logits(rng):
    hidden, _, _ = _inputs(rng)
    head = MultiLabelHead(67, 8, use_bias=True, vocab_size=60, rngs=nnx.Rngs(1))
    head.bias[...] = jnp.asarray(rng.standard_normal(67), jnp.float32)
    want = np.einsum("bnd,vd->bnv", np.asarray(hidden, np.float64), np.asarray(head.table[...], np.float64))
    want = want + np.asarray(head.bias[...])
    got = head.scores(hidden)
    assert got.shape == (3, 5, 60)  # padding rows past vocab_size dropped
    np.testing.assert_allclose(got, want[..., :60], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(head.embed(jnp.array([2, 5])), head.table[...][jnp.array([2, 5])])
    lh = LinenMultiLabelHead(num_items=67, features=8)
    variables = lh.init(jax.random.key(0), hidden, method="scores")
    np.testing.assert_allclose(lh.apply(variables, hidden, method="scores"),
                               np.einsum("bnd,vd->bnv", hidden, variables["params"]["table"]),
                               rtol=1e-5, atol=1e-5)


def _layout():
    devices = np.array(jax.devices()[:8]).reshape(2, 2, 2)
    return recloss.MeshLayout(Mesh(devices, ("data", "fsdp", "vocab")))


def test_layout_passes_through_and_specs(rng):
    layout = _layout()
    hidden, targets, weights = _inputs(rng, b=4, n=4, v=256)
    head = MultiLabelHead(256, 8, layout=layout, use_bias=True, block_v=32, rngs=nnx.Rngs(2))
    plain = MultiLabelHead(256, 8, use_bias=True, block_v=32, rngs=nnx.Rngs(2))
    specs = head.partition_specs()
    assert specs == plain.partition_specs(layout) == \
        recloss.get_strategy("cutbce", block_v=32).partition_specs(layout)
    assert specs.table == jax.sharding.PartitionSpec(("vocab", "fsdp"), None)
    with pytest.raises(ValueError, match="needs a recloss.MeshLayout"):
        plain.partition_specs()
    assert LinenMultiLabelHead(num_items=256, features=8).partition_specs(layout) == specs
    # The layout reaches bce_loss: the sharded program runs under shard_map, the plain one does not.
    assert "shard_map" in str(jax.make_jaxpr(lambda h: head(h, targets, weights).loss)(hidden))
    assert "shard_map" not in str(jax.make_jaxpr(lambda h: plain(h, targets, weights).loss)(hidden))
    fn = make_loss_fn({"loss": "cutbce", "block_v": 32}, layout=layout)
    assert fn.partition_specs() == fn.partition_specs(layout) == specs
    with pytest.raises(ValueError, match="needs a recloss.MeshLayout"):
        make_loss_fn({"loss": "cutbce"}).partition_specs()
    with pytest.raises(TypeError, match="layout must be a recloss.MeshLayout"):
        make_loss_fn({}, layout=layout.mesh)
    assert "shard_map" in str(jax.make_jaxpr(lambda h: fn(h, head.table[...], targets, weights)[0])(hidden))
    np.testing.assert_allclose(nnx.jit(lambda m, h: m(h, targets, weights).loss)(head, hidden),
                               plain(hidden, targets, weights).loss, rtol=1e-5)


# ------------------------------------------------------------------ make_loss_fn
def _config(**kw):
    return ml_collections.ConfigDict(kw) if ml_collections is not None else dict(kw)


def test_make_loss_fn_jit_grad_equals_bce_loss(rng):
    hidden, targets, weights = _inputs(rng)
    table = jnp.asarray(rng.standard_normal((67, 8)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(67), jnp.float32)
    cfg = _config(loss="cutbce", loss_block_v=16, label_smoothing=0.1, loss_threshold=0.3, pos_weight=1.5,
                  loss_block_n=0)
    fn = make_loss_fn(cfg)
    assert fn.options == recloss.LossOptions(block_v=16, label_smoothing=0.1, threshold=0.3, pos_weight=1.5)
    assert fn.strategy.name == "cutbce"
    (loss, metrics), grads = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 4), has_aux=True))(
        hidden, table, targets, weights, bias)

    def direct(h, e, b):
        out = recloss.bce_loss(h, e, targets, weights, b, strategy="cutbce", block_v=16,
                               label_smoothing=0.1, threshold=0.3, pos_weight=1.5)
        return out.loss, out.metrics

    (want_loss, want_metrics), want = jax.jit(jax.value_and_grad(direct, argnums=(0, 1, 2), has_aux=True))(
        hidden, table, bias)
    np.testing.assert_allclose(loss, want_loss, **TIGHT)
    _assert_tree_close(metrics, want_metrics, **TIGHT)
    _assert_tree_close(grads, want, **TIGHT)
    # Both spellings of an option resolve to the same LossOptions.
    assert resolve_config({"threshold": 0.3, "block_v": 16}) == resolve_config(
        {"loss_threshold": 0.3, "loss_block_v": 16})


def test_make_loss_fn_with_a_softmax_strategy_equals_softmax_loss(rng):
    hidden, targets, weights = _inputs(rng)
    table = jnp.asarray(rng.standard_normal((67, 8)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(67), jnp.float32)
    fn = make_loss_fn(_config(loss="cutce", z_loss=1e-4, temperature=0.5, loss_block_v=16))
    assert fn.options == recloss.LossOptions(z_loss=1e-4, temperature=0.5, block_v=16)
    assert fn.strategy.name == "cutce" and fn.strategy.objective == "softmax"
    assert make_loss_fn({"loss": "cutce", "z_loss": 1e-4, "temperature": 0.5}).options == \
        recloss.LossOptions(z_loss=1e-4, temperature=0.5)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 4), has_aux=True))(
        hidden, table, targets, weights, bias)

    def direct(h, e, b):
        out = recloss.softmax_loss(h, e, targets, weights, b, strategy="cutce", z_loss=1e-4, temperature=0.5,
                                   block_v=16)
        return out.loss, out.metrics

    (want_loss, want_metrics), want = jax.jit(jax.value_and_grad(direct, argnums=(0, 1, 2), has_aux=True))(
        hidden, table, bias)
    np.testing.assert_allclose(loss, want_loss, **TIGHT)
    _assert_tree_close(metrics, want_metrics, **TIGHT)
    _assert_tree_close(grads, want, **TIGHT)
    # The prefixed spellings name the same options.
    assert resolve_config({"loss": "cutce", "loss_z_loss": 1e-4, "loss_temperature": 0.5}) == \
        ("cutce", recloss.LossOptions(z_loss=1e-4, temperature=0.5))


@pytest.mark.parametrize("config, key", [
    ({"loss": "cutce", "pos_weight": 2}, "pos_weight"),
    ({"loss": "dense_ce", "loss_threshold": 0.5}, "loss_threshold"),
    ({"loss": "cutce", "vocab_reduction": "sum"}, "vocab_reduction"),
    ({"loss": "cutbce", "z_loss": 1e-4}, "z_loss"),
    ({"loss": "cutbce", "loss_temperature": 2.0}, "loss_temperature"),
])
def test_make_loss_fn_rejects_options_of_the_other_objective_naming_the_key(config, key):
    with pytest.raises(ValueError, match=rf"loss config key {key!r}=.*strategy {config['loss']!r}"):
        make_loss_fn(config)


def test_config_errors():
    with pytest.raises(ValueError, match="unknown loss config key 'loss_blok_v'.*did you mean 'loss_block_v'"):
        make_loss_fn({"loss": "cutbce", "loss_blok_v": 128})
    with pytest.raises(ValueError, match="unknown loss config key 'steps'"):
        make_loss_fn({"loss": "cutbce", "steps": 10})
    with pytest.raises(ValueError, match="'loss'='cutbse' is not a recloss strategy.*did you mean 'cutbce'"):
        make_loss_fn({"loss": "cutbse"})
    with pytest.raises(ValueError, match="must be a strategy name"):
        make_loss_fn({"loss": 3})
    with pytest.raises(ValueError, match="'threshold'=0.5 and 'loss_threshold'=0.25"):
        make_loss_fn({"threshold": 0.5, "loss_threshold": 0.25})
    with pytest.raises(ValueError, match="label_smoothing=2.0"):
        make_loss_fn({"label_smoothing": 2.0})
    with pytest.raises(TypeError, match="config must be a dict"):
        make_loss_fn(["loss=cutbce"])
    # strict=False ignores the trainer's other keys but still catches loss_ typos.
    fn = make_loss_fn({"loss": "dense_bce", "steps": 10, "loss_block_v": 0, "vocab_size": 0}, strict=False)
    assert fn.strategy.name == "dense_bce" and fn.options == recloss.LossOptions()
    with pytest.raises(ValueError, match="unknown loss config key 'loss_treshold'"):
        make_loss_fn({"loss_treshold": 0.1, "steps": 10}, strict=False)
    # Default strategy when 'loss' is absent.
    assert make_loss_fn({}).strategy.name == "cutbce"


# ------------------------------------------------------------------ sampled strategies
def _sampled_direct(targets, weights, key, log_q, opts):
    def direct(table, bias, hidden):
        out = recloss.sampled_loss(hidden, table, targets, weights, bias, key=key, log_q=log_q, **opts)
        return out.loss, out.metrics
    return jax.jit(jax.value_and_grad(direct, argnums=(0, 1, 2), has_aux=True))


def test_heads_and_make_loss_fn_with_a_sampled_strategy_equal_sampled_loss(rng):
    """The NNX head, the linen head and make_loss_fn pass key= and log_q= through: same loss, metrics and
    gradients as recloss.sampled_loss with that key; a missing key is the library's named error."""
    hidden, targets, weights = _inputs(rng, v=128)
    key = jax.random.key(int(rng.integers(1 << 20)))
    log_q = jnp.asarray(rng.normal(size=128), jnp.float32)
    opts = dict(strategy="sampled_softmax", num_negatives=24, in_batch_negatives=True)
    head = MultiLabelHead(128, 8, strategy="sampled_softmax", use_bias=True, rngs=nnx.Rngs(0),
                          num_negatives=24, in_batch_negatives=True)
    head.bias[...] = jnp.asarray(rng.standard_normal(128), jnp.float32)

    def via_head(head, hidden):
        out = head(hidden, targets, weights, key=key, log_q=log_q)
        return out.loss, out.metrics

    (loss, metrics), (g_head, g_hidden) = nnx.jit(nnx.value_and_grad(via_head, argnums=(0, 1), has_aux=True))(
        head, hidden)
    (want_loss, want_metrics), want = _sampled_direct(targets, weights, key, log_q, opts)(
        head.table[...], head.bias[...], hidden)
    np.testing.assert_allclose(loss, want_loss, **TIGHT)
    assert {"top1", "weight_sum", "num_targets"} <= set(metrics)
    _assert_tree_close(metrics, want_metrics, **TIGHT)
    _assert_tree_close((g_head.table[...], g_head.bias[...], g_hidden), want, **TIGHT)
    assert float(jnp.abs(want[0]).sum()) > 0
    with pytest.raises(ValueError, match="needs key="):
        head(hidden, targets, weights)

    lhead = LinenMultiLabelHead(num_items=128, features=8, strategy="gbce", options=dict(num_negatives=16),
                                use_bias=True)
    params = lhead.init(jax.random.key(1), hidden, targets, key=key)["params"]
    got = lhead.apply({"params": params}, hidden, targets, weights, key=key)
    ref = recloss.sampled_loss(hidden, params["table"], targets, weights, params["bias"], key=key,
                               strategy="gbce", num_negatives=16)
    np.testing.assert_allclose(got.loss, ref.loss, **TIGHT)

    fn = make_loss_fn({"loss": "gbce", "num_negatives": 16, "gbce_t": 0.5})
    assert fn.strategy.objective == "sampled" and fn.options.gbce_t == 0.5
    table = jnp.asarray(rng.standard_normal((128, 8)), jnp.float32)
    (l1, _), g1 = jax.jit(jax.value_and_grad(lambda h, e: fn(h, e, targets, weights, key=key), argnums=(0, 1),
                                             has_aux=True))(hidden, table)
    want = jax.value_and_grad(lambda h, e: recloss.sampled_loss(h, e, targets, weights, key=key, strategy="gbce",
                                                                num_negatives=16, gbce_t=0.5).loss,
                              argnums=(0, 1))(hidden, table)
    np.testing.assert_allclose(l1, want[0], **TIGHT)
    _assert_tree_close(g1, want[1], rtol=1e-5, atol=1e-7)
    with pytest.raises(TypeError, match=r"takes no argument\(s\) \['key'\]"):
        make_loss_fn({"loss": "cutbce"})(hidden, table, targets, weights, key=key)
