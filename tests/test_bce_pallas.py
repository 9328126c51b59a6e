"""cutbce_pallas in Pallas interpret mode against 'cutbce' and a float64 NumPy oracle.

Shapes are small and odd (M not a multiple of 8, V not a multiple of 128,
D=37) so that padded rows, partial vocab blocks and padded D are exercised;
interpret mode is slow, so every case is a handful of kernel calls.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recloss
from recloss import sweep
from helpers import assert_close, pallas_calls
from oracle import bce_oracle, pq_terms, sigmoid_pair
from recloss.pallas import strategy as pallas_strategy
from recloss.bce.strategies import CutBCEPallas
from recloss.pallas import tiling
from recloss.shard import VocabShard

# `stack` (docs/development.md): the Pallas API and its interpreter change between jax versions
# (recloss/_compat.py absorbs the renames); the newest-stack leg runs this module.
pytestmark = [pytest.mark.tier1, pytest.mark.stack, pytest.mark.filterwarnings("ignore:strategy 'cutbce_pallas' is running")]


# ----------------------------------------------------------------------------- helpers
def _inputs(rng, lead, v, d, *, l=4, dtype=jnp.float32, bias=True, weights=False):
    hidden = rng.normal(size=lead + (d,)).astype(np.float32)
    table = (rng.normal(size=(v, d)) / np.sqrt(d)).astype(np.float32)
    targets = rng.integers(-1, v, size=lead + (l,)).astype(np.int32)
    targets[..., 1] = targets[..., 0]               # a duplicate in every position
    b = rng.normal(size=(v,)).astype(np.float32) if bias else None
    w = rng.uniform(0.2, 2.0, size=lead).astype(np.float32) if weights else None
    cast = lambda x: None if x is None else jnp.asarray(x, dtype)
    return cast(hidden), cast(table), jnp.asarray(targets), (None if w is None else jnp.asarray(w)), cast(b)


def _softplus(x):
    return np.logaddexp(0.0, x)


def _oracle(hidden, table, targets, weights, bias, vocab_size=None):
    """Default-options loss and gradients (dA, dE, db) in float64 NumPy, dense."""
    a = np.asarray(hidden, np.float64).reshape(-1, hidden.shape[-1])
    e = np.asarray(table, np.float64)
    v_rows = e.shape[0]
    v = vocab_size or v_rows
    t = np.asarray(targets).reshape(a.shape[0], -1)
    w = np.ones(a.shape[0]) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    x = a @ e.T + (0.0 if bias is None else np.asarray(bias, np.float64)[None, :])
    y = np.zeros_like(x)
    for i, row in enumerate(t):
        for tid in row:
            if 0 <= tid < v:
                y[i, tid] = 1.0
    live = (np.arange(v_rows) < v)[None, :]
    predicted = np.sum(w * np.sum(live & (x > 0), axis=-1))
    per = np.where(live, y * _softplus(-x) + (1 - y) * _softplus(x), 0.0)
    scale = w / v / w.sum()
    loss = np.sum(scale * per.sum(-1))
    g = np.where(live, 1 / (1 + np.exp(-x)) - y, 0.0) * scale[:, None]
    return loss, (g @ e).reshape(hidden.shape), g.T @ a, g.sum(0), predicted


def _loss_and_grads(strategy, hidden, table, targets, weights, bias):
    """jit(value_and_grad) of a strategy's loss w.r.t. hidden, table and (if any) bias."""
    def f(h, e, b):
        out = strategy(h, e, targets, weights, b)
        return out.loss, out.metrics
    argnums = (0, 1, 2) if bias is not None else (0, 1)
    return jax.jit(jax.value_and_grad(f, argnums=argnums, has_aux=True))(hidden, table, bias)


def _close(x, y, rtol=2e-5, atol=1e-7):
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)


def _compare_to_cutbce(strategy, hidden, table, targets, weights, bias, *, rtol=2e-5, atol=1e-7):
    ref = recloss.get_strategy("cutbce", strategy.options)
    (l1, m1), g1 = _loss_and_grads(strategy, hidden, table, targets, weights, bias)
    (l2, m2), g2 = _loss_and_grads(ref, hidden, table, targets, weights, bias)
    _close(l1, l2, rtol, atol)
    assert m1.keys() == m2.keys()
    for k in m1:     # weighted sums of identical integer counts; summation order may differ
        _close(m1[k], m2[k], 1e-6, 0)
    for a, b in zip(g1, g2):
        assert a.dtype == b.dtype and a.shape == b.shape
        _close(a, b, rtol, atol * max(1.0, float(jnp.max(jnp.abs(b.astype(jnp.float32))))))
    return (l1, m1), g1


# ----------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("bias", [True, False])
def test_matches_oracle_and_cutbce_odd_shapes(rng, bias):
    hidden, table, targets, weights, b = _inputs(rng, (3, 5), 300, 37, bias=bias, weights=True)
    s = recloss.get_strategy("cutbce_pallas")
    (loss, mets), grads = _compare_to_cutbce(s, hidden, table, targets, weights, b)
    want = _oracle(hidden, table, targets, weights, b)
    _close(loss, want[0], 1e-5)
    for got, exp in zip(grads, want[1:4]):
        _close(got, exp, 1e-4, 1e-7)
    _close(mets["tp"] + mets["fp"], want[4], 1e-6)


@pytest.mark.parametrize("m, chunks", [(30, 4), (75, 10)])
def test_multiple_blocks_row_chunks_and_vocab_size(rng, m, chunks):
    # block_n=8 over 30 rows → 4 row chunks (dE accumulated in HBM; 75 rows → 10, past
    # grid.MAX_UNROLLED_CHUNKS: a rolled loop); block_v=128 over 300 rows → 3 vocab blocks,
    # the last partial; rows ≥ 263 are padding.
    hidden, table, targets, weights, b = _inputs(rng, (m,), 300, 37, weights=True)
    s = recloss.get_strategy("cutbce_pallas", block_n=8, block_v=128, vocab_size=263)
    t = tiling.choose(("bce", "fused"), m, 300, 37, jnp.float32, jnp.float32, s.options, bias=True,
                      chip=tiling.get_chip())
    assert (t.num_chunks, t.bv, -(-300 // t.bv)) == (chunks, 128, 3)
    (loss, _), (ga, ge, gb) = _compare_to_cutbce(s, hidden, table, targets, weights, b)
    want = _oracle(hidden, table, targets, weights, b, vocab_size=263)
    _close(loss, want[0], 1e-5)
    for got, exp in zip((ga, ge, gb), want[1:4]):
        _close(got, exp, 1e-4, 1e-7)
    assert not np.any(np.asarray(ge[263:])) and not np.any(np.asarray(gb[263:]))


def test_two_core_split(rng):
    # chip='v5p' selects the leading 2-core grid axis; 3 vocab blocks split 2 + 1
    # (the second core's last step has no block), with and without row chunks.
    hidden, table, targets, weights, b = _inputs(rng, (21,), 300, 40)
    for block_n in (None, 8):
        s = CutBCEPallas(recloss.LossOptions(block_v=128, block_n=block_n, reduction="sum"), chip="v5p")
        t = tiling.choose(("bce", "fused"), 21, 300, 40, jnp.float32, jnp.float32, s.options, bias=True,
                          chip=tiling.get_chip("v5p"))
        assert t.cores == 2
        _compare_to_cutbce(s, hidden, table, targets, weights, b)


def test_traced_vocab_offset_under_jit(rng):
    # A vocab shard owning global ids [offset, offset + 200) of a V=450 vocabulary,
    # offset passed as a traced jit argument (as axis_index·V_local inside shard_map).
    m, v_local, d, vocab_size = 19, 200, 37, 450
    hidden, table, targets, _, b = _inputs(rng, (m,), v_local, d)
    r = jnp.asarray(rng.uniform(0.1, 1.0, size=(m,)), jnp.float32)
    opts = recloss.LossOptions(block_v=128)
    pallas, ref = CutBCEPallas(opts), recloss.get_strategy("cutbce", opts)

    def total(strategy, h, e, bb, rr, offset):
        shard = VocabShard(e, bb, offset, vocab_size, "cpu")
        return sweep.sweep_total(h, shard, rr, strategy.plan(h.shape[0], shard))

    for offset in (0, 300):   # shard fully inside, and straddling vocab_size (rows ≥ 150 inert)
        fn = lambda s: jax.jit(jax.value_and_grad(lambda *a: total(s, *a), argnums=(0, 1, 2, 3),
                                                  has_aux=True))
        (l1, p1), g1 = fn(pallas)(hidden, table, b, r, jnp.int32(offset))
        (l2, p2), g2 = fn(ref)(hidden, table, b, r, jnp.int32(offset))
        _close(l1, l2)
        _close(p1, p2, 0, 0)
        live = min(v_local, max(0, vocab_size - offset))
        x = np.asarray(hidden, np.float64) @ np.asarray(table, np.float64).T + np.asarray(b)[None]
        per_row = _softplus(x[:, :live]).sum(-1)                  # default ε=0: Q = softplus
        want = np.sum(np.asarray(r) * per_row)
        # Each against float64, not against each other: a chip's exp is within 8e-6 relative (helpers), so
        # the two float32 sweeps can differ entry-wise by more than either differs from the truth in norm.
        sg = np.where(np.arange(v_local)[None, :] < live, sigmoid_pair(x)[0], 0.0) * np.asarray(r)[:, None]
        want_g = (sg @ np.asarray(table, np.float64), sg.T @ np.asarray(hidden, np.float64), sg.sum(0), per_row)
        for name, g in (("cutbce_pallas", g1), ("cutbce", g2)):
            for what, got, truth in zip(("dhidden", "dtable", "dbias", "dweights"), g, want_g):
                assert_close(got, truth, 2e-5, f"{name} {what} at offset {offset}")
        _close(l1, want, 1e-5)
        _close(p1, (x[:, :live] > 0).sum(-1), 0, 0)
        if live < v_local:
            assert not np.any(np.asarray(g1[1][live:])) and not np.any(np.asarray(g1[2][live:]))


def test_reduction_none_random_cotangent(rng):
    hidden, table, targets, weights, b = _inputs(rng, (2, 7), 300, 37, weights=True)
    ct = jnp.asarray(rng.normal(size=(2, 7)), jnp.float32)
    s = recloss.get_strategy("cutbce_pallas", reduction="none", block_v=128)
    ref = recloss.get_strategy("cutbce", reduction="none", block_v=128)

    def vjp(strategy):
        f = lambda h, e, bb: strategy(h, e, targets, weights, bb).loss
        out, pull = jax.vjp(f, hidden, table, b)
        return out, pull(ct)

    out1, g1 = jax.jit(lambda: vjp(s))()
    out2, g2 = jax.jit(lambda: vjp(ref))()
    assert out1.shape == (2, 7)
    _close(out1, out2)
    for x, y in zip(g1, g2):
        _close(x, y, 2e-5, 1e-6)


def test_all_options(rng):
    hidden, table, targets, weights, b = _inputs(rng, (11,), 260, 24, weights=True)
    opts = dict(label_smoothing=0.1, pos_weight=2.5, focal_gamma=1.5, focal_alpha=0.3,
                vocab_reduction="sum", reduction="sum", threshold=0.25, block_v=128)
    s = recloss.get_strategy("cutbce_pallas", **opts)
    _compare_to_cutbce(s, hidden, table, targets, weights, b, rtol=5e-5, atol=1e-6)
    s = recloss.get_strategy("cutbce_pallas", **opts, compute_metrics=False)
    (_, mets), _ = _compare_to_cutbce(s, hidden, table, targets, weights, b, rtol=5e-5, atol=1e-6)
    assert "tp" not in mets


def test_bf16(rng):
    hidden, table, targets, weights, b = _inputs(rng, (21,), 300, 48, dtype=jnp.bfloat16)
    s = recloss.get_strategy("cutbce_pallas", block_v=128, block_n=16)   # 2 row chunks of 16
    (l1, _), g1 = _loss_and_grads(s, hidden, table, targets, weights, b)
    (l2, _), g2 = _loss_and_grads(recloss.get_strategy("cutbce"), hidden, table, targets, weights, b)
    want = _oracle(hidden.astype(jnp.float32), table.astype(jnp.float32), targets, None,
                   b.astype(jnp.float32))
    _close(l1, l2, 1e-5)
    _close(l1, want[0], 1e-5)
    for x, y, z in zip(g1, g2, want[1:4]):
        assert x.dtype == jnp.bfloat16
        scale = float(np.max(np.abs(z)))
        _close(x, y, 0, 2e-2 * scale)
        _close(x, z, 0, 2e-2 * scale)


@pytest.mark.parametrize("chip,block_n", [(None, 8), ("v5p", 8), ("v5p", None)])
def test_logit_soft_cap_in_the_kernel_against_the_oracle(rng, chip, block_n):
    # The grid caps each sub-tile's logits and multiplies Step.grad's G by the slope: 30 rows in 4
    # row chunks (dE accumulated in HBM) or one tile, 3 vocab blocks (the last partial), rows
    # >= 263 inert, and on v5p the 2-core split; logits ≈ N(0, 9) against a cap of 1.5.
    hidden, table, targets, weights, b = _inputs(rng, (30,), 300, 37, weights=True)
    table = table * 3.0
    opts = dict(block_n=block_n, block_v=128, vocab_size=263, logit_soft_cap=1.5, label_smoothing=0.1,
                threshold=0.5, pos_weight=2.0)
    s = CutBCEPallas(recloss.LossOptions(**opts), chip=chip)
    (loss, mets), grads = _compare_to_cutbce(s, hidden, table, targets, weights, b)
    ref = bce_oracle(hidden, table, targets, weights, b, **opts)
    assert_close(loss, ref.loss, 1e-5, "loss")
    for name, g in zip(("hidden", "table", "bias"), grads):
        assert_close(g, ref.grads[name], 1e-4, f"d/d{name}")
    assert abs(float(mets["tp"]) - ref.metrics["tp"]) <= ref.metric_slack + 1e-5 * ref.metrics["tp"]
    assert not np.any(np.asarray(grads[1][263:])) and not np.any(np.asarray(grads[2][263:]))


def test_logit_soft_cap_costs_one_tanh_per_logit(rng):
    hidden, table, targets, _, b = _inputs(rng, (9,), 200, 16)

    def cost(**opts):
        s = recloss.get_strategy("cutbce_pallas", **opts)
        f = lambda h, e, bb: s(h, e, targets, None, bb).loss
        [(_, c)] = pallas_calls(jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1, 2)))(hidden, table, b).jaxpr)
        return c

    plain, capped = cost(), cost(logit_soft_cap=30.0)
    assert capped.flops == plain.flops and capped.transcendentals == plain.transcendentals + 16 * 200


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="the race detector runs the CPU interpreter")
def test_detect_races_two_cores(rng):
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    if not hasattr(pltpu, "InterpretParams"):
        pytest.skip("this jax has no pltpu.InterpretParams")
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
    # V a multiple of block_v: jax 0.10.2's TPU interpreter returns the padded
    # buffer for an aliased output with a partial last block (a verifier error).
    hidden, table, targets, weights, b = _inputs(rng, (20,), 384, 37)
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    s = CutBCEPallas(recloss.LossOptions(block_v=128, block_n=8), chip="v5p", interpret_params=params)
    _compare_to_cutbce(s, hidden, table, targets, weights, b)
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found


# ----------------------------------------------------------------------------- structure

def _pallas_names(jaxpr):
    return [name for name, _ in pallas_calls(jaxpr)]


def test_one_fused_sweep_for_loss_and_grad(rng):
    hidden, table, targets, _, b = _inputs(rng, (9,), 200, 16)
    s = recloss.get_strategy("cutbce_pallas")
    f = lambda h, e, bb: s(h, e, targets, None, bb).loss
    assert _pallas_names(jax.make_jaxpr(f)(hidden, table, b).jaxpr) == ["cutbce_loss"]
    grad = jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1, 2)))(hidden, table, b)
    [(name, cost)] = pallas_calls(grad.jaxpr)
    assert name == "cutbce_fused"
    # 6·M·V·D with M rounded to the row tile (16 rows) and D padded to 128 lanes; the term's
    # transcendentals a logit: exp, the reciprocal, and the log (and its Newton step's exp) once per 128
    # lanes of a 256-column block.
    from recloss.bce.bernoulli import Bernoulli
    per_logit = Bernoulli.background(recloss.LossOptions()).transcendentals(value=True, grad=True, bv=256)
    assert per_logit == 3.0
    assert cost.flops == 6 * 16 * 200 * 128 and cost.transcendentals == int(per_logit * 16 * 200)
    s = recloss.get_strategy("cutbce_pallas", reduction="none")
    g = lambda h, e, bb: jnp.sum(s(h, e, targets, None, bb).loss ** 2)
    rows = jax.make_jaxpr(jax.grad(g, argnums=(0, 1, 2)))(hidden, table, b)
    assert _pallas_names(rows.jaxpr) == ["cutbce_loss", "cutbce_grad"]


# ----------------------------------------------------------------------------- errors, platforms
def _trace(strategy, m=12, v=300, d=40, dtype=jnp.float32):
    args = (jax.ShapeDtypeStruct((m, d), dtype), jax.ShapeDtypeStruct((v, d), dtype),
            jax.ShapeDtypeStruct((m, 3), jnp.int32))
    return jax.eval_shape(lambda h, e, t: strategy(h, e, t).loss, *args)


def test_bad_block_sizes_are_rejected():
    with pytest.raises(ValueError, match=r"block_v=100 .*multiple of 128.*VMEM budget"):
        _trace(recloss.get_strategy("cutbce_pallas", block_v=100))
    with pytest.raises(ValueError, match=r"block_n=12 .*bfloat16.*multiple of 16 rows.*VMEM budget"):
        _trace(recloss.get_strategy("cutbce_pallas", block_n=12), dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"block_n=12 .*float32.*multiple of 8 rows"):
        _trace(recloss.get_strategy("cutbce_pallas", block_n=12))
    # 16 MiB of VMEM per core on v4: 8192 resident rows of D=1024 cannot fit.
    with pytest.raises(ValueError, match=r"block_n=8192, block_v=2048 need about .* MiB.*over the VMEM "
                                         r"budget of .* on chip 'v4'"):
        _trace(CutBCEPallas(recloss.LossOptions(block_n=8192, block_v=2048), chip="v4"),
               m=8192, v=4096, d=1024)
    with pytest.raises(ValueError, match=r"LossOptions.block_v=65536 and 128-row tiles within the VMEM "
                                         r"budget of 9.6 MiB .* on chip 'v4'"):
        _trace(CutBCEPallas(recloss.LossOptions(block_v=65536), chip="v4"), m=1024, v=70000, d=256)
    _trace(recloss.get_strategy("cutbce_pallas", block_n=16, block_v=256))   # valid: no error


def test_gpu_is_rejected_naming_cutbce():
    s = recloss.get_strategy("cutbce_pallas")
    assert not s.supported_on("gpu") and s.supported_on("tpu") and s.supported_on("cpu")
    with pytest.raises(ValueError, match="cutbce_pallas.*'gpu'.*strategy='cutbce'"):
        s.check_platform("gpu")
    with pytest.raises(ValueError, match="unknown TPU chip 'v9'"):
        CutBCEPallas(recloss.LossOptions(), chip="v9")


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="the warning is for interpret mode off TPU")
def test_interpret_warning_once(rng, monkeypatch):
    monkeypatch.setattr(pallas_strategy, "_warned", set())
    hidden, table, targets, _, _ = _inputs(rng, (5,), 130, 8, bias=False)
    s = recloss.get_strategy("cutbce_pallas")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            jax.eval_shape(lambda h, e: s(h, e, targets).loss, hidden, table)
    msgs = [w for w in seen if "interpret mode" in str(w.message)]
    assert len(msgs) == 1 and issubclass(msgs[0].category, RuntimeWarning)
    assert recloss.get_strategy("cutbce_pallas").interpret("cpu")
    assert not recloss.get_strategy("cutbce_pallas").interpret("tpu")
    assert not recloss.get_strategy("cutbce_pallas", interpret=False).interpret("cpu")



# ----------------------------------------------------------------------------- the term at a tile
@pytest.mark.parametrize("opts", [dict(), dict(label_smoothing=0.2, pos_weight=3.0), dict(focal_gamma=1.5)],
                         ids=["plain", "smoothed", "focal"])
def test_the_terms_tile_is_its_value_and_gradient(opts, rng):
    """`Bernoulli.tile` (the kernels' least work: one exp, a refined approximate reciprocal, a log a lane)
    against `Bernoulli.value_and_grad` summed by lane: logits from -30 to 30 and exact zeros, the last
    columns dead (x = NaN there, as a partial block's unspecified memory can be)."""
    from recloss.bce.bernoulli import Bernoulli
    term = Bernoulli.background(recloss.LossOptions(**opts))
    x = rng.uniform(-30, 30, size=(16, 512)).astype(np.float32)
    x[:, ::7] = 0.0
    live = np.arange(512)[None, :] < 450
    # float64 truth, the oracle's k_p·P + k_q·Q and its derivative (not the float32 `value_and_grad`, whose
    # log1p on a v5e is ~1e-4 off at these lane sums where the tile's Newton-refined log is ~1e-5).
    kp, kq = term.kp, term.kq
    p, q, dp, dq = pq_terms(x.astype(np.float64), focal_gamma=term.gamma)
    want_lanes = np.where(live, kp * p + kq * q, 0.0).reshape(16, 4, 128).sum(1)
    want_g = (kp * dp + kq * dq)[:, :450]
    tpu = jax.default_backend() == "tpu"
    x[:, 450:] = np.nan
    out = jax.jit(lambda x: term.tile(x, jnp.asarray(live), value=True, grad=True, newton=2))(jnp.asarray(x))
    # on a chip: the tile's Newton-refined log ~1e-5 off; with γ ≠ 0 XLA's log1p there, ~6e-5 at these sums
    lanes_atol = (3e-5 if term.gamma == 0.0 else 1.5e-4) if tpu else 1e-5
    np.testing.assert_allclose(np.asarray(out.lanes), want_lanes, rtol=2e-6, atol=lanes_atol)
    g = np.asarray(out.dval)[:, :450]
    # a few float32 ulps of the term's scale; a chip's exp is within 8e-6 relative, and with γ ≠ 0 XLA's
    # focal chain there (powers as exp of softplus) was 8e-5 off
    g_tol = (8e-6 if term.gamma == 0.0 else 2e-4) if tpu else 1e-6
    np.testing.assert_allclose(g, want_g, rtol=g_tol, atol=(g_tol if tpu else 3e-7) * (kp + kq))
    if out.clean:
        assert np.all(np.asarray(out.dval)[:, 450:] == 0.0)


@pytest.mark.tier1
def test_sigma_takes_one_newton_step_only_where_its_gradient_is_rounded_to_16_bits():
    """`newton_steps`: one step (2⁻¹⁶) only where G reaches the MXU in 16 bits and no bias sums it in
    float32: 16-bit operands, or float32 at DEFAULT precision on a chip; the interpreter's float32
    products are exact, and 'highest' keeps float32, so both take two."""
    from recloss.bce.kernel import newton_steps
    bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
    assert newton_steps(bf16, bf16, bias=False, interpret=False) == 1
    assert newton_steps(bf16, bf16, bias=False, interpret=True) == 1
    assert newton_steps(bf16, bf16, bias=True, interpret=False) == 2
    assert newton_steps(f32, bf16, bias=False, interpret=True) == 2        # promoted to float32: exact here
    with jax.default_matmul_precision("highest"):
        assert newton_steps(f32, f32, bias=False, interpret=False) == 2
        assert newton_steps(f16, f16, bias=False, interpret=False) == 2    # widened to float32 at the edge
    with jax.default_matmul_precision("default"):
        assert newton_steps(f32, f32, bias=False, interpret=False) == 1
        assert newton_steps(f32, f32, bias=False, interpret=True) == 2
        assert newton_steps(f32, f32, bias=True, interpret=False) == 2


@pytest.mark.tier1
@pytest.mark.parametrize("live_cols", [1, 3, 512], ids=["lone", "three", "all"])
def test_the_terms_tile_keeps_small_terms_to_float32_relative(live_cols, rng):
    """Every logit well below 0 (a trained model's background: e = exp(x) from 1e-11 to 0.05): each lane's
    log Π(1 + e) ≈ Σ e must stay within float32 of the float64 truth in relative terms, where 1 + e itself
    keeps e only to 2⁻²⁴ absolute (a lone logit at −10.4, V = 1, was 1e-3 off when the tile took log(Π(1 + e)))."""
    from recloss.bce.bernoulli import Bernoulli
    term = Bernoulli.background(recloss.LossOptions())
    x = rng.uniform(-25, -3, size=(16, 512)).astype(np.float32)
    live = np.arange(512)[None, :] < live_cols
    p, q, _, _ = pq_terms(x.astype(np.float64), focal_gamma=0.0)
    want = np.where(live, term.kp * p + term.kq * q, 0.0).reshape(16, 4, 128).sum(1)
    out = jax.jit(lambda x: term.tile(x, jnp.asarray(live), value=True, grad=False))(jnp.asarray(x))
    got = np.asarray(out.lanes)
    # A lane whose q is below 2⁻⁴ takes a series, exact float32 operations on e: a few ulps off a chip, on
    # one the chip's exp error (8e-6 relative). One above it takes a Newton step on its log,
    # y + (Π·exp(−y) − 1), whose residual carries exp's relative error into y as an absolute one: ~1e-7
    # off a chip, up to 8e-6 on one (2.8e-6 measured on a v5e: 3.2e-5 relative at y = 0.086).
    tpu = jax.default_backend() == "tpu"
    series = np.expm1(want) < 2.0 ** -4 * (1 - 1e-6)     # the tile's choice is on q = Π(1 + e) − 1
    np.testing.assert_allclose(got[series], want[series], rtol=1e-5 if tpu else 2e-6, atol=0.0)
    atol = 8e-6 if tpu else 2e-7
    np.testing.assert_allclose(got[~series], want[~series], rtol=2e-6, atol=atol)
