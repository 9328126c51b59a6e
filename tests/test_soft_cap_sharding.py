"""LossOptions.logit_soft_cap under shard_map: the cap lives in the per-logit maths, so the sharded
paths need nothing of their own. On a (2, 2, 2) data/fsdp/vocab mesh, with the table gathered once
and passed round the fsdp axis ('ring', whose scalar BCE loss adds the capped target correction at
each slice's visit), the loss, metrics and gradients equal the single-device run (as test_sharding:
≤ 1e-5 loss and metrics, ≤ 1e-4 gradients), which test_bce / test_softmax check against the
float64 oracle with the cap on.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import recloss
from helpers import SOFTMAX_OPTIONS, assert_matches, make_inputs, make_layout, strategies

pytestmark = pytest.mark.tier2

# Every option of each objective at a non-default value; softmax strategies refuse label smoothing
# with a cap (its ε/V·Σ_v x_v is a column sum of uncapped logits).
BCE_OPTIONS = dict(label_smoothing=0.1, pos_weight=1.7, focal_gamma=1.5, focal_alpha=0.3, threshold=0.25,
                   block_v=128, block_n=8)
CE_OPTIONS = {k: v for k, v in SOFTMAX_OPTIONS.items() if k != "label_smoothing"}


def _cases():
    for name in strategies() + strategies("softmax"):
        for gather in ("once", "ring") if name.startswith("cut") else ("once",):
            yield pytest.param(name, gather, id=f"{name}-{gather}")


@pytest.mark.parametrize("strategy,gather", list(_cases()))
def test_logit_soft_cap_sharded_equals_single_device(strategy, gather, rng):
    layout = make_layout((2, 2, 2), fsdp_gather=gather)
    inputs = make_inputs(rng, V=1000, rows=1024)       # logits ≈ N(−0.5, 5): a cap of 2 bends them
    softmax = recloss.get_strategy(strategy).objective == "softmax"
    opts = dict(CE_OPTIONS if softmax else BCE_OPTIONS, vocab_size=1000, logit_soft_cap=2.0)
    assert_matches(strategy, inputs, layout, reduction="mean", **opts)
    cot = jnp.asarray(rng.normal(size=inputs["hidden"].shape[:-1]), jnp.float32)
    loss, _, _ = assert_matches(strategy, inputs, layout, cot=cot, reduction="none", **opts)
    assert loss.shape == inputs["hidden"].shape[:-1]
