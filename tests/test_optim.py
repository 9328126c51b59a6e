"""The trainer's optimizer (`recloss_plugins.sasrec.optim`) against a float64 reference of its update:
global-norm clipping over every gradient, AdamW (decoupled decay on matrices) for the dense parameters and,
with ``item_optimizer: rowwise_adagrad``, one accumulator per item row for the item table and the bias; the
schedule's warm-up and decay rescaled for the tables. Fresh random parameters and gradients (the ``rng``
fixture prints the seed), rows with no gradient, and one step whose gradient norm is far past the clip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from recloss_plugins.config import ConfigError, default_config_path, load_config
from recloss_plugins.sasrec import optim, parallel, program

pytestmark = pytest.mark.tier1

V, D = 37, 6


def _cfg(*extra):
    return load_config([str(default_config_path()), "steps=8", "warmup_steps=3", "learning_rate=0.01",
                        "learning_rate_final_fraction=0.2", "weight_decay=0.05", "grad_clip=1.0", *extra])


def _params(rng):
    return {"item_emb": {"embedding": rng.normal(size=(V, D))}, "out_bias": rng.normal(size=(V,)),
            "blocks": {"w": rng.normal(size=(D, D)), "b": rng.normal(size=(D,))}}


def _grads(rng, step):
    g = {"item_emb": {"embedding": rng.normal(size=(V, D)) * 0.1}, "out_bias": rng.normal(size=(V,)) * 0.1,
         "blocks": {"w": rng.normal(size=(D, D)) * 0.1, "b": rng.normal(size=(D,)) * 0.1}}
    g["item_emb"]["embedding"][rng.random(V) < 0.4] = 0.0      # items the batch did not touch
    g["out_bias"][rng.random(V) < 0.4] = 0.0
    if step == 2:                                               # far past grad_clip: clipped
        g["blocks"]["w"] *= 100.0
    return g


def _reference(cfg, params, grads_by_step):
    """float64 numpy: the parameters after each step."""
    sched = program.learning_rate_schedule(cfg)
    lr = lambda t: float(sched(t))
    item_peak = (cfg.item_learning_rate or cfg.learning_rate) / cfg.learning_rate
    p = {k: np.asarray(v, np.float64) for k, v in _flat(params).items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    acc = {k: np.full(x.shape[:1], cfg.item_adagrad_initial_accumulator) for k, x in p.items()}
    rowwise = cfg.item_optimizer == "rowwise_adagrad"
    out = []
    for t, grads in enumerate(grads_by_step):
        g = {k: np.asarray(x, np.float64) for k, x in _flat(grads).items()}
        norm = np.sqrt(sum(np.sum(x * x) for x in g.values()))
        if norm > cfg.grad_clip:
            g = {k: x * (cfg.grad_clip / norm) for k, x in g.items()}
        for k in p:
            if rowwise and k in ("item_emb/embedding", "out_bias"):
                acc[k] = acc[k] + np.mean((g[k] ** 2).reshape(len(g[k]), -1), axis=1)
                root = (np.sqrt(acc[k]) + cfg.item_adagrad_eps).reshape((-1,) + (1,) * (g[k].ndim - 1))
                p[k] = p[k] - lr(t) * item_peak * g[k] / root
                continue
            m[k] = cfg.adam_b1 * m[k] + (1 - cfg.adam_b1) * g[k]
            v2[k] = cfg.adam_b2 * v2[k] + (1 - cfg.adam_b2) * g[k] ** 2
            mh, vh = m[k] / (1 - cfg.adam_b1 ** (t + 1)), v2[k] / (1 - cfg.adam_b2 ** (t + 1))
            decay = cfg.weight_decay * p[k] if p[k].ndim >= 2 else 0.0
            p[k] = p[k] - lr(t) * (mh / (np.sqrt(vh) + cfg.adam_eps) + decay)
        out.append(dict(p))
    return out


def _flat(tree):
    return {"/".join(parallel.path_names(path)): x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("extra", [(), ("item_optimizer=rowwise_adagrad",),
                                   ("item_optimizer=rowwise_adagrad", "item_learning_rate=0.2",
                                    "item_adagrad_initial_accumulator=0.1", "item_adagrad_eps=1e-6")],
                         ids=["adamw", "rowwise_adagrad", "rowwise_adagrad_all_keys"])
def test_the_update_matches_a_float64_reference(extra, rng):
    cfg = _cfg(*extra)
    tx, _ = program.make_optimizer(cfg)
    params = _params(rng)
    grads = [_grads(rng, t) for t in range(6)]
    want = _reference(cfg, params, grads)
    p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    state = tx.init(p)
    step = jax.jit(lambda p, s, g: (lambda u, s: (jax.tree.map(jnp.add, p, u), s))(*tx.update(g, s, p)))
    for t, g in enumerate(grads):
        p, state = step(p, state, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g))
        got = _flat(p)
        for k, ref in want[t].items():
            # Judged against how far the parameter moved; float32 holds it to 2⁻²⁴ of its size besides.
            moved = np.linalg.norm(ref - np.asarray(_flat(params)[k], np.float64))
            err = np.linalg.norm(np.asarray(got[k], np.float64) - ref)
            assert (moved > 0) == (t > 0), (t, k, moved)      # the warm-up starts at a rate of 0
            assert err <= 1e-5 * moved + 2.0 ** -23 * np.linalg.norm(ref), (t, k, err, moved)
    if "item_optimizer=rowwise_adagrad" in extra:
        # One float32 per row of each item parameter; untouched rows kept their parameters.
        accs = [x for x in jax.tree.leaves(state) if x.ndim == 1 and x.shape == (V,) and x.dtype == jnp.float32]
        assert len(accs) >= 2
        untouched = np.all(np.stack([g["item_emb"]["embedding"] for g in grads]) == 0, axis=(0, 2))
        if untouched.any():
            np.testing.assert_array_equal(np.asarray(p["item_emb"]["embedding"])[untouched],
                                          np.asarray(params["item_emb"]["embedding"], np.float32)[untouched])


def test_row_wise_state_is_split_like_the_table_rows():
    """On a (2, 2, 2) mesh the accumulators take the table's row split (vocab × fsdp), AdamW's moments
    the parameters' own specs."""
    tx = optim.make_optimizer(_cfg("item_optimizer=rowwise_adagrad"), lambda c: 0.01)
    shapes = jax.eval_shape(lambda: _params(np.random.default_rng(0)))
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), shapes)
    t = ("vocab", "fsdp")
    p_specs = {"item_emb": {"embedding": P(t, None)}, "out_bias": P(t), "blocks": {"w": P("fsdp", None), "b": P()}}
    specs = parallel.opt_state_specs(jax.eval_shape(tx.init, shapes), p_specs)
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    by = {"/".join(map(str, parallel.path_names(path))): s for path, s in leaves}
    acc = {k: s for k, s in by.items() if "accumulator" in k}
    assert acc and all(s == P(t) for s in acc.values()), acc
    mu = {k: s for k, s in by.items() if k.endswith("mu/blocks/w")}
    assert list(mu.values()) == [P("fsdp", None)], by


@pytest.mark.parametrize("key, value", [("item_learning_rate", "0.1"), ("item_adagrad_eps", "1e-6"),
                                        ("item_adagrad_initial_accumulator", "0.1")])
def test_row_wise_settings_without_row_wise_adagrad_name_both_keys(key, value):
    with pytest.raises(ConfigError, match=rf"config key '{key}' .*item_optimizer='adamw': set "
                                          rf"item_optimizer=rowwise_adagrad, or leave {key} at"):
        _cfg(f"{key}={value}")
    with pytest.raises(ConfigError, match=r"item_optimizer.*'sgd'"):
        _cfg("item_optimizer=sgd")


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour(rng):
    """Each result is one of x's two bfloat16 neighbours, and over many draws the mean is x (within 5
    standard errors), where round-to-nearest would lose an update below half a bfloat16 step."""
    base = np.float32(1.0) + rng.uniform(0, 1, size=64).astype(np.float32) * np.float32(2 ** -7)   # inside one step
    x = jnp.asarray(np.repeat(base[None], 4096, axis=0))
    key = jax.random.key(int(rng.integers(2 ** 31)))
    got = np.asarray(optim.stochastic_round(x, key).astype(jnp.float32), np.float64)
    lo, hi = 1.0, 1.0 + 2 ** -7
    assert np.all((got == lo) | (got == hi))
    frac = (base.astype(np.float64) - lo) / (hi - lo)
    se = np.sqrt(frac * (1 - frac) / x.shape[0]) * (hi - lo)
    assert np.all(np.abs(got.mean(axis=0) - base) <= 5 * se + 1e-12)
    exact = jnp.asarray(rng.normal(size=100).astype(jnp.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(optim.stochastic_round(exact, key).astype(jnp.float32), exact)
    # A float32 leaf is added as optax adds it; a bfloat16 one rounded stochastically from the float32 sum.
    p = {"f": jnp.asarray(rng.normal(size=8), jnp.float32), "t": jnp.ones((4096,), jnp.bfloat16)}
    u = {"f": jnp.asarray(rng.normal(size=8), jnp.float32), "t": jnp.full((4096,), 2.0 ** -10, jnp.float32)}
    out = optim.apply_updates(p, u, key)
    np.testing.assert_array_equal(out["f"], p["f"] + u["f"])
    assert out["t"].dtype == jnp.bfloat16
    assert abs(float(jnp.mean(out["t"].astype(jnp.float32))) - (1 + 2 ** -10)) <= 5 * 2 ** -7 * 0.35 / 64


def test_a_bfloat16_table_needs_row_wise_adagrad():
    with pytest.raises(ConfigError, match=r"config key 'item_table_dtype' .* is 'bfloat16', which needs "
                                          r"item_optimizer=rowwise_adagrad .*got item_optimizer='adamw'"):
        _cfg("item_table_dtype=bfloat16")
    cfg = _cfg("item_table_dtype=bfloat16", "item_optimizer=rowwise_adagrad", "emb_dim=8", "num_heads=2")
    model = program.make_model(cfg, 64, program.nnx.Rngs(0), 60)
    dtypes = {"/".join(map(str, k)): v.dtype for k, v in _flat_state(model).items()}
    assert dtypes["item_emb/embedding"] == jnp.bfloat16
    assert all(d == jnp.float32 for k, d in dtypes.items() if k != "item_emb/embedding"), dtypes


def _flat_state(model):
    state = program.nnx.to_pure_dict(program.nnx.state(model))
    return {parallel.path_names(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
