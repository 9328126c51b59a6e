"""recloss as MaxText's training loss.

MaxText (``maxtext.trainers.pre_train.train``) computes its loss in
``loss_fn(model, config, data, dropout_rng, params, sparsity_state=None, is_train=True)``.
With ``num_vocab_tiling > 1`` the decoder skips the [batch, length, vocab]
logits, sows its final hidden states, and ``loss_fn`` hands them to
``vocab_tiling_nnx_loss(model, hidden_states, data, config, is_train) ->
(xent_sum, z_loss_sum)``. This module supplies:

* `vocab_loss`: a drop-in for that hook computing ``Σ_tokens w·ℓ`` with the
  configured recloss strategy (w = ``targets_segmentation != 0``), from the hidden states after
  MaxText's final norm and dropout, against the output table (the
  ``logits_dense`` kernel transposed, or the token embedding when
  ``logits_via_embedding``, scaled by D^-1/2 when ``normalize_embedding_logits``).
  With a softmax strategy (``loss=cutce``, ``cutce_pallas``, ``dense_ce``) ℓ is
  `recloss.softmax_loss` with L = 1 target per token, the next token:
  ``logsumexp(x) − x[target] + λ·logsumexp(x)²`` with λ = MaxText's
  ``z_loss_multiplier`` (or ``z_loss``), which is MaxText's own token
  cross-entropy (``max_utils.cross_entropy_with_logits``, z-loss included in
  xent as MaxText includes it), computed without [tokens, V] logits; the
  z-loss sum Σ w·λ·logsumexp(x)² comes back apart as the hook's second value,
  as MaxText's own does. x is soft-capped, c·tanh(x/c), with MaxText's
  ``final_logits_soft_cap`` where MaxText applies it (tied embedding logits)
  or with ``logit_soft_cap``. With a BCE strategy (``loss=cutbce`` ...) ℓ is
  the full-vocabulary BCE of `recloss.bce_loss` (z-loss sum 0). With a sampled
  strategy (``loss=sampled_softmax``, ``gbce``) ℓ is `recloss.sampled_loss` over
  K uniformly drawn negatives, their key from MaxText's own RNG state
  (`negatives_key`), so a resumed run draws what an uninterrupted one would.
* `loss_fn`: MaxText's ``loss_fn`` signature. It runs MaxText's own
  ``loss_fn`` (so MoE, MTP and indexer auxiliary losses, gradient-accumulation
  normalisation and the aux dict stay MaxText's) with `vocab_loss` in place of
  the vocab-tiling hook, and adds ``aux['recloss_metrics']`` (num_targets,
  invalid_targets, weight_sum, and tp, fp, fn, tn for BCE or top1 — the
  weighted count of tokens whose argmax is the target — and mean_lse for softmax).
* `install()`: makes MaxText's trainer use `loss_fn`
  (``train.loss_fn = loss_fn``); call it before ``train.main(argv)``, or
  run ``train.main(argv)`` inside ``with installed():``.

Targets: ``data['targets']`` [B, T] (one id per token, the language-model
case) or [B, T, L] (L ids per token, multi-label; a softmax strategy then
averages the cross-entropies of a token's targets); ``loss_pad_id`` marks
padding inside the L ids.

MaxText's separate z-loss (``aux['z_loss']``, logged as learning/z_loss) is
MaxText's: it divides the hook's z-loss sum (the softmax strategies'
``metrics['z_loss']``, from the same pass) by the token count and only logs
it, since λ·Z² is already inside ``xent_sum``; the loss is not changed by it.
``recloss_metrics['mean_lse']`` is the mean log-partition Z.

Verified against MaxText 0.2.5 (``loss_fn`` and ``vocab_tiling_nnx_loss``
signatures, the NNX decoder's ``decoder_norm``/``dropout``/``logits_dense``
and ``token_embedder.embedding``); MaxText needs Python >= 3.12.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp

import recloss
from recloss_plugins.flax import unwrap
from recloss_plugins.maxtext import config as config_lib

_TRAIN_MODULE = "maxtext.trainers.pre_train.train"
_HOOK = "vocab_tiling_nnx_loss"
# Where `install` keeps MaxText's own loss_fn on the train module.
_ORIGINAL = "_recloss_original_loss_fn"
_lock = threading.RLock()


def output_table(model, config, features: int, dtype=None):
    """(table [V, D], hidden scale) of a MaxText NNX Transformer's output projection, in ``dtype``
    (default: the parameter's).

    Logits are ``(scale·y) · table[v]``: with ``logits_via_embedding`` the
    table is the token embedding rounded to bfloat16 (as MaxText's
    ``attend_on_embedding`` does) and scale is D^-1/2 when
    ``normalize_embedding_logits``; otherwise the table is the ``logits_dense``
    kernel [D, V] cast to ``dtype``, then transposed (`row_major_transpose`: a V·D copy in
    ``dtype``) and scale is 1.
    """
    if getattr(config, "logits_via_embedding", False):
        table = unwrap(model.token_embedder.embedding)
        table = table.astype(jnp.bfloat16).astype(dtype or table.dtype)
        scale = features ** -0.5 if getattr(config, "normalize_embedding_logits", True) else 1.0
        return table, scale
    dense = model.decoder.logits_dense
    kernel = unwrap(dense.kernel)
    if kernel.ndim != 2 or kernel.shape[0] != features:
        raise ValueError(f"logits_dense kernel has shape {tuple(kernel.shape)}; expected [D={features}, V]")
    if getattr(dense, "bias", None) is not None:
        raise ValueError("logits_dense has a bias, which the recloss MaxText loss does not read")
    return row_major_transpose(kernel.astype(dtype or kernel.dtype)), 1.0


def _row_major(x):
    from jax.experimental.layout import Layout, with_layout_constraint
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


@jax.custom_vjp
def row_major_transpose(kernel):
    """``kernel.T`` [V, D] of a [D, V] ``kernel``, moved in memory (row-major), and its gradient moved
    back the same way.

    Left to itself, XLA makes a transpose free by giving the kernel a transposed memory layout; for a
    parameter that means copying it, and its optimizer moments with it, into that layout for the
    update (three float32 [D, V] copies in a MaxText step: 1.5 GiB for llama3.1-8b on v5p-8). Moved
    explicitly, the copy is one of the compute dtype (bfloat16) each way, and the parameter and its
    moments keep their layout.
    """
    return _row_major(kernel.T)


def _row_major_transpose_fwd(kernel):
    return row_major_transpose(kernel), None


def _row_major_transpose_bwd(_, g):
    return (_row_major(g.T),)


row_major_transpose.defvjp(_row_major_transpose_fwd, _row_major_transpose_bwd)


# Tags the negatives' key apart from every other draw of the decoder's dropout stream.
_NEGATIVES_TAG = 0x73616D70


def negatives_key(model):
    """The key of this call's sampled negatives: one draw of the decoder's ``dropout`` RNG stream, tagged.

    MaxText keeps its randomness as NNX RNG state in the model (``decoder.rngs``,
    seeded from ``init_weights_seed``): the stream's count is part of the train
    state, advanced by every draw and carried across steps, gradient-accumulation
    microbatches and checkpoints, so step s draws the same negatives in a
    resumed run. The draw advances the count whether or not dropout is on.
    """
    rngs = getattr(getattr(model, "decoder", None), "rngs", None)
    try:
        stream = rngs.dropout
    except (AttributeError, KeyError):
        raise ValueError("a sampled recloss loss draws its negatives from the decoder's 'dropout' RNG stream, "
                         "which this MaxText model does not have (a model built for inference has only "
                         "'params'); build it for training, or use a softmax or BCE strategy") from None
    return jax.random.fold_in(stream(), _NEGATIVES_TAG)


def _targets_and_weights(data):
    targets = data["targets"]
    if targets.ndim == 2:
        targets = targets[..., None]
    if targets.ndim != 3:
        raise ValueError(f"data['targets'] must be [batch, length] or [batch, length, L] ids, got shape "
                         f"{tuple(targets.shape)}")
    weights = (data["targets_segmentation"] != 0).astype(jnp.float32)
    return targets, weights


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def grad_in_layout(table, sharding):
    """``table`` unchanged; its gradient is laid out as ``sharding`` (MaxText's own table layout) in the
    table's dtype before it leaves the loss.

    Under shard_map the table's gradient comes out in the loss's layout (rows over the fsdp axis),
    and MaxText stores its table with D over that axis. Without this, XLA moves it after the cast back
    to the float32 parameter, so the all-to-all carries float32 (two [V, D]/|fsdp| float32 buffers at
    the step's peak); with it, the move carries the table's dtype (bfloat16) and the cast follows.
    The values are the same: a layout, not a rounding.
    """
    return table


def _grad_in_layout_fwd(table, sharding):
    return table, None


def _grad_in_layout_bwd(sharding, _, g):
    return (jax.lax.with_sharding_constraint(g, sharding),)


grad_in_layout.defvjp(_grad_in_layout_fwd, _grad_in_layout_bwd)


def loss_from_hidden(hidden, table, data, config, *, mesh=None, key=None):
    """(Σ w·ℓ, metrics) of the configured recloss strategy (BCE, softmax or sampled, through the strategy object).

    hidden [B, T, D] (already normed and scaled), table [V, D];
    ``data['targets']`` [B, T] or [B, T, L], ``data['targets_segmentation']``
    [B, T] (0 = padding token, weight 0). ``mesh`` is MaxText's: the loss runs
    under shard_map on it when the config sets ``loss_batch_axes``, or, for a
    Mosaic kernel on a multi-device TPU mesh, on the axes `config.derive_mesh_axes`
    reads from it; ``key`` (a `jax.random` key) only for a
    sampled strategy, whose K negatives it draws (uniform over the vocabulary). A Pallas strategy runs its
    TPU kernel (not interpret mode) under MaxText's ``jax.set_mesh`` of a TPU mesh unless ``loss_interpret``
    is set, also when the host compiling it is a CPU (MaxText's train_compile): the strategy reads the
    platform from the ambient mesh.
    """
    name, options = config_lib.loss_settings(config)
    targets, weights = _targets_and_weights(data)
    strategy = recloss.get_strategy(name, options)
    layout = config_lib.layout_for(config, mesh, hidden, table)
    if layout is not None:
        spec = config_lib.table_spec(config, mesh)
        if spec is not None:
            table = grad_in_layout(table, jax.sharding.NamedSharding(mesh, spec))
    extra = {}
    if strategy.objective == "sampled":
        if key is None:
            raise ValueError(f"loss={name!r} draws K={options.num_negatives} negatives and needs key= (vocab_loss "
                             "passes `negatives_key(model)`)")
        extra["key"] = key
    out = strategy(hidden, table, targets, weights, layout=layout, **extra)
    return out.loss, out.metrics


def vocab_loss(model, hidden_states, data, config, is_train, *, metrics_out: Optional[Dict] = None):
    """Drop-in for MaxText's ``vocab_tiling_nnx_loss``: (Σ_tokens w·ℓ, Σ_tokens w·λ·Z²), f32 scalars.

    ℓ is the configured strategy's (module docstring): for a softmax strategy
    MaxText's token cross-entropy including its z-loss term λ·Z², for a BCE one
    the full-vocabulary BCE, for a sampled one the sampled loss over negatives
    drawn with `negatives_key`. The second value is the z-loss part alone (the
    strategy's ``metrics['z_loss']``; 0 without a z-loss), which MaxText only
    logs: it is inside the first already.

    Applies the decoder's final norm and dropout to ``hidden_states``
    [B, T, D] (as MaxText's output head does), then the recloss loss against
    `output_table`. Computes in float32 when ``logits_dot_in_fp32``, else in
    ``config.dtype`` (recloss accumulates in float32 either way). The metrics
    dict is stored into ``metrics_out`` when given.
    """
    config_lib.check_supported(config)
    decoder = model.decoder
    deterministic = not config.enable_dropout if is_train else True
    y = decoder.decoder_norm(hidden_states)
    y = decoder.dropout(y, deterministic=deterministic)
    dtype = jnp.float32 if getattr(config, "logits_dot_in_fp32", False) else getattr(config, "dtype", None)
    table, scale = output_table(model, config, y.shape[-1], dtype)
    if scale != 1.0:
        y = y * jnp.asarray(scale, y.dtype)
    if dtype is not None:
        y = y.astype(dtype)
    sampled = recloss.get_strategy(config_lib.loss_settings(config)[0]).objective == "sampled"
    loss_sum, metrics = loss_from_hidden(y, table, data, config, mesh=getattr(model, "mesh", None),
                                         key=negatives_key(model) if sampled else None)
    if metrics_out is not None:
        metrics_out.update(metrics)
    return loss_sum, metrics.get("z_loss", jnp.zeros((), jnp.float32))


def train_module():
    """MaxText's pre-training module, ``maxtext.trainers.pre_train.train`` (imported on first use)."""
    import importlib
    return importlib.import_module(_TRAIN_MODULE)


def original_loss_fn(train):
    """MaxText's own loss_fn, also after `install` replaced ``train.loss_fn``."""
    return getattr(train, _ORIGINAL, train.loss_fn)


@contextlib.contextmanager
def _hook(train, fn):
    with _lock:
        saved = getattr(train, _HOOK)
        setattr(train, _HOOK, fn)
        try:
            yield
        finally:
            setattr(train, _HOOK, saved)


def loss_fn(model, config, data, dropout_rng, params, sparsity_state=None, is_train=True):
    """MaxText's ``loss_fn`` with the recloss loss: returns (loss, aux) as MaxText's does.

    loss = Σ w·ℓ / (Σ w + EPS) plus MaxText's auxiliary losses (Σ w·ℓ alone
    under manual gradient accumulation, as MaxText does); aux is MaxText's
    dict, with ``xent_sum`` = Σ w·ℓ, ``z_loss`` = Σ w·λ·Z² / (Σ w + EPS)
    (MaxText's normalisation of the hook's z-loss sum; 0 for BCE), and
    ``recloss_metrics``.
    """
    config_lib.check_supported(config)
    train = train_module()
    metrics: Dict[str, Any] = {}

    def hook(model_, hidden_states, data_, config_, is_train_):
        return vocab_loss(model_, hidden_states, data_, config_, is_train_, metrics_out=metrics)

    with _hook(train, hook):
        loss, aux = original_loss_fn(train)(model, config, data, dropout_rng, params,
                                            sparsity_state=sparsity_state, is_train=is_train)
    if not metrics:
        raise RuntimeError("MaxText's loss_fn did not call its vocab-tiling hook, so the recloss loss did "
                           "not run; check num_vocab_tiling > 1 and that this MaxText version still calls "
                           f"{_TRAIN_MODULE}.{_HOOK}")
    aux = dict(aux)
    aux["recloss_metrics"] = metrics
    return loss, aux


def install(train=None):
    """Makes MaxText's pre-training loop use `loss_fn`; returns MaxText's original loss_fn.

    Idempotent. ``train`` defaults to `train_module()`.
    """
    train = train if train is not None else train_module()
    if train.loss_fn is not loss_fn:
        setattr(train, _ORIGINAL, train.loss_fn)
        train.loss_fn = loss_fn
    return getattr(train, _ORIGINAL)


def uninstall(train=None):
    """Undoes `install`."""
    train = train if train is not None else train_module()
    original = getattr(train, _ORIGINAL, None)
    if original is not None:
        train.loss_fn = original
        delattr(train, _ORIGINAL)


@contextlib.contextmanager
def installed(train=None):
    """`install` for the duration of the block; undone after unless it was installed before.

    ``train`` defaults to `train_module()`; the block gets the train module.
    """
    train = train if train is not None else train_module()
    was_installed = getattr(train, _ORIGINAL, None) is not None
    install(train)
    try:
        yield train
    finally:
        if not was_installed:
            uninstall(train)
