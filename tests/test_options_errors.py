"""Bad input is rejected before any computation, with a message naming the argument and the bad value.

Also: option validation through every entry point, and the strategy registry.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

import recloss
from helpers import strategies
from recloss import registry
from recloss.bce.strategies import CutBCE, DenseBCE

pytestmark = pytest.mark.tier1

STRATEGIES = strategies()
B, N, V, D, L = 2, 5, 50, 8, 3


@pytest.fixture
def inputs(rng):
    return {
        "hidden": jnp.asarray(rng.normal(size=(B, N, D)), jnp.float32),
        "table": jnp.asarray(rng.normal(size=(V, D)) / np.sqrt(D), jnp.float32),
        "targets": jnp.asarray(rng.integers(-1, V, size=(B, N, L)), jnp.int32),
        "weights": jnp.asarray(rng.uniform(0.5, 1.5, size=(B, N)), jnp.float32),
        "bias": jnp.asarray(rng.normal(size=(V,)), jnp.float32),
    }


def _call(strategy, args, **options):
    return recloss.bce_loss(args["hidden"], args["table"], args["targets"], args["weights"], args["bias"],
                            strategy=strategy, **options)


def test_valid_inputs_run(inputs):
    """The baseline the bad cases below perturb is itself accepted (so each failure is the perturbation)."""
    for name in STRATEGIES:
        out = _call(name, inputs)
        assert np.isfinite(float(out.loss))


# (id, change to the valid inputs, error type, fragments the message must contain)
BAD_INPUTS = [
    ("targets_missing_L", lambda a: {"targets": a["targets"][..., 0]}, ValueError,
     ["targets", "(2, 5)", "(2, 5, 8)"]),
    ("targets_lead_mismatch", lambda a: {"targets": a["targets"][:, :4]}, ValueError,
     ["targets", "(2, 4, 3)"]),
    ("targets_extra_dim", lambda a: {"targets": a["targets"][None]}, ValueError,
     ["targets", "(1, 2, 5, 3)"]),
    ("targets_empty_L", lambda a: {"targets": a["targets"][..., :0]}, ValueError,
     ["targets", "(2, 5, 0)"]),
    ("targets_float", lambda a: {"targets": a["targets"].astype(jnp.float32)}, TypeError,
     ["targets", "float32"]),
    ("hidden_int", lambda a: {"hidden": a["hidden"].astype(jnp.int32)}, TypeError, ["hidden", "int32"]),
    ("hidden_scalar", lambda a: {"hidden": jnp.float32(1.0)}, ValueError, ["hidden"]),
    ("hidden_not_array", lambda a: {"hidden": "activations"}, TypeError, ["hidden", "str"]),
    ("table_int", lambda a: {"table": a["table"].astype(jnp.int32)}, TypeError, ["table", "int32"]),
    ("table_rank_1", lambda a: {"table": a["table"][:, 0]}, ValueError, ["table", "(50,)"]),
    ("table_rank_3", lambda a: {"table": a["table"][None]}, ValueError, ["table", "(1, 50, 8)"]),
    ("table_no_rows", lambda a: {"table": a["table"][:0], "bias": None}, ValueError, ["table", "(0, 8)"]),
    ("D_mismatch", lambda a: {"table": a["table"][:, :7]}, ValueError, ["D=7", "D=8", "table", "hidden"]),
    ("bias_short", lambda a: {"bias": a["bias"][:49]}, ValueError, ["bias", "(49,)", "(50,)"]),
    ("bias_2d", lambda a: {"bias": a["bias"][None]}, ValueError, ["bias", "(1, 50)"]),
    ("bias_int", lambda a: {"bias": a["bias"].astype(jnp.int32)}, TypeError, ["bias", "int32"]),
    ("weights_short", lambda a: {"weights": a["weights"][:, :4]}, ValueError, ["weights", "(2, 4)", "(2, 5)"]),
    ("weights_extra_dim", lambda a: {"weights": a["weights"][..., None]}, ValueError,
     ["weights", "(2, 5, 1)"]),
    ("weights_flat", lambda a: {"weights": a["weights"].reshape(-1)}, ValueError, ["weights", "(10,)"]),
]


@pytest.mark.parametrize("change,error,fragments", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bad_inputs(strategy, inputs, change, error, fragments):
    args = {**inputs, **change(inputs)}
    with pytest.raises(error) as info:
        _call(strategy, args)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in message: {info.value}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vocab_size_larger_than_table(strategy, inputs):
    with pytest.raises(ValueError) as info:
        _call(strategy, inputs, vocab_size=V + 1)
    assert "vocab_size=51" in str(info.value) and "50" in str(info.value)


# ------------------------------------------------------------------------- option values
BAD_OPTIONS = [
    ("reduction", "avg"), ("reduction", None), ("reduction", "MEAN"),
    ("vocab_reduction", "none"), ("vocab_reduction", "avg"),
    ("pad_id", 1.5), ("pad_id", True), ("pad_id", "-1"),
    ("label_smoothing", 1.0), ("label_smoothing", -0.1), ("label_smoothing", math.nan),
    ("label_smoothing", "0.1"),
    ("pos_weight", 0), ("pos_weight", -2.0), ("pos_weight", math.inf),
    ("focal_gamma", -1), ("focal_gamma", math.nan), ("focal_gamma", True),
    ("focal_alpha", 2), ("focal_alpha", -0.1), ("focal_alpha", "0.25"),
    ("threshold", math.nan), ("threshold", -math.inf), ("threshold", None),
    ("block_v", 0), ("block_v", -128), ("block_v", 128.0), ("block_v", True),
    ("block_n", 0), ("block_n", -8), ("block_n", 8.5),
    ("vocab_size", 0), ("vocab_size", -1), ("vocab_size", 1000.0),
    ("compute_metrics", 1), ("compute_metrics", "yes"), ("compute_metrics", None),
    ("interpret", "no"), ("interpret", 0),
    ("logit_soft_cap", 0), ("logit_soft_cap", -30.0), ("logit_soft_cap", math.nan), ("logit_soft_cap", math.inf),
    ("logit_soft_cap", "30"), ("logit_soft_cap", True),
]


def _assert_names(err, name, value):
    msg = str(err)
    assert f"{name}={value!r}" in msg, f"message does not name {name}={value!r}: {msg}"
    assert "expected" in msg, msg


@pytest.mark.parametrize("name,value", BAD_OPTIONS, ids=[f"{n}={v!r}" for n, v in BAD_OPTIONS])
def test_bad_option_value_in_loss_options(name, value):
    with pytest.raises(ValueError) as info:
        recloss.LossOptions(**{name: value})
    _assert_names(info.value, name, value)
    with pytest.raises(ValueError) as info:      # replace() validates too
        recloss.LossOptions().replace(**{name: value})
    _assert_names(info.value, name, value)


@pytest.mark.parametrize("name,value", [("reduction", "avg"), ("label_smoothing", 1.0), ("pos_weight", 0),
                                        ("focal_gamma", -1), ("focal_alpha", 2), ("block_v", 0)])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bad_option_value_through_bce_loss_and_get_strategy(strategy, inputs, name, value):
    with pytest.raises(ValueError) as info:
        _call(strategy, inputs, **{name: value})
    _assert_names(info.value, name, value)
    with pytest.raises(ValueError) as info:
        recloss.get_strategy(strategy, **{name: value})
    _assert_names(info.value, name, value)


GOOD_OPTIONS = [
    dict(reduction="sum", vocab_reduction="sum"), dict(reduction="none"), dict(pad_id=0), dict(pad_id=-100),
    dict(label_smoothing=0.0), dict(label_smoothing=0.999), dict(pos_weight=1e-6), dict(pos_weight=3),
    dict(focal_gamma=0), dict(focal_gamma=5.0), dict(focal_alpha=0.0), dict(focal_alpha=1.0),
    dict(focal_alpha=None), dict(threshold=-3), dict(threshold=2.5), dict(block_v=1), dict(block_n=1),
    dict(vocab_size=1), dict(compute_metrics=False), dict(interpret=True), dict(interpret=None),
    dict(logit_soft_cap=None), dict(logit_soft_cap=30.0), dict(logit_soft_cap=1e-3), dict(logit_soft_cap=50),
]


@pytest.mark.parametrize("options", GOOD_OPTIONS, ids=[repr(o) for o in GOOD_OPTIONS])
def test_boundary_option_values_are_accepted(options):
    opts = recloss.LossOptions(**options)
    for k, v in options.items():
        assert getattr(opts, k) == v


def test_loss_options_is_frozen():
    opts = recloss.LossOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.reduction = "sum"
    assert opts.replace(reduction="sum").reduction == "sum" and opts.reduction == "mean"


# ------------------------------------------------------------------------- names
@pytest.mark.parametrize("bad,suggestion", [("cutbse", "cutbce"), ("dense_bc", "dense_bce"),
                                            ("CutBCE", None), ("", None)])
def test_unknown_strategy(inputs, bad, suggestion):
    for call in (lambda: recloss.get_strategy(bad), lambda: _call(bad, inputs)):
        with pytest.raises(ValueError) as info:
            call()
        msg = str(info.value)
        assert repr(bad) in msg, msg
        for name in recloss.available_strategies():
            assert repr(name) in msg, f"available strategy {name!r} not listed: {msg}"
        if suggestion is not None:
            assert f"did you mean {suggestion!r}" in msg, msg


@pytest.mark.parametrize("bad,suggestion", [("label_smothing", "label_smoothing"), ("reduce", "reduction"),
                                            ("focal_gama", "focal_gamma"), ("blockv", "block_v"),
                                            ("zzz", None)])
def test_unknown_option_keyword(inputs, bad, suggestion):
    for call in (lambda: recloss.get_strategy("cutbce", **{bad: 1}), lambda: _call("cutbce", inputs, **{bad: 1})):
        with pytest.raises(TypeError) as info:
            call()
        msg = str(info.value)
        assert repr(bad) in msg, msg
        if suggestion is not None:
            assert f"did you mean {suggestion!r}" in msg, msg
        assert "valid options" in msg and "label_smoothing" in msg, msg


def test_get_strategy_rejects_non_loss_options():
    with pytest.raises(TypeError) as info:
        recloss.get_strategy("cutbce", {"reduction": "sum"})
    assert "LossOptions" in str(info.value) and "dict" in str(info.value)


def test_get_strategy_merges_options_and_keywords():
    s = recloss.get_strategy("cutbce", recloss.LossOptions(reduction="sum", threshold=0.5), threshold=1.5,
                             block_v=128)
    assert (s.options.reduction, s.options.threshold, s.options.block_v) == ("sum", 1.5, 128)
    assert s.name == "cutbce" and isinstance(s, recloss.Strategy)


# ------------------------------------------------------------------------- registry
@pytest.fixture
def scratch_registry():
    """Registrations a test makes vanish after it; the built-ins are never replaced by these tests."""
    before = set(recloss.available_strategies())
    yield
    for name in set(recloss.available_strategies()) - before:
        recloss.unregister_strategy(name)
    assert set(recloss.available_strategies()) == before


class _Doubled(DenseBCE):
    """A custom strategy whose loss is provably different: twice dense_bce."""
    name = "doubled_dense"

    def local_loss(self, *args, **kwargs):
        loss, counts = super().local_loss(*args, **kwargs)
        return 2.0 * loss, counts


def test_register_and_get_strategy_roundtrip(scratch_registry, inputs):
    made = []

    def factory(options):
        made.append(options)
        return _Doubled(options)

    assert "doubled_dense" not in recloss.available_strategies()
    recloss.register_strategy("doubled_dense", factory)
    assert "doubled_dense" in recloss.available_strategies()
    assert list(recloss.available_strategies()) == sorted(recloss.available_strategies())

    s = recloss.get_strategy("doubled_dense", reduction="sum", label_smoothing=0.1)
    assert isinstance(s, _Doubled) and made[-1] is s.options
    assert (s.options.reduction, s.options.label_smoothing) == ("sum", 0.1)

    mine = _call("doubled_dense", inputs, reduction="sum")
    base = _call("dense_bce", inputs, reduction="sum")
    np.testing.assert_allclose(float(mine.loss), 2.0 * float(base.loss), rtol=1e-6)
    assert float(mine.metrics["tp"]) == float(base.metrics["tp"])
    direct = s(inputs["hidden"], inputs["table"], inputs["targets"], inputs["weights"], inputs["bias"])
    np.testing.assert_allclose(float(direct.loss), 2.0 * float(_call("dense_bce", inputs, reduction="sum",
                                                                     label_smoothing=0.1).loss), rtol=1e-6)

    # Registering a name again replaces the factory.
    recloss.register_strategy("doubled_dense", DenseBCE)
    np.testing.assert_allclose(float(_call("doubled_dense", inputs).loss), float(_call("dense_bce", inputs).loss),
                               rtol=1e-6)


def test_register_strategy_rejects_bad_arguments(scratch_registry):
    with pytest.raises(ValueError) as info:
        recloss.register_strategy("", CutBCE)
    assert "''" in str(info.value)
    with pytest.raises(ValueError):
        recloss.register_strategy(None, CutBCE)
    with pytest.raises(TypeError) as info:
        recloss.register_strategy("broken", 3)
    assert "'broken'" in str(info.value) and "3" in str(info.value)
    assert "broken" not in recloss.available_strategies()


class _TpuOnly(CutBCE):
    name = "tpu_only"
    platforms = ("tpu",)


def test_strategy_for_another_platform_is_an_error_naming_alternatives(scratch_registry, inputs):
    recloss.register_strategy("tpu_only", _TpuOnly)
    s = recloss.get_strategy("tpu_only")
    assert s.supported_on("tpu") and not s.supported_on("cpu")
    with pytest.raises(ValueError) as info:
        _call("tpu_only", inputs)
    msg = str(info.value)
    assert "'tpu_only'" in msg and "'cpu'" in msg and "'cutbce'" in msg and "'dense_bce'" in msg, msg


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_builtin_strategies_know_their_platforms(strategy):
    s = recloss.get_strategy(strategy)
    assert s.name == strategy
    assert s.supported_on("cpu")         # all of them run here (Pallas via interpret mode)
    assert not s.supported_on("quantum")


# ------------------------------------------------------------------------- options a strategy ignores
@pytest.mark.parametrize("strategy,option", [
    ("dense_bce", dict(interpret=True)), ("dense_ce", dict(interpret=False)), ("cutbce", dict(interpret=True)),
    ("cutce", dict(interpret=True)), ("dense_bce", dict(block_v=128)), ("dense_ce", dict(block_n=8)),
    ("gbce", dict(label_smoothing=0.1)), ("sampled_softmax", dict(block_v=128)), ("gbce", dict(interpret=True)),
    ("gbce", dict(logit_soft_cap=30.0)), ("sampled_softmax", dict(logit_soft_cap=30.0)),
])
def test_an_option_the_strategy_ignores_is_an_error_naming_it(strategy, option):
    (name, value), = option.items()
    with pytest.raises(ValueError) as info:
        recloss.get_strategy(strategy, **option)
    msg = str(info.value)
    assert repr(strategy) in msg and f"{name}={value!r}" in msg, msg


def test_interpret_and_block_sizes_belong_to_the_strategies_that_use_them():
    for name in recloss.available_strategies():
        takes = recloss.get_strategy(name).options_supported
        assert ("interpret" in takes) == name.endswith("_pallas"), name
        assert ("block_v" in takes) == ("block_n" in takes) == name.startswith("cut"), name


def test_pallas_strategy_arguments_through_get_strategy_and_the_entry_point(inputs):
    s = recloss.get_strategy("cutbce_pallas", block_v=128, chip="v5p")
    assert s.chip == "v5p" and s.options.block_v == 128
    assert recloss.get_strategy("cutce_pallas", chip="v6e").chip == "v6e"
    with pytest.raises(ValueError, match="v9"):
        recloss.get_strategy("cutbce_pallas", chip="v9")
    for name in ("cutbce", "dense_ce", "gbce"):
        with pytest.raises(TypeError, match=rf"strategy '{name}' takes no argument\(s\) chip=.*cutbce_pallas"):
            recloss.get_strategy(name, chip="v5p")
    with pytest.raises(TypeError, match="takes no argument"):
        _call("cutbce", inputs, chip="v5p")


def test_unregister_strategy(scratch_registry):
    recloss.register_strategy("doubled_dense", _Doubled)
    recloss.unregister_strategy("doubled_dense")
    assert "doubled_dense" not in recloss.available_strategies()
    with pytest.raises(KeyError, match="no strategy 'doubled_dense' is registered; registered are .*'cutbce'"):
        recloss.unregister_strategy("doubled_dense")
