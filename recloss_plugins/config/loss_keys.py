"""The one mapping from config keys to `recloss.LossOptions` fields, shared by every plugin.

Every LossOptions field is a config key: under its own name, or under the name `RENAMED` gives it
(with a conversion: 0 for None where a config cannot say null). `LOSS_OPTION_KEYS` holds them all;
`config_specs` says what a plugin's schema declares for each (type, default, choices, description,
all read from LossOptions), so a new option reaches the trainer (`keys.SCHEMA`), MaxText
(`recloss_plugins.maxtext.config.FIELDS`) and `recloss_plugins.flax.make_loss_fn` without a line
here, unless its key is spelled differently. Each plugin leaves out the fields it sets itself
(the trainer: reduction, pad_id, compute_metrics, vocab_size).

Which options a strategy takes depends on its objective (BCE: vocab_reduction,
pos_weight, focal_*, threshold; softmax: z_loss, temperature; both: logit_soft_cap; sampled: num_negatives,
remove_accidental_hits, temperature, in_batch_negatives for sampled_softmax, gbce_t for gbce).
`check_strategy_options` names the config key of an option set, to a value
other than its default, for a strategy that does not take it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import recloss

# make_loss_fn also takes every LossOptions field under this prefix (``loss_threshold``).
OPTION_PREFIX = "loss_"


def zero_is_none(value):
    """None for 0 (the configs' "chosen by the strategy" / "not set"), else ``value``; False stays False."""
    return None if value == 0 and not isinstance(value, bool) else value


def _as_is(value):
    return value


@dataclasses.dataclass(frozen=True)
class LossKey:
    """How a config key sets a LossOptions field: ``field`` gets ``convert(value)``; with `zero_is_none`,
    ``zero`` says what the config's 0 stands for (the field's None)."""
    field: str
    convert: Callable[[Any], Any] = _as_is
    zero: str = ""


# Config keys spelled differently from the LossOptions field they set (every other field is a key of its
# own name). A plugin reads the keys its own schema declares: the trainer has no loss_pad_id (it pads with
# item 0) and no loss_vocab_size (the data sets V); MaxText has no loss_vocab_size; make_loss_fn takes all
# (and the spellings of `option_for`).
RENAMED = {
    "loss_block_v": LossKey("block_v", zero_is_none, "chosen by the strategy"),
    "loss_block_n": LossKey("block_n", zero_is_none, "chosen by the strategy"),
    "loss_threshold": LossKey("threshold"),
    "loss_interpret": LossKey("interpret"),
    "loss_pad_id": LossKey("pad_id"),
    "loss_vocab_size": LossKey("vocab_size", zero_is_none, "every table row"),
}


def _all_keys() -> Dict[str, LossKey]:
    by_field = {option.field: key for key, option in RENAMED.items()}
    return {by_field.get(f, f): RENAMED[by_field[f]] if f in by_field else LossKey(f)
            for f in recloss.LossOptions.field_names()}


# Config key -> the LossOptions field it sets, one key per field, in LossOptions' order.
LOSS_OPTION_KEYS: Dict[str, LossKey] = _all_keys()


@dataclasses.dataclass(frozen=True)
class ConfigSpec:
    """What a plugin's schema declares for a loss config key, read from `recloss.LossOptions`: ``type``
    (str, int, float or bool), ``optional`` (None admitted), ``choices``, ``default`` (the config's
    spelling of the field's default), ``nonnegative`` (0 stands for None: ``LossKey.zero`` says what),
    ``doc`` (the field's description)."""
    key: str
    field: str
    type: type
    optional: bool
    choices: Optional[Tuple[Any, ...]]
    default: Any
    nonnegative: bool
    doc: str


_TYPES = {"str": str, "int": int, "float": float, "bool": bool}


def config_specs(exclude: Tuple[str, ...] = ()) -> Dict[str, ConfigSpec]:
    """{config key: `ConfigSpec`} of every LossOptions field but the ``exclude``d ones, in field order."""
    docs = recloss.LossOptions.field_docs()
    fields = {f.name: f for f in dataclasses.fields(recloss.LossOptions)}
    out = {}
    for key, option in LOSS_OPTION_KEYS.items():
        if option.field in exclude:
            continue
        f = fields[option.field]
        annotation = f.type if isinstance(f.type, str) else f.type.__name__
        optional = annotation.startswith("Optional[")
        base = _TYPES[annotation[len("Optional["):-1] if optional else annotation]
        zero = option.convert is zero_is_none
        default = 0 if zero and f.default is None else f.default
        doc = docs[option.field].replace("None = ", "0 = ") if zero else docs[option.field]
        out[key] = ConfigSpec(key, option.field, base, optional and not zero, f.metadata.get("choices"), default,
                              zero, doc)
    return out


class LossOptionError(ValueError):
    """Config values that make no valid `recloss.LossOptions`.

    ``key``: the config key to blame (None when no single key is); ``reason``:
    what is wrong with it, without the key (for callers that name keys their own way).
    """

    def __init__(self, message: str, key: Optional[str] = None, reason: Optional[str] = None):
        super().__init__(message)
        self.key = key
        self.reason = message if reason is None else reason


def option_for(key: str) -> Optional[LossKey]:
    """The `LossKey` config key ``key`` names, or None.

    A key of `LOSS_OPTION_KEYS`, else a LossOptions field under its own name
    or with `OPTION_PREFIX` (converted as that field's row in the table converts).
    """
    if key in LOSS_OPTION_KEYS:
        return LOSS_OPTION_KEYS[key]
    fields = recloss.LossOptions.field_names()
    if key not in fields and key.startswith(OPTION_PREFIX):
        key = key[len(OPTION_PREFIX):]
    if key not in fields:
        return None
    return next((o for o in LOSS_OPTION_KEYS.values() if o.field == key), LossKey(key))


def option_keys() -> Tuple[str, ...]:
    """Every key `option_for` knows: the table's keys, the LossOptions fields and the prefixed fields."""
    fields = recloss.LossOptions.field_names()
    return tuple(dict.fromkeys((*LOSS_OPTION_KEYS, *fields, *(OPTION_PREFIX + f for f in fields))))


def build_loss_options(values: Mapping[str, Any]) -> recloss.LossOptions:
    """The `recloss.LossOptions` that ``values`` {config key: value} ask for; unset fields keep their defaults.

    Each key is looked up with `option_for` (an unknown key is a KeyError: the
    callers report unknown keys in their own terms) and its value converted.
    Raises LossOptionError naming the key when two keys set one field to
    different values, or when LossOptions rejects a value.
    """
    kwargs: Dict[str, Any] = {}
    source: Dict[str, str] = {}
    for key, value in values.items():
        option = option_for(key)
        if option is None:
            raise KeyError(f"{key!r} names no recloss.LossOptions field")
        value = option.convert(value)
        if option.field in kwargs and kwargs[option.field] != value:
            raise LossOptionError(f"config keys {source[option.field]!r}={kwargs[option.field]!r} and "
                                  f"{key!r}={value!r} set the same loss option {option.field!r} to "
                                  "different values; keep one", key)
        kwargs[option.field] = value
        source[option.field] = key
    try:
        return recloss.LossOptions(**kwargs)
    except (ValueError, TypeError) as err:
        key = _rejected_key(kwargs, source)
        message = (f"bad loss options: {err}" if key is None
                   else f"loss config key {key!r}={values[key]!r} is rejected: {err}")
        raise LossOptionError(message, key, str(err)) from err


def _rejected_key(kwargs: Dict[str, Any], source: Dict[str, str]) -> Optional[str]:
    """The config key whose value LossOptions rejects on its own, or None."""
    for field, value in kwargs.items():
        try:
            recloss.LossOptions(**{field: value})
        except (ValueError, TypeError):
            return source[field]
    return None


def check_strategy_options(name: str, values: Mapping[str, Any]):
    """Raises LossOptionError naming the config key when ``values`` set an option that strategy ``name``
    does not take (e.g. the BCE option ``pos_weight`` for the softmax strategy ``cutce``).

    An option at its `recloss.LossOptions` default is fine for every strategy, so a
    config that lists every key at its default serves both objectives. ``name``
    must be registered (`recloss.get_strategy` raises for an unknown one); keys
    that name no option are ignored here (the callers report them).
    """
    strategy = recloss.get_strategy(name)
    supported = set(strategy.options_supported)
    defaults = recloss.LossOptions()
    for key, value in values.items():
        option = option_for(key) if isinstance(key, str) else None
        if option is None or option.field in supported:
            continue
        default = getattr(defaults, option.field)
        if option.convert(value) == default:
            continue
        takers = [n for n in recloss.available_strategies()
                  if option.field in recloss.get_strategy(n).options_supported]
        objectives = sorted({recloss.get_strategy(n).objective or "custom" for n in takers})
        of = f"an option of the {' and '.join(objectives)} objective" if objectives else "an option"
        reason = (f"strategy {name!r} ({strategy.objective or 'custom'} objective, "
                  f"{strategy.entry_point or 'a custom strategy'}) does not take {option.field}={value!r}: "
                  f"it is {of} (strategies {takers}); remove it or set it to its default {default!r}")
        raise LossOptionError(f"loss config key {key!r}={value!r} is rejected: {reason}", key, reason)
