"""MaxText plugin: config keys, the vocab-tiling hook replacement, the loss_fn wrapper.

Two groups:
* without MaxText: the adapter on stand-ins with MaxText's attribute names
  (config attributes, an NNX model with ``decoder.decoder_norm/dropout/
  logits_dense`` and ``token_embedder.embedding``, a train module whose
  ``loss_fn`` calls the module-global ``vocab_tiling_nnx_loss`` hook);
* with MaxText installed (Python >= 3.12): ``pyconfig.initialize`` with
  `config_class()`, and the loss and every parameter gradient of a tiny real
  MaxText Transformer against BCE computed from MaxText's own logits, and
  (softmax strategies) against MaxText's own vocab-tiled cross-entropy.

Softmax strategies (``loss=cutce`` ...) must be MaxText's token cross-entropy:
optax.softmax_cross_entropy_with_integer_labels over the target mask, plus the
z-loss of ``z_loss_multiplier``.
"""

import math
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import recloss
from helpers import count_vocab_loss_calls, rel, strategies
from recloss_plugins import maxtext as rm
from recloss_plugins.maxtext import config as rm_config
from recloss_plugins.maxtext import loss as rm_loss


EPS = 1e-8


def _config(**overrides):
    base = {name: key.default for name, key in rm.FIELDS.items()}
    base.update(enable_dropout=False, logits_via_embedding=False, normalize_embedding_logits=True,
                logits_dot_in_fp32=False, dtype=jnp.float32, num_vocab_tiling=2, z_loss_multiplier=0.0,
                final_logits_soft_cap=None)
    base.update(overrides)
    return types.SimpleNamespace(**base)


def _dense_sum(x, targets, weights, opts: recloss.LossOptions, v):
    """Σ_tokens w·ℓ from logits x [B, T, V] (float64), targets [B, T] or [B, T, L]."""
    x = np.asarray(x, np.float64)
    t = np.asarray(targets)
    t = t[..., None] if t.ndim == 2 else t
    y = np.zeros(x.shape)
    for idx in np.ndindex(t.shape[:-1]):
        ids = [i for i in t[idx] if 0 <= i < v and i != opts.pad_id]
        y[idx + (ids,)] = 1.0
    eps = opts.label_smoothing
    y = y * (1 - eps) + eps / 2
    ell = y * opts.pos_weight * np.logaddexp(0, -x) + (1 - y) * np.logaddexp(0, x)
    ell = ell.sum(-1) / (v if opts.vocab_reduction == "mean" else 1)
    return float((ell * np.asarray(weights, np.float64)).sum())


# ------------------------------------------------------------------ config keys (no MaxText)
@pytest.mark.tier1
def test_loss_settings_map_config_keys():
    cfg = _config(loss="cutbce_pallas", loss_block_v=0, loss_block_n=64, vocab_reduction="sum",
                  label_smoothing=0.1, pos_weight=2.0, focal_gamma=1.0, focal_alpha=0.25, loss_threshold=0.5,
                  loss_interpret=True, loss_pad_id=0)
    name, opts = rm.loss_settings(cfg)
    assert name == "cutbce_pallas"
    assert opts == recloss.LossOptions(reduction="sum", vocab_reduction="sum", block_v=None, block_n=64,
                                       label_smoothing=0.1, pos_weight=2.0, focal_gamma=1.0, focal_alpha=0.25,
                                       threshold=0.5, interpret=True, pad_id=0, compute_metrics=True)
    # Every option key maps to a LossOptions field; every FIELDS key is an option, the strategy or a mesh role.
    assert set(rm.OPTION_KEYS.values()) <= set(recloss.LossOptions.field_names())
    assert set(rm.FIELDS) == set(rm.OPTION_KEYS) | {"loss", "loss_batch_axes", "loss_fsdp_axis",
                                                     "loss_vocab_axis", "loss_fsdp_gather"}
    # Attributes a config lacks take the FIELDS defaults.
    assert rm.loss_settings(types.SimpleNamespace(loss="cutbce"))[1] == recloss.LossOptions(reduction="sum")


@pytest.mark.tier1
@pytest.mark.parametrize("overrides,match", [
    (dict(loss="cutbse"), r"'loss'='cutbse' is not a recloss strategy.*did you mean 'cutbce'"),
    (dict(label_smoothing=1.5), r"label_smoothing=1.5"),
    (dict(loss_block_v=-8), r"block_v=-8"),
    (dict(num_vocab_tiling=1), r"num_vocab_tiling=1: .*needs num_vocab_tiling > 1"),
    (dict(z_loss_multiplier=1e-4), r"z_loss_multiplier=0.0001"),
    (dict(loss="cutce_palas"), r"'loss'='cutce_palas' is not a recloss strategy.*did you mean 'cutce_pallas'"),
    (dict(logit_soft_cap=0.0), r"loss config key 'logit_soft_cap'=0.0 is rejected: .*logit_soft_cap=0.0"),
    (dict(logit_soft_cap=-30.0), r"'logit_soft_cap'=-30.0 is rejected"),
    (dict(final_logits_soft_cap=-1.0, logits_via_embedding=True), r"final_logits_soft_cap=-1.0: expected"),
    (dict(final_logits_soft_cap=30.0, logit_soft_cap=20.0, logits_via_embedding=True),
     r"logit_soft_cap=20.0 and MaxText's final_logits_soft_cap=30.0 both set"),
    (dict(loss="cutce", label_smoothing=0.1, logit_soft_cap=30.0),
     r"'cutce' .*label_smoothing=0.1 together with logit_soft_cap=30.0"),
    (dict(loss_vocab_axis="tensor"), r"need loss_batch_axes"),
    (dict(loss_fsdp_gather="rings"), r"loss_fsdp_gather='rings': expected one of 'once', 'ring', 'rows', 'auto'"),
    (dict(loss_fsdp_gather="ring", loss_batch_axes=["data"]),
     r"loss_fsdp_gather='ring' .*loss_fsdp_axis, which is not set"),
    (dict(loss_fsdp_gather="rows", loss_batch_axes=["data"]),
     r"loss_fsdp_gather='rows' gathers the tokens over loss_fsdp_axis, which is not set"),
    (dict(loss="dense_ce", loss_fsdp_gather="ring", loss_batch_axes=["fsdp"], loss_fsdp_axis="fsdp"),
     r"loss_fsdp_gather='ring': strategy 'dense_ce' does not take it.*or use a blocked strategy: .*cutce_pallas"),
])
def test_check_supported_errors(overrides, match):
    with pytest.raises(ValueError, match=match) as err:
        rm.check_supported(_config(**overrides))
    assert "\n" not in str(err.value)      # one line, naming the key and its value


@pytest.mark.tier1
def test_check_supported_accepts_defaults():
    rm.check_supported(_config())
    rm.check_supported(_config(loss="cutbce_pallas", final_logits_soft_cap=0.0, loss_batch_axes=["data"],
                               loss_vocab_axis="tensor"))


@pytest.mark.tier1
@pytest.mark.parametrize("loss", ["cutbce", "cutce"])
def test_final_logits_soft_cap_is_the_logit_soft_cap_where_maxtext_applies_it(loss):
    settings = lambda **kw: rm.loss_settings(_config(loss=loss, **kw))[1].logit_soft_cap
    # MaxText 0.2.5 caps only the tied-embedding logits (apply_output_head); None and 0 are no cap.
    assert settings(final_logits_soft_cap=30.0, logits_via_embedding=True) == 30.0
    assert settings(final_logits_soft_cap=30.0, logits_via_embedding=False) is None
    assert settings(final_logits_soft_cap=0.0, logits_via_embedding=True) is None
    assert settings(final_logits_soft_cap=None, logits_via_embedding=True) is None
    assert settings(logit_soft_cap=20.0) == 20.0          # recloss's own key, tied or not
    assert settings(logit_soft_cap=30.0, final_logits_soft_cap=30.0, logits_via_embedding=True) == 30.0
    assert settings(logit_soft_cap=20.0, final_logits_soft_cap=30.0, logits_via_embedding=False) == 20.0
    rm.check_supported(_config(loss=loss, final_logits_soft_cap=30.0, logits_via_embedding=True))
    assert "logit_soft_cap" in rm.OPTION_KEYS


@pytest.mark.tier1
@pytest.mark.parametrize("batch,length,want", [
    (1, 8, 2), (2, 4096, 2), (1, 9, 3), (1, 49, 7), (1, 13, 13), (0.5, 14, 7), (4.0, 2048, 2), (0, 14, 2)])
def test_pick_num_vocab_tiling_is_the_smallest_value_maxtext_accepts(batch, length, want):
    k, why = rm.pick_num_vocab_tiling(batch, length)
    assert k == want
    if batch > 0:   # MaxText's own check: the per-device tokens split into k tiles
        assert (batch * length) % k == 0 and all((batch * length) % d for d in range(2, k))
        assert f"{k} is the smallest value > 1 that divides the {int(batch * length):,} tokens per device " \
               f"(per_device_batch_size={batch} x max_target_length={length}), as MaxText requires" in why
    else:
        assert f"with per_device_batch_size={batch} MaxText checks no divisibility, so 2" in why
    for batch, length in ((0.125, 8), (1, 1), (0.3, 5)):     # 1 token, 1 token, 1.5 tokens: no k > 1 divides
        with pytest.raises(ValueError, match=rf"num_vocab_tiling: .*tokens per device \(per_device_batch_size="
                                             rf"{batch} x max_target_length={length}\), which no value > 1 does"):
            rm.pick_num_vocab_tiling(batch, length)


@pytest.mark.tier1
def test_config_class_picks_num_vocab_tiling_before_maxtext_checks_it(capsys):
    pydantic = pytest.importorskip("pydantic", reason="pydantic is not installed (MaxText's config needs it)")
    seen = []

    class Base(pydantic.BaseModel):           # MaxText's config as far as num_vocab_tiling goes
        model_config = pydantic.ConfigDict(extra="forbid")
        num_vocab_tiling: int = 1
        per_device_batch_size: float = 1.0
        max_target_length: int = 9
        z_loss_multiplier: float = 0.0

        @pydantic.model_validator(mode="after")
        def maxtext_checks(self):
            seen.append(self.num_vocab_tiling)
            if (self.per_device_batch_size * self.max_target_length) % self.num_vocab_tiling:
                raise ValueError("Per device batch size times sequence length should be divisible by the number "
                                 "of vocab tiles.")
            return self

    cls = rm.config_class(Base)
    cfg = cls(loss="cutce_pallas")
    assert cfg.num_vocab_tiling == 3 and seen == [3]         # MaxText's own check saw the pick
    out = capsys.readouterr().out
    assert out.startswith("recloss: num_vocab_tiling=3 (picked; the config has 1): the recloss loss needs "
                          "num_vocab_tiling > 1") and out.count("\n") == 1
    assert "3 is the smallest value > 1 that divides the 9 tokens per device (per_device_batch_size=1.0 x " \
           "max_target_length=9), as MaxText requires" in out
    assert cls(loss="cutce_pallas", per_device_batch_size=2, max_target_length=4096).num_vocab_tiling == 2
    assert "2 is the smallest value > 1 that divides the 8,192 tokens per device" in capsys.readouterr().out
    assert cls(loss="cutce", num_vocab_tiling=4, max_target_length=8).num_vocab_tiling == 4    # a value set stays,
    assert capsys.readouterr().out == ""                                                         # unreported
    with pytest.raises(pydantic.ValidationError, match=r"no value > 1 does; raise per_device_batch_size"):
        cls(loss="cutce", per_device_batch_size=0.125, max_target_length=8)


@pytest.mark.tier1
def test_config_class_on_a_pydantic_base():
    pydantic = pytest.importorskip("pydantic", reason="pydantic is not installed (MaxText's config needs it)")

    class Base(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        vocab_size: int = 32
        num_vocab_tiling: int = 1
        z_loss_multiplier: float = 0.0

    cls = rm.config_class(Base)
    assert rm.config_class(Base) is cls  # cached
    cfg = cls(num_vocab_tiling=2, loss="cutbce_pallas", loss_block_v=256, label_smoothing=0.1)
    assert (cfg.loss, cfg.loss_block_v, cfg.label_smoothing, cfg.loss_batch_axes) == \
        ("cutbce_pallas", 256, 0.1, [])
    assert rm.loss_settings(cfg) == ("cutbce_pallas", recloss.LossOptions(reduction="sum", block_v=256,
                                                                          label_smoothing=0.1))
    for bad, match in ((dict(loss="nope"), "not a recloss strategy"), (dict(num_vocab_tiling=1), "num_vocab"),
                       (dict(vocab_reduction="max"), "vocab_reduction"),
                       (dict(loss_block_v=-1), "loss_block_v"), (dict(loss_blok_v=1), "loss_blok_v")):
        with pytest.raises(pydantic.ValidationError, match=match):
            cls(**{"num_vocab_tiling": 2, **bad})

    class Taken(Base):
        label_smoothing: float = 0.0

    with pytest.raises(ValueError, match=r"already defines \['label_smoothing'\]"):
        rm.config_class(Taken)
    with pytest.raises(TypeError, match="pydantic model class"):
        rm.config_class(dict)


# ------------------------------------------------------------------ a stand-in MaxText model (no MaxText)
class _Dense(nnx.Module):
    def __init__(self, d, v, rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (d, v)) / math.sqrt(d))


class _Decoder(nnx.Module):
    def __init__(self, d, v, rngs):
        self.decoder_norm = nnx.RMSNorm(d, rngs=rngs)
        self.decoder_norm.scale[...] = jax.random.uniform(rngs.params(), (d,), minval=0.5, maxval=1.5)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)  # off: enable_dropout=False in the test configs
        self.logits_dense = _Dense(d, v, rngs)


class _Embed(nnx.Module):
    def __init__(self, v, d, rngs):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (v, d)))


class _Model(nnx.Module):
    """MaxText's attribute layout: token_embedder.embedding, decoder.{decoder_norm, dropout, logits_dense}."""

    def __init__(self, v, d, rngs, mesh=None):
        self.token_embedder = _Embed(v, d, rngs)
        self.decoder = _Decoder(d, v, rngs)
        self.mesh = mesh

    def logits(self, hidden, config):
        y = self.decoder.decoder_norm(hidden)
        if config.logits_via_embedding:
            table = self.token_embedder.embedding[...].astype(jnp.bfloat16).astype(jnp.float32)
            x = y @ table.T
            return x / math.sqrt(y.shape[-1]) if config.normalize_embedding_logits else x
        return y @ self.decoder.logits_dense.kernel[...]


def _grad_close(actual, desired, rtol=2e-5):
    """Two float32 gradients equal up to summation order: rtol, and an absolute floor of 64 float32
    ulps of the gradient's largest entry, since an entry that is a sum over V cancelling terms (e.g.
    -0.014 from terms of magnitude ~9) carries the rounding of those terms, not of itself."""
    desired = np.asarray(desired)
    atol = 64 * np.finfo(np.float32).eps * max(float(np.abs(desired).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol)


def _param_close(tied):
    """Parameter-gradient check: a tied head reads the embedding rounded to bfloat16 (as MaxText does), so
    the embedding's gradient is rounded to bfloat16 too and two exact computations may land one bf16 ulp
    (2^-8 relative) apart."""
    return lambda a, b: _grad_close(a, b, rtol=1e-2 if tied else 2e-5)


def _batch(rng, b=2, t=6, v=40, num_labels=None):
    shape = (b, t) if num_labels is None else (b, t, num_labels)
    return {"targets": jnp.asarray(rng.integers(0, v, shape), jnp.int32),
            "targets_segmentation": jnp.asarray(rng.random((b, t)) < 0.75, jnp.int32)}


def _capped(x, cap):
    return x if cap is None else cap * jnp.tanh(x / cap)


@pytest.mark.tier1
@pytest.mark.parametrize("tied,num_labels,overrides,cap", [
    (False, None, dict(loss="cutbce", loss_block_v=16, label_smoothing=0.1), None),
    (True, None, dict(loss="dense_bce", pos_weight=2.0), None),
    (True, 3, dict(loss="cutbce", vocab_reduction="sum", normalize_embedding_logits=False), None),
    (True, None, dict(loss="cutbce", final_logits_soft_cap=1.0, loss_block_v=16), 1.0),   # MaxText's cap
    (False, 3, dict(loss="dense_bce", logit_soft_cap=1.5), 1.5),                          # recloss's key
])
def test_vocab_loss_matches_dense_bce_of_the_output_head(rng, tied, num_labels, overrides, cap):
    v, d = 40, 8
    cfg = _config(logits_via_embedding=tied, **overrides)
    model = _Model(v, d, nnx.Rngs(int(rng.integers(1 << 30))))
    hidden = jnp.asarray(rng.standard_normal((2, 6, d)), jnp.float32)
    data = _batch(rng, v=v, num_labels=num_labels)
    weights = np.asarray(data["targets_segmentation"] != 0, np.float64)
    _, opts = rm.loss_settings(cfg)
    assert opts.logit_soft_cap == cap
    metrics = {}
    xent_sum, z = rm.vocab_loss(model, hidden, data, cfg, True, metrics_out=metrics)
    want = _dense_sum(_capped(model.logits(hidden, cfg), cap), data["targets"], weights, opts, v)
    np.testing.assert_allclose(float(xent_sum), want, rtol=2e-6)
    assert float(z) == 0.0
    assert float(metrics["weight_sum"]) == weights.sum()
    assert float(metrics["num_targets"]) > 0

    def ours(m, h):
        return rm.vocab_loss(m, h, data, cfg, True)[0]

    def dense(m, h):
        x = _capped(m.logits(h, cfg), cap)
        t = data["targets"] if num_labels else data["targets"][..., None]
        y = jnp.zeros(x.shape).at[jnp.arange(2)[:, None, None], jnp.arange(6)[None, :, None], t].set(1.0)
        y = y * (1 - opts.label_smoothing) + opts.label_smoothing / 2
        ell = (y * opts.pos_weight * jax.nn.softplus(-x) + (1 - y) * jax.nn.softplus(x)).sum(-1)
        ell = ell / (v if opts.vocab_reduction == "mean" else 1)
        return (ell * data["targets_segmentation"]).sum()

    g_ours = nnx.jit(nnx.grad(ours, argnums=(0, 1)))(model, hidden)
    g_dense = nnx.jit(nnx.grad(dense, argnums=(0, 1)))(model, hidden)
    jax.tree.map(_param_close(tied),
                 nnx.state(g_ours[0], nnx.Param), nnx.state(g_dense[0], nnx.Param))
    _grad_close(g_ours[1], g_dense[1])
    used = g_ours[0].token_embedder.embedding[...] if tied else g_ours[0].decoder.logits_dense.kernel[...]
    assert float(jnp.abs(used).sum()) > 0



@pytest.mark.tier1
@pytest.mark.parametrize("loss", ["sampled_softmax", "gbce"])
def test_sampled_vocab_loss_draws_its_negatives_from_the_decoder_rng_state(rng, loss):
    # MaxText keeps its randomness as NNX RNG state (decoder.rngs, a train-state count advanced by every
    # draw): each call draws new negatives, and a model restored from the state after a call (a
    # checkpoint) draws what the uninterrupted one draws next.
    v, d, seed = 40, 8, int(rng.integers(1 << 30))
    print(f"seed={seed}")
    cfg = _config(loss=loss, num_negatives=7)
    name, opts = rm.loss_settings(cfg)
    assert (name, opts.num_negatives, opts.remove_accidental_hits) == (loss, 7, True)

    def fresh():
        rngs = nnx.Rngs(params=seed, dropout=seed + 1)
        model = _Model(v, d, rngs)
        model.decoder.rngs = rngs          # MaxText's NNXDecoder keeps the Rngs it was built with
        return model

    model, hidden, data = fresh(), jnp.asarray(rng.standard_normal((2, 6, d)), jnp.float32), _batch(rng, v=v)
    twin = nnx.clone(model)
    key = jax.random.fold_in(twin.decoder.rngs.dropout(), rm_loss._NEGATIVES_TAG)
    want = recloss.sampled_loss(model.decoder.decoder_norm(hidden), model.decoder.logits_dense.kernel[...].T,
                                data["targets"][..., None], data["targets_segmentation"], key=key,
                                strategy=loss, **{f: getattr(opts, f) for f in ("num_negatives", "reduction")})
    step = nnx.jit(lambda m, h: rm.vocab_loss(m, h, data, cfg, True)[0])
    first = float(step(model, hidden))
    np.testing.assert_allclose(first, float(want.loss), rtol=1e-6)
    checkpoint = nnx.clone(model)          # the state after one call, by value
    second = float(step(model, hidden))
    assert second != first, "the second call drew the first call's negatives"
    restored = fresh()
    nnx.update(restored, nnx.state(checkpoint))
    assert float(step(restored, hidden)) == second
    third = float(step(model, hidden))
    assert third not in (first, second)
    # The count is MaxText's: with a key but no decoder stream, a clear error.
    no_stream = fresh()
    no_stream.decoder.rngs = nnx.Rngs(params=seed)       # as MaxText builds a model for inference
    with pytest.raises(ValueError, match="'dropout' RNG stream"):
        rm.vocab_loss(no_stream, hidden, data, cfg, True)
    with pytest.raises(ValueError, match=rf"loss='{loss}' draws K=7 negatives and needs key="):
        rm.loss_from_hidden(hidden, model.decoder.logits_dense.kernel[...].T, data, cfg)


# MaxText 0.2.5's logical_axis_rules for what places the output head (a subset of its base.yml, in its order).
MAXTEXT_RULES = [
    ["activation_embed_and_logits_batch", ["data", "stage", "fsdp", "fsdp_transpose", "expert"]],
    ["activation_norm_length", ["tensor_sequence", "context", "context_usp_ulysses"]],
    ["vocab", ["tensor", "tensor_sequence", "autoregressive"]],
    ["activation_batch", ["data", "fsdp", "fsdp_transpose", "expert"]],
    ["embed", ["fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert"]],
    ["embed", ["fsdp", "context", "context_usp_ulysses", "expert"]],
    ["embed_vocab", ["fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert"]],
]
MAXTEXT_AXES = ("data", "stage", "fsdp", "fsdp_transpose", "context", "tensor", "tensor_sequence", "expert")


def _stand_in_mesh(platform="tpu", **sizes):
    """A mesh stand-in with MaxText's axis names: ``devices`` (of ``platform``) shaped by ``sizes`` (else 1)."""
    shape = tuple(sizes.get(a, 1) for a in MAXTEXT_AXES)
    devices = np.array([types.SimpleNamespace(platform=platform)] * math.prod(shape)).reshape(shape)
    return types.SimpleNamespace(devices=devices, axis_names=MAXTEXT_AXES)


@pytest.mark.tier1
@pytest.mark.parametrize("sizes,want", [
    (dict(fsdp=8), (("fsdp",), "fsdp", None)),                       # MaxText's default mesh
    (dict(data=2, fsdp=4), (("data", "fsdp"), "fsdp", None)),
    (dict(data=8), (("data",), None, None)),
    (dict(data=2, fsdp=2, tensor=2), (("data", "fsdp"), "fsdp", "tensor")),
    (dict(data=2, fsdp=2, stage=2), (("data", "stage", "fsdp"), "fsdp", None)),
    (dict(fsdp=2, expert=2), r"cannot derive loss_fsdp_axis: MaxText's rule for 'embed_vocab' spreads it over "
                             r"mesh axes \['fsdp', 'expert'\]"),
    (dict(fsdp=4, context=2), r"the tokens' length is split over mesh axes \['context'\] \(sizes \[2\]\)"),
    (dict(fsdp=2, fsdp_transpose=2), r"cannot derive loss_fsdp_axis: MaxText's rule for 'embed_vocab' spreads it over "
                                     r"mesh axes \['fsdp', 'fsdp_transpose'\]"),
    (dict(fsdp=2, tensor=2, tensor_sequence=2), r"the tokens' length is split over mesh axes \['tensor_sequence'\]"),
])
def test_mesh_axes_are_derived_from_maxtext_mesh_and_rules(sizes, want):
    cfg = _config(logical_axis_rules=MAXTEXT_RULES)
    mesh = _stand_in_mesh(**sizes)
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want + r".*set loss_batch_axes .* yourself"):
            rm.derive_mesh_axes(cfg, mesh)
    else:
        assert rm.derive_mesh_axes(cfg, mesh) == want
    with pytest.raises(ValueError, match=r"cannot derive loss_batch_axes: MaxText's logical_axis_rules map neither"):
        rm.derive_mesh_axes(_config(), mesh)


@pytest.mark.tier1
def test_pallas_loss_on_a_tpu_mesh_runs_the_kernel_and_derives_its_axes(rng, monkeypatch):
    # Compiling for a TPU topology on a CPU host (MaxText's train_compile): jax.default_backend() is
    # 'cpu', the mesh is TPU. The kernel must not fall back to interpret mode there, and XLA cannot
    # partition a Mosaic call over a multi-device mesh: the loss runs under shard_map on the axes read
    # from MaxText's mesh and rules, or stops with one line that names the keys.
    assert rm_config.mesh_platform(_stand_in_mesh(fsdp=8)) == "tpu" and rm_config.mesh_platform(None) is None
    assert rm_config.mesh_platform(Mesh(np.array(jax.devices()[:1]), ("x",))) == "cpu"
    hidden = jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.float32)
    table = jnp.asarray(rng.standard_normal((40, 8)), jnp.float32)
    data = _batch(rng, v=40)
    for loss in ("cutce_pallas", "cutbce_pallas"):
        with pytest.raises(ValueError, match=r"cannot derive loss_batch_axes: .*set loss_batch_axes \(the mesh "
                                             r"axes the tokens are split over\), loss_fsdp_axis and loss_vocab_axis"):
            rm.loss_from_hidden(hidden, table, data, _config(loss=loss), mesh=_stand_in_mesh(fsdp=8))
    # interpret mode asked for, or a blocked strategy: XLA partitions those itself.
    stand_in = _stand_in_mesh(fsdp=8)
    rm.loss_from_hidden(hidden, table, data, _config(loss="cutce_pallas", loss_interpret=True), mesh=stand_in)
    rm.loss_from_hidden(hidden, table, data, _config(loss="cutce"), mesh=stand_in)
    with pytest.raises(ValueError, match=r"loss_fsdp_gather='ring' needs the loss under shard_map, and "
                                         r"loss='cutce' runs without one \(XLA partitions it\)"):
        rm.loss_from_hidden(hidden, table, data, _config(loss="cutce", loss_fsdp_gather="ring"), mesh=stand_in)

    # The derived layout end to end: a real 8-device CPU mesh with MaxText's axis names, its platform
    # read as 'tpu' so the plugin derives the axes (the kernel itself runs in interpret mode on CPU).
    monkeypatch.setattr(rm_config, "mesh_platform", lambda mesh: None if mesh is None else "tpu")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 1, 4, 1, 1, 1, 1, 1), MAXTEXT_AXES)
    lines = []
    for loss in ("cutce_pallas", "cutbce_pallas"):
        for b, t, gather in ((8, 4, "rows"), (16, 64, "ring")):     # fsdp 4: rows while 4·M < 2·S (S = 512 padded rows / 4)
            hidden = jnp.asarray(rng.standard_normal((b, t, 8)), jnp.float32)
            table = jnp.asarray(rng.standard_normal((256, 8)), jnp.float32)
            data = _batch(rng, b=b, t=t, v=256)
            cfg = _config(loss=loss, logical_axis_rules=MAXTEXT_RULES)
            lines.clear()
            layout = rm.layout_for(cfg, mesh, hidden, table, log=lines.append)
            assert (layout.batch_axes, layout.fsdp_axis, layout.vocab_axis, layout.fsdp_gather) == \
                (("data", "fsdp"), "fsdp", None, gather), lines
            assert f"loss={loss!r} runs a Mosaic kernel under shard_map on MaxText's 8-device mesh: " \
                   "loss_batch_axes=['data', 'fsdp'], loss_fsdp_axis=fsdp" in lines[0]
            assert lines[1].startswith(f"recloss: loss_fsdp_gather=auto: {gather!r} (fsdp 4, 128 table rows a slice, "
                                       f"{b * t // 8} positions a chip; per chip: once ")
            got = jax.jit(lambda h: rm.loss_from_hidden(h, table, data, cfg, mesh=mesh)[0])(hidden)
            want = rm.loss_from_hidden(hidden, table, data, _config(loss=loss.replace("_pallas", "")))[0]
            np.testing.assert_allclose(got, want, rtol=2e-5)
    # The user's own keys win over the derivation and over 'auto'.
    explicit = _config(loss="cutce_pallas", logical_axis_rules=MAXTEXT_RULES, loss_batch_axes=["data", "fsdp"],
                       loss_fsdp_axis="fsdp", loss_fsdp_gather="once")
    assert rm.layout_for(explicit, mesh, log=lines.append).fsdp_gather == "once"


@pytest.mark.tier1
def test_the_table_gradient_leaves_the_loss_in_maxtext_layout_and_dtype(rng):
    """MaxText stores the [V, D] table with D over fsdp (rule 'embed_vocab') and V over tensor ('vocab');
    under shard_map the loss's gradient of it is row-sharded. `grad_in_layout` lays the gradient out as
    MaxText's table in the table's dtype (the constraint sits on the bfloat16 cotangent, before the cast
    to the float32 parameter) and changes no value."""
    cfg = _config(logical_axis_rules=MAXTEXT_RULES)
    assert rm_config.table_spec(cfg, _stand_in_mesh(fsdp=8)) == P(None, "fsdp")
    assert rm_config.table_spec(cfg, _stand_in_mesh(data=2, fsdp=2, tensor=2)) == P("tensor", "fsdp")
    assert rm_config.table_spec(cfg, _stand_in_mesh(data=8)) is None and rm_config.table_spec(_config(), _stand_in_mesh(fsdp=8)) is None
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 1, 4, 1, 1, 1, 1, 1), MAXTEXT_AXES)
    sharding = jax.sharding.NamedSharding(mesh, rm_config.table_spec(cfg, mesh))
    param = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((64, 16)), jnp.bfloat16)
    # The cotangent of the bfloat16 table is ``weights`` exactly, so the parameter's gradient is known.
    f = lambda p, wrap: jnp.sum((wrap(p.astype(jnp.bfloat16)) * weights).astype(jnp.float32))
    plain = weights.astype(jnp.float32)
    np.testing.assert_array_equal(jax.jit(jax.grad(lambda p: f(p, lambda t: t)))(param), plain)
    lowered = jax.jit(jax.grad(lambda p: f(p, lambda t: rm_loss.grad_in_layout(t, sharding)))).lower(param)
    np.testing.assert_array_equal(lowered.compile()(param), plain)
    text = lowered.as_text()
    constraint = [l for l in text.splitlines() if "sharding_constraint" in l or "mhlo.sharding" in l and "custom_call" in l]
    assert any("bf16" in l for l in constraint), constraint


@pytest.mark.tier1
def test_an_untied_head_is_transposed_in_its_compute_dtype_with_the_same_values(rng):
    """`row_major_transpose`: kernel.T and its gradient's transpose, moved in memory (a layout
    constraint, so XLA does not re-lay out the float32 parameter and its moments instead); the values
    are kernel.T's, forward and backward."""
    kernel = jnp.asarray(rng.standard_normal((16, 40)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((40, 16)), jnp.float32)
    f = lambda k, t: jnp.sum(jnp.sin(t(k.astype(jnp.bfloat16)).astype(jnp.float32)) * weights)
    got = jax.jit(jax.value_and_grad(lambda k: f(k, rm_loss.row_major_transpose)))(kernel)
    want = jax.jit(jax.value_and_grad(lambda k: f(k, lambda x: x.T)))(kernel)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(rm_loss.row_major_transpose(kernel), kernel.T)


@pytest.mark.tier1
def test_loss_from_hidden_with_mesh_layout(rng):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    cfg = _config(loss_batch_axes=["data", "fsdp"], loss_fsdp_axis="fsdp", loss_vocab_axis="tensor",
                  loss_fsdp_gather="once")
    layout = rm.layout_for(cfg, mesh)
    assert (layout.batch_axes, layout.fsdp_axis, layout.vocab_axis) == (("data", "fsdp"), "fsdp", "tensor")
    assert rm.layout_for(_config(), mesh) is None and rm.layout_for(_config(), None) is None
    with pytest.raises(ValueError, match="no mesh was given"):
        rm.layout_for(cfg, None)
    with pytest.raises(ValueError, match="need loss_batch_axes"):
        rm.layout_for(_config(loss_fsdp_axis="fsdp"), mesh)
    with pytest.raises(ValueError, match=r"loss_fsdp_gather='auto' picks the mode from the shapes: pass hidden"):
        rm.layout_for(_config(loss_batch_axes=["data", "fsdp"], loss_fsdp_axis="fsdp"), mesh)
    ring = _config(loss_batch_axes=["data", "fsdp"], loss_fsdp_axis="fsdp", loss_vocab_axis="tensor",
                   loss_fsdp_gather="ring")
    assert rm.layout_for(ring, mesh).fsdp_gather == "ring" and layout.fsdp_gather == "once"
    hidden = jnp.asarray(rng.standard_normal((4, 2, 8)), jnp.float32)
    table = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)
    data = _batch(rng, b=4, t=2, v=64)
    program = str(jax.make_jaxpr(lambda h: rm.loss_from_hidden(h, table, data, cfg, mesh=mesh)[0])(hidden))
    assert "shard_map" in program and "ppermute" not in program
    assert "ppermute" in str(jax.make_jaxpr(lambda h: rm.loss_from_hidden(h, table, data, ring, mesh=mesh)[0])(hidden))
    rows = _config(loss_batch_axes=["data", "fsdp"], loss_fsdp_axis="fsdp", loss_vocab_axis="tensor",
                   loss_fsdp_gather="rows")
    assert rm.layout_for(rows, mesh).fsdp_gather == "rows"
    program = str(jax.make_jaxpr(lambda h: rm.loss_from_hidden(h, table, data, rows, mesh=mesh)[0])(hidden))
    assert "all_gather" in program and "ppermute" not in program
    want = rm.loss_from_hidden(hidden, table, data, _config())[0]
    for c in (cfg, ring, rows):
        got = jax.jit(lambda h: rm.loss_from_hidden(h, table, data, c, mesh=mesh)[0])(hidden)
        np.testing.assert_allclose(got, want, rtol=1e-5)
    with pytest.raises(ValueError, match="no mesh was given"):
        rm.loss_from_hidden(hidden, table, data, cfg)


# ------------------------------------------------------------------ softmax strategies = MaxText's token CE
SOFTMAX = strategies("softmax")


def _blocks(loss, **blocks):
    """``blocks`` (loss_block_v=...) for the blocked pure-JAX strategies; a Pallas kernel picks its own
    (128-lane) blocks and a dense baseline has none."""
    return blocks if loss in ("cutbce", "cutce") else {}


def _token_ce(x, targets, mask, z_loss=0.0):
    """MaxText's masked token cross-entropy sum from logits x [B, T, V]: optax CE + z_loss·lse², over the mask."""
    ce = optax.softmax_cross_entropy_with_integer_labels(x, targets)
    ce = ce + z_loss * jax.scipy.special.logsumexp(x, axis=-1) ** 2
    return jnp.sum(ce * (mask != 0))


@pytest.mark.tier1
@pytest.mark.parametrize("loss", SOFTMAX)
@pytest.mark.parametrize("tied,overrides,z,cap", [
    (False, dict(loss_block_v=16), 0.0, None),
    (True, dict(z_loss_multiplier=1e-3), 1e-3, None),                    # MaxText's own z-loss key
    (False, dict(z_loss=1e-3, temperature=0.5, loss_block_v=8), 1e-3, None),
    (True, dict(z_loss_multiplier=1e-2, final_logits_soft_cap=1.0), 1e-2, 1.0),   # MaxText's cap (tied)
    (False, dict(final_logits_soft_cap=1.0, logit_soft_cap=1.5, loss_block_v=8), 0.0, 1.5),   # untied: ours only
])
def test_softmax_vocab_loss_is_maxtext_token_cross_entropy(rng, loss, tied, overrides, z, cap):
    v, d = 40, 8
    overrides = dict(overrides)   # the parameter's dict is shared by the cases of every strategy
    blocks = _blocks(loss, loss_block_v=overrides.pop("loss_block_v", 0))
    cfg = _config(loss=loss, logits_via_embedding=tied, **overrides, **blocks)
    model = _Model(v, d, nnx.Rngs(int(rng.integers(1 << 30))))
    hidden = jnp.asarray(rng.standard_normal((2, 6, d)), jnp.float32)
    data = _batch(rng, v=v)
    tau = overrides.get("temperature", 1.0)
    name, opts = rm.loss_settings(cfg)
    assert name == loss and opts.z_loss == z and opts.temperature == tau and opts.reduction == "sum"
    assert opts.logit_soft_cap == cap

    def reference(m, h):
        return _token_ce(_capped(m.logits(h, cfg), cap) / tau, data["targets"], data["targets_segmentation"], z)

    metrics = {}
    xent_sum, z_sum = rm.vocab_loss(model, hidden, data, cfg, True, metrics_out=metrics)
    np.testing.assert_allclose(float(xent_sum), float(reference(model, hidden)), rtol=2e-6)
    mask = np.asarray(data["targets_segmentation"] != 0)
    # The z-loss part alone, as MaxText's hook returns it: Σ_mask λ·logsumexp(x)².
    lse = jax.scipy.special.logsumexp(_capped(model.logits(hidden, cfg), cap) / tau, axis=-1)
    np.testing.assert_allclose(float(z_sum), float(jnp.sum(z * lse ** 2 * mask)), rtol=2e-5, atol=0)
    assert float(metrics["weight_sum"]) == mask.sum() and "tp" not in metrics
    top = np.argmax(np.asarray(_capped(model.logits(hidden, cfg), cap)), -1) == np.asarray(data["targets"])
    assert float(metrics["top1"]) == (top & mask).sum()

    g_ours = nnx.jit(nnx.grad(lambda m, h: rm.vocab_loss(m, h, data, cfg, True)[0], argnums=(0, 1)))(model, hidden)
    g_ref = nnx.jit(nnx.grad(reference, argnums=(0, 1)))(model, hidden)
    jax.tree.map(_param_close(tied),
                 nnx.state(g_ours[0], nnx.Param), nnx.state(g_ref[0], nnx.Param))
    _grad_close(g_ours[1], g_ref[1])


@pytest.mark.tier1
@pytest.mark.parametrize("loss", SOFTMAX)
def test_softmax_loss_fn_is_maxtext_mean_token_cross_entropy(rng, monkeypatch, loss):
    # MaxText's loss_fn divides xent_sum by the mask's token count: the mean of optax's CE over the mask.
    monkeypatch.setattr(rm_loss, "train_module", lambda: _fake_train_module())
    v, d = 40, 8
    cfg = _config(loss=loss, **_blocks(loss, loss_block_v=8))
    model = _Model(v, d, nnx.Rngs(int(rng.integers(1 << 30))))
    data = {"inputs": jnp.asarray(rng.integers(0, v, (2, 6)), jnp.int32), **_batch(rng, v=v)}

    def reference(m):
        hidden = m.token_embedder.embedding[...][data["inputs"]]
        ce = optax.softmax_cross_entropy_with_integer_labels(m.logits(hidden, cfg), data["targets"])
        w = (data["targets_segmentation"] != 0).astype(jnp.float32)
        return jnp.sum(ce * w) / (jnp.sum(w) + EPS)

    loss_value, aux = rm.loss_fn(model, cfg, dict(data), None, None, is_train=True)
    np.testing.assert_allclose(float(loss_value), float(reference(model)), rtol=2e-6)
    assert {"top1", "mean_lse", "weight_sum", "num_targets", "invalid_targets"} <= set(aux["recloss_metrics"])
    grads = nnx.grad(lambda m: rm.loss_fn(m, cfg, dict(data), None, None)[0])(model)
    want = nnx.grad(reference)(model)
    jax.tree.map(_grad_close,
                 nnx.state(grads, nnx.Param), nnx.state(want, nnx.Param))
    assert float(jnp.abs(grads.decoder.logits_dense.kernel[...]).sum()) > 0


@pytest.mark.tier1
def test_loss_fn_reports_the_z_loss_apart_and_keeps_the_total(rng, monkeypatch):
    # The hook's second value is Σ w·λ·Z² (MaxText's learning/z_loss, after its normalisation); the
    # loss is xent_sum / Σ w with λ·Z² inside xent_sum once, as in MaxText's own cross-entropy.
    monkeypatch.setattr(rm_loss, "train_module", lambda: _fake_train_module())
    v, d = 40, 8
    model = _Model(v, d, nnx.Rngs(int(rng.integers(1 << 30))))
    data = {"inputs": jnp.asarray(rng.integers(0, v, (2, 6)), jnp.int32), **_batch(rng, v=v)}
    cfg = _config(loss="cutce", z_loss_multiplier=1e-2, loss_block_v=8)
    loss_value, aux = rm.loss_fn(model, cfg, dict(data), None, None, is_train=True)
    hidden = model.token_embedder.embedding[...][data["inputs"]]
    x = model.logits(hidden, cfg)
    mask = data["targets_segmentation"] != 0
    w = float(jnp.sum(mask))
    z_sum = float(jnp.sum(1e-2 * jax.scipy.special.logsumexp(x, axis=-1) ** 2 * mask))
    np.testing.assert_allclose(float(aux["z_loss"]), z_sum, rtol=2e-5)
    assert z_sum > 0
    np.testing.assert_allclose(float(loss_value), float(_token_ce(x, data["targets"], mask, 1e-2)) / (w + EPS),
                               rtol=2e-6)
    np.testing.assert_allclose(float(aux["xent_sum"]), float(loss_value) * (w + EPS), rtol=2e-6)
    np.testing.assert_allclose(float(aux["recloss_metrics"]["z_loss"]), z_sum, rtol=2e-5)
    _, bce_aux = rm.loss_fn(model, _config(loss="cutbce"), dict(data), None, None, is_train=True)
    assert float(bce_aux["z_loss"]) == 0.0


@pytest.mark.tier1
def test_softmax_config_keys_and_errors():
    assert {"z_loss", "temperature"} <= set(rm.OPTION_KEYS)
    assert rm.loss_settings(_config(loss="cutce", z_loss=1e-4, temperature=2.0)) == \
        ("cutce", recloss.LossOptions(reduction="sum", z_loss=1e-4, temperature=2.0))
    # MaxText's z_loss_multiplier is the softmax z-loss; the same value under both keys is fine.
    assert rm.loss_settings(_config(loss="cutce", z_loss_multiplier=1e-4))[1].z_loss == 1e-4
    assert rm.loss_settings(_config(loss="cutce", z_loss=1e-4, z_loss_multiplier=1e-4))[1].z_loss == 1e-4
    rm.check_supported(_config(loss="cutce", z_loss_multiplier=1e-4))
    with pytest.raises(ValueError, match=r"z_loss=0.001 and MaxText's z_loss_multiplier=0.0001"):
        rm.check_supported(_config(loss="cutce", z_loss=1e-3, z_loss_multiplier=1e-4))
    # BCE strategies have no normaliser to penalise; BCE options stay off softmax strategies.
    with pytest.raises(ValueError, match=r"z_loss_multiplier=0.0001: .*strategy 'cutbce'.*softmax strategy"):
        rm.check_supported(_config(loss="cutbce", z_loss_multiplier=1e-4))
    for overrides, key in ((dict(pos_weight=2.0), "pos_weight"), (dict(vocab_reduction="sum"), "vocab_reduction"),
                           (dict(loss_threshold=0.5), "loss_threshold"), (dict(focal_gamma=1.0), "focal_gamma")):
        with pytest.raises(ValueError, match=rf"loss config key {key!r}=.*strategy 'cutce' \(softmax objective"):
            rm.check_supported(_config(loss="cutce", **overrides))
    with pytest.raises(ValueError, match=r"loss config key 'z_loss'=.*strategy 'cutbce'"):
        rm.check_supported(_config(loss="cutbce", z_loss=1e-4))
    with pytest.raises(ValueError, match=r"'logit_soft_cap'=30.0 is rejected: strategy 'gbce' \(sampled"):
        rm.check_supported(_config(loss="gbce", logit_soft_cap=30.0))
    with pytest.raises(ValueError, match=r"final_logits_soft_cap=30.0: strategy 'gbce' \(sampled objective\)"):
        rm.check_supported(_config(loss="gbce", final_logits_soft_cap=30.0, logits_via_embedding=True))



@pytest.mark.tier1
@pytest.mark.parametrize("overrides,match", [
    (dict(loss="gbce", num_negatives=0), r"'num_negatives'=0 is rejected: .*expected an int >= 1"),
    (dict(loss="sampled_softmax", num_negatives=65, vocab_size=64), r"num_negatives=65: .*at most vocab_size=64"),
    (dict(loss="cutce", num_negatives=16), r"'num_negatives'=16 is rejected: strategy 'cutce'"),
    (dict(loss="gbce", gbce_t=2.0), r"'gbce_t'=2.0 is rejected: .*\[0, 1\]"),
    (dict(loss="gbce", in_batch_negatives=True), r"'in_batch_negatives'=True is rejected: strategy 'gbce'"),
    (dict(loss="sampled_softmax", z_loss_multiplier=1e-3), r"z_loss_multiplier=0.001: .*'sampled_softmax'"),
])
def test_sampled_config_errors_name_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        rm.check_supported(_config(**overrides))
    rm.check_supported(_config(loss="gbce", num_negatives=64, vocab_size=64))        # K = V is fine

@pytest.mark.tier1
def test_softmax_config_class_on_a_pydantic_base():
    pydantic = pytest.importorskip("pydantic", reason="pydantic is not installed (MaxText's config needs it)")

    class Base(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        num_vocab_tiling: int = 1
        z_loss_multiplier: float = 0.0

    cls = rm.config_class(Base)
    cfg = cls(num_vocab_tiling=2, loss="cutce", z_loss_multiplier=1e-4, temperature=0.5)
    assert rm.loss_settings(cfg) == ("cutce", recloss.LossOptions(reduction="sum", z_loss=1e-4, temperature=0.5))
    with pytest.raises(pydantic.ValidationError, match="pos_weight"):
        cls(num_vocab_tiling=2, loss="cutce", pos_weight=2.0)
    with pytest.raises(pydantic.ValidationError, match="z_loss_multiplier"):
        cls(num_vocab_tiling=2, loss="cutbce", z_loss_multiplier=1e-4)


# ------------------------------------------------------------------ loss_fn wrapper, install (no MaxText)
def _fake_train_module(call_hook=True):
    """A module shaped like maxtext.trainers.pre_train.train: loss_fn looks the hook up as a global."""
    mod = types.ModuleType("fake_maxtext_train")

    def vocab_tiling_nnx_loss(model, hidden_states, data, config, is_train):
        raise AssertionError("MaxText's own vocab tiling ran instead of recloss")

    def loss_fn(model, config, data, dropout_rng, params, sparsity_state=None, is_train=True):
        hidden = model.token_embedder.embedding[...][data["inputs"]]
        weights = jnp.sum(data["targets_segmentation"] != 0)
        if call_hook:
            xent_sum, z = mod.vocab_tiling_nnx_loss(model, hidden, data, config, is_train)
        else:
            xent_sum, z = jnp.float32(0.0), jnp.float32(0.0)
        return xent_sum / (weights + EPS), {"xent_sum": xent_sum, "z_loss": z, "total_weights": weights}

    mod.vocab_tiling_nnx_loss = vocab_tiling_nnx_loss
    mod.loss_fn = loss_fn
    return mod


@pytest.mark.tier1
def test_loss_fn_runs_maxtext_loss_with_the_recloss_hook(rng, monkeypatch):
    train = _fake_train_module()
    original_hook, original_loss_fn = train.vocab_tiling_nnx_loss, train.loss_fn
    monkeypatch.setattr(rm_loss, "train_module", lambda: train)
    v, d = 40, 8
    cfg = _config(loss="cutbce", loss_block_v=8)
    model = _Model(v, d, nnx.Rngs(int(rng.integers(1 << 30))))
    data = {"inputs": jnp.asarray(rng.integers(0, v, (2, 6)), jnp.int32), **_batch(rng, v=v)}
    loss, aux = rm.loss_fn(model, cfg, dict(data), None, None, is_train=True)
    hidden = model.token_embedder.embedding[...][data["inputs"]]
    want_sum = float(rm.vocab_loss(model, hidden, data, cfg, True)[0])
    np.testing.assert_allclose(float(aux["xent_sum"]), want_sum, rtol=1e-6)
    np.testing.assert_allclose(float(loss), want_sum / (float(aux["total_weights"]) + EPS), rtol=1e-6)
    assert set(aux["recloss_metrics"]) >= {"tp", "fp", "fn", "tn", "num_targets", "weight_sum"}
    assert train.vocab_tiling_nnx_loss is original_hook  # restored after the call
    # Differentiable end to end (as MaxText's train_step takes nnx.value_and_grad of it).
    grads = nnx.grad(lambda m: rm.loss_fn(m, cfg, dict(data), None, None)[0])(model)
    assert float(jnp.abs(grads.decoder.logits_dense.kernel[...]).sum()) > 0

    assert rm.install(train) is original_loss_fn and train.loss_fn is rm.loss_fn
    assert rm.install(train) is original_loss_fn  # idempotent
    loss2, _ = train.loss_fn(model, cfg, dict(data), None, None)  # no recursion into itself
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    rm.uninstall(train)
    assert train.loss_fn is original_loss_fn and not hasattr(train, "_recloss_original_loss_fn")
    # `installed` undoes its install on exit, and leaves an earlier install in place.
    with rm.installed(train) as within:
        assert within is train and train.loss_fn is rm.loss_fn
    assert train.loss_fn is original_loss_fn and not hasattr(train, "_recloss_original_loss_fn")
    rm.install(train)
    with rm.installed(train):
        pass
    assert train.loss_fn is rm.loss_fn
    rm.uninstall(train)

    with pytest.raises(ValueError, match="num_vocab_tiling=1"):
        rm.loss_fn(model, _config(num_vocab_tiling=1), dict(data), None, None)


@pytest.mark.tier1
def test_loss_fn_fails_loudly_when_the_hook_is_not_called(rng, monkeypatch):
    monkeypatch.setattr(rm_loss, "train_module", lambda: _fake_train_module(call_hook=False))
    model = _Model(40, 8, nnx.Rngs(0))
    data = {"inputs": jnp.zeros((2, 6), jnp.int32), **_batch(rng)}
    with pytest.raises(RuntimeError, match="did not call its vocab-tiling hook"):
        rm.loss_fn(model, _config(), data, None, None)


@pytest.mark.tier1
def test_targets_shape_error(rng):
    model = _Model(40, 8, nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"data\['targets'\] must be"):
        rm.vocab_loss(model, jnp.ones((2, 6, 8)), {"targets": jnp.zeros((2,), jnp.int32),
                                                   "targets_segmentation": jnp.ones((2, 6))}, _config(), True)


# ------------------------------------------------------------------ real MaxText (Python >= 3.12)
@pytest.fixture(scope="module")
def maxtext():
    reason = ("MaxText is not installed (it needs Python >= 3.12: pip install 'recloss[maxtext]'); "
              "its adapter is tested above on stand-ins")
    if os.environ.get("RECLOSS_REQUIRE_MAXTEXT") == "1":     # `make test-py312`: a skip would hide a break
        from maxtext.configs import pyconfig
    else:
        pyconfig = pytest.importorskip("maxtext.configs.pyconfig", reason=reason)
    from maxtext.utils import model_creation_utils
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR
    return types.SimpleNamespace(pyconfig=pyconfig, create=model_creation_utils.from_config,
                                 base_yml=os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml"))


TINY = ["run_name=recloss_test", "enable_checkpointing=false", "base_emb_dim=16", "base_num_query_heads=2",
        "base_num_kv_heads=2", "head_dim=8", "base_mlp_dim=32", "base_num_decoder_layers=1", "vocab_size=64",
        "max_target_length=8", "per_device_batch_size=1", "dtype=float32", "attention=dot_product",
        "log_config=false", "skip_jax_distributed_system=true"]


def _initialize(maxtext, *overrides):
    return maxtext.pyconfig.initialize(["", maxtext.base_yml, *TINY, *overrides],
                                       config_class=rm.config_class())


@pytest.mark.tier2
@pytest.mark.stack
def test_maxtext_pyconfig_accepts_recloss_keys(maxtext):
    cfg = _initialize(maxtext, "num_vocab_tiling=2", "loss=cutbce_pallas", "loss_block_v=512",
                      "label_smoothing=0.05", "focal_alpha=0.25", "loss_batch_axes=[data,fsdp]")
    assert (cfg.loss, cfg.loss_block_v, cfg.label_smoothing, cfg.focal_alpha, list(cfg.loss_batch_axes)) == \
        ("cutbce_pallas", 512, 0.05, 0.25, ["data", "fsdp"])
    assert rm.loss_settings(cfg)[1] == recloss.LossOptions(reduction="sum", block_v=512, label_smoothing=0.05,
                                                           focal_alpha=0.25)
    for bad, match in (("loss=cutbse", "not a recloss strategy"), ("loss_blok_v=8", "loss_blok_v"),
                       ("label_smoothing=1.5", "label_smoothing")):
        with pytest.raises(Exception, match=match):
            _initialize(maxtext, "num_vocab_tiling=2", bad)
    assert _initialize(maxtext, "loss=cutbce").num_vocab_tiling == 2  # base.yml has 1: the plugin picks one


@pytest.mark.tier2
@pytest.mark.stack
def test_maxtext_pyconfig_picks_and_reports_num_vocab_tiling(maxtext, capsys):
    """MaxText's base.yml leaves num_vocab_tiling at 1, which the recloss loss cannot run with: the config class
    picks the smallest value > 1 that MaxText's own check accepts, and says so."""
    for overrides, want, tokens in ((("loss=cutce_pallas",), 2, 8),
                                    (("loss=cutce_pallas", "max_target_length=9"), 3, 9),
                                    (("loss=cutbce", "per_device_batch_size=3", "max_target_length=5"), 3, 15)):
        capsys.readouterr()
        cfg = _initialize(maxtext, *overrides)
        assert cfg.num_vocab_tiling == want, overrides
        out = capsys.readouterr().out
        assert f"recloss: num_vocab_tiling={want} (picked; the config has 1): the recloss loss needs " \
               "num_vocab_tiling > 1" in out, out
        assert f"{want} is the smallest value > 1 that divides the {tokens} tokens per device" in out, out
    assert _initialize(maxtext, "loss=cutce", "num_vocab_tiling=4").num_vocab_tiling == 4     # set: kept
    assert "picked" not in capsys.readouterr().out
    with pytest.raises(Exception, match=r"tokens per device \(per_device_batch_size=0.125 x max_target_length=8\), "
                                        r"which no value > 1 does"):
        _initialize(maxtext, "loss=cutce", "per_device_batch_size=0.125")
    with pytest.raises(Exception, match="divisible by the number of vocab tiles"):   # MaxText's own check
        _initialize(maxtext, "loss=cutce", "num_vocab_tiling=3")


@pytest.mark.tier2
@pytest.mark.stack
def test_maxtext_pyconfig_soft_cap_keys_and_errors(maxtext):
    cfg = _initialize(maxtext, "num_vocab_tiling=2", "loss=cutce", "logit_soft_cap=30")
    assert cfg.logit_soft_cap == 30.0 and rm.loss_settings(cfg)[1].logit_soft_cap == 30.0
    cfg = _initialize(maxtext, "num_vocab_tiling=2", "loss=cutbce", "logits_via_embedding=true",
                      "final_logits_soft_cap=30.0")
    assert cfg.logit_soft_cap is None and rm.loss_settings(cfg)[1].logit_soft_cap == 30.0
    untied = _initialize(maxtext, "num_vocab_tiling=2", "loss=cutce", "final_logits_soft_cap=30.0")
    assert rm.loss_settings(untied)[1].logit_soft_cap is None     # MaxText caps no logits_dense head
    for bad, match in (("logit_soft_cap=0", r"loss config key 'logit_soft_cap'=0.0 is rejected"),
                       ("logit_soft_cap=-2", r"'logit_soft_cap'=-2.0 is rejected"),
                       ("loss=cutce_palas", r"'loss'='cutce_palas' is not a recloss strategy.*did you mean "
                                            r"'cutce_pallas'")):
        with pytest.raises(Exception, match=match):
            _initialize(maxtext, "num_vocab_tiling=2", "loss=cutce", bad)
    with pytest.raises(Exception, match=r"logit_soft_cap=20.0 and MaxText's final_logits_soft_cap=30.0"):
        _initialize(maxtext, "num_vocab_tiling=2", "loss=cutce", "logits_via_embedding=true",
                    "final_logits_soft_cap=30.0", "logit_soft_cap=20")
    with pytest.raises(Exception, match="loss"):
        maxtext.pyconfig.initialize(["", maxtext.base_yml, *TINY, "loss=cutbce"])  # MaxText's own class


def _maxtext_batch(cfg, rng):
    """One MaxText batch of the config's shape: random tokens and targets, about 20 % of the targets padding."""
    b, t, v = cfg.global_batch_size_to_train_on, cfg.max_target_length, cfg.vocab_size
    return {"inputs": jnp.asarray(rng.integers(1, v, (b, t)), jnp.int32),
            "inputs_position": jnp.asarray(np.broadcast_to(np.arange(t), (b, t)), jnp.int32),
            "inputs_segmentation": jnp.ones((b, t), jnp.int32),
            "targets": jnp.asarray(rng.integers(1, v, (b, t)), jnp.int32),
            "targets_segmentation": jnp.asarray(rng.random((b, t)) < 0.8, jnp.int32)}


@pytest.mark.tier2
@pytest.mark.stack
@pytest.mark.parametrize("overrides", [
    ("loss=cutbce", "label_smoothing=0.1", "loss_block_v=16"),
    ("loss=dense_bce", "logits_via_embedding=true", "pos_weight=2.0"),
])
def test_maxtext_loss_and_grads_match_bce_of_maxtext_logits(maxtext, rng, overrides):
    cfg = _initialize(maxtext, "num_vocab_tiling=2", *overrides)
    model = maxtext.create(cfg, rngs=nnx.Rngs(params=int(rng.integers(1 << 30)), dropout=1))
    data = _maxtext_batch(cfg, rng)
    _, opts = rm.loss_settings(cfg)

    def ours(m):
        return rm.loss_fn(m, cfg, dict(data), None, None, is_train=True)[0]

    def reference(m):  # MaxText's own logits (its output head), then dense BCE.
        m(decoder_input_tokens=data["inputs"], decoder_positions=data["inputs_position"],
          decoder_segment_ids=data["inputs_segmentation"], enable_dropout=False,
          decoder_target_tokens=data["targets"], decoder_target_mask=data["targets_segmentation"])
        hidden = nnx.pop(m, nnx.Intermediate).to_pure_dict()["decoder"]["hidden_states"][0]
        x = m.logits_from_hidden_states_for_vocab_tiling(hidden, True, "train").astype(jnp.float32)
        v = cfg.vocab_size
        y = jax.nn.one_hot(data["targets"], v) * (1 - opts.label_smoothing) + opts.label_smoothing / 2
        ell = (y * opts.pos_weight * jax.nn.softplus(-x) + (1 - y) * jax.nn.softplus(x)).sum(-1) / v
        w = (data["targets_segmentation"] != 0).astype(jnp.float32)
        return (ell * w).sum() / (w.sum() + EPS)

    loss, grads = nnx.jit(nnx.value_and_grad(ours))(model)
    want, want_grads = nnx.jit(nnx.value_and_grad(reference))(model)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    got_leaves = jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))
    want_leaves = jax.tree_util.tree_leaves_with_path(nnx.state(want_grads, nnx.Param))
    assert len(got_leaves) == len(want_leaves) > 0
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        scale = float(jnp.max(jnp.abs(w)))
        assert scale > 0
        # The reference's tied head (MaxText's attend) rounds the embedding's cotangent to bfloat16.
        tied = cfg.logits_via_embedding and "embedding" in jax.tree_util.keystr(path)
        np.testing.assert_allclose(np.asarray(g) / scale, np.asarray(w) / scale, atol=2 ** -8 if tied else 1e-5,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.tier2
@pytest.mark.stack
@pytest.mark.parametrize("overrides", [
    ("loss=cutce", "loss_block_v=16"),
    ("loss=cutce", "z_loss_multiplier=1e-4", "logits_via_embedding=true"),
    # MaxText's soft cap where it applies it (the tied head), and where it does not (logits_dense).
    ("loss=cutce", "z_loss_multiplier=1e-2", "logits_via_embedding=true", "final_logits_soft_cap=0.5"),
    ("loss=cutce", "final_logits_soft_cap=0.5", "loss_block_v=16"),
] + [(f"loss={name}",) for name in SOFTMAX if name not in ("cutce", "dense_ce")])
def test_maxtext_softmax_loss_and_grads_match_maxtext_own_cross_entropy(maxtext, rng, overrides):
    # MaxText's own loss_fn (its vocab-tiling hook builds [chunk, V] logits) against the recloss one.
    train = pytest.importorskip("maxtext.trainers.pre_train.train")
    cfg = _initialize(maxtext, "num_vocab_tiling=2", *overrides)
    seed = int(rng.integers(1 << 30))
    model = maxtext.create(cfg, rngs=nnx.Rngs(params=seed, dropout=1))
    data = _maxtext_batch(cfg, rng)
    own = rm_loss.original_loss_fn(train)
    (loss, aux), grads = nnx.jit(nnx.value_and_grad(lambda m: rm.loss_fn(m, cfg, dict(data), None, None),
                                                    has_aux=True))(model)
    (want, want_aux), want_grads = nnx.jit(nnx.value_and_grad(lambda m: own(m, cfg, dict(data), None, None),
                                                              has_aux=True))(model)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    # learning/z_loss: MaxText's normalised z-loss part, non-zero with z_loss_multiplier; not in the total twice.
    np.testing.assert_allclose(float(aux["z_loss"]), float(want_aux["z_loss"]), rtol=1e-5, atol=1e-12)
    assert (float(aux["z_loss"]) > 0) == (cfg.z_loss_multiplier > 0)
    if rm.maxtext_soft_cap(cfg) is not None:    # the cap changes MaxText's own loss here: a real check
        cfg0 = _initialize(maxtext, "num_vocab_tiling=2", *[o for o in overrides if "soft_cap" not in o])
        model0 = maxtext.create(cfg0, rngs=nnx.Rngs(params=seed, dropout=1))     # the same parameters
        uncapped = own(model0, cfg0, dict(data), None, None)[0]
        assert abs(float(uncapped) - float(want)) > 1e-3 * abs(float(want)), (float(uncapped), float(want))
    got_leaves = jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))
    want_leaves = jax.tree_util.tree_leaves_with_path(nnx.state(want_grads, nnx.Param))
    assert len(got_leaves) == len(want_leaves) > 0
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        scale = max(float(np.max(np.abs(w))), 1e-12)
        if cfg.logits_via_embedding and "embedding" in jax.tree_util.keystr(path):
            # MaxText's tied output head (attend) multiplies by the table cast to bfloat16, so the head's part
            # of its embedding cotangent is rounded to bfloat16 (2^-9 relative a rounding); recloss keeps
            # float32. That part can exceed the leaf's total (the lookup's part cancels it), so an element
            # may differ by more than 2^-9 of the leaf's largest (seed 1376439920: 4.1e-3 at 2^-8 = 3.9e-3);
            # over the leaf it stays near 2^-9.5 (1.2e-3 to 1.8e-3 of its norm: 6 seeds, both tied cases here).
            assert np.linalg.norm(g - w) <= 2 ** -8 * np.linalg.norm(w), (np.linalg.norm(g - w), np.linalg.norm(w))
            np.testing.assert_allclose(g / scale, w / scale, atol=2 ** -6, err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_allclose(g / scale, w / scale, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def _relative_errors(grads, ref):
    """{parameter path: ‖g − ref‖ / ‖ref‖} over the nnx.Param leaves of two gradient states."""
    return {jax.tree_util.keystr(path): rel(g, r)
            for (path, g), (_, r) in zip(jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)),
                                         jax.tree_util.tree_leaves_with_path(nnx.state(ref, nnx.Param)))}


# The pure-JAX tied head, and the two gathers whose cross-device sums carry bfloat16 (the ring's carry is float32).
BF16_LOSSES = [("loss=cutce",),
               *[("loss=cutce_pallas", "loss_batch_axes=[data,fsdp]", "loss_fsdp_axis=fsdp",
                  f"loss_fsdp_gather={g}") for g in ("once", "rows")]]


@pytest.mark.tier2
@pytest.mark.stack
def test_maxtext_bfloat16_gradients_are_as_close_to_float32_as_maxtext_own(maxtext, rng):
    """docs/sharding.md "16-bit gradients", against MaxText: with dtype=bfloat16 (the step MaxText users run),
    every parameter's gradient under recloss is as close to MaxText's own float32 gradient (same weights,
    same batch) as MaxText's own bfloat16 loss gives, normwise: ‖g − g32‖ ≤ 2·‖g_MaxText − g32‖ + 2^-8·‖g32‖
    (both are about 1e-2: the decoder's bfloat16 passes dominate; a gradient summed or laid out wrong is far off),
    for each of `BF16_LOSSES` on a tied head. The fsdp gathers run under shard_map on the 8-device mesh, so the
    table's gradient crosses devices in bfloat16 as on a chip (test_ring's bound holds each entry to the float64
    oracle). MaxText's own two gradients do not read the loss keys: computed once for all three."""
    train = pytest.importorskip("maxtext.trainers.pre_train.train")
    config = lambda *more: _initialize(maxtext, "num_vocab_tiling=2", "logits_via_embedding=true", *more)
    cfg32 = config(*BF16_LOSSES[0])
    assert cfg32.dtype == jnp.float32
    seed = int(rng.integers(1 << 30))
    data = _maxtext_batch(cfg32, rng)
    own = rm_loss.original_loss_fn(train)

    def grads(cfg, fn):
        model = maxtext.create(cfg, rngs=nnx.Rngs(params=seed, dropout=1))     # the same float32 weights
        return nnx.jit(nnx.grad(lambda m: fn(m, cfg, dict(data), None, None)[0]))(model)

    ref = grads(cfg32, own)
    theirs = _relative_errors(grads(config(*BF16_LOSSES[0], "dtype=bfloat16"), own), ref)
    assert max(theirs.values()) > 2 ** -12      # bfloat16 moved MaxText's own gradients: a real comparison
    for overrides in BF16_LOSSES:
        cfg16 = config(*overrides, "dtype=bfloat16")
        assert cfg16.dtype == jnp.bfloat16
        ours = _relative_errors(grads(cfg16, rm.loss_fn), ref)
        print(overrides, {k: (round(ours[k], 5), round(theirs[k], 5)) for k in ours})
        assert set(ours) == set(theirs) and ours
        for k in ours:
            assert ours[k] <= 2 * theirs[k] + 2 ** -8, (overrides, k, ours[k], theirs[k])


@pytest.mark.tier2
@pytest.mark.stack
def test_maxtext_install_replaces_train_loss_fn(maxtext):
    train = pytest.importorskip("maxtext.trainers.pre_train.train")
    original = train.loss_fn
    try:
        assert rm.install() is original and train.loss_fn is rm.loss_fn
    finally:
        rm.uninstall()
    assert train.loss_fn is original
    assert "vocab_tiling_nnx_loss" in vars(train)  # the hook recloss swaps in is still where it was



@pytest.mark.tier2
@pytest.mark.stack
def test_maxtext_training_loop_runs_the_recloss_loss(maxtext, monkeypatch, tmp_path):
    from recloss_plugins.maxtext import train as rm_train
    train = pytest.importorskip("maxtext.trainers.pre_train.train")
    calls = count_vocab_loss_calls(monkeypatch)
    original = train.loss_fn
    rm_train.main(["", maxtext.base_yml, *TINY, f"base_output_directory={tmp_path}", "steps=2",
                   "dataset_type=synthetic", "num_vocab_tiling=2", "loss=cutbce", "loss_block_v=16"])
    assert calls and set(calls) == {"cutbce"}  # traced inside MaxText's train/eval steps
    assert train.loss_fn is original and maxtext.pyconfig.initialize.__module__ == "maxtext.configs.pyconfig"


def _metrics(path):
    """MaxText's metrics_file: one JSON line per step -> [{metric: value}] in step order."""
    import json
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [r for r in sorted(rows, key=lambda r: r["step"])]


@pytest.mark.tier2
@pytest.mark.stack
@pytest.mark.parametrize("loss, overrides", [
    ("cutce", ("z_loss_multiplier=1e-2",)),
    ("cutce", ("z_loss_multiplier=1e-2", "logits_via_embedding=true", "final_logits_soft_cap=0.5",
               "packing=true", "max_segments_per_seq=3")),
    ("cutce_pallas", ("z_loss_multiplier=1e-2", "logits_via_embedding=true", "final_logits_soft_cap=0.5")),
])
def test_maxtext_two_training_steps_log_what_maxtext_own_loss_logs(maxtext, rng, tmp_path, loss, overrides):
    # MaxText's own train loop, twice on the same synthetic batches and initial weights: its own loss,
    # then the recloss one. Step 1's loss follows the optimizer's update from step 0's gradients, so
    # the whole gradient has to match, not only the loss; learning/z_loss is the z-loss part alone.
    from recloss_plugins.maxtext import train as rm_train
    train = pytest.importorskip("maxtext.trainers.pre_train.train")
    seed = int(rng.integers(1 << 30))
    print(f"init_weights_seed={seed}")
    common = [*TINY, "steps=2", "dataset_type=synthetic", "num_vocab_tiling=2", f"init_weights_seed={seed}",
              "learning_rate=1e-2", "warmup_steps_fraction=0", *overrides]
    runs = {}
    for who in ("maxtext", loss):
        out = tmp_path / who
        argv = ["", maxtext.base_yml, *common, f"base_output_directory={out}", f"metrics_file={out}.jsonl",
                f"run_name={who}", f"jax_cache_dir={tmp_path / 'jax_cache'}"]
        if who == "maxtext":
            train.main(argv)
        else:
            rm_train.main(argv + [f"loss={loss}"])
        runs[who] = _metrics(f"{out}.jsonl")
    want, got = runs["maxtext"], runs[loss]
    print({who: [(r["learning/loss"], r["learning/z_loss"]) for r in rows] for who, rows in runs.items()})
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1]
    assert abs(want[1]["learning/loss"] - want[0]["learning/loss"]) > 1e-4    # the step moved the weights
    # Step 0 is the same float32 loss. MaxText's tied head (attend) rounds the embedding's gradient to
    # bfloat16 (2^-8 relative) where recloss keeps float32, so after one update the tied runs differ
    # by a few 1e-6 of the loss (6e-6 seen); untied ones agree to float32 rounding (1e-7 seen).
    tied = "logits_via_embedding=true" in overrides
    for step, (g, w) in enumerate(zip(got, want)):
        rtol = 1e-4 if (tied and step) else 1e-5
        np.testing.assert_allclose(g["learning/loss"], w["learning/loss"], rtol=rtol, err_msg=f"step {step}")
        np.testing.assert_allclose(g["learning/z_loss"], w["learning/z_loss"], rtol=rtol, err_msg=f"step {step}")
        assert g["learning/z_loss"] > 0


@pytest.mark.tier2
@pytest.mark.stack
def test_maxtext_sampled_loss_draws_new_negatives_each_step_and_the_same_after_a_resume(maxtext, rng, tmp_path):
    # learning_rate=0 and MaxText's synthetic data (the same batch every step; MaxText's own loss is
    # constant then): a sampled loss moves from step to step only through its negatives. A run stopped
    # after 2 steps and resumed from its checkpoint logs the uninterrupted run's step-2 loss. (gbce draws
    # through the same negatives_key: the stand-in test above covers both.)
    from recloss_plugins.maxtext import train as rm_train
    loss = "sampled_softmax"
    seed = int(rng.integers(1 << 30))
    print(f"init_weights_seed={seed}")
    common = [*[a for a in TINY if a != "enable_checkpointing=false"], "dataset_type=synthetic", "num_vocab_tiling=2",
              f"init_weights_seed={seed}", "learning_rate=0", f"loss={loss}", "num_negatives=16",
              f"jax_cache_dir={tmp_path / 'jax_cache'}"]
    runs = {}
    for who, steps, ckpt in (("straight", 3, False), ("stopped", 2, True), ("stopped", 3, True)):
        out = tmp_path / who
        rm_train.main(["", maxtext.base_yml, *common, f"steps={steps}", f"base_output_directory={out}",
                       f"metrics_file={out}-{steps}.jsonl", f"run_name={who}",
                       f"enable_checkpointing={str(ckpt).lower()}", "checkpoint_period=1", "async_checkpointing=false"])
        runs[f"{who}-{steps}"] = {r["step"]: r["learning/loss"] for r in _metrics(f"{out}-{steps}.jsonl")}
    print(runs)
    straight = runs["straight-3"]
    assert sorted(straight) == [0, 1, 2] and len(set(straight.values())) == 3, straight
    assert runs["stopped-2"] == {0: straight[0], 1: straight[1]}
    assert runs["stopped-3"] == {2: straight[2]}, "the resumed run did not resume, or drew other negatives"
