"""The call path of docs/design.md "The call path, and the shard": from `Strategy.__call__` to the
scan or kernel body, on one device and under a (2, 2, 2) mesh, loss alone and loss + gradient, is at
most six calls into recloss, each a named (module- or class-level) function with a docstring.

The path is measured, not declared: `recloss.sweep.blocked` (the lax.scan over vocab blocks) and
`recloss.pallas.grid.call` (the pallas_call) are wrapped to record the Python stack when they are
traced, and the recloss frames between `Strategy.__call__` and them are counted (JAX's own frames,
custom_vjp's and shard_map's, are not recloss's and do not count). Only tracing is needed, so the
functions are lowered, not run.
"""

from __future__ import annotations

import inspect
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recloss
from helpers import make_layout
from recloss import sweep
from recloss.pallas import grid

pytestmark = pytest.mark.tier1

PACKAGE = os.path.dirname(recloss.__file__) + os.sep
BLOCKED = {"cutbce": "blocked", "cutce": "blocked", "cutbce_pallas": "call", "cutce_pallas": "call"}
LIMIT = 6


def _function_of(frame):
    """The module- or class-level function a frame runs, or None for a closure."""
    obj = sys.modules[frame.f_globals["__name__"]]
    for part in frame.f_code.co_qualname.split("."):
        if part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj


def _where(frame) -> str:
    return f"{frame.f_globals['__name__']}.{frame.f_code.co_qualname}".removeprefix("recloss.")


def _recloss_frames():
    """recloss frames from the caller of the wrapped function out to `Strategy.__call__` (excluded),
    innermost first; None when the trace did not start at a strategy call."""
    chain = []
    for info in inspect.stack()[2:]:
        if not info.filename.startswith(PACKAGE):
            continue
        if info.function == "__call__" and info.filename.endswith(os.sep + "strategy.py"):
            return chain
        chain.append(info.frame)
    return None


def _paths(monkeypatch, fn):
    """Every recorded path (outermost first, ending at the wrapped function) while tracing ``fn``."""
    paths = []
    for module, name in ((sweep, "blocked"), (grid, "call")):
        original = getattr(module, name)

        def spy(*args, _original=original, _name=f"{module.__name__}.{name}".removeprefix("recloss."), **kw):
            chain = _recloss_frames()
            if chain is not None:
                paths.append([(_where(f), _function_of(f)) for f in reversed(chain)] + [(_name, _original)])
            return _original(*args, **kw)

        monkeypatch.setattr(module, name, spy)
    fn()
    return paths


def _inputs(seed):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(16, 24)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(256, 24)) * 0.2, jnp.float32)
    b = jnp.asarray(rng.normal(size=(256,)) * 0.1, jnp.float32)
    t = jnp.asarray(rng.integers(0, 250, size=(16, 3)), jnp.int32)
    return h, e, b, t


@pytest.mark.parametrize("mesh", [None, (2, 2, 2)], ids=["one-device", "mesh-2x2x2"])
@pytest.mark.parametrize("grad", [False, True], ids=["loss", "loss+grad"])
@pytest.mark.parametrize("name", list(BLOCKED))
def test_call_path_is_at_most_six_documented_calls(name, grad, mesh, monkeypatch, seed):
    layout = None if mesh is None else make_layout(mesh)
    strategy = recloss.get_strategy(name, recloss.LossOptions(vocab_size=250, block_v=128))
    h, e, b, t = _inputs(seed)

    def loss(h, e, b):
        return strategy(h, e, t, bias=b, layout=layout).loss

    f = jax.value_and_grad(loss, argnums=(0, 1, 2)) if grad else loss
    paths = _paths(monkeypatch, lambda: jax.jit(f).lower(h, e, b))
    assert paths, f"{name}: tracing never reached the sweep's body"
    for path in paths:
        names = " → ".join(q for q, _ in path)
        assert path[-1][0].endswith("." + BLOCKED[name]), names
        assert len(path) <= LIMIT, f"{name}: {len(path)} calls from Strategy.__call__: {names}"
        for qualname, fn in path:
            assert fn is not None, f"{name}: {qualname} is a closure on the call path: {names}"
            assert (fn.__doc__ or "").strip(), f"{name}: {qualname} has no docstring: {names}"


RING_FRAMES = ("ring._ring_sweep", "ring.Ring.walk", "ring.Ring.walk.<locals>.body", "ring._ring_sweep.<locals>.visit")


@pytest.mark.parametrize("name", list(BLOCKED))
def test_ring_adds_only_its_walk(name, monkeypatch, seed):
    # fsdp_gather='ring': the ring's sweep, its walk, the walk's loop body and its visit of one slice
    # come between the shell and the objective's sweep (docs/design.md); nothing else is added.
    layout = make_layout((1, 2, 1), fsdp_gather="ring")
    strategy = recloss.get_strategy(name, recloss.LossOptions(vocab_size=250))
    h, e, b, t = _inputs(seed)
    f = jax.value_and_grad(lambda h, e, b: strategy(h, e, t, bias=b, layout=layout).loss, argnums=(0, 1, 2))
    paths = _paths(monkeypatch, lambda: jax.jit(f).lower(h, e, b))
    assert paths, f"{name}: tracing never reached the sweep's body"
    for path in paths:
        names = [q for q, _ in path]
        assert "ring.Ring.walk" in names, names
        rest = [q for q in names if q not in RING_FRAMES]
        assert len(rest) <= LIMIT, f"{name}: {len(rest)} calls besides the ring's: {' → '.join(names)}"
