"""Today's JAX conventions: Explicit and Auto meshes, inputs placed or not, float16, jax_enable_x64.

* Sharding: every strategy on meshes with Explicit axes (`jax.make_mesh`'s default in current JAX,
  where shardings live in the array types) and with Auto axes (`jax.sharding.Mesh(devices, names)`),
  on the mesh shapes and layouts of test_sharding, test_softmax_sharding, test_sampled and test_ring
  (fsdp_gather='ring' included), with weights and bias given or None, with the inputs placed by the
  strategy's `partition_specs` or plain arrays: loss, metrics and gradients equal the single-device
  run (‖got − ref‖/‖ref‖ ≤ 1e-5 for loss and metrics, ≤ 1e-4 for gradients, as test_sharding).
  Under jit without a mesh context, and with ``jax.set_mesh`` under jit and eagerly.
* dtypes: float16 inputs (float32 accumulation inside) against the float64 oracles of
  tests/oracle.py; gradients come back in float16. With ``jax_enable_x64`` (in a subprocess, so
  the flag never reaches the rest of the suite) int64 ids and float64 inputs, on one device and
  sharded: the loss is float32, gradients float64 at float32 accuracy.

Tolerances against the oracle are multiples of the compute dtype's eps (float32 accumulation)
and, for the float16 gradients, of float16's eps (they are rounded to float16, and the blocked
backward casts its logit cotangents to the input dtype before the matmuls); a result that
cancels is judged against 1% of the size of its terms (`helpers.CANCEL_FLOOR`).
Inputs are fresh random draws from the `rng` fixture (its seed is printed).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

import recloss
from helpers import strategies
from oracle import bce_oracle, f64, sampled_oracle, softmax_oracle
from recloss.sampled import sampler

pytestmark = [pytest.mark.tier1, pytest.mark.stack]

try:
    from jax.sharding import AxisType
except ImportError:   # pragma: no cover - every supported jax has it
    AxisType = None

ALL = [s for obj in ("bce", "softmax", "sampled") for s in strategies(obj)]
OBJECTIVE = {s: obj for obj in ("bce", "softmax", "sampled") for s in strategies(obj)}
AXES = ("data", "fsdp", "vocab")
# (id, shape, axis names, MeshLayout roles): the meshes of the sharding tests.
MESHES = [
    ("8x1x1", (8, 1, 1), AXES, {}),
    ("1x8x1", (1, 8, 1), AXES, {}),
    ("1x1x8", (1, 1, 8), AXES, {}),
    ("2x2x2", (2, 2, 2), AXES, {}),
    ("4x1x2", (4, 1, 2), AXES, {}),
    ("tensor-2x2x2", (2, 2, 2), ("data", "fsdp", "tensor"), dict(vocab_axis="tensor")),
    ("data-vocab-4x2", (4, 2), ("data", "vocab"), dict(batch_axes=("data",), fsdp_axis=None)),
    ("ring-1x8x1", (1, 8, 1), AXES, dict(fsdp_gather="ring")),
    ("ring-2x4x1", (2, 4, 1), AXES, dict(fsdp_gather="ring")),
    ("ring-1x4x2", (1, 4, 2), AXES, dict(fsdp_gather="ring")),
]
RING = ("cutbce", "cutbce_pallas", "cutce", "cutce_pallas")
V, ROWS, D, L, LEAD = 250, 256, 8, 3, (8, 2)      # rows ≥ V: 6 padding rows, inert
SAMPLED = dict(num_negatives=24)
F32_EPS = float(np.finfo(np.float32).eps)
F16_EPS = float(np.finfo(np.float16).eps)
CANCEL_FLOOR = 1e-2


# ------------------------------------------------------------------------- helpers
def make_mesh(shape, names, axis_type: str) -> Mesh:
    """A mesh over the first prod(shape) devices: 'explicit' via jax.make_mesh, 'auto' via Mesh()."""
    if axis_type == "explicit":
        return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names)


def make_inputs(rng, *, dtype=jnp.float32, bias=True, weights=True):
    """hidden [*LEAD, D], table [ROWS, D], targets [*LEAD, L] (pad −1, repeats, ids ≥ V), weights, bias."""
    m = int(np.prod(LEAD))
    t = rng.integers(0, V, size=(m, L))
    u = rng.random((m, L))
    t[:, 1:] = np.where(u[:, 1:] < 0.2, t[:, :-1], t[:, 1:])
    t = np.where((u > 0.2) & (u < 0.3), rng.integers(V, ROWS + 20, size=(m, L)), t)
    t = np.where(u > 0.8, -1, t)
    t[0] = -1
    w = rng.uniform(0.0, 2.0, size=m)
    w[rng.random(m) < 0.2] = 0.0
    return dict(
        hidden=jnp.asarray(rng.normal(size=LEAD + (D,)), dtype),
        table=jnp.asarray(rng.normal(size=(ROWS, D)) * (1.5 / np.sqrt(D)), dtype),
        targets=jnp.asarray(t.reshape(LEAD + (L,)), jnp.int32),
        weights=jnp.asarray(w.reshape(LEAD), dtype) if weights else None,
        bias=jnp.asarray(rng.normal(-0.5, 0.5, size=ROWS), dtype) if bias else None,
    )


def place(inputs, strategy, layout):
    """The inputs laid out by the strategy's own partition_specs (leading dims flattened there,
    so hidden/targets/weights get the [M, ...] spec with trailing dims replicated)."""
    specs = recloss.get_strategy(strategy).partition_specs(layout)
    out = dict(inputs)
    for name in ("hidden", "table", "targets", "weights", "bias"):
        if inputs[name] is not None:
            out[name] = jax.device_put(inputs[name], NamedSharding(layout.mesh, getattr(specs, name)))
    return out


def call(strategy, inputs, layout, *, key=None, **opts):
    """The entry point of ``strategy``'s objective on ``inputs`` (a sampled one with ``key``)."""
    obj = OBJECTIVE[strategy]
    fn = {"bce": recloss.bce_loss, "softmax": recloss.softmax_loss, "sampled": recloss.sampled_loss}[obj]
    more = dict(SAMPLED, key=key) if obj == "sampled" else {}
    return fn(inputs["hidden"], inputs["table"], inputs["targets"], inputs["weights"], inputs["bias"],
              strategy=strategy, layout=layout, vocab_size=V, **more, **opts)


def loss_and_grads(strategy, inputs, layout, *, jit=True, cot=None, **opts):
    """(loss, metrics, {name: gradient}) of the loss (of Σ cot·loss for reduction='none') in the
    differentiable inputs: hidden, table and, when given, bias. Jitted functions are cached per
    (strategy, layout, options, which inputs are None): cases with the same signature compile once."""
    names = tuple(n for n in ("hidden", "table", "bias") if inputs[n] is not None)
    g = _value_and_grad(strategy, layout, names, cot is not None, tuple(sorted(opts.items())))
    args = [inputs[n] for n in names] + [inputs["targets"], inputs["weights"], jax.random.key(7), cot]
    (_, out), grads = (_jit(g) if jit else g)(*args)
    return out.loss, out.metrics, dict(zip(names, grads))


@functools.lru_cache(maxsize=None)
def _value_and_grad(strategy, layout, names, with_cot, opts):
    """value_and_grad of the loss in its first len(names) arguments; then targets, weights, key, cot."""
    k = len(names)

    def f(*args):
        diff, (targets, weights, key, cot) = args[:k], args[k:]
        inputs = dict(zip(names, diff), targets=targets, weights=weights)
        inputs.setdefault("bias", None)
        out = call(strategy, inputs, layout, key=key, **dict(opts))
        return (out.loss if not with_cot else jnp.sum(out.loss * cot)), out

    return jax.value_and_grad(f, argnums=tuple(range(k)), has_aux=True)


@functools.lru_cache(maxsize=None)
def _jit(fn):
    return jax.jit(fn)


def rel(got, ref, floor=0.0):
    """‖got − ref‖ / max(‖ref‖, floor), in float64."""
    got, ref = f64(got), f64(ref)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    den = max(float(np.linalg.norm(ref.ravel())), floor)
    num = float(np.linalg.norm((got - ref).ravel()))
    return num / den if den > 0 else num


def assert_same(got, ref, what):
    """Sharded (loss, metrics, grads) equal the single-device ones (test_sharding's criterion)."""
    (loss, mets, grads), (rloss, rmets, rgrads) = got, ref
    assert loss.dtype == jnp.float32 and loss.shape == rloss.shape, (what, loss.dtype, loss.shape)
    assert rel(loss, rloss) <= 1e-5, (what, "loss", loss, rloss)
    assert set(mets) == set(rmets), what
    for k in rmets:
        assert rel(mets[k], rmets[k]) <= 1e-5, (what, k, mets[k], rmets[k])
    assert set(grads) == set(rgrads), what
    for n, g in grads.items():
        assert g.shape == rgrads[n].shape and g.dtype == rgrads[n].dtype, (what, n, g.dtype)
        assert float(jnp.max(jnp.abs(rgrads[n]))) > 0, (what, n)    # the comparison means something
        assert rel(g, rgrads[n]) <= 1e-4, (what, n, rel(g, rgrads[n]))
        # Padding rows past vocab_size stay inert under every layout.
        if n in ("table", "bias"):
            assert float(np.max(np.abs(np.asarray(g)[V:]))) == 0.0, (what, n)


# ------------------------------------------------------------------------- sharding conventions
def _sharding_cases():
    """Every strategy × axis type × weights None/given. Bias goes with weights (given or None
    together: two single-device references per strategy, each compiled once) and placement
    alternates so that each axis type meets placed and plain inputs; the meshes rotate over the
    strategies so that every mesh of `MESHES` appears (ring meshes with the strategies that take 'ring')."""
    cases, turn = [], 0
    for strategy in ALL:
        meshes = [m for m in MESHES if "fsdp_gather" not in m[3] or strategy in RING]
        for j, (axis_type, weights) in enumerate([(a, w) for a in ("explicit", "auto")
                                                   for w in ("weights", "no-weights")]):
            bias = weights == "weights"
            placed = j in (0, 3)
            mesh_id, shape, names, roles = meshes[turn % len(meshes)]
            turn += 1
            cid = f"{strategy}-{axis_type}-{mesh_id}-{weights}-{'bias' if bias else 'no-bias'}-" \
                  f"{'placed' if placed else 'unplaced'}"
            cases.append(pytest.param(strategy, axis_type, shape, names, roles, weights == "weights", bias,
                                      placed, id=cid))
    return cases


@pytest.mark.parametrize("strategy,axis_type,shape,names,roles,weights,bias,placed", _sharding_cases())
def test_sharded_equals_single_device(strategy, axis_type, shape, names, roles, weights, bias, placed, rng):
    layout = recloss.MeshLayout(make_mesh(shape, names, axis_type), **roles)
    inputs = make_inputs(rng, bias=bias, weights=weights)
    ref = loss_and_grads(strategy, inputs, None)
    got = loss_and_grads(strategy, place(inputs, strategy, layout) if placed else inputs, layout)
    assert_same(got, ref, (strategy, axis_type, shape))


def test_all_meshes_and_states_covered():
    """The cut of `_sharding_cases` keeps every strategy with both axis types and both weights,
    bias and placement states, and every mesh of MESHES."""
    cases = [c.values for c in _sharding_cases()]
    for s in ALL:
        mine = [c for c in cases if c[0] == s]
        for i, states in ((1, {"explicit", "auto"}), (5, {True, False}), (6, {True, False}),
                          (7, {True, False})):
            assert {c[i] for c in mine} == states, (s, i)
        for a in ("explicit", "auto"):
            assert {c[7] for c in mine if c[1] == a} == {True, False}, (s, a)
    used = {(c[2], c[3], tuple(sorted(c[4].items()))) for c in cases}
    assert len(used) == len(MESHES), sorted(used)


# Each objective inside jax.set_mesh (the sharding test above runs jit without a mesh context).
# Eager runs op by op (slow on CPU): only the dense strategy, whose program is smallest.
MODES = [("cutbce", "explicit", "set_mesh-jit"), ("cutce", "explicit", "set_mesh-jit"),
         ("dense_ce", "explicit", "set_mesh-eager"), ("sampled_softmax", "explicit", "set_mesh-jit"),
         ("gbce", "auto", "set_mesh-jit")]


@pytest.mark.parametrize("strategy,axis_type,mode", MODES, ids=["-".join(m) for m in MODES])
def test_jit_eager_and_set_mesh(strategy, axis_type, mode, rng):
    """A 2x2x2 mesh, plain inputs, reduction='none' (rows split over the batch axes and reshaped
    to hidden's leading shape) inside ``jax.set_mesh``, under jit and eagerly. (Without a mesh
    context JAX itself refuses an eager grad on an Explicit mesh and asks for jax.set_mesh.)"""
    layout = recloss.MeshLayout(make_mesh((2, 2, 2), AXES, axis_type))
    inputs = make_inputs(rng, weights=False)
    cot = jnp.asarray(rng.normal(size=LEAD), jnp.float32)
    # sampled_softmax with in-batch negatives: the batch's targets gathered to every shard.
    opts = dict(reduction="none", **({"in_batch_negatives": True} if strategy == "sampled_softmax" else {}))
    ref = loss_and_grads(strategy, inputs, None, cot=cot, **opts)
    ctx = jax.set_mesh(layout.mesh) if mode.startswith("set_mesh") else contextlib.nullcontext()
    with ctx:
        got = loss_and_grads(strategy, inputs, layout, jit=mode.endswith("jit"), cot=cot, **opts)
    assert got[0].shape == LEAD
    assert_same(got, ref, (strategy, mode))


def test_placed_gradients_keep_their_layout(rng):
    """On an Explicit mesh the gradients of placed inputs come back in the inputs' shardings."""
    layout = recloss.MeshLayout(make_mesh((2, 2, 2), AXES, "explicit"))
    inputs = place(make_inputs(rng), "cutbce", layout)
    _, _, grads = loss_and_grads("cutbce", inputs, layout)
    for n, g in grads.items():
        assert g.sharding.is_equivalent_to(inputs[n].sharding, g.ndim), (n, g.sharding, inputs[n].sharding)


# ------------------------------------------------------------------------- dtypes
def oracle_of(strategy, inputs, **opts):
    """The float64 oracle of ``strategy``'s objective (the sampled one with the negatives its
    key draws: `loss_and_grads` uses jax.random.key(7))."""
    obj = OBJECTIVE[strategy]
    args = {k: inputs[k] for k in ("hidden", "table", "targets", "weights", "bias")}
    if obj == "bce":
        return bce_oracle(**args, vocab_size=V, **opts)
    if obj == "softmax":
        return softmax_oracle(**args, vocab_size=V, **opts)
    s = recloss.get_strategy(strategy, vocab_size=V, **SAMPLED)
    neg = s.draw_negatives(jax.random.key(7), None, vocab_size=V)
    return sampled_oracle(**args, negatives=np.asarray(neg), strategy=strategy, vocab_size=V, **SAMPLED, **opts)


def assert_oracle(got, ref, *, grad_eps, what):
    """Loss within 2^7 float32 eps (float32 accumulation), gradients within 2^3 ``grad_eps``
    (their dtype's eps), both relative to the oracle (or to 1% of the size of their terms)."""
    loss, _, grads = got
    floor = CANCEL_FLOOR * float(np.linalg.norm(np.ravel(ref.loss_scale)))
    assert rel(loss, ref.loss, floor) <= 2 ** 7 * F32_EPS, (what, "loss", float(loss), ref.loss)
    for n, g in grads.items():
        floor = CANCEL_FLOOR * float(np.linalg.norm(ref.grad_scale[n].ravel()))
        assert np.all(np.isfinite(f64(g))), (what, n)
        err = rel(g, ref.grads[n], floor)
        assert err <= 2 ** 3 * grad_eps, (what, n, err)


# Every strategy on one device; a few sharded too (shard_map itself is dtype-blind).
SHARDED_DTYPE = ("cutce", "sampled_softmax")
FLOAT16 = [(s, False) for s in ALL] + [(s, True) for s in SHARDED_DTYPE]


@pytest.mark.parametrize("strategy,sharded", FLOAT16,
                         ids=[f"{s}-{'explicit-2x2x2' if sh else 'one-device'}" for s, sh in FLOAT16])
def test_float16_against_oracle(strategy, sharded, rng):
    """float16 hidden, table, bias and weights: float32 loss, float16 gradients, against float64."""
    inputs = make_inputs(rng, dtype=jnp.float16)
    layout = recloss.MeshLayout(make_mesh((2, 2, 2), AXES, "explicit")) if sharded else None
    got = loss_and_grads(strategy, inputs, layout)
    assert got[0].dtype == jnp.float32
    for n, g in got[2].items():
        assert g.dtype == jnp.float16, (n, g.dtype)
    assert_oracle(got, oracle_of(strategy, inputs), grad_eps=F16_EPS, what=(strategy, "float16"))


X64_SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np
import test_conventions as tc   # this module's own helpers, re-imported under x64
seed = int(sys.argv[1])
print("x64 subprocess seed", seed)
rng = np.random.default_rng(seed)
assert jnp.asarray(1).dtype == jnp.int64
for strategy in tc.ALL:
    for sharded in (False, True) if strategy in tc.SHARDED_DTYPE else (False,):
        inputs = tc.make_inputs(rng, dtype=jnp.float64)
        inputs["targets"] = inputs["targets"].astype(jnp.int64)
        assert inputs["targets"].dtype == jnp.int64 and inputs["hidden"].dtype == jnp.float64
        layout = tc.recloss.MeshLayout(tc.make_mesh((2, 2, 2), tc.AXES, "explicit")) if sharded else None
        got = tc.loss_and_grads(strategy, inputs, layout)
        assert got[0].dtype == jnp.float32, (strategy, got[0].dtype)
        for n, g in got[2].items():
            assert g.dtype == jnp.float64, (strategy, n, g.dtype)
        tc.assert_oracle(got, tc.oracle_of(strategy, inputs), grad_eps=2 ** 5 * tc.F32_EPS,
                         what=(strategy, "x64", sharded))
        print("ok", strategy, "sharded" if sharded else "one-device", flush=True)
"""


def test_x64_against_oracle(rng):
    """jax_enable_x64 on (in a subprocess): int64 ids and float64 inputs for every strategy, on one
    device (and SHARDED_DTYPE on an Explicit 2x2x2 mesh); float32 loss, float64 gradients at
    float32 accuracy."""
    seed = int(rng.integers(2 ** 31))
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(X64_SCRIPT), str(seed)], cwd=here, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"x64 subprocess (seed {seed}) failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    done = {tuple(line.split()[1:]) for line in proc.stdout.splitlines() if line.startswith("ok ")}
    assert done == ({(s, "one-device") for s in ALL} | {(s, "sharded") for s in SHARDED_DTYPE}), proc.stdout
