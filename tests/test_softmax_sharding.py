"""softmax_loss under shard_map equals the single-device result: the shards' log-partitions combine into
the global Z (pmax, psum), targets are corrected on the shard that owns them, padding rows are inert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recloss
import test_sharding as sh
from conftest import strategies
from oracle import options_for

OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3, temperature=0.7, block_v=128, block_n=8)
# The BCE meshes, and a MaxText-style mesh whose vocab axis is called 'tensor'.
MESHES = [((8, 1, 1), {}), ((1, 8, 1), {}), ((1, 1, 8), {}), ((2, 2, 2), {}), ((4, 1, 2), {}),
          ((2, 2, 2), dict(names=("data", "fsdp", "tensor"), vocab_axis="tensor"))]


def loss_and_grads(strategy, inputs, layout, cot=None, **opts):
    def f(h, e, b):
        out = recloss.softmax_loss(h, e, inputs["targets"], inputs["weights"], b, strategy=strategy,
                                   layout=layout, **options_for(strategy, opts))
        return (out.loss if cot is None else jnp.sum(out.loss * cot)), out

    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
        inputs["hidden"], inputs["table"], inputs["bias"])
    return out.loss, out.metrics, grads


def assert_matches(strategy, inputs, layout, cot=None, **opts):
    ref_loss, ref_m, ref_g = loss_and_grads(strategy, inputs, None, cot, **opts)
    loss, mets, grads = loss_and_grads(strategy, inputs, layout, cot, **opts)
    assert loss.shape == ref_loss.shape
    assert sh.rel(loss, ref_loss) <= 1e-5, (loss, ref_loss)
    assert set(mets) == set(ref_m)
    for k in ref_m:
        assert sh.rel(mets[k], ref_m[k]) <= 1e-5, (k, mets[k], ref_m[k])
    for name, g, rg in zip(("hidden", "table", "bias"), grads, ref_g):
        assert g.shape == rg.shape and g.dtype == rg.dtype
        assert float(jnp.max(jnp.abs(rg))) > 0, name
        assert sh.rel(g, rg) <= 1e-4, (name, sh.rel(g, rg))
    return loss, mets, grads


def _cases():
    for name in strategies("softmax"):
        for shape, roles in (MESHES if "pallas" not in name else [MESHES[2], MESHES[3]]):
            marks = [pytest.mark.slow] if "pallas" in name else []
            tag = "x".join(map(str, shape)) + ("-tensor" if roles else "")
            yield pytest.param(name, shape, roles, id=f"{name}-{tag}", marks=marks)


@pytest.mark.parametrize("strategy,shape,roles", list(_cases()))
def test_sharded_equals_single_device(strategy, shape, roles, rng):
    """V=1000 padded to 1024 rows (not divisible into 1000/shards), every option, 'mean' and 'none'."""
    layout = sh.make_layout(shape, **roles)
    rows = recloss.padded_vocab_size(1000, layout)
    inputs = sh.make_inputs(rng, V=1000, rows=rows)
    opts = dict(OPTIONS, vocab_size=1000)
    _, mets, grads = assert_matches(strategy, inputs, layout, reduction="mean", **opts)
    assert float(jnp.max(jnp.abs(grads[1][1000:]))) == 0.0 and float(jnp.max(jnp.abs(grads[2][1000:]))) == 0.0
    assert float(mets["invalid_targets"]) > 0 and float(mets["top1"]) >= 0
    cot = jnp.asarray(rng.normal(size=inputs["hidden"].shape[:-1]), jnp.float32)
    loss, _, _ = assert_matches(strategy, inputs, layout, cot=cot, reduction="none", **opts)
    assert loss.shape == inputs["hidden"].shape[:-1]


def test_a_shard_holding_only_padding_rows(rng):
    """V=900 over 8 vocab shards of 128 rows: the last shard has no live row (its lse is −inf)."""
    layout = sh.make_layout((1, 1, 8))
    inputs = sh.make_inputs(rng, V=900, rows=1024)
    loss, mets, grads = assert_matches("cutce", inputs, layout, reduction="sum", vocab_size=900, block_v=64)
    assert np.isfinite(float(loss)) and float(jnp.max(jnp.abs(grads[1][900:]))) == 0.0


def test_argmax_across_shards_finds_the_global_top1(rng):
    """Targets set to each row's dense argmax: top1 must count every row with a target, sharded too."""
    layout = sh.make_layout((1, 1, 8))
    inputs = sh.make_inputs(rng, V=1024, rows=1024)
    top = jnp.argmax(inputs["hidden"].reshape(-1, 16) @ inputs["table"].T + inputs["bias"], axis=-1)
    targets = jnp.stack([top, jnp.full_like(top, -1)], axis=-1).reshape(inputs["hidden"].shape[:-1] + (2,))
    for lay in (None, layout):
        out = recloss.softmax_loss(inputs["hidden"], inputs["table"], targets, inputs["weights"], inputs["bias"],
                                   layout=lay)
        np.testing.assert_allclose(float(out.metrics["top1"]), float(jnp.sum(inputs["weights"])), rtol=1e-6)
