"""cutce_pallas in Pallas interpret mode against 'cutce' (the pure-JAX plan of the same contract).

tests/test_softmax.py runs cutce_pallas through every scenario against the float64 oracle; this
file checks what is specific to the kernels: partial vocab blocks, several row chunks, the
two-TensorCore split (chip='v5p'), bf16, a traced vocab offset (including a shard with no live
column), the argmax lanes' tie-breaking, the pallas_calls and their cost estimates, and errors.
Shapes are small and odd (M not a multiple of 8, V not a multiple of 128, D=37); interpret mode is
slow, so every case is a handful of kernel calls.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recloss
from helpers import assert_close, pallas_calls
from oracle import softmax_oracle
from recloss.pallas import grid, strategy as pallas_strategy, tiling
from recloss import sweep
from recloss.shard import VocabShard
from recloss.softmax import cut, kernel, partition
from recloss.softmax.strategies import CutCEPallas

# `stack` (docs/development.md): the Pallas API and its interpreter change between jax versions
# (recloss/_compat.py absorbs the renames); the newest-stack leg runs this module.
pytestmark = [pytest.mark.tier1, pytest.mark.stack, pytest.mark.filterwarnings("ignore:strategy 'cutce_pallas' is running")]


# ----------------------------------------------------------------------------- helpers
def _arrays(rng, m, v, d, dtype=jnp.float32, bias=True):
    a = jnp.asarray(rng.normal(size=(m, d)), dtype)
    e = jnp.asarray(rng.normal(size=(v, d)) / np.sqrt(d) * 2, dtype)
    b = jnp.asarray(rng.normal(size=(v,)), dtype) if bias else None
    return a, e, b


def _plans(m, v, opts, *, vocab_size, offset, chip=None):
    static = offset if isinstance(offset, int) else None
    k = sweep.Plan(kernel.SWEEPS, "lse", opts, vocab_size, static, chip=tiling.get_chip(chip), interpret=True)
    c = sweep.Plan(cut.SWEEPS, "lse", opts, vocab_size, static,
                   blocks=sweep.blocks(m, v, block_v=opts.block_v, block_n=opts.block_n, vocab_size=vocab_size,
                                       static_offset=static))
    return k, c


def _both_sweeps(plan, a, e, b, r, offset):
    """(lse, aux, dA, dE, db) of a plan's 'loss' then 'grad' sweeps, under jit."""
    def f(a, e, b, r, offset):
        lse, aux, *_ = plan.sweep("loss", a, e, b, None, offset)
        _, _, da, de, db = plan.sweep("grad", a, e, b, r, offset, fwd=lse)
        return lse, aux, da, de, db
    return jax.jit(f)(a, e, b, r, offset)


def _close(x, y, rtol=2e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)


def _compare_plans(rng, m, v, d, opts, *, vocab_size=None, offset=0, chip=None, bias=True):
    vocab_size = vocab_size or v
    a, e, b = _arrays(rng, m, v, d, bias=bias)
    r = jnp.asarray(rng.normal(size=(m,)), jnp.float32)
    kp, cp = _plans(m, v, opts, vocab_size=vocab_size, offset=offset, chip=chip)
    off = offset if isinstance(offset, int) else jnp.int32(offset)
    got = _both_sweeps(kp, a, e, b, r, off)
    want = _both_sweeps(cp, a, e, b, r, off)
    lse, aux, da, de, db = got
    _close(lse, want[0])
    if opts.compute_metrics:
        _close(aux[0], want[1][0], 1e-6, 1e-6)
        np.testing.assert_array_equal(np.asarray(aux[1]), np.asarray(want[1][1]))
    else:
        assert aux is None
    for x, y in zip((da, de, db), want[2:]):
        if y is None:
            assert x is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape
        _close(x, y, 2e-5, 1e-6 * max(1.0, float(jnp.max(jnp.abs(y)))))
    return got, (a, e, b, r)


def _strategy_vs_cutce(s, rng, lead, v, d, *, dtype=jnp.float32, rtol=2e-5, atol=1e-6, cot=False):
    h = jnp.asarray(rng.normal(size=lead + (d,)), dtype)
    e = jnp.asarray(rng.normal(size=(v, d)) / np.sqrt(d), dtype)
    b = jnp.asarray(rng.normal(size=(v,)), dtype)
    t = jnp.asarray(rng.integers(-1, v, size=lead + (4,)), jnp.int32)
    ct = jnp.asarray(rng.normal(size=lead), jnp.float32) if cot else None
    ref = recloss.get_strategy("cutce", s.options)

    def run(strategy):
        def f(h, e, b):
            out = strategy(h, e, t, None, b)
            return (jnp.sum(out.loss * ct) if cot else out.loss), out
        (_, out), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(h, e, b)
        return out, g

    (o1, g1), (o2, g2) = run(s), run(ref)
    _close(o1.loss, o2.loss, rtol, atol)
    assert o1.metrics.keys() == o2.metrics.keys()
    for k in o1.metrics:
        _close(o1.metrics[k], o2.metrics[k], 1e-5, 1e-5)
    for x, y in zip(g1, g2):
        assert x.dtype == y.dtype == dtype and x.shape == y.shape
        _close(x, y, rtol, atol * max(1.0, float(jnp.max(jnp.abs(y.astype(jnp.float32))))))
    return o1, g1


# ----------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("metrics", [True, False])
def test_partial_blocks_and_row_chunks_match_cutce(rng, metrics):
    # block_n=8 over 30 rows → 4 row chunks (dE accumulated in HBM); block_v=128 over 300
    # columns → 3 blocks, the last partial; columns ≥ 263 are padding; τ = 0.5.
    opts = recloss.LossOptions(block_n=8, block_v=128, temperature=0.5, compute_metrics=metrics)
    for mode in (("softmax", "loss"), ("softmax", "grad")):
        t = tiling.choose(mode, 30, 300, 37, jnp.float32, jnp.float32, opts, bias=True,
                          chip=tiling.get_chip())
        assert (t.num_chunks, t.bv, -(-300 // t.bv)) == (4, 128, 3)
    (_, _, _, de, db), _ = _compare_plans(rng, 30, 300, 37, opts, vocab_size=263)
    assert not np.any(np.asarray(de[263:])) and not np.any(np.asarray(db[263:]))


def _chunk_scans(jaxpr):
    """(length, unroll) of every scan in a jaxpr (nested ones included) whose body calls a kernel."""
    found = []
    for eqn in jaxpr.eqns:
        inner = [p for p in eqn.params.values() if hasattr(getattr(p, "jaxpr", None), "eqns")]
        inner += [p for p in eqn.params.values() if hasattr(p, "eqns")]
        for p in inner:
            body = getattr(p, "jaxpr", p)
            if eqn.primitive.name == "scan" and pallas_calls(body):
                found.append((eqn.params["length"], eqn.params["unroll"]))
            found += _chunk_scans(body)
    return found


@pytest.mark.parametrize("m, chunks", [(30, 4), (75, 10)])
def test_many_row_chunks_stay_a_loop(rng, m, chunks):
    # Up to MAX_UNROLLED_CHUNKS (8) row chunks the scan is unrolled; past it a loop (compiling 128
    # unrolled chunks of a D = 4,096 sweep took minutes). Same numbers either way.
    opts = recloss.LossOptions(block_n=8, block_v=128)
    t = tiling.choose(("softmax", "grad"), m, 300, 37, jnp.float32, jnp.float32, opts, bias=True,
                      chip=tiling.get_chip())
    assert t.num_chunks == chunks
    _compare_plans(rng, m, 300, 37, opts, vocab_size=290)
    kp, _ = _plans(m, 300, opts, vocab_size=290, offset=0)
    a, e, b = _arrays(rng, m, 300, 37)
    r = jnp.asarray(rng.normal(size=(m,)), jnp.float32)

    def f(a, e, b, r):
        lse, *_ = kp.sweep("loss", a, e, b, None, 0)
        return kp.sweep("grad", a, e, b, r, 0, fwd=lse)
    scans = _chunk_scans(jax.make_jaxpr(f)(a, e, b, r).jaxpr)
    assert scans and all(n == chunks for n, _ in scans), scans
    assert all(u == (chunks if chunks <= grid.MAX_UNROLLED_CHUNKS else 1) for _, u in scans), scans


def test_one_resident_tile_no_bias(rng):
    # Automatic sizes: all 13 rows in one tile, one block wider than V (a partial block larger
    # than the array), D=37 padded to 128, no bias.
    _compare_plans(rng, 13, 200, 37, recloss.LossOptions(), bias=False)


@pytest.mark.parametrize("block_n", [None, 8])
def test_two_core_split(rng, block_n):
    # chip='v5p' selects the leading 2-core grid axis; 3 vocab blocks split 2 + 1 (the second
    # core's last step has no block), with and without row chunks; the lanes of both cores are
    # combined outside the kernel (max, rescaled sums, first argmax).
    opts = recloss.LossOptions(block_v=128, block_n=block_n, reduction="sum")
    t = tiling.choose(("softmax", "loss"), 21, 300, 40, jnp.float32, jnp.float32, opts, bias=True,
                      chip=tiling.get_chip("v5p"))
    assert t.cores == 2 and (t.num_chunks > 1) == (block_n is not None)
    _compare_plans(rng, 21, 300, 40, opts, chip="v5p", vocab_size=290)
    _strategy_vs_cutce(CutCEPallas(opts, chip="v5p"), rng, (21,), 300, 40)


def test_argmax_ties_go_to_the_smallest_id(rng):
    # One direction w repeated at columns 12 (block 0, lane 12), 140 (block 1, lane 12) and 263
    # (block 2, lane 7; the other core on v5p): every row's maximum is tied three ways.
    m, v, d = 11, 300, 40
    a, e, _ = _arrays(rng, m, v, d, bias=False)
    w = rng.normal(size=(d,))
    w = 4 * w / np.linalg.norm(w)
    e = np.asarray(e).copy()
    for c in (12, 140, 263):
        e[c] = w
    e = jnp.asarray(e, jnp.float32)
    a = jnp.asarray(np.asarray(a) * 0.1 + w[None, :], jnp.float32)
    for chip, offset in ((None, 0), ("v5p", 0), ("v5p", 1000)):
        opts = recloss.LossOptions(block_v=128, block_n=8)
        kp, _ = _plans(m, v, opts, vocab_size=2000, offset=offset, chip=chip)
        lse, (top, ids), *_ = jax.jit(lambda a, e: kp.sweep("loss", a, e, None, None, offset))(a, e)
        x = np.asarray(a, np.float64) @ np.asarray(e, np.float64).T
        assert np.all(np.argmax(x, axis=1) == 12)
        np.testing.assert_array_equal(np.asarray(ids), 12 + offset)
        _close(top, x.max(axis=1), 1e-5, 1e-5)


def test_bf16(rng):
    # 2 row chunks of 16 rows: dE accumulated in f32 across chunks, cast once; bf16 gradients.
    s = recloss.get_strategy("cutce_pallas", block_v=128, block_n=16)
    _strategy_vs_cutce(s, rng, (21,), 300, 48, dtype=jnp.bfloat16, rtol=2e-2, atol=2e-2)
    # One chunk: dE written in bf16 from the f32 VMEM accumulator.
    s = recloss.get_strategy("cutce_pallas", block_v=128)
    _strategy_vs_cutce(s, rng, (2, 7), 300, 48, dtype=jnp.bfloat16, rtol=2e-2, atol=2e-2)


def test_traced_vocab_offset_under_jit(rng):
    # A vocab shard owning global ids [offset, offset + 200) of a V=450 vocabulary, the offset a
    # traced jit argument (as axis_index·V_local inside shard_map): fully inside, straddling
    # vocab_size (columns ≥ 150 dead), and entirely past it (no live column: lse = −inf, zero
    # gradients, no NaN).
    m, v_local, d, vocab_size = 19, 200, 37, 450
    opts = recloss.LossOptions(block_v=128)
    for offset in (0, 300, 450):
        (lse, aux, da, de, db), (a, e, b, r) = _compare_plans(
            rng, m, v_local, d, opts, vocab_size=vocab_size, offset=jnp.int32(offset))
        live = min(v_local, max(0, vocab_size - offset))
        x = np.asarray(a, np.float64) @ np.asarray(e, np.float64).T + np.asarray(b, np.float64)[None]
        if live:
            top = x[:, :live].max(axis=1)
            _close(lse, top + np.log(np.exp(x[:, :live] - top[:, None]).sum(axis=1)), 1e-5, 1e-5)
            np.testing.assert_array_equal(np.asarray(aux[1]), np.argmax(x[:, :live], axis=1) + offset)
        else:
            assert np.all(np.isneginf(np.asarray(lse)))
            assert np.all(np.asarray(aux[0]) == partition.NEG)
        for g in (da, de, db):
            assert np.all(np.isfinite(np.asarray(g)))
        assert not np.any(np.asarray(de[live:])) and not np.any(np.asarray(db[live:]))
        if not live:
            assert not np.any(np.asarray(da))


def test_reduction_none_random_cotangent_all_options(rng):
    s = recloss.get_strategy("cutce_pallas", reduction="none", block_v=128, block_n=8,
                             label_smoothing=0.1, z_loss=1e-2, temperature=0.7, vocab_size=270)
    out, _ = _strategy_vs_cutce(s, rng, (2, 7), 300, 37, cot=True)
    assert out.loss.shape == (2, 7)


@pytest.mark.parametrize("chip,block_n", [(None, 8), ("v5p", 8), ("v5p", None)])
def test_logit_soft_cap_in_the_kernels_against_the_oracle(rng, chip, block_n):
    # The grid caps each sub-tile's logits (before τ) in both kernels and multiplies the recompute's
    # G by the slope: 30 rows in 4 row chunks or one tile, 3 vocab blocks (the last partial), columns
    # >= 263 dead, on v5p the 2-core split; logits ≈ N(0, 9) against a cap of 1.5.
    opts = dict(block_n=block_n, block_v=128, vocab_size=263, logit_soft_cap=1.5, temperature=0.7, z_loss=1e-2)
    _compare_plans(rng, 30, 300, 37, recloss.LossOptions(**opts), vocab_size=263, chip=chip)
    h = jnp.asarray(rng.normal(size=(30, 37)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(300, 37)) * (3.0 / np.sqrt(37)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(300,)), jnp.float32)
    t = jnp.asarray(rng.integers(-1, 300, size=(30, 4)), jnp.int32).at[:, 1].set(7)   # 7: a repeated target
    s = CutCEPallas(recloss.LossOptions(**opts), chip=chip)

    def f(h, e, b):
        out = s(h, e, t, None, b)
        return out.loss, out
    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(h, e, b)
    ref = softmax_oracle(h, e, t, None, b, **opts)
    assert_close(out.loss, ref.loss, 1e-5, "loss")
    for name, g in zip(("hidden", "table", "bias"), grads):
        assert_close(g, ref.grads[name], 1e-4, f"d/d{name}")
    np.testing.assert_allclose(float(out.metrics["mean_lse"]), ref.metrics["mean_lse"], rtol=1e-5)
    assert not np.any(np.asarray(grads[1][263:])) and not np.any(np.asarray(grads[2][263:]))


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="the race detector runs the CPU interpreter")
def test_detect_races_two_cores(rng):
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    if not hasattr(pltpu, "InterpretParams"):
        pytest.skip("this jax has no pltpu.InterpretParams")
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
    # V a multiple of block_v: jax 0.10.2's TPU interpreter returns the padded buffer for an
    # aliased output with a partial last block (a verifier error); see tests/test_bce_pallas.py.
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    s = CutCEPallas(recloss.LossOptions(block_v=128, block_n=8), chip="v5p", interpret_params=params)
    _strategy_vs_cutce(s, rng, (20,), 384, 37)
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found


def test_empty_rows_fall_back_to_cutce():
    s = recloss.get_strategy("cutce_pallas")
    h, e = jnp.zeros((0, 8), jnp.float32), jnp.ones((50, 8), jnp.float32)
    out = s(h, e, jnp.zeros((0, 2), jnp.int32))
    assert float(out.loss) == 0.0
    shard = VocabShard.whole(e, None, vocab_size=50, platform="cpu")
    plan = s.plan(0, shard)
    assert plan.sweeps is cut.SWEEPS     # no rows: the pure-JAX sweep, which gives the empty sums
    assert sweep.sweep_rows(h, shard, plan)[0].shape == (0,)


# ----------------------------------------------------------------------------- structure
def test_loss_sweep_then_recompute_sweep(rng):
    h = jnp.asarray(rng.normal(size=(9, 16)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(200, 16)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(200,)), jnp.float32)
    t = jnp.asarray(rng.integers(0, 200, size=(9, 3)), jnp.int32)
    f = lambda h, e, b: recloss.softmax_loss(h, e, t, bias=b, strategy="cutce_pallas").loss
    [(name, cost)] = pallas_calls(jax.make_jaxpr(f)(h, e, b).jaxpr)
    # 2·M·V·D with M rounded to the row tile (16 rows) and D padded to 128 lanes; one exp per logit.
    assert name == "cutce_loss" and cost.flops == 2 * 16 * 200 * 128 and cost.transcendentals == 16 * 200
    grad = jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1, 2)))(h, e, b)
    calls = pallas_calls(grad.jaxpr)
    assert [n for n, _ in calls] == ["cutce_loss", "cutce_grad"]
    assert calls[1][1].flops == 6 * 16 * 200 * 128     # the logits again, dA and dE


# ----------------------------------------------------------------------------- errors, platforms
def test_bad_block_sizes_name_the_strategy():
    args = (jax.ShapeDtypeStruct((12, 40), jnp.float32), jax.ShapeDtypeStruct((300, 40), jnp.float32),
            jax.ShapeDtypeStruct((12, 3), jnp.int32))
    trace = lambda s: jax.eval_shape(lambda h, e, t: s(h, e, t).loss, *args)
    with pytest.raises(ValueError, match=r"block_v=100 is invalid for cutce_pallas.*multiple of 128"):
        trace(recloss.get_strategy("cutce_pallas", block_v=100))
    with pytest.raises(ValueError, match=r"block_n=12 is invalid for cutce_pallas.*multiple of 8 rows"):
        trace(recloss.get_strategy("cutce_pallas", block_n=12))
    trace(recloss.get_strategy("cutce_pallas", block_n=16, block_v=256))   # valid: no error


def test_gpu_is_rejected_naming_cutce():
    s = recloss.get_strategy("cutce_pallas")
    assert s.objective == "softmax" and s.entry_point == "recloss.softmax_loss"
    assert not s.supported_on("gpu") and s.supported_on("tpu") and s.supported_on("cpu")
    with pytest.raises(ValueError, match=r"cutce_pallas.*'gpu'.*strategy='cutce'"):
        s.check_platform("gpu")
    with pytest.raises(ValueError, match="unknown TPU chip 'v9'"):
        CutCEPallas(recloss.LossOptions(), chip="v9")
    with pytest.raises(ValueError, match="pos_weight"):
        recloss.get_strategy("cutce_pallas", pos_weight=2.0)


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="the warning is for interpret mode off TPU")
def test_interpret_warning_once_per_strategy(rng, monkeypatch):
    monkeypatch.setattr(pallas_strategy, "_warned", set())
    h = jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(130, 8)), jnp.float32)
    t = jnp.asarray(rng.integers(0, 130, size=(5, 2)), jnp.int32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            jax.eval_shape(lambda h, e: recloss.softmax_loss(h, e, t, strategy="cutce_pallas").loss, h, e)
        jax.eval_shape(lambda h, e: recloss.bce_loss(h, e, t, strategy="cutbce_pallas").loss, h, e)
    msgs = [str(w.message) for w in seen if "interpret mode" in str(w.message)]
    assert all(issubclass(w.category, RuntimeWarning) for w in seen if "interpret mode" in str(w.message))
    assert len(msgs) == 2, msgs
    assert msgs[0].startswith("strategy 'cutce_pallas' is running its Pallas kernel in interpret mode")
    assert "strategy='cutce'" in msgs[0] and "strategy='cutbce'" in msgs[1]
    assert recloss.get_strategy("cutce_pallas").interpret("cpu")
    assert not recloss.get_strategy("cutce_pallas").interpret("tpu")
    assert not recloss.get_strategy("cutce_pallas", interpret=False).interpret("cpu")
