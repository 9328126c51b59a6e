"""`tools.hlo`, the refactor check: the same program traced through differently named
functions normalises to the same text, and a changed program does not."""

import jax
import jax.numpy as jnp
import pytest

from tools import hlo

pytestmark = pytest.mark.tier1


def _compiled(fn):
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    return hlo.normalise(jax.jit(jax.grad(fn)).lower(x).compile().as_text())


def test_names_and_locations_do_not_count_but_the_program_does():
    def first_name(x):
        return jnp.sum(jnp.tanh(x) * 2.0)

    def another_name(y):
        z = jnp.tanh(y)   # same ops from another line of another function
        return jnp.sum(z * 2.0)

    def changed(x):
        return jnp.sum(jnp.tanh(x) * 3.0)

    a, b, c = _compiled(first_name), _compiled(another_name), _compiled(changed)
    assert a == b
    assert a != c
    assert "metadata" not in a and "test_hlo_tool" not in a
