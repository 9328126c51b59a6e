"""softmax_loss under shard_map equals the single-device result: the shards' log-partitions combine into
the global Z (pmax, psum), targets are corrected on the shard that owns them, padding rows are inert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recloss
from helpers import assert_matches, make_inputs, make_layout, SOFTMAX_OPTIONS, strategies

# `stack` (docs/development.md): shard_map, meshes (Auto and Explicit) and resharding change between jax
# versions (recloss/_compat.py absorbs the renames); the newest-stack leg runs this module.
pytestmark = pytest.mark.stack


# The BCE meshes, and a MaxText-style mesh whose vocab axis is called 'tensor'.
MESHES = [((8, 1, 1), {}), ((1, 8, 1), {}), ((1, 1, 8), {}), ((2, 2, 2), {}), ((4, 1, 2), {}),
          ((2, 2, 2), dict(names=("data", "fsdp", "tensor"), vocab_axis="tensor"))]


def _cases():
    for name in strategies("softmax"):
        for shape, roles in (MESHES if "pallas" not in name else [MESHES[2], MESHES[3]]):
            tag = "x".join(map(str, shape)) + ("-tensor" if roles else "")
            yield pytest.param(name, shape, roles, id=f"{name}-{tag}")


@pytest.mark.tier1
@pytest.mark.parametrize("strategy,shape,roles", list(_cases()))
def test_sharded_equals_single_device(strategy, shape, roles, rng):
    """V=1000 padded to 1024 rows (not divisible into 1000/shards), every option, 'mean' and 'none'."""
    layout = make_layout(shape, **roles)
    rows = recloss.padded_vocab_size(1000, layout)
    inputs = make_inputs(rng, V=1000, rows=rows)
    opts = dict(SOFTMAX_OPTIONS, vocab_size=1000)
    _, mets, grads = assert_matches(strategy, inputs, layout, reduction="mean", **opts)
    assert float(jnp.max(jnp.abs(grads[1][1000:]))) == 0.0 and float(jnp.max(jnp.abs(grads[2][1000:]))) == 0.0
    assert float(mets["invalid_targets"]) > 0 and float(mets["top1"]) >= 0
    cot = jnp.asarray(rng.normal(size=inputs["hidden"].shape[:-1]), jnp.float32)
    loss, _, _ = assert_matches(strategy, inputs, layout, cot=cot, reduction="none", **opts)
    assert loss.shape == inputs["hidden"].shape[:-1]


@pytest.mark.tier1
def test_a_shard_holding_only_padding_rows(rng):
    """V=900 over 8 vocab shards of 128 rows: the last shard has no live row (its lse is −inf)."""
    layout = make_layout((1, 1, 8))
    inputs = make_inputs(rng, V=900, rows=1024)
    loss, mets, grads = assert_matches("cutce", inputs, layout, reduction="sum", vocab_size=900, block_v=64)
    assert np.isfinite(float(loss)) and float(jnp.max(jnp.abs(grads[1][900:]))) == 0.0


@pytest.mark.tier2
def test_argmax_across_shards_finds_the_global_top1(rng):
    """Targets set to each row's dense argmax: top1 must count every row with a target, sharded too.
    (Second tier: the first tier's shard-edge cases, tests/test_boundaries.py, plant each row's argmax at
    a shard edge with exact ties across shards, against the float64 oracle.)"""
    layout = make_layout((1, 1, 8))
    inputs = make_inputs(rng, V=1024, rows=1024)
    top = jnp.argmax(inputs["hidden"].reshape(-1, 16) @ inputs["table"].T + inputs["bias"], axis=-1)
    targets = jnp.stack([top, jnp.full_like(top, -1)], axis=-1).reshape(inputs["hidden"].shape[:-1] + (2,))
    for lay in (None, layout):
        out = recloss.softmax_loss(inputs["hidden"], inputs["table"], targets, inputs["weights"], inputs["bias"],
                                   layout=lay)
        np.testing.assert_allclose(float(out.metrics["top1"]), float(jnp.sum(inputs["weights"])), rtol=1e-6)
