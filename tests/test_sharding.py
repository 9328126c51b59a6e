"""Sharded loss (recloss.sharding) against the single-device result, plus layout, memory and HLO checks.

Criterion: the sharded loss, metrics and gradients (hidden, table, bias) equal
the unsharded run (layout=None) on the same inputs: relative error
‖got − ref‖/‖ref‖ ≤ 1e-5 for the loss and metrics, ≤ 1e-4 for gradients.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import recloss
from helpers import (assert_matches, compiled_loss_grad, hlo_computations, loop_computations, loss_and_grads,
                     make_inputs, make_layout, options_for, rel, strategies, v6e8_layout)
from recloss import sharding

# `stack` (docs/development.md): shard_map, meshes (Auto and Explicit) and resharding change between jax
# versions (recloss/_compat.py absorbs the renames); the newest-stack leg runs this module.
pytestmark = pytest.mark.stack

ALL_OPTIONS = dict(label_smoothing=0.1, pos_weight=1.7, focal_gamma=1.5, focal_alpha=0.3,
                   threshold=0.25, block_v=128, block_n=8)
MESHES = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (4, 1, 2)]
PALLAS_MESHES = [(1, 1, 8), (2, 2, 2)]


def _cases():
    for name in strategies():
        meshes = PALLAS_MESHES if "pallas" in name else MESHES
        for shape in meshes:
            yield pytest.param(name, shape, id=f"{name}-{'x'.join(map(str, shape))}")


# ------------------------------------------------------------------------- loss_fsdp_gather=auto
@pytest.mark.tier1
@pytest.mark.parametrize("shape,vocab,features,itemsize", [((1, 8, 1), 1000, 16, 4), ((2, 4, 1), 100_000, 64, 2),
                                                           ((1, 4, 2), 4096, 8, 2), ((4, 2, 1), 5000, 32, 4)])
def test_choose_fsdp_gather_picks_the_least_estimated_bytes(shape, vocab, features, itemsize, rng):
    """The rule the docs state (docs/sharding.md): per chip once F·S·D·(b+4), ring S·D·(2b+12), rows
    F·M·D·(b+4c) with c dA partials (1 here: the kernel is interpreted on CPU); the least wins, ties
    once < ring < rows. Pinned at random row counts and at the boundaries where rows ties the smaller
    of the other two."""
    layout = make_layout(shape)
    f, per = layout.fsdp_shards, features * (itemsize + 4)
    s = recloss.padded_vocab_size(vocab, layout) // layout.table_shards
    kw = dict(vocab_size=vocab, features=features, itemsize=itemsize)
    cutce = recloss.get_strategy("cutce_pallas")
    assert cutce.grad_partials(layout) == 1 and recloss.get_strategy("cutce").grad_partials(layout) == 1
    once, ring = f * s * per, s * features * (2 * itemsize + 12)
    other = min(once, ring)
    boundary = -(-other // (f * per))              # the least M whose rows estimate reaches the other two's
    draws = [int(m) for m in rng.integers(1, 4 * s, 4)]
    print("rows drawn:", draws)
    for m in draws + [boundary - 1, boundary, boundary + 1, 1]:
        got = recloss.choose_fsdp_gather(cutce, layout, rows=m, **kw)
        assert got.bytes == {"once": once, "ring": ring, "rows": f * m * per}
        want = "rows" if f * m * per < other else ("once" if once <= ring else "ring")
        assert got.mode == want, (m, got)
        assert got.describe().startswith(f"loss_fsdp_gather=auto: {want!r} (fsdp {f}, {s:,} table rows a slice")
    if f * boundary * per == other:                # an exact tie goes to the mode with fewer collectives
        assert recloss.choose_fsdp_gather(cutce, layout, rows=boundary, **kw).mode != "rows"
    # A compiled kernel for a two-core chip keeps two dA partials a row: rows counts its gradient twice.
    from recloss.softmax.strategies import CutCEPallas
    two = CutCEPallas(recloss.LossOptions(interpret=False), chip="v5p")
    assert two.grad_partials(layout) == 2
    m = draws[0]
    assert recloss.choose_fsdp_gather(two, layout, rows=m, **kw).bytes["rows"] == f * m * features * (itemsize + 8)
    dense = recloss.choose_fsdp_gather(recloss.get_strategy("dense_ce"), layout, rows=1, **kw)
    assert (dense.mode, dense.bytes) == ("once", {}) and "takes only 'once'" in dense.describe()
    alone = recloss.choose_fsdp_gather(cutce, make_layout((8, 1, 1)), rows=1, **kw)
    assert (alone.mode, alone.bytes) == ("once", {}) and "no fsdp axis" in alone.describe()
    with pytest.raises(ValueError, match=r"choose_fsdp_gather: rows=0, expected an int >= 1"):
        recloss.choose_fsdp_gather(cutce, layout, rows=0, **kw)


# ------------------------------------------------------------------------- numerics
@pytest.mark.tier1
@pytest.mark.parametrize("strategy,shape", list(_cases()))
def test_sharded_equals_single_device(strategy, shape, rng):
    """V=1000 padded to padded_vocab_size rows, all options on, reductions 'mean' and 'none'."""
    layout = make_layout(shape)
    rows = recloss.padded_vocab_size(1000, layout)
    assert rows == 1024
    inputs = make_inputs(rng, V=1000, rows=rows)
    opts = dict(ALL_OPTIONS, vocab_size=1000)
    _, mets, grads = assert_matches(strategy, inputs, layout, reduction="mean", **opts)
    # Rows past vocab_size are inert: exactly zero gradient.
    assert float(jnp.max(jnp.abs(grads[1][1000:]))) == 0.0
    assert float(jnp.max(jnp.abs(grads[2][1000:]))) == 0.0
    assert float(mets["invalid_targets"]) > 0
    cot = jnp.asarray(rng.normal(size=inputs["hidden"].shape[:-1]), jnp.float32)
    loss, _, _ = assert_matches(strategy, inputs, layout, cot=cot, reduction="none", **opts)
    assert loss.shape == inputs["hidden"].shape[:-1]


@pytest.mark.tier1
@pytest.mark.parametrize("strategy", strategies())
def test_vocab_axis_named_tensor(strategy, rng):
    """A MaxText-style mesh whose vocab axis is 'tensor'; defaults otherwise, no bias, 'sum'."""
    layout = make_layout((2, 2, 2), names=("data", "fsdp", "tensor"), vocab_axis="tensor")
    inputs = make_inputs(rng, V=1024, rows=1024, bias=False)
    assert_matches(strategy, inputs, layout, reduction="sum", vocab_reduction="sum")


@pytest.mark.tier1
def test_layout_without_roles_and_extra_axis(rng):
    """Roles set to None, and a mesh axis with no role (the loss is replicated over it)."""
    layout = make_layout((4, 2), names=("data", "stage"), batch_axes=("data",), fsdp_axis=None,
                         vocab_axis=None)
    inputs = make_inputs(rng, V=1000, rows=1024)
    assert_matches("cutbce", inputs, layout, reduction="mean", vocab_size=1000)
    layout = make_layout((1, 8), names=("data", "model"), batch_axes=("data",), fsdp_axis=None,
                         vocab_axis="model")
    assert_matches("cutbce", inputs, layout, reduction="mean", vocab_size=1000, block_v=64)


@pytest.mark.tier1
def test_weight_gradient_matches(rng):
    """The weights enter through Σw (a psum): their gradient must also be exact."""
    layout = make_layout((2, 2, 2))
    inputs = make_inputs(rng, V=1024, rows=1024)

    def f(w, lay):
        return recloss.bce_loss(inputs["hidden"], inputs["table"], inputs["targets"], w, inputs["bias"],
                                layout=lay, reduction="mean").loss

    ref = jax.grad(f)(inputs["weights"], None)
    got = jax.jit(jax.grad(f), static_argnums=1)(inputs["weights"], layout)
    assert rel(got, ref) <= 1e-4


@pytest.mark.tier1
def test_presharded_inputs_keep_their_layout(rng):
    """Inputs placed with the layout's specs go in without resharding; grads come back in storage layout."""
    layout = make_layout((2, 2, 2))
    specs = recloss.get_strategy("cutbce").partition_specs(layout)
    inputs = make_inputs(rng, lead=(16,), V=1024, rows=1024)
    put = lambda x, s: jax.device_put(x, NamedSharding(layout.mesh, s))
    h, e, b = put(inputs["hidden"], specs.hidden), put(inputs["table"], specs.table), put(inputs["bias"],
                                                                                            specs.bias)
    t, w = put(inputs["targets"], specs.targets), put(inputs["weights"], specs.weights)
    f = lambda h, e, b: recloss.bce_loss(h, e, t, w, b, layout=layout).loss
    gh, ge, gb = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(h, e, b)
    assert ge.sharding.is_equivalent_to(NamedSharding(layout.mesh, specs.table), 2)
    assert gb.sharding.is_equivalent_to(NamedSharding(layout.mesh, specs.bias), 1)
    ref = jax.grad(lambda e: recloss.bce_loss(inputs["hidden"], e, inputs["targets"], inputs["weights"],
                                              inputs["bias"]).loss)(inputs["table"])
    assert rel(ge, ref) <= 1e-4


# ------------------------------------------------------------------------- layout API
@pytest.mark.tier1
def test_layout_roles_and_sizes():
    layout = make_layout((2, 2, 2))
    assert layout.platform == "cpu"
    assert (layout.batch_shards, layout.fsdp_shards, layout.vocab_shards, layout.table_shards) == (4, 2, 2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.vocab_axis = "data"
    one = make_layout((8, 1, 1))
    assert (one.batch_shards, one.vocab_shards, one.table_shards) == (8, 1, 1)


@pytest.mark.tier1
@pytest.mark.parametrize("roles,match", [
    (dict(vocab_axis="tensor"), r"'tensor'.*\('data', 'fsdp', 'vocab'\)"),
    (dict(batch_axes=("data", "replica")), r"'replica'.*\('data', 'fsdp', 'vocab'\)"),
    (dict(fsdp_axis="fsdp2"), r"'fsdp2'"),
    (dict(batch_axes=("data",)), r"fsdp_axis='fsdp' must also be one of batch_axes"),
    (dict(batch_axes=("data", "fsdp", "vocab")), r"vocab_axis='vocab' cannot also be a batch axis"),
])
def test_layout_rejects_bad_roles(roles, match):
    with pytest.raises(ValueError, match=match):
        make_layout((2, 2, 2), **roles)


@pytest.mark.tier1
def test_bad_shapes_name_the_problem(rng):
    layout = make_layout((4, 2, 1))
    inputs = make_inputs(rng, lead=(12,), V=1024, rows=1024)
    with pytest.raises(ValueError, match=r"M=12 .* 8 batch shards"):
        recloss.bce_loss(inputs["hidden"], inputs["table"], inputs["targets"], layout=layout)
    layout = make_layout((1, 2, 4))
    inputs = make_inputs(rng, lead=(16,), V=996, rows=996)
    with pytest.raises(ValueError, match=r"996 rows.*8 shards.*padded_vocab_size\(996, layout\)=1024"):
        recloss.bce_loss(inputs["hidden"], inputs["table"], inputs["targets"], layout=layout)


@pytest.mark.tier1
def test_padded_vocab_size():
    assert recloss.padded_vocab_size(1000) == 1024
    assert recloss.padded_vocab_size(1024) == 1024
    assert recloss.padded_vocab_size(1, make_layout((1, 1, 8))) == 1024
    assert recloss.padded_vocab_size(1025, make_layout((1, 1, 8))) == 2048
    assert recloss.padded_vocab_size(876_939, make_layout((8, 1, 1))) == 877_056
    assert recloss.padded_vocab_size(876_939, make_layout((2, 2, 2))) == 877_056  # unit 512
    assert recloss.padded_vocab_size(876_939, make_layout((1, 8, 1))) == 877_568  # unit 1024
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="vocab_size must be a positive int"):
            recloss.padded_vocab_size(bad)


@pytest.mark.tier1
def test_default_specs():
    s = sharding.default_specs(make_layout((2, 2, 2)))
    assert isinstance(s, recloss.Specs)
    assert s.hidden == P(("data", "fsdp"), None) and s.targets == P(("data", "fsdp"), None)
    assert s.weights == P(("data", "fsdp")) and s.row_loss == P(("data", "fsdp"))
    assert s.table == P(("vocab", "fsdp"), None) and s.bias == P(("vocab", "fsdp"))
    assert s.loss == P() and s.metrics == P()
    s = make_layout((4, 2), names=("data", "tensor"), batch_axes=("data",), fsdp_axis=None,
                    vocab_axis="tensor")
    s = recloss.get_strategy("cutbce").partition_specs(s)
    assert s.hidden == P("data", None) and s.table == P("tensor", None) and s.bias == P("tensor")


# ------------------------------------------------------------------------- memory and HLO

@pytest.mark.tier1
def test_vocab_parallelism_splits_memory():
    M, V, D = 64, 100_000, 128
    mem = {}
    for strat in ("cutbce", "dense_bce"):
        for name, lay in (("data8", make_layout((8, 1, 1))), ("vocab8", make_layout((1, 1, 8))),
                          ("single", None)):
            ma = compiled_loss_grad(strat, lay, M=M, V=V, D=D).memory_analysis()
            mem[strat, name] = (ma.argument_size_in_bytes + ma.output_size_in_bytes, ma.temp_size_in_bytes)
    print({k: v for k, v in mem.items()})
    # Per device: the vocab-sharded table and its gradient are 1/8 of the replicated ones.
    assert mem["cutbce", "vocab8"][0] <= mem["cutbce", "data8"][0] / 4
    # The dense baseline's [M, V] logits are split 8 ways.
    assert mem["dense_bce", "vocab8"][1] <= mem["dense_bce", "single"][1] / 4


@pytest.mark.tier1
def test_fsdp_hlo_gathers_once_and_reduce_scatters():
    layout = make_layout((2, 4, 1))
    V, D = 4096, 128
    hlo = compiled_loss_grad("cutbce", layout, M=64, V=V, D=D, block_v=256).as_text()
    comps = hlo_computations(hlo)
    loops = loop_computations(comps)
    assert any(re.search(r"\bdot\(", comps[n]) for n in loops), "expected the block matmuls in a while loop"
    gathers = [(n, l) for n, text in comps.items() if n != "__entry__"
               for l in text.splitlines() if re.search(r"\ball-gather(-start)?\(", l)]
    table_gathers = [(n, l) for n, l in gathers if f"f32[{V},{D}]" in l]
    print("all-gathers:", [l.strip()[:120] for _, l in gathers])
    assert len(table_gathers) == 1, gathers
    assert not [n for n, _ in gathers if n in loops], "an all-gather sits inside the block loop"
    scatters = [l for text in comps.values() if isinstance(text, str)
                for l in text.splitlines() if re.search(r"\breduce-scatter(-start)?\(", l)]
    print("reduce-scatters:", [l.strip()[:120] for l in scatters])
    # dE (and nothing bigger) is reduce-scattered over the 4 fsdp shards back to [V/4, D].
    assert any(f"f32[{V // 4},{D}]" in l for l in scatters), scatters


# ------------------------------------------------------------------------- TPU ahead-of-time

@pytest.mark.tier2
@pytest.mark.tpu_aot
@pytest.mark.parametrize("strategy,shape", [
    pytest.param("cutbce_pallas", (8, 1, 1), id="cutbce_pallas-data8"),
    pytest.param("cutbce_pallas", (1, 8, 1), id="cutbce_pallas-fsdp8"),
    pytest.param("cutbce_pallas", (2, 1, 4), id="cutbce_pallas-data2-vocab4"),
    pytest.param("cutbce", (1, 8, 1), id="cutbce-fsdp8"),
])
def test_tpu_v6e8_compiles_at_paper_shapes(strategy, shape):
    """Global batch 128 × N=256 positions, D=128, V=876,939 padded; loss+grad on a v6e-8 topology."""
    assert strategy in recloss.available_strategies(), recloss.available_strategies()
    layout = v6e8_layout(shape)
    assert layout.platform == "tpu"
    B, N, D, L, V = 128, 256, 128, 8, 876_939
    rows = recloss.padded_vocab_size(V, layout)
    compiled = compiled_loss_grad(strategy, layout, M=B * N, V=rows, D=D, L=L, vocab_size=V)
    ma = compiled.memory_analysis()
    total = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
             - ma.alias_size_in_bytes)
    print(f"{strategy} v6e-8 {shape}: rows={rows} per-chip HBM args={ma.argument_size_in_bytes / 2**20:.1f} "
          f"MiB out={ma.output_size_in_bytes / 2**20:.1f} MiB temp={ma.temp_size_in_bytes / 2**20:.1f} MiB "
          f"total={total / 2**20:.1f} MiB")
    table_bytes = rows * D * 4 // layout.table_shards
    assert ma.argument_size_in_bytes >= table_bytes
    assert total < 32 * 2**30       # fits a v6e chip's 32 GiB HBM


# ------------------------------------------------------------------------- manual (caller's shard_map)
def _manual_loss_and_grads(strategy, inputs, mesh, *, chunk_bytes, **opts):
    """The loss and its gradients from inside a hand-written data-parallel step: shard_map over
    'data', value_and_grad per device with MeshLayout(manual=True), the table's and bias's
    gradients summed with psum_in_place (chunks of ``chunk_bytes``)."""
    from recloss import _compat
    layout = recloss.MeshLayout(mesh, batch_axes=("data",), fsdp_axis=None, vocab_axis=None, manual=True)
    entry = recloss.softmax_loss if recloss.get_strategy(strategy).objective == "softmax" else recloss.bce_loss

    def step(h, e, b, t, w):
        def f(h, e, b):
            out = entry(h, e, t, w, b, strategy=strategy, layout=layout, **options_for(strategy, opts))
            return out.loss, out.metrics
        (loss, mets), (gh, ge, gb) = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(h, e, b)
        ge = recloss.psum_in_place(ge, "data", chunk_bytes=chunk_bytes)
        gb = recloss.psum_in_place(gb, "data", chunk_bytes=chunk_bytes)
        return loss, mets, (gh, ge, gb)

    rows = P("data")
    specs = (rows, P(), P(), rows, rows)
    fn = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(P(), P(), (rows, P(), P())),
                                   check_vma=False))
    args = [jax.device_put(inputs[k], NamedSharding(mesh, s))   # Explicit axes: typed as the specs say
            for k, s in zip(("hidden", "table", "bias", "targets", "weights"), specs)]
    return fn(*args)


@pytest.mark.tier1
@pytest.mark.parametrize("explicit", [False, True], ids=["Mesh", "make_mesh"])
@pytest.mark.parametrize("strategy", ["cutbce", "dense_bce", "cutce", "dense_ce", "cutbce_pallas"])
def test_manual_layout_inside_callers_shard_map(strategy, explicit, rng):
    """Loss, metrics and gradients from the caller's own data-parallel shard_map (8 devices, the
    table's gradient reduced in place in chunks of 200 rows and a remainder) equal the
    single-device ones: the batch sums pass each device's own gradient back, not |data| times it."""
    if explicit:
        mesh = jax.make_mesh((8,), ("data",))
    else:
        mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    inputs = make_inputs(rng, lead=(8, 5), V=1000, rows=1024)
    inputs = dict(inputs, hidden=inputs["hidden"].reshape(40, -1), targets=inputs["targets"].reshape(40, -1),
                  weights=inputs["weights"].reshape(40))
    opts = dict(vocab_size=1000, block_v=128, block_n=8)
    if strategy == "cutbce_pallas":
        opts = dict(vocab_size=1000, interpret=True)
    ref_loss, ref_m, ref_g = loss_and_grads(strategy, inputs, None, **opts)
    loss, mets, grads = _manual_loss_and_grads(strategy, inputs, mesh, chunk_bytes=200 * 16 * 4, **opts)
    assert rel(loss, ref_loss) <= 1e-5, (loss, ref_loss)
    for k in ref_m:
        assert rel(mets[k], ref_m[k]) <= 1e-5, (k, mets[k], ref_m[k])
    for name, g, rg in zip(("hidden", "table", "bias"), grads, ref_g):
        assert float(jnp.max(jnp.abs(rg))) > 0, name
        assert rel(g, rg) <= 1e-4, (name, rel(g, rg))


@pytest.mark.tier1
def test_psum_in_place_keeps_one_buffer():
    """On 8 CPU devices: the chunked sum equals psum for every chunk size (one row, a remainder, one
    chunk, the whole array), and its compiled temporaries are one chunk, where psum's hold a second
    array."""
    from recloss import _compat
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8 * 1000, 64)), jnp.float32)

    def run(fn):
        return jax.jit(_compat.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                         check_vma=False))
    ref = run(lambda x: jax.lax.psum(x, "data"))(x)
    for chunk_rows in (1, 300, 1000, 4000):
        got = run(lambda x: recloss.psum_in_place(x, "data", chunk_bytes=chunk_rows * 64 * 4))(x)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    arg = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("data")))

    def temp(fn):
        f = jax.jit(_compat.shard_map(lambda x: fn(x * 2.0), mesh=mesh, in_specs=P("data"),
                                      out_specs=P("data"), check_vma=False))
        return f.lower(arg).compile().memory_analysis().temp_size_in_bytes
    whole = temp(lambda x: jax.lax.psum(x, "data"))
    chunked = temp(lambda x: recloss.psum_in_place(x, "data", chunk_bytes=100 * 64 * 4))
    one = 1000 * 64 * 4
    assert chunked < whole and chunked <= one // 2, (chunked, whole)


@pytest.mark.tier1
def test_manual_layout_errors():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "vocab"))
    with pytest.raises(ValueError, match=r"manual=True\) takes the whole table.*split 4 ways"):
        recloss.MeshLayout(mesh, batch_axes=("data",), fsdp_axis=None, vocab_axis="vocab", manual=True)
    with pytest.raises(TypeError, match=r"psum_in_place's axes must be a mesh axis name.*got 3"):
        recloss.psum_in_place(jnp.ones((4, 2)), 3)
    with pytest.raises(TypeError, match="MeshLayout.manual must be True or False, got 'yes'"):
        recloss.MeshLayout(mesh, batch_axes=("data",), fsdp_axis=None, vocab_axis=None, manual="yes")
    layout = recloss.MeshLayout(mesh, batch_axes=("data",), fsdp_axis=None, vocab_axis=None, manual=True)
    strat = recloss.get_strategy("sampled_softmax", recloss.LossOptions(in_batch_negatives=True,
                                                                        num_negatives=4))
    with pytest.raises(ValueError, match="in_batch_negatives=True.*manual=True"):
        strat(jnp.ones((4, 8)), jnp.ones((128, 8)), jnp.zeros((4, 1), jnp.int32), layout=layout,
              key=jax.random.key(0))
