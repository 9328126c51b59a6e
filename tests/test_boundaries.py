"""Every boundary of the sweeps, the kernel grid, the tiling, the targets and the sharded paths, on purpose.

Each case puts the boundary in a fixed place and checks every strategy that has it against the
float64 oracle (`helpers.oracle_check`: loss, every gradient entry by entry, metrics, padding rows
exactly 0), so the boundaries no longer depend on what a random search happens to draw (Hypothesis
stays the wide net, in tests/test_bce.py and tests/test_softmax.py):

* columns: rows = V, V + 1 (a whole block's last row; a tail block of one padding row) and a full
  extra block of padding; the first and last column of every block and of a partial last block;
* rows: a row tile and a row chunk exactly full and one row over (block_n), and one row past a kernel's
  512-row sub-tile;
* shards: targets at every shard edge and a shard of padding, under vocab sharding (traced offsets)
  and each fsdp gather ('once', 'ring', 'rows'); the one-device offset is static;
* targets: ``pad_id`` equal to a real id at a block edge, duplicates that are not adjacent, invalid ids
  at V (a padding row that exists) and at the table's end;
* 16-bit tables with and without a bias, in one row tile and in row chunks, held to the stated bound.

The inputs make each boundary count: padding rows carry logits of +6 (+12 with a bias) for every row,
so a padding column let through moves the loss by far more than its tolerance; every row has one
target planted at a boundary column with a logit of +4 (its softmax argmax), repeated later in the
row; the weights are multiples of 1/4 (the metrics are then exact). Values are drawn from the test's
seed; what is asserted holds for every seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recloss
from helpers import (BV, PLANT_LOGIT, assert_close, block_edges, make_layout, oracle_check, planted_case, strategies,
                     twins_of)
from oracle import f64, sampled_oracle

pytestmark = [pytest.mark.tier1, pytest.mark.filterwarnings("ignore:strategy '.*' is running its Pallas kernel")]

BCE, SOFTMAX = strategies("bce"), strategies("softmax")
BLOCKED = ("cutbce", "cutbce_pallas", "cutce", "cutce_pallas")


# ------------------------------------------------------------------------- columns and rows, one device
# name -> (m, V, rows, per-objective options). block_v=128 and block_n=8 for every blocked strategy: m = 8
# is one row tile (one kernel row chunk) exactly, 9 one row over, 16 two exactly, 17 one over; the offset
# is static (one device). The planted logits are multiples of 2⁻¹², so a BCE threshold of 2⁻¹³ has none within
# float32 doubt of it: the metrics' counts are then exact, with no slack for elements at the threshold.
COLUMN_CASES = {
    "rows=V": (8, 384, 384, dict(threshold=2.0 ** -13), dict()),
    "rows=V+1,whole-blocks": (9, 383, 384, dict(label_smoothing=0.1), dict(label_smoothing=0.1)),
    "rows=V+1,tail-of-one": (16, 384, 385, dict(reduction="none", pos_weight=2.0),
                             dict(reduction="none", z_loss=1e-2)),
    "rows=V+block": (17, 384, 512, dict(threshold=0.5, vocab_reduction="sum"), dict(temperature=0.7)),
    "partial-last-block": (17, 300, 300, dict(focal_gamma=1.0, focal_alpha=0.25), dict(label_smoothing=0.05)),
}


def _column_params():
    for name in COLUMN_CASES:
        for strategy in BCE + SOFTMAX:
            yield pytest.param(name, strategy, id=f"{name}-{strategy}")


@pytest.mark.parametrize("case_name,strategy", list(_column_params()))
def test_column_and_row_boundaries_on_one_device(case_name, strategy, rng):
    m, v, rows, bce_opts, softmax_opts = COLUMN_CASES[case_name]
    objective = recloss.get_strategy(strategy).objective
    opts = dict(bce_opts if objective == "bce" else softmax_opts, block_v=BV, block_n=8)
    if rows > v:
        opts["vocab_size"] = v
    plant = block_edges(v)
    twins = twins_of(plant, v, (BV // 2, BV, BV + 5, -BV))     # ties in a block, a lane, across blocks
    case = planted_case(rng, m=m, v=v, rows=rows, plant=plant, bias=case_name != "rows=V", twins=twins)
    oracle_check(strategy, case, opts, rng, evaluate=objective == "bce" and opts.get("reduction") != "none",
                 exact_ties=True)


@pytest.mark.parametrize("strategy", ("cutbce", "cutbce_pallas", "cutce", "cutce_pallas"))
def test_automatic_tiles_one_row_past_a_512_row_sub_tile(strategy, rng):
    """513 rows with automatic blocks: the kernels walk two 512-row sub-tiles (the second holding one
    real row), the pure-JAX sweep one row tile; V = 200 in 256 rows (one partial block of padding)."""
    case = planted_case(rng, m=513, v=200, rows=256, plant=block_edges(200))
    oracle_check(strategy, case, dict(vocab_size=200), rng)


# ------------------------------------------------------------------------- shard edges, traced offsets
# (mesh shape (data, fsdp, vocab), fsdp gathers, V, rows), and targets planted at every shard's first and
# last id. (1, 1, 4): 4 vocab shards of 200 rows (a partial last block of 72 in each, so a shard before the
# last has columns past its rows that are below V), V = 599: the third shard ends in one padding row, the
# fourth is all padding. (2, 2, 2): 4 batch shards and 4 table slices of 136 rows (2 vocab shards of 272),
# V = 409: the last slice holds one live row.
SHARD_CASES = {
    "vocab4": ((1, 1, 4), ("once",), 599, 800),
    "data2-fsdp2-vocab2": ((2, 2, 2), ("once", "ring", "rows"), 409, 544),
}


def _shard_params():
    for name, (shape, gathers, _, _) in SHARD_CASES.items():
        for strategy in BCE + SOFTMAX:
            for gather in gathers:
                if gather in recloss.get_strategy(strategy).fsdp_gathers:
                    yield pytest.param(name, strategy, gather, id=f"{name}-{strategy}-{gather}")


@pytest.mark.parametrize("case_name,strategy,gather", list(_shard_params()))
def test_shard_edges_under_every_gather(case_name, strategy, gather, rng):
    shape, _, v, rows = SHARD_CASES[case_name]
    layout = make_layout(shape, fsdp_gather=gather)
    objective = recloss.get_strategy(strategy).objective
    opts = dict(block_v=BV, block_n=8, vocab_size=v)
    if objective == "softmax":
        opts.update(label_smoothing=0.1, z_loss=1e-3)      # the column sum and z-loss cross the shards too
    else:
        opts.update(label_smoothing=0.1, pos_weight=2.0)
    piece = rows // layout.table_shards           # a table slice: the ring's and the rows gather's shard
    plant = sorted(set(block_edges(v, piece)) | {c + BV for c in range(0, v - BV, piece)})
    twins = twins_of(plant, v, (piece, piece + 5, -piece + 3))     # ties across slices and shards
    case = planted_case(rng, m=16, v=v, rows=rows, plant=plant, d=24, twins=twins)
    oracle_check(strategy, case, opts, rng, layout=layout, exact_ties=True)


def test_a_traced_offset_at_each_shard_edge_equals_the_static_one(rng):
    """One vocab shard's loss-only sweep with its offset static (an int) and traced (under jit), for a
    300-row shard (a partial last block of 44) that ends in one padding row, holds one live row, and
    sits inside the catalogue (its last block's columns past its rows are below V): the dense float64
    sums over the shard's live columns. (A shard that ends at V and one of padding only: the sharded
    cases above.)"""
    from recloss.shard import VocabShard

    v_local, v = 300, 1000
    case = planted_case(rng, m=9, v=v_local, rows=v_local, plant=block_edges(v_local))
    h, e, b = case["hidden"], case["table"], case["bias"]
    x = f64(h) @ f64(e).T + f64(b)[None, :]
    for name in ("cutbce", "cutbce_pallas", "cutce", "cutce_pallas"):
        strategy = recloss.get_strategy(name, block_v=BV, block_n=8)
        for offset in (v - v_local + 1, v - 1, 0):     # ends in one padding row; one live row; inside V
            live = np.arange(v_local) + offset < v
            if strategy.objective == "bce":
                want = np.where(live, np.logaddexp(0.0, x), 0.0).sum(1)     # Σ_live softplus(x): the background
            else:
                want = np.log(np.where(live, np.exp(x), 0.0).sum(1)) if live.any() else np.full(x.shape[0], -np.inf)
            for static in (True, False):
                def value(h, e, b, off):
                    shard = VocabShard(e, b, offset if static else off, v, "cpu")
                    return strategy.plan(h.shape[0], shard).sweep("loss", h, e, b, None, shard.offset).value

                got = f64(jax.jit(value)(h, e, b, jnp.int32(offset)))
                what = f"{name}: offset {offset} ({'static' if static else 'traced'}) of V={v}"
                if live.any():
                    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=what)
                else:
                    assert np.all(got == want), what


# ------------------------------------------------------------------------- targets
@pytest.mark.parametrize("strategy", BCE + SOFTMAX)
def test_pad_id_equal_to_a_real_id_at_a_block_edge(strategy, rng):
    """pad_id = 128, a live id (the first of the second block) and one row's planted target: every 128
    is padding (never a target, never invalid), −1 is then an invalid id, the column itself still counts."""
    plant = block_edges(300)
    case = planted_case(rng, m=11, v=300, rows=300, plant=plant, pad_id=128)
    t = np.asarray(case["targets"]).copy()
    t[2, 4] = -1                                   # counted as invalid now
    case["targets"] = jnp.asarray(t)
    assert 128 in plant and np.sum(t == 128) > 3
    out, _, ref = oracle_check(strategy, case, dict(pad_id=128, block_v=BV, block_n=8), rng)
    assert ref.metrics["invalid_targets"] == float(np.sum((t != 128) & ((t < 0) | (t >= 300))))


@pytest.mark.parametrize("strategy", BCE + SOFTMAX)
def test_duplicates_that_are_not_adjacent_count_once(strategy, rng):
    """Every row names its planted target twice, two places apart, and here a second id three times
    ([a, b, c, a, b, b]): the loss is the oracle's, in which each id counts once."""
    case = planted_case(rng, m=10, v=300, rows=300, plant=block_edges(300), bias=False)
    t = np.asarray(case["targets"]).copy()
    t[2:, 4] = t[2:, 1]
    t[2:, 5] = t[2:, 1]
    case["targets"] = jnp.asarray(t)
    _, _, ref = oracle_check(strategy, case, dict(block_v=BV, block_n=8), rng)
    assert ref.metrics["num_targets"] < float(np.sum((t >= 0) & (t < 300)))     # repeats really occur


# ------------------------------------------------------------------------- 16-bit tables
# docs/sharding.md "16-bit gradients": every entry within (n + 2)·u·S + 1e-5·S of the float64 gradient of
# the same 16-bit inputs, u = 2⁻⁸ (bfloat16), n = 2 partials on one device (the sweep's, and a target term's
# gathered separately): 1.6 % of S. The targets are well predicted (+4) and every other row is far below at
# their columns (−8): a target row's S is then about half its correction's, so a correction (or its bias part)
# dropped or put on another row moves it by ~30x that bound.
def _sixteen_bit_bound(name, s, want, u=2.0 ** -8, n=2):
    return (n + 2) * u * s + 1e-5 * s + 1e-30


def _sixteen_bit_params():
    # The kernels write a 16-bit dE from one row tile and an f32 one across row chunks, with or without a
    # bias; the pure-JAX sweeps have one 16-bit path whatever their row tiles.
    for strategy in BLOCKED:
        for bias in (True, False):
            for block_n in ((None, 16) if strategy.endswith("_pallas") else (None,)):
                tag = f"{strategy}-{'bias' if bias else 'no-bias'}-{'one-tile' if block_n is None else 'row-chunks'}"
                yield pytest.param(strategy, bias, block_n, id=tag)


@pytest.mark.parametrize("strategy,bias,block_n", list(_sixteen_bit_params()))
def test_a_16_bit_table_within_the_stated_bound(strategy, bias, block_n, rng):
    case = planted_case(rng, m=32, v=300, rows=300, plant=block_edges(300), bias=bias, dtype=jnp.bfloat16,
                        other_logit=-8.0)
    opts = dict(block_v=BV, block_n=block_n, reduction="sum", vocab_reduction="sum")
    if recloss.get_strategy(strategy).objective == "softmax":
        opts = dict(block_v=BV, block_n=block_n, reduction="sum")
    oracle_check(strategy, case, opts, rng, tol_loss=2e-2, tol_grad=2e-2, entry_bound=_sixteen_bit_bound)


# ------------------------------------------------------------------------- the sampled objective
class _Fixed:
    """Test hook: the negatives given up front instead of drawn."""
    ids = None

    def draw_negatives(self, key, proposal, *, vocab_size):
        return jnp.asarray(self.ids, jnp.int32)


class FixedSoftmax(_Fixed, recloss.sampled.SampledSoftmax):
    pass


class FixedGBCE(_Fixed, recloss.sampled.GBCE):
    pass


FIXED = {"sampled_softmax": FixedSoftmax, "gbce": FixedGBCE}


def sampled_check(name, case, negatives, opts, rng, *, layout=None, log_q=None):
    """The sampled strategy ``name`` with the given ``negatives`` against `oracle.sampled_oracle`: loss,
    every gradient entry by entry (of c·loss, c ≠ 1), metrics. Returns the oracle's result."""
    strat = FIXED[name](recloss.LossOptions(num_negatives=len(negatives), **opts))
    strat.ids = list(negatives)
    names = ("hidden", "table", "bias", "weights")
    c = float(rng.choice([-2.5, 1.75, 3.0]))

    def f(args):
        kw = dict(zip(names, args))
        out = strat(kw["hidden"], kw["table"], case["targets"], kw["weights"], kw["bias"], key=jax.random.key(0),
                    log_q=log_q, layout=layout)
        return c * out.loss, out

    (_, out), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(tuple(case[n] for n in names))
    ref = sampled_oracle(**case, negatives=negatives, strategy=name, log_q=None if log_q is None else f64(log_q),
                         num_negatives=len(negatives), **opts)
    assert_close(out.loss, ref.loss, 1e-5, "loss")
    for n, g in zip(names, grads):
        want, s = c * ref.grads[n], np.abs(c * ref.grad_scale[n])
        ratio = np.abs(f64(g) - want) / (1e-4 * s + 1e-7 * np.max(s))
        at = np.unravel_index(np.argmax(ratio), ratio.shape)
        assert ratio[at] <= 1, f"d/d{n}: {int(np.sum(ratio > 1))} entries off, the worst {ratio[at]:.3g}x its bound"
    for k in ("num_targets", "invalid_targets", "weight_sum"):
        assert float(out.metrics[k]) == ref.metrics[k], (k, float(out.metrics[k]), ref.metrics[k])
    # Logits are exact (`planted_case`): the only ties are exact ones, which a target must win outright.
    assert float(out.metrics["top1"]) == ref.metrics["top1"], ("top1", float(out.metrics["top1"]), ref.metrics["top1"])
    return ref


def _sampled_case(rng, *, v, rows, plant, m=12, bias=True, plant_logit=-PLANT_LOGIT):
    """A planted case for the sampled losses: targets at ``plant`` with logits of −4 (the positive term
    large), the other columns ≈ N(−2, 0.5) with the bias (the negatives' terms small); with
    ``plant_logit`` = +4 each row's planted target is above every other id instead."""
    case = planted_case(rng, m=m, v=v, rows=rows, plant=plant, plant_logit=plant_logit, bias=bias)
    if bias:
        case["bias"] = case["bias"] - 1.5
    return case


@pytest.mark.parametrize("k", [5, 7, 8], ids=["K=5", "K=V-1", "K=V"])
def test_gbce_sampling_rate_at_a_small_catalogue(k, rng):
    """V = 8: α = K/(V − 1) is 5/7, 1 (capped at K = V − 1) and 1 again at K = V; the positive term,
    scaled by β = 1 − t·(1 − α), dominates the loss, so an α off by one id moves it by ≥ 8 %."""
    case = _sampled_case(rng, v=8, rows=8, plant=[0, 3, 4, 7])
    negatives = [0, 7, 3, 4, 1, 6, 2, 5][:k]
    sampled_check("gbce", case, negatives, dict(gbce_t=0.75), rng)


@pytest.mark.parametrize("name", ["sampled_softmax", "gbce"])
def test_sampled_negatives_at_block_and_catalogue_edges(name, rng):
    """V = 300 in 384 rows: negatives at 0, 127, 128, 255, 256, 299 (V − 1), repeated, and every valid
    target id after them (accidental hits), with padding, invalid ids (V, the table's end, −2) and
    non-adjacent duplicates in the targets. gBCE keeps its hits (remove_accidental_hits=False): each row's
    planted target (logit +4, above every other id) then ties exactly with itself as a negative, which is
    not a top-1 hit; pad_id is a real id."""
    case = _sampled_case(rng, v=300, rows=384, plant=block_edges(300),
                         plant_logit=PLANT_LOGIT if name == "gbce" else -PLANT_LOGIT)
    opts = dict(vocab_size=300, temperature=1.3)
    if name == "gbce":
        opts.update(pad_id=128, gbce_t=0.5, remove_accidental_hits=False)
    t = np.asarray(case["targets"])
    valid = t[(t >= 0) & (t < 300) & (t != opts.get("pad_id", -1))]
    sampled_check(name, case, [0, 127, 128, 255, 256, 299, 299, 5, 0] + sorted(set(valid.tolist())), opts, rng)


@pytest.mark.parametrize("shape", [(1, 1, 4), (2, 2, 2)], ids=["vocab4", "data2-fsdp2-vocab2"])
@pytest.mark.parametrize("name", ["sampled_softmax", "gbce"])
def test_sampled_shard_edges_under_vocab_sharding(name, shape, rng):
    """128-row table shards (4 vocab shards; or 2 vocab shards of 256, gathered over fsdp 2, under 4 batch
    shards), V = 383: negatives and targets at every 128-row slice's first and last id, each read by the
    shard that owns it; a log q over the shards (the softmax's correction) and in-batch negatives."""
    layout = make_layout(shape)
    case = _sampled_case(rng, v=383, rows=512, m=16, plant=block_edges(383))
    log_q = None
    opts = dict(vocab_size=383, temperature=0.7)
    if name == "sampled_softmax":
        log_q = jnp.asarray(rng.normal(size=512), jnp.float32)
        opts["in_batch_negatives"] = True
    sampled_check(name, case, [0, 127, 128, 255, 256, 382, 383 - 1, 200], opts, rng, layout=layout, log_q=log_q)
