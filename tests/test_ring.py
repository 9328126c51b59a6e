"""MeshLayout(fsdp_gather='ring'): table slices travel round the fsdp axis (recloss.ring), and
fsdp_gather='rows': the slices stay home and the fsdp group's rows are gathered instead.

Criterion: the ring's and the rows gather's loss, metrics and gradients equal the single-device run
on the same inputs (tests/test_sharding.py holds 'once' to the same reference) (relative error ≤ 1e-5 loss and
metrics, ≤ 1e-4 gradients), and the single-device cutbce equals the float64
oracle; the ring's compiled program has no all-gather / reduce-scatter of the table,
collective-permutes inside a while loop, and far less temporary memory; the rows gather's moves no
table-sized array at all and holds less than the ring.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recloss
from helpers import (SOFTMAX_OPTIONS, assert_matches, compiled_loss_grad, hlo_computations, loop_computations,
                     loss_and_grads, make_inputs, make_layout, rel, v6e8_layout)
from oracle import bce_oracle
from recloss import targets as targets_lib

# `stack` (docs/development.md): shard_map, meshes (Auto and Explicit) and resharding change between jax
# versions (recloss/_compat.py absorbs the renames); the newest-stack leg runs this module.
pytestmark = [pytest.mark.tier1, pytest.mark.stack]

BCE_OPTIONS = dict(label_smoothing=0.1, pos_weight=1.7, focal_gamma=1.5, focal_alpha=0.3, threshold=0.25,
                   block_v=40, block_n=8)
RING_MESHES = [(1, 8, 1), (2, 4, 1), (1, 4, 2)]
# V = 997 real items in 1008 rows: 126-row slices under fsdp=8, 63 under fsdp=4 × vocab=2 (block_v=40
# leaves a tail block); rows 997… are padding.
V, ROWS = 997, 1008


def _ring_matches(objective, strategy, inputs, meshes, cot=None, gather="ring", **opts):
    """``gather`` ('ring' or 'rows') on each mesh against one single-device reference (test_sharding
    checks 'once' against the same reference, so ring = rows = once = single device). Returns the last
    mesh's (loss, metrics, grads)."""
    ref_loss, ref_m, ref_g = loss_and_grads(strategy, inputs, None, cot, **opts)
    for shape in meshes:
        loss, mets, grads = loss_and_grads(strategy, inputs, make_layout(shape, fsdp_gather=gather), cot, **opts)
        assert loss.shape == ref_loss.shape and rel(loss, ref_loss) <= 1e-5, (shape, loss, ref_loss)
        assert set(mets) == set(ref_m)
        for k in ref_m:
            assert rel(mets[k], ref_m[k]) <= 1e-5, (shape, k, mets[k], ref_m[k])
        for name, g, rg in zip(("hidden", "table", "bias"), grads, ref_g):
            assert g.shape == rg.shape and g.dtype == rg.dtype
            assert float(jnp.max(jnp.abs(rg))) > 0, name      # the comparison means something
            assert rel(g, rg) <= 1e-4, (shape, name, rel(g, rg))
    return loss, mets, grads


@pytest.mark.parametrize("gather", ["ring", "rows"])
def test_cutbce_ring_equals_single_device(gather, rng):
    """Every BCE option, bias, padding rows, on (1,8,1), (2,4,1), (1,4,2) (reduction='none', the
    recompute ring, is the softmax test's); the last mesh also against the float64 oracle."""
    inputs = make_inputs(rng, V=V, rows=ROWS)
    opts = dict(BCE_OPTIONS, vocab_size=V)
    loss, mets, grads = _ring_matches("bce", "cutbce", inputs, RING_MESHES, gather=gather, reduction="mean", **opts)
    # ... and the reference is itself exact: the float64 oracle.
    ref = bce_oracle(inputs["hidden"], inputs["table"], inputs["targets"], inputs["weights"], inputs["bias"],
                     reduction="mean", **opts)
    assert abs(float(loss) - ref.loss) <= 1e-5 * abs(ref.loss)
    for name, g in zip(("hidden", "table", "bias"), grads):
        assert rel(g, ref.grads[name]) <= 1e-4, name
    assert float(mets["num_targets"]) == ref.metrics["num_targets"]
    assert float(jnp.max(jnp.abs(grads[1][V:]))) == 0.0 and float(jnp.max(jnp.abs(grads[2][V:]))) == 0.0
    assert float(mets["invalid_targets"]) > 0 and float(mets["tp"]) > 0


def test_cutbce_ring_bf16_and_large_logits_no_bias(rng):
    """bf16 hidden/table with logits near ±1e4, no bias, 'sum': ring and rows equal once exactly in the math."""
    inputs = make_inputs(rng, V=V, rows=ROWS, bias=False)
    inputs["hidden"] = (inputs["hidden"] * 300.0).astype(jnp.bfloat16)
    inputs["table"] = (inputs["table"] * 30.0).astype(jnp.bfloat16)
    out = {}
    for gather in ("once", "ring", "rows"):
        layout = make_layout((2, 4, 1), fsdp_gather=gather)
        out[gather] = loss_and_grads("cutbce", inputs, layout, reduction="sum", vocab_reduction="sum",
                                        block_v=64, vocab_size=V)
    logits = np.asarray(inputs["hidden"], np.float32).reshape(-1, 16) @ np.asarray(inputs["table"], np.float32).T
    assert np.abs(logits).max() > 5e3
    for gather in ("ring", "rows"):
        assert np.isfinite(float(out[gather][0]))
        assert rel(out[gather][0], out["once"][0]) <= 1e-5, gather
        for a, b in zip(out[gather][2], out["once"][2]):
            assert a.dtype == jnp.bfloat16 and rel(a, b) <= 2e-2, gather


@pytest.mark.parametrize("gather", ["ring", "rows"])
def test_cutce_ring_equals_single_device(gather, rng):
    """Softmax (label smoothing, z-loss, temperature): two rings (Z, then the dE recompute), or the
    gathered rows; reduction='none' with a random cotangent (the rows gather cuts each chip's rows back)."""
    inputs = make_inputs(rng, V=V, rows=ROWS)
    opts = dict(SOFTMAX_OPTIONS, block_v=40, vocab_size=V)
    _, mets, grads = _ring_matches("softmax", "cutce", inputs, RING_MESHES, gather=gather, reduction="mean", **opts)
    assert float(jnp.max(jnp.abs(grads[1][V:]))) == 0.0 and float(mets["top1"]) >= 0
    cot = jnp.asarray(rng.normal(size=inputs["hidden"].shape[:-1]), jnp.float32)
    _ring_matches("softmax", "cutce", inputs, RING_MESHES[:2], cot=cot, gather=gather, reduction="none", **opts)


def test_cutbce_rows_per_row_loss(rng):
    """BCE reduction='none' under the rows gather: each chip's own rows come back, in order."""
    inputs = make_inputs(rng, V=V, rows=ROWS)
    cot = jnp.asarray(rng.normal(size=inputs["hidden"].shape[:-1]), jnp.float32)
    _ring_matches("bce", "cutbce", inputs, [(2, 4, 1), (1, 4, 2)], cot=cot, gather="rows", reduction="none",
                  **dict(BCE_OPTIONS, vocab_size=V))


@pytest.mark.parametrize("gather", ["ring", "rows"])
@pytest.mark.parametrize("strategy,objective", [("cutbce_pallas", "bce"), ("cutce_pallas", "softmax")])
def test_pallas_ring_equals_single_device(strategy, objective, gather, rng):
    """The Mosaic kernels (interpret mode on CPU) walked round the ring, or on the gathered rows,
    fsdp=4 × vocab=2."""
    inputs = make_inputs(rng, V=V, rows=1024)
    opts = dict(BCE_OPTIONS if objective == "bce" else SOFTMAX_OPTIONS, vocab_size=V)
    opts.pop("block_v"), opts.pop("block_n")
    _ring_matches(objective, strategy, inputs, [(1, 4, 2)], gather=gather, reduction="mean", **opts)


def test_gather_logits_vjp_matches_autodiff(rng):
    """targets.gather_logits' own VJP (chunked scatter) equals autodiff of the plain gather, with repeats."""
    m, l, d, v = 4500, 5, 12, 300       # 4500 rows: five scan chunks of scatters, the last one padded
    h = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(v, d)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(v,)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, size=(m, l)), jnp.int32)
    g = jnp.asarray(rng.normal(size=(m, l)), jnp.float32)

    def plain(h, e, b):
        return jnp.einsum("md,mld->ml", h, e[ids]) + b[ids]

    ref = jax.vjp(plain, h, e, b)[1](g)
    got = jax.vjp(lambda h, e, b: targets_lib.gather_logits(h, e, b, ids), h, e, b)[1](g)
    for a, r in zip(got, ref):
        assert rel(a, r) <= 1e-5


@pytest.mark.parametrize("gather", ["ring", "rows"])
def test_dense_strategies_refuse_the_ring(gather, rng):
    inputs = make_inputs(rng, V=V, rows=ROWS)
    with pytest.raises(ValueError, match=rf"MeshLayout.fsdp_gather='{gather}': strategy 'dense_bce' does not take "
                                         rf"it.*'once', or use a blocked strategy: cutbce, cutbce_pallas"):
        loss_and_grads("dense_bce", inputs, make_layout((2, 4, 1), fsdp_gather=gather))


@pytest.mark.parametrize("gather", ["ring", "rows"])
def test_ring_without_fsdp_axis_is_a_no_op(gather, rng):
    """fsdp_gather='ring' or 'rows' with no fsdp axis (None) or one of size 1 is allowed and gives the
    'once' result."""
    inputs = make_inputs(rng, V=V, rows=ROWS)
    lay = make_layout((4, 2), names=("data", "vocab"), batch_axes=("data",), fsdp_axis=None,
                         fsdp_gather=gather)
    assert_matches("dense_bce", inputs, lay, vocab_size=V)
    lay = make_layout((8, 1, 1), fsdp_gather=gather)
    assert_matches("dense_bce", inputs, lay, vocab_size=V)   # size-1 fsdp: no ring, dense allowed


@pytest.mark.parametrize("bad", ["gather", "RING", None, 1])
def test_bad_fsdp_gather_names_the_value(bad):
    with pytest.raises(ValueError, match=re.escape(f"MeshLayout.fsdp_gather={bad!r}: expected one of 'once', 'ring', 'rows'")):
        make_layout((1, 8, 1), fsdp_gather=bad)


def test_ring_hlo_permutes_in_the_loop_and_saves_memory():
    """(1,8,1), V=100k, D=128: the ring has no all-gather or reduce-scatter of the table, collective-
    permutes inside while loops, and ≤ 1/3 of the 'once' path's temporary memory per device."""
    Vb, D = 100_000, 128
    rows = recloss.padded_vocab_size(Vb, make_layout((1, 8, 1)))
    temp = {}
    for gather in ("once", "ring"):
        compiled = compiled_loss_grad("cutbce", make_layout((1, 8, 1), fsdp_gather=gather), M=64,
                                          V=rows, D=D, vocab_size=Vb)
        temp[gather] = compiled.memory_analysis().temp_size_in_bytes
        hlo = compiled.as_text()
    comps = hlo_computations(hlo)
    loops = loop_computations(comps)
    lines = [(n, l) for n, text in comps.items() if n != "__entry__" for l in text.splitlines()]
    big = lambda l: re.search(r"f32\[\d{4,},128\]", l)      # a table-sized (≥ 1000-row) operand
    assert not [l for _, l in lines if re.search(r"\b(all-gather|reduce-scatter)(-start)?\(", l) and big(l)]
    permutes = [n for n, l in lines if re.search(r"\bcollective-permute(-start)?\(", l)]
    assert [n for n in permutes if n in loops], "expected collective-permutes inside the ring loop"
    assert any(big(l) for n, l in lines if n in loops and "collective-permute" in l)
    print({k: f"{v / 2**20:.1f} MiB" for k, v in temp.items()})
    assert temp["ring"] <= temp["once"] / 3, temp


def _single_device_groups(line: str) -> bool:
    """Whether an HLO collective's replica groups are single devices (a sum over the mesh's size-1
    axes, which moves nothing), in any of XLA's spellings: {{0},{1},...}, the iota form [8,1]<=[8],
    or mesh['data'=1,'fsdp'=8,'vocab'=1] {'vocab'} (newer XLA)."""
    if re.search(r"replica_groups=\{(\{\d+\},?)+\}", line) or re.search(r"replica_groups=\[\d+,1\]<=", line):
        return True
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if not m:
        return False
    sizes = {k.strip("' "): int(v) for k, v in (kv.split("=") for kv in m.group(1).split(","))}
    return all(sizes[a.strip("' ")] == 1 for a in m.group(2).split(",") if a.strip())


def test_rows_gather_moves_no_table_and_holds_less_than_the_ring():
    """(1,8,1), V=100k, D=128, 8 rows a chip: under 'rows' no collective touches a table-sized array
    (the rows are all-gathered, 64 × 128, and their gradient reduce-scattered), and the per-device
    temporaries are below the ring's (which holds two travelling slices and their dE)."""
    Vb, D = 100_000, 128
    rows = recloss.padded_vocab_size(Vb, make_layout((1, 8, 1)))
    temp, hlo = {}, {}
    for gather in ("ring", "rows"):
        compiled = compiled_loss_grad("cutbce", make_layout((1, 8, 1), fsdp_gather=gather), M=64,
                                      V=rows, D=D, vocab_size=Vb)
        temp[gather] = compiled.memory_analysis().temp_size_in_bytes
        hlo[gather] = compiled.as_text()
    collectives = [l for l in hlo["rows"].splitlines()
                   if re.search(r"\b(all-gather|reduce-scatter|collective-permute|all-reduce)(-start)?\(", l)
                   and not _single_device_groups(l)]
    assert not [l for l in collectives if re.search(r"f32\[\d{4,},128\]", l)], "a table-sized collective"
    assert [l for l in collectives if re.search(r"all-gather(-start)?\(", l) and "f32[64,128]" in l], \
        "expected the rows' all-gather"
    print({k: f"{v / 2**20:.1f} MiB" for k, v in temp.items()})
    assert temp["rows"] < temp["ring"], temp


@pytest.mark.tpu_aot
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not importable: no TPU AOT")
def test_tpu_v6e8_ring_compiles_the_kernel_and_saves_memory():
    """cutbce_pallas's Mosaic kernel inside the ring loop lowers for a v6e-8 (1,8,1) mesh; V=100k, D=128,
    8 × 128 rows: per-chip temporaries ≤ 1/3 of 'once'. (The full paper train step with the ring is in the
    README: it compiles in minutes.)"""
    from recloss import aot
    aot.libtpu_env()
    Vb, D = 100_000, 128
    temp = {}
    for gather in ("once", "ring"):
        layout = dataclasses.replace(v6e8_layout((1, 8, 1)), fsdp_gather=gather)
        rows = recloss.padded_vocab_size(Vb, layout)
        ma = compiled_loss_grad("cutbce_pallas", layout, M=8 * 128, V=rows, D=D, L=8, vocab_size=Vb,
                                    interpret=False).memory_analysis()
        temp[gather] = ma.temp_size_in_bytes
    print({k: f"{v / 2**20:.1f} MiB" for k, v in temp.items()})
    assert 0 < temp["ring"] <= temp["once"] / 3, temp


# ------------------------------------------------------------------------- 16-bit gradients: the error bound
# docs/sharding.md "16-bit gradients": with hidden, table and bias in a 16-bit dtype of unit roundoff u, every
# gradient entry g of a sharded loss is within (n + 2)·u·S + η·(T + n + 2) + 1e-5·S of the float64 gradient of the
# same 16-bit inputs: S the entry's sum of absolute terms (|G|ᵀ|H| for the table, |G||E| for the hidden states,
# Σ|G| for the bias: `OracleResult.grad_scale`), n the partial gradients added in the 16-bit dtype (G rounded to
# the dtype before its products, each partial rounded once, n − 1 sums: n + 1 roundings of at most u·S each, and
# one for the second-order terms), η half the dtype's smallest subnormal (a rounding's absolute error near 0), T
# what a G entry's η is multiplied into (Σ_m |H_md| for the table, Σ_v |E_vd| for the hidden states, M for the
# bias) and 1e-5·S the float32 work before any rounding. η·T is float16's: a 'mean' over M rows and V columns puts
# G near 1/(M·V), below float16's least normal 2^-14 already at M·V ≈ 16,000, where it keeps fewer bits; for
# bfloat16 (η = 2^-134) the bound is (n + 2)·u·S.
SIXTEEN_BIT = {"bfloat16": (2.0 ** -8, 2.0 ** -134), "float16": (2.0 ** -11, 2.0 ** -25)}


def sixteen_bit_partials(gather: str, layout) -> dict:
    """n per gradient: the table's and bias' are summed over the data axes (shard_map's transpose) and, under
    'once', reduce-scattered over fsdp; 'rows' writes each slice's once; the ring adds each visit's 16-bit
    partial into a float32 carry and rounds the sum once more. The hidden states' are summed over the vocab
    axis and, under 'rows', reduce-scattered over fsdp. Each gets one more for a target (sparse) term whose
    gradient is a separate 16-bit value."""
    data = int(np.prod([layout.axis_size(a) for a in layout.batch_axes if a != layout.fsdp_axis]))
    f, vocab = layout.fsdp_shards, layout.vocab_shards
    table = data * (f if gather == "once" else 1) + (2 if gather == "ring" else 1)
    return {"table": table, "bias": table, "hidden": vocab * (f if gather == "rows" else 1) + 1}


def _sixteen_bit_cases():
    for strategy in ("cutce", "cutce_pallas", "cutbce", "cutbce_pallas"):
        for gather in ("once", "ring", "rows"):
            # float16 operands are widened to float32 before a kernel (`tiling.kernel_dtype`): bfloat16 is
            # the kernels' 16-bit path.
            for dtype in ("bfloat16",) if "pallas" in strategy else ("bfloat16", "float16"):
                yield pytest.param(strategy, gather, dtype, id=f"{strategy}-{gather}-{dtype}")


@pytest.mark.parametrize("strategy,gather,dtype", list(_sixteen_bit_cases()))
def test_16bit_gradients_are_within_the_stated_bound_of_the_float64_oracle(strategy, gather, dtype, rng):
    from oracle import softmax_oracle
    layout = make_layout((2, 4, 1), fsdp_gather=gather)
    inputs = {k: (v.astype(dtype) if k in ("hidden", "table", "bias") else v)
              for k, v in make_inputs(rng, lead=(4, 16), D=64, V=V, rows=ROWS).items()}
    objective = recloss.get_strategy(strategy).objective
    # The kernels' least blocks for bfloat16 (16-row sublane packing, 128 lanes); 252-row slices leave a tail.
    opts = dict(SOFTMAX_OPTIONS if objective == "softmax" else BCE_OPTIONS, vocab_size=V, block_n=16, block_v=128)
    _, _, grads = loss_and_grads(strategy, inputs, layout, **opts)
    oracle = (softmax_oracle if objective == "softmax" else bce_oracle)(
        inputs["hidden"], inputs["table"], inputs["targets"], inputs["weights"], inputs["bias"],
        **{k: v for k, v in opts.items() if k not in ("block_v", "block_n")})
    (u, eta), n = SIXTEEN_BIT[dtype], sixteen_bit_partials(gather, layout)
    h = np.abs(np.asarray(inputs["hidden"], np.float64)).reshape(-1, inputs["hidden"].shape[-1])
    e = np.abs(np.asarray(inputs["table"], np.float64))
    into = {"table": h.sum(0)[None, :], "hidden": e.sum(0).reshape(1, 1, -1), "bias": float(h.shape[0])}
    worst = {}
    for name, g in zip(("hidden", "table", "bias"), grads):
        assert g.dtype == jnp.dtype(dtype), (name, g.dtype)
        want, scale = oracle.grads[name], oracle.grad_scale[name]
        assert np.max(np.abs(want)) > 0, name
        err = np.abs(np.asarray(g, np.float64) - want)
        bound = (n[name] + 2) * u * scale + eta * (into[name] + n[name] + 2) + 1e-5 * scale
        worst[name] = round(float(np.max(err / bound)), 3)
        bad = np.argwhere(err > bound)
        assert bad.size == 0, (name, f"{len(bad)} entries past the bound with n = {n[name]}, e.g. at "
                                     f"{tuple(bad[0])}: {err[tuple(bad[0])]:.3g} > {bound[tuple(bad[0])]:.3g}")
    print(f"{strategy} {gather} {dtype}: worst |g − g64| / bound {worst}, n {n}")
