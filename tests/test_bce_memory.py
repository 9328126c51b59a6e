"""The compiled cutbce loss+grad program holds no [BN, V] buffer; dense_bce does.

Measured from XLA's own buffer assignment (`memory_analysis().temp_size_in_bytes`)
of the compiled CPU program, so nothing of size BN·V is ever allocated here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import recloss

pytestmark = pytest.mark.tier1

BN, D, L = 2048, 64, 8
V = 20000
MiB = 2**20


def _temp_bytes(strategy: str, vocab: int = V, **options) -> int:
    """Temp bytes of jit(value_and_grad(Σ loss)) w.r.t. hidden, table, bias at [BN, D] × [vocab, D]."""
    def loss(hidden, table, bias, targets, weights):
        out = recloss.bce_loss(hidden, table, targets, weights, bias, strategy=strategy, **options)
        return out.loss.sum()

    args = (jax.ShapeDtypeStruct((BN, D), jnp.float32), jax.ShapeDtypeStruct((vocab, D), jnp.float32),
            jax.ShapeDtypeStruct((vocab,), jnp.float32), jax.ShapeDtypeStruct((BN, L), jnp.int32),
            jax.ShapeDtypeStruct((BN,), jnp.float32))
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    analysis = compiled.memory_analysis()
    assert analysis is not None, "this backend reports no memory analysis"
    return int(analysis.temp_size_in_bytes)


def test_dense_bce_holds_the_logits():
    """Control: the measurement does see a [BN, V] float32 buffer when there is one."""
    temp = _temp_bytes("dense_bce")
    print(f"dense_bce temp {temp / MiB:.1f} MiB, BN·V·4 = {BN * V * 4 / MiB:.1f} MiB")
    assert temp >= BN * V * 4


def test_cutbce_small_blocks_temp_under_an_eighth_of_the_logits():
    temp = _temp_bytes("cutbce", block_v=512, block_n=512)
    print(f"cutbce block 512x512 temp {temp / MiB:.1f} MiB, BN·V·4/8 = {BN * V * 4 / 8 / MiB:.1f} MiB")
    assert temp < BN * V * 4 / 8


@pytest.mark.parametrize("options", [{}, {"reduction": "none"}], ids=["default", "reduction_none"])
def test_cutbce_temp_does_not_grow_with_bn_times_v(options):
    """Default blocks: temp holds a few logit tiles (block_n × block_v, ~8 MiB by default),
    never [BN, V]; quadrupling V must not add anything of order BN·ΔV."""
    small = _temp_bytes("cutbce", V, **options)
    large = _temp_bytes("cutbce", 4 * V, **options)
    print(f"cutbce {options} temp {small / MiB:.1f} MiB at V={V}, {large / MiB:.1f} MiB at V={4 * V}")
    assert small < BN * V * 4 / 4
    assert large - small < BN * (3 * V) * 4 / 8
