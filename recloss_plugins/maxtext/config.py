"""MaxText config keys for recloss: a MaxText config class that accepts ``loss=...`` and the loss options.

``loss=cutce`` / ``loss=cutce_pallas`` (softmax strategies) replace MaxText's own token
cross-entropy with the same loss computed without [tokens, vocab] logits;
``loss=cutbce`` / ``cutbce_pallas`` train with full-vocabulary BCE instead.

MaxText's pydantic config (``maxtext.configs.types.MaxTextConfig``) forbids
unknown keys, so ``loss=cutbce_pallas`` on its command line fails. The class
from `config_class()` subclasses it with the keys below:

    from maxtext.configs import pyconfig
    from recloss_plugins.maxtext import config_class
    config = pyconfig.initialize(["", "base.yml", "loss=cutbce_pallas", "num_vocab_tiling=2"],
                                 config_class=config_class())

Keys (the names of recloss's own trainer config, so one YAML vocabulary serves both):

    loss                  recloss strategy, one of recloss.available_strategies(): softmax
                          (dense_ce, cutce, cutce_pallas), BCE (dense_bce, cutbce, cutbce_pallas) or
                          sampled (sampled_softmax, gbce: K uniform negatives per step, drawn from
                          MaxText's own RNG state)
    loss_block_v          vocabulary block size, 0 = chosen by the strategy
    loss_block_n          row block size, 0 = chosen by the strategy
    label_smoothing       ε in [0, 1)
    loss_interpret        Pallas interpret mode: null = automatic (on off TPU)
    vocab_reduction       BCE only: 'mean' (÷ V per position, Keras) or 'sum'
    pos_weight            BCE only: weight of the positive term, > 0
    focal_gamma           BCE only: focal γ >= 0 (0 = plain BCE)
    focal_alpha           BCE only: focal α in [0, 1], or null
    loss_threshold        BCE only: logit threshold of the TP/FP/FN/TN metrics
    z_loss                softmax only: λ >= 0 of λ·logsumexp² (MaxText's z_loss_multiplier sets it too)
    temperature           softmax only: τ > 0, logits are divided by it
    num_negatives         sampled only: K >= 1 negatives drawn per step (<= V)
    in_batch_negatives    sampled_softmax only: the other tokens' targets are negatives too
    remove_accidental_hits  sampled only: a drawn negative equal to the token's target is dropped
    gbce_t                gbce only: gSASRec's calibration t in [0, 1]
    logit_soft_cap        c > 0: every logit x becomes c·tanh(x/c), or null (MaxText's final_logits_soft_cap
                          sets it too, where MaxText applies it: with logits_via_embedding)
    loss_pad_id           target id that marks padding (-1: MaxText masks with targets_segmentation)
    loss_batch_axes       mesh axes the tokens are split over for a shard_map'ed loss; [] = none, or, for
                          a Mosaic kernel on a multi-device TPU mesh, derived from MaxText's mesh and
                          logical axis rules (`derive_mesh_axes`), with loss_fsdp_axis and loss_vocab_axis
    loss_fsdp_axis        mesh axis the table is additionally stored over (with loss_batch_axes), or null
    loss_vocab_axis       mesh axis the vocabulary is split over (with loss_batch_axes), or null
    loss_fsdp_gather      with an fsdp axis: 'once' (all-gather the table once per step), 'ring'
                          (slices passed round the fsdp axis, ~1/|fsdp| of the table's memory),
                          'rows' (slices stay home, the fsdp group's tokens are all-gathered instead;
                          ring and rows: blocked strategies only) or 'auto' (default: the one that holds
                          least by `recloss.choose_fsdp_gather`'s estimate, printed when the step is traced)

An option of the other objective must stay at its default (``loss=cutce
pos_weight=2`` is an error naming ``pos_weight``). MaxText's own
``z_loss_multiplier`` is the softmax strategies' z-loss λ (or set ``z_loss``;
both set to different values is an error); a BCE strategy has no normaliser
to penalise, so it needs ``z_loss_multiplier = 0``. MaxText's
``final_logits_soft_cap`` c > 0 is ``logit_soft_cap`` where MaxText 0.2.5
applies it, on the tied-embedding logits (``logits_via_embedding``; its
``logits_dense`` head is never capped, so neither is recloss's unless
``logit_soft_cap`` is set); ``logit_soft_cap`` set to a different value is an
error naming both.

Checked at load time (a clear error before any work): the strategy name (with
the closest names), every option's value (``logit_soft_cap`` <= 0 among them),
the strategy built with them, ``loss_fsdp_gather`` against the strategy and the
mesh keys, and the MaxText settings the recloss loss needs (the z-loss and the
soft cap as above). ``num_vocab_tiling`` must be > 1 so the decoder hands back
hidden states; a config that leaves it at MaxText's 1 gets one picked and printed
(`pick_num_vocab_tiling`: the smallest value > 1 that MaxText accepts, i.e. that
divides the per-device tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp

import recloss
from recloss_plugins.config import FSDP_GATHER_VALUES, LOSS_OPTION_KEYS
from recloss_plugins.config.loss_keys import config_specs
from recloss_plugins.flax import resolve_config


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: its annotation (a name of `_annotations`, or a tuple of the values a Literal
    admits) for the pydantic field, default and description."""
    type: Any
    default: Any
    description: str


# LossOptions fields the MaxText loss sets itself (`loss_settings`): not config keys.
FIXED_LOSS_FIELDS = ("reduction", "compute_metrics", "vocab_size")
# What a loss option's key means in MaxText beyond its recloss.LossOptions description.
_NOTES = {
    "z_loss": "MaxText's z_loss_multiplier sets it too.",
    "logit_soft_cap": "None = MaxText's final_logits_soft_cap where MaxText applies it (tied embedding logits), "
                      "else no cap.",
    "loss_pad_id": "MaxText already masks padding with targets_segmentation, so -1 (none) is right unless token "
                   "ids need excluding.",
    "num_negatives": "Drawn per step from MaxText's RNG state.",
}


def _option_fields():
    """A `Key` for each loss option key, read from recloss.LossOptions (`config_specs`)."""
    out = {}
    for key, spec in config_specs(exclude=FIXED_LOSS_FIELDS).items():
        if spec.choices:
            kind = spec.choices
        elif spec.nonnegative:
            kind = "NonNegativeInt"
        else:
            kind = f"Optional[{spec.type.__name__}]" if spec.optional else spec.type.__name__
        out[key] = Key(kind, spec.default, " ".join(filter(None, (spec.doc, _NOTES.get(key)))))
    return out


# The annotation strings are resolved against `_annotations()` when the class is built.
FIELDS = {
    "loss": Key("str", "cutbce", "recloss strategy: one of recloss.available_strategies(); softmax "
                "(dense_ce, cutce, cutce_pallas: MaxText's token cross-entropy), BCE (dense_bce, cutbce, "
                "cutbce_pallas) or sampled (sampled_softmax, gbce: uniform negatives from MaxText's RNG state)."),
    **_option_fields(),
    "loss_batch_axes": Key("list[str]", [], "Mesh axes the tokens are split over when the recloss loss "
                           "runs under shard_map; [] = no shard_map (XLA partitions the blocked loss)."),
    "loss_fsdp_axis": Key("Optional[str]", None, "With loss_batch_axes: mesh axis the item table is "
                          "additionally stored over (must be one of loss_batch_axes), or None."),
    "loss_vocab_axis": Key("Optional[str]", None, "With loss_batch_axes: mesh axis the vocabulary is "
                           "split over, or None."),
    "loss_fsdp_gather": Key(FSDP_GATHER_VALUES, "auto", "With an fsdp axis: 'once' all-gathers the item table "
                            "over it once per step; 'ring' passes the slices round it instead (about 1/|fsdp| of the "
                            "table's memory); 'rows' leaves the slices home and all-gathers the fsdp group's "
                            "tokens instead (ring and rows: blocked strategies only); 'auto' picks the one that "
                            "holds least by recloss.choose_fsdp_gather's estimate from the shapes, and prints it."),
}

# Config key -> recloss.LossOptions field: the FIELDS keys the shared mapping knows (the rest
# are the strategy and the mesh layout).
OPTION_KEYS = {key: option.field for key, option in LOSS_OPTION_KEYS.items() if key in FIELDS}


def _get(config, key):
    """``config.key``, or its `FIELDS` default when ``config`` lacks the attribute."""
    try:
        return getattr(config, key)
    except AttributeError:
        return FIELDS[key].default


def loss_settings(config) -> Tuple[str, recloss.LossOptions]:
    """(strategy name, LossOptions) from a MaxText config (or any object with these attributes).

    The loss is reduced with ``reduction='sum'`` (Σ w·ℓ over tokens): MaxText
    divides by the token count itself (and skips the division under manual
    gradient accumulation). Missing attributes take the defaults of `FIELDS`.
    For a strategy that takes ``z_loss`` (the softmax ones), MaxText's
    ``z_loss_multiplier`` is its z-loss λ; MaxText's soft cap as it applies it
    (`maxtext_soft_cap`) is ``logit_soft_cap``. Raises ValueError naming the key
    of an option the strategy does not take, or when ``z_loss`` and
    ``z_loss_multiplier`` (or ``logit_soft_cap`` and ``final_logits_soft_cap``)
    are both set to different values.
    """
    items = {"loss": _get(config, "loss")}
    items.update({key: _get(config, key) for key in OPTION_KEYS})
    name, options = resolve_config(items)
    strategy = recloss.get_strategy(name)
    supported = strategy.options_supported
    multiplier = getattr(config, "z_loss_multiplier", 0.0) or 0.0
    if multiplier and "z_loss" in supported:
        if options.z_loss and options.z_loss != multiplier:
            raise ValueError(f"z_loss={options.z_loss} and MaxText's z_loss_multiplier={multiplier} both set "
                             f"the z-loss of strategy {name!r} to different values; keep one")
        options = options.replace(z_loss=float(multiplier))
    cap = maxtext_soft_cap(config)
    if cap is not None:
        if options.logit_soft_cap is not None and options.logit_soft_cap != cap:
            raise ValueError(f"logit_soft_cap={options.logit_soft_cap} and MaxText's final_logits_soft_cap={cap} "
                             f"both set the logit soft cap of strategy {name!r} to different values; keep one")
        if "logit_soft_cap" not in supported:
            raise ValueError(f"final_logits_soft_cap={cap}: strategy {name!r} "
                             f"({strategy.objective or 'custom'} objective) takes no logit soft "
                             "cap; unset it or use a BCE or softmax strategy")
        options = options.replace(logit_soft_cap=cap)
    return name, options.replace(reduction="sum", compute_metrics=True)


def maxtext_soft_cap(config) -> Optional[float]:
    """MaxText's ``final_logits_soft_cap`` c where MaxText applies it, else None.

    MaxText 0.2.5 caps the output head's logits as c·tanh(x/c) only with
    ``logits_via_embedding`` (``apply_output_head``; the ``logits_dense`` head is
    never capped), and reads None or 0 as no cap. Raises ValueError naming the
    key for a negative or non-finite c (MaxText's own schema refuses those too).
    """
    cap = getattr(config, "final_logits_soft_cap", None)
    if cap is None or cap == 0:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap < 0:
        raise ValueError(f"final_logits_soft_cap={cap!r}: expected None, 0 (no cap) or a finite float > 0")
    return float(cap) if getattr(config, "logits_via_embedding", False) else None


def _check_gather(gather, strategy=None):
    """``loss_fsdp_gather``: one of `FSDP_GATHER_VALUES`, and (but 'auto') a mode ``strategy`` takes."""
    if gather == "auto":
        return
    if gather not in FSDP_GATHER_VALUES:
        raise ValueError(f"loss_fsdp_gather={gather!r}: expected one of {', '.join(map(repr, FSDP_GATHER_VALUES))}")
    recloss.check_fsdp_gather(gather, strategy, key="loss_fsdp_gather")


def _no_shard_map(gather, name) -> ValueError:
    """The error for 'ring' or 'rows' asked of a loss that runs without a shard_map."""
    return ValueError(f"loss_fsdp_gather={gather!r} needs the loss under shard_map, and loss={name!r} runs "
                      "without one (XLA partitions it): set loss_batch_axes and loss_fsdp_axis, or "
                      "loss_fsdp_gather=auto or once")


def _mesh_axes(config) -> Tuple[Tuple[str, ...], Optional[str], Optional[str], str]:
    """(loss_batch_axes, loss_fsdp_axis, loss_vocab_axis, loss_fsdp_gather) as set; the axes need the
    first, ``'ring'`` and ``'rows'`` an fsdp axis (set, or derived when the batch axes are)."""
    batch_axes = tuple(_get(config, "loss_batch_axes") or ())
    fsdp, vocab = _get(config, "loss_fsdp_axis"), _get(config, "loss_vocab_axis")
    gather = _get(config, "loss_fsdp_gather")
    if not batch_axes and (fsdp is not None or vocab is not None):
        raise ValueError(f"loss_fsdp_axis={fsdp!r} / loss_vocab_axis={vocab!r} need loss_batch_axes "
                         "(the mesh axes the tokens are split over) to be set")
    _check_gather(gather)
    if gather in ("ring", "rows") and fsdp is None and batch_axes:
        what = {"ring": "passes the table slices round", "rows": "gathers the tokens over"}[gather]
        raise ValueError(f"loss_fsdp_gather={gather!r} {what} loss_fsdp_axis, which is not "
                         "set; set loss_fsdp_axis, or loss_fsdp_gather=auto or once")
    return batch_axes, fsdp, vocab, gather


# MaxText's logical axes that place the output head's work: the tokens' batch and length dims at the
# head (the first name a config's rules know is read), the table's rows ('vocab') and its D ('embed').
_BATCH_NAMES = ("activation_embed_and_logits_batch", "activation_batch")
_LENGTH_NAMES = ("activation_norm_length", "activation_length")
# The output table's D: 'embed_vocab' in MaxText 0.2.5 (token_embedder.embedding, logits_dense.kernel), 'embed' before.
_TABLE_D_NAMES = ("embed_vocab", "embed")


def table_spec(config, mesh):
    """The PartitionSpec MaxText stores the output table in, for its [V, D] view: V over the mesh axes
    of size > 1 its rule for ``vocab`` names, D over those of ``embed_vocab`` (else ``embed``); None
    without rules or when neither dim is split."""
    rules, _, live = _mesh_rules(config, mesh)
    rows = live(_rule_axes(rules, ("vocab",)))
    cols = tuple(a for a in live(_rule_axes(rules, _TABLE_D_NAMES)) if a not in rows)
    if not rows and not cols:
        return None
    entry = lambda axes: None if not axes else (axes[0] if len(axes) == 1 else axes)
    return jax.sharding.PartitionSpec(entry(rows), entry(cols))


def _mesh_rules(config, mesh):
    """(MaxText's logical_axis_rules or None, {mesh axis: size}, live) where live(axes) keeps the axes
    of size > 1, in order."""
    size = dict(zip(mesh.axis_names, mesh.devices.shape))
    return (getattr(config, "logical_axis_rules", None), size,
            lambda axes: tuple(a for a in axes or () if size.get(a, 1) > 1))


def _rule_axes(rules, names) -> Optional[Tuple[str, ...]]:
    """The mesh axes of the first rule in ``rules`` ([logical name, axes] pairs) for the first of
    ``names`` any rule has, or None."""
    for name in names:
        for rule in rules or ():
            if len(rule) == 2 and rule[0] == name:
                axes = rule[1]
                return (axes,) if isinstance(axes, str) else tuple(axes or ())
    return None


def derive_mesh_axes(config, mesh) -> Tuple[Tuple[str, ...], Optional[str], Optional[str]]:
    """(loss_batch_axes, loss_fsdp_axis, loss_vocab_axis) read from MaxText's ``mesh`` and its
    ``config.logical_axis_rules``, for a loss that must run under shard_map.

    Only axes of size > 1 count. The batch axes are those the rule for the head's token batch
    (``activation_embed_and_logits_batch``) maps to, in its order; the fsdp axis is the one of them
    the rule for the table's D (``embed_vocab``, else ``embed``) maps to, or None; the vocab axis is
    the one the rule for ``vocab`` maps to (the table's rows), or None. Raises ValueError naming the
    axes when the rules cannot be read that way: no batch rule, the tokens' length split too
    (context or sequence parallelism), or two axes in one role.
    """
    rules, size, live = _mesh_rules(config, mesh)
    fix = ("; set loss_batch_axes (the mesh axes the tokens are split over), loss_fsdp_axis and "
           "loss_vocab_axis yourself")
    batch = _rule_axes(rules, _BATCH_NAMES)
    if batch is None:
        raise ValueError(f"cannot derive loss_batch_axes: MaxText's logical_axis_rules map neither of "
                         f"{list(_BATCH_NAMES)} to mesh axes{fix}")
    batch = live(batch)
    length = tuple(a for a in live(_rule_axes(rules, _LENGTH_NAMES)) if a not in batch)
    if length:
        raise ValueError(f"cannot derive loss_batch_axes: the tokens' length is split over mesh axes "
                         f"{list(length)} (sizes {[size[a] for a in length]}), which the recloss loss's "
                         f"shard_map does not split{fix}")
    roles = {}
    for role, rule in (("loss_fsdp_axis", _TABLE_D_NAMES), ("loss_vocab_axis", ("vocab",))):
        axes = live(_rule_axes(rules, rule))
        rule = next((r for r in rule if _rule_axes(rules, (r,)) is not None), rule[0])
        axes = tuple(a for a in axes if (a in batch) == (role == "loss_fsdp_axis"))
        if len(axes) > 1:
            raise ValueError(f"cannot derive {role}: MaxText's rule for {rule!r} spreads it over mesh axes "
                             f"{list(axes)} (sizes {[size[a] for a in axes]}), and recloss takes one{fix}")
        roles[role] = axes[0] if axes else None
    return batch, roles["loss_fsdp_axis"], roles["loss_vocab_axis"]


def layout_for(config, mesh, hidden=None, table=None, *, log=print) -> Optional[recloss.MeshLayout]:
    """The `recloss.MeshLayout` the config asks for on ``mesh``, or None (no shard_map).

    The axes are the config's; with ``loss_batch_axes`` empty they are `derive_mesh_axes`' when the
    strategy is a Mosaic kernel on a multi-device TPU mesh (XLA cannot partition it), else there is
    no layout. ``loss_fsdp_gather=auto`` is resolved by `recloss.choose_fsdp_gather` from ``hidden``
    [..., D] and ``table`` [V, D] (arrays or shape structs), and what it picked goes to ``log``, as do
    derived axes. Raises ValueError when ``loss_fsdp_axis`` / ``loss_vocab_axis`` are set without
    ``loss_batch_axes``, a layout is needed and ``mesh`` is None, or 'auto' has no shapes to go by.
    """
    batch_axes, fsdp, vocab, gather = _mesh_axes(config)
    name, options = loss_settings(config)
    strategy = recloss.get_strategy(name, options)
    platform = mesh_platform(mesh)
    if not batch_axes:
        if platform is None or mesh.devices.size == 1 or strategy.xla_partitions(platform):
            if gather in ("ring", "rows"):
                raise _no_shard_map(gather, name)
            return None
        batch_axes, fsdp, vocab = derive_mesh_axes(config, mesh)
        log(f"recloss: loss={name!r} runs a Mosaic kernel under shard_map on MaxText's "
            f"{mesh.devices.size}-device mesh: loss_batch_axes={list(batch_axes)}, loss_fsdp_axis={fsdp}, "
            f"loss_vocab_axis={vocab} (derived from the mesh and logical_axis_rules)")
        if gather in ("ring", "rows") and fsdp is None:
            raise ValueError(f"loss_fsdp_gather={gather!r} needs an fsdp axis, and MaxText's mesh stores the "
                             "table over none of the batch axes; set loss_fsdp_gather=auto or once")
    if mesh is None:
        raise ValueError(f"loss_batch_axes={list(batch_axes)} is set but no mesh was given to build the "
                         "recloss.MeshLayout")
    layout = recloss.MeshLayout(mesh, batch_axes=batch_axes, fsdp_axis=fsdp, vocab_axis=vocab,
                                fsdp_gather="once" if gather == "auto" else gather)
    if gather == "auto":
        if hidden is None or table is None:
            raise ValueError("loss_fsdp_gather='auto' picks the mode from the shapes: pass hidden and table "
                             "to layout_for, or set loss_fsdp_gather to once, ring or rows")
        rows = math.prod(hidden.shape[:-1])
        choice = recloss.choose_fsdp_gather(strategy, layout, rows=max(1, rows // layout.batch_shards),
                                            vocab_size=int(table.shape[0]), features=int(table.shape[-1]),
                                            itemsize=jnp.dtype(table.dtype).itemsize)
        if layout.fsdp_shards > 1:
            log(f"recloss: {choice.describe()}")
        layout = dataclasses.replace(layout, fsdp_gather=choice.mode)
    return layout


def mesh_platform(mesh) -> Optional[str]:
    """The platform of ``mesh``'s devices ('tpu' for a TPU topology compiled ahead of time), or None."""
    devices = getattr(mesh, "devices", None)
    if devices is None or getattr(devices, "size", 0) == 0:
        return None
    return getattr(devices.flat[0], "platform", None)


def pick_num_vocab_tiling(per_device_batch_size, max_target_length) -> Tuple[int, str]:
    """(k, why): the ``num_vocab_tiling`` the recloss loss runs with when a config leaves it at 1
    (MaxText's default), and why: the rule, in words, for the line that reports the pick.

    The recloss loss needs k > 1 only so that MaxText's decoder hands back hidden states instead of
    [batch, length, vocab] logits; k itself sizes MaxText's own tiled loss, which the recloss loss
    replaces (it walks the vocabulary in its own blocks, ``loss_block_v``). MaxText accepts k when it
    divides the per-device tokens, ``per_device_batch_size`` × ``max_target_length`` (its config check;
    with ``per_device_batch_size`` <= 0 it checks nothing). The pick is the smallest such k > 1: 2 when
    the token count is even. Raises ValueError, naming the keys, when no k > 1 divides it.
    """
    b, t = per_device_batch_size, max_target_length
    if b <= 0:
        return 2, ("the recloss loss needs num_vocab_tiling > 1 (MaxText's decoder then returns hidden states, not "
                   f"logits), and with per_device_batch_size={b} MaxText checks no divisibility, so 2; set "
                   "num_vocab_tiling to choose another")
    tokens = b * t
    n = int(tokens) if float(tokens).is_integer() else 0
    if n < 2:
        raise ValueError(f"num_vocab_tiling: the recloss loss needs num_vocab_tiling > 1 (so that MaxText's decoder "
                         f"returns hidden states, not logits), and MaxText takes only a value that divides the "
                         f"{tokens:g} tokens per device (per_device_batch_size={b} x max_target_length={t}), which "
                         "no value > 1 does; raise per_device_batch_size or max_target_length")
    k = next((d for d in range(2, math.isqrt(n) + 1) if n % d == 0), n)
    return k, ("the recloss loss needs num_vocab_tiling > 1 (MaxText's decoder then returns hidden states, not "
               f"logits), and {k} is the smallest value > 1 that divides the {n:,} "
               f"tokens per device (per_device_batch_size={b} x max_target_length={t}), as MaxText requires; "
               "the value sizes only MaxText's own tiled loss, which the recloss loss replaces (set "
               "num_vocab_tiling to choose another)")


def _with_num_vocab_tiling(cls, values, log=None):
    """``values`` (the keyword arguments a config class is built from, before validation) with
    ``num_vocab_tiling`` picked (`pick_num_vocab_tiling`, the pick logged) when it is <= 1 and the class
    has the batch and length keys to pick by; else as given (the checks then name what is wrong)."""
    fields = getattr(cls, "model_fields", {})
    needed = ("num_vocab_tiling", "per_device_batch_size", "max_target_length")
    if not isinstance(values, dict) or not all(k in fields for k in needed):
        return values
    tiles, b, t = (values.get(k, fields[k].default) for k in needed)
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
    if not (number(tiles) and number(b) and number(t)) or tiles > 1:
        return values
    k, why = pick_num_vocab_tiling(b, t)
    (log or functools.partial(print, flush=True))(f"recloss: num_vocab_tiling={k} (picked; the config has {tiles}): "
                                                  f"{why}")
    return {**values, "num_vocab_tiling": k}


def check_supported(config):
    """Raises ValueError when ``config`` asks for something the recloss MaxText loss cannot do.

    Checks the strategy and options (via `loss_settings`, and the strategy built
    with them), MaxText's ``num_vocab_tiling`` (> 1, so the decoder returns
    hidden states instead of logits), ``z_loss_multiplier`` (0 unless the
    strategy takes a z-loss, as the softmax ones do), ``num_negatives`` (at most
    ``vocab_size`` for a sampled strategy) and the mesh axis keys
    (``loss_fsdp_axis`` / ``loss_vocab_axis`` need ``loss_batch_axes``;
    ``loss_fsdp_gather=ring`` or ``rows`` needs ``loss_fsdp_axis`` and a strategy that takes it).
    """
    name, options = loss_settings(config)
    strategy = recloss.get_strategy(name, options)     # combinations a strategy refuses (smoothing with a cap)
    tiles = getattr(config, "num_vocab_tiling", None)
    if tiles is not None and tiles <= 1:
        raise ValueError(f"num_vocab_tiling={tiles}: the recloss loss needs num_vocab_tiling > 1 so that "
                         "MaxText's decoder returns hidden states instead of [batch, length, vocab] logits; "
                         "any value > 1 that divides per_device_batch_size * max_target_length works "
                         "(recloss walks the vocabulary in its own blocks, loss_block_v), and config_class() "
                         "picks the smallest itself when the config leaves it at 1")
    z = getattr(config, "z_loss_multiplier", 0.0)
    if z and "z_loss" not in strategy.options_supported:
        softmax = [n for n in recloss.available_strategies()
                   if "z_loss" in recloss.get_strategy(n).options_supported]
        raise ValueError(f"z_loss_multiplier={z}: z-loss penalises the softmax normaliser, which strategy "
                         f"{name!r} ({strategy.objective or 'custom'} objective) does not "
                         f"have; set z_loss_multiplier=0, or use a softmax strategy ({softmax})")
    vocab = getattr(config, "vocab_size", None)
    if strategy.objective == "sampled" and isinstance(vocab, int) and options.num_negatives > vocab:
        raise ValueError(f"num_negatives={options.num_negatives}: strategy {name!r} draws at most vocab_size={vocab} "
                         "negatives per step; lower num_negatives")
    batch_axes, _, _, gather = _mesh_axes(config)
    try:
        _check_gather(gather, strategy)
    except ValueError as err:
        raise ValueError(f"loss_fsdp_gather does not go with loss={name!r}: {err}") from None
    if gather in ("ring", "rows") and not batch_axes and strategy.xla_partitions("tpu"):
        raise _no_shard_map(gather, name)


def _annotation(kind):
    """A `Key`'s annotation as a type: a name, or a tuple of the values of a Literal."""
    from typing import Literal

    from pydantic.types import NonNegativeInt
    if isinstance(kind, tuple):
        return Literal[kind]
    return {"str": str, "int": int, "float": float, "bool": bool, "NonNegativeInt": NonNegativeInt,
            "Optional[float]": Optional[float], "Optional[bool]": Optional[bool], "Optional[str]": Optional[str],
            "list[str]": list[str]}[kind]


@functools.lru_cache(maxsize=None)
def config_class(base: Optional[type] = None) -> type:
    """A subclass of MaxText's config type (default ``maxtext.configs.types.MaxTextConfig``) with `FIELDS`.

    Pass it as ``pyconfig.initialize(argv, config_class=config_class())``.
    Before MaxText's own validation a ``num_vocab_tiling`` <= 1 is replaced by
    `pick_num_vocab_tiling`'s pick, printed as one ``recloss:`` line. Validation
    (after MaxText's own) runs `check_supported`; its ValueError surfaces as
    MaxText's config error naming the key.
    """
    import pydantic

    if base is None:
        from maxtext.configs import types as maxtext_types
        base = maxtext_types.MaxTextConfig
    if not (isinstance(base, type) and issubclass(base, pydantic.BaseModel)):
        raise TypeError(f"base must be a pydantic model class (MaxText's MaxTextConfig), got {base!r}")
    taken = sorted(set(FIELDS) & set(base.model_fields))
    if taken:
        raise ValueError(f"{base.__name__} already defines {taken}; recloss cannot add these keys to it")
    fields = {name: (_annotation(key.type), pydantic.Field(key.default, description=key.description))
              for name, key in FIELDS.items()}

    def _pick_recloss_tiling(cls, values):
        return _with_num_vocab_tiling(cls, values)

    def _check_recloss(self):
        check_supported(self)
        return self

    # The pick runs before every validation of the base (MaxText's own num_vocab_tiling checks see it);
    # check_supported after them.
    return pydantic.create_model(
        f"Recloss{base.__name__}", __base__=base, __module__=__name__,
        __validators__={"_pick_recloss_tiling": pydantic.model_validator(mode="before")(
                            classmethod(_pick_recloss_tiling)),
                        "_check_recloss": pydantic.model_validator(mode="after")(_check_recloss)},
        **fields)
