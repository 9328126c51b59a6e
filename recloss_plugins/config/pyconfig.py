"""Load a YAML config chain, apply ``key=value`` overrides, validate, return a locked ConfigDict.

Resolution order (later wins): the ``base_config:`` chain from its root down
to the named file, then command-line overrides in order. Every key of
`keys.SCHEMA` must be set by the chain (configs/base.yml sets all of them, so
experiment files start with ``base_config: base.yml``).
"""

from __future__ import annotations

import difflib
import functools
import math
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import yaml

from recloss_plugins.config.keys import SCHEMA, loss_options
from recloss_plugins.config.loss_keys import LOSS_OPTION_KEYS, LossOptionError, check_strategy_options

BASE_CONFIG_KEY = "base_config"


class ConfigError(ValueError):
    """A config key is unknown, missing, or has a value of the wrong type or range."""


def default_config_path() -> Path:
    """The trainer's base config, every key at its default: shipped with this package
    (``recloss_plugins/config/base.yml``; the repository's configs/base.yml is a link to it)."""
    from importlib import resources
    return Path(str(resources.files("recloss_plugins.config") / "base.yml"))


def _suggest(key: str, valid: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _unknown(key: str, where: str) -> ConfigError:
    return ConfigError(f"unknown config key {key!r} ({where}){_suggest(key, SCHEMA)}")


# ----------------------------------------------------------------------------- YAML chain
def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must be a mapping of key: value, "
                          f"got a {type(data).__name__}")
    return data


def _load_chain(path: Path, seen: tuple = ()) -> dict:
    """Merged raw values of ``path`` and its base_config ancestors (child wins)."""
    path = path.resolve()
    if path in seen:
        cycle = " -> ".join(str(p) for p in seen + (path,))
        raise ConfigError(f"base_config cycle: {cycle}")
    data = _read_yaml(path)
    base = data.pop(BASE_CONFIG_KEY, None)
    for key in data:
        if key not in SCHEMA:
            raise _unknown(key, f"in {path}")
    if base is None:
        merged = {}
    else:
        if not isinstance(base, str) or not base:
            raise ConfigError(f"{BASE_CONFIG_KEY} in {path} must be a relative or absolute file path, "
                              f"got {base!r}")
        merged = _load_chain((path.parent / base), seen + (path,))
    merged.update({k: (v, str(path)) for k, v in data.items()})
    return merged


# ----------------------------------------------------------------------------- values
def _to_bool(text: str):
    low = text.strip().lower()
    if low in ("true", "yes", "on", "1"):
        return True
    if low in ("false", "no", "off", "0"):
        return False
    raise ValueError


def _to_int(value):
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            return int(text)
        except ValueError:
            return _to_int(float(text))
    raise ValueError


def _to_float(value):
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return float(value.strip())
    raise ValueError


def _to_list(value):
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        items = [t.strip() for t in text.split(",") if t.strip()]
    else:
        raise ValueError
    if not all(isinstance(i, (str, int, float)) and not isinstance(i, bool) for i in items):
        raise ValueError
    return [str(i) for i in items]


_TYPE_NAMES = {int: "an int", float: "a float", bool: "a bool (true/false)", str: "a string",
               list: "a list of strings"}


def coerce(key: str, value: Any, where: str):
    """``value`` converted to ``key``'s type and checked; raises ConfigError naming the key."""
    spec = SCHEMA[key]
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "~")
                         and spec.type is not str):
        if spec.optional:
            return None
        raise ConfigError(f"config key {key!r} ({where}) must be {_TYPE_NAMES[spec.type]}, got None")
    try:
        if spec.type is bool:
            out = value if isinstance(value, bool) else _to_bool(str(value))
        elif spec.type is int:
            out = _to_int(value)
        elif spec.type is float:
            out = _to_float(value)
        elif spec.type is str:
            if isinstance(value, (list, dict)):
                raise ValueError
            out = str(value)
        elif spec.type is list:
            out = _to_list(value)
        else:  # pragma: no cover - schema error
            raise TypeError(f"bad schema type for {key}")
    except (ValueError, TypeError):
        raise ConfigError(f"config key {key!r} ({where}) must be {_TYPE_NAMES[spec.type]}, "
                          f"got {value!r}") from None
    if spec.type is float and not math.isfinite(out):
        raise ConfigError(f"config key {key!r} ({where}) must be a finite float, got {value!r}")
    if spec.choices is not None and out not in spec.choices:
        raise ConfigError(f"config key {key!r} ({where}) must be one of {list(spec.choices)}, got {out!r}"
                          + _suggest(str(out), [str(c) for c in spec.choices]))
    if spec.check is not None and not spec.check(out):
        raise ConfigError(f"config key {key!r} ({where}) must be {spec.expected}, got {out!r}")
    return out


def parse_override(arg: str):
    """``key=value`` (or ``--key=value``) -> (key, raw value text)."""
    text = arg[2:] if arg.startswith("--") else arg
    if "=" not in text:
        raise ConfigError(f"command-line argument {arg!r} is not key=value")
    key, value = text.split("=", 1)
    key = key.strip()
    if key == BASE_CONFIG_KEY:
        raise ConfigError(f"{BASE_CONFIG_KEY} cannot be overridden on the command line; "
                          "pass the config file as the first argument")
    if key not in SCHEMA:
        raise _unknown(key, f"from override {arg!r}")
    return key, value


def _parse_override_value(key: str, text: str):
    """Command-line text -> Python value before coercion (YAML scalars for non-string keys)."""
    if SCHEMA[key].type is str:
        return text
    if SCHEMA[key].type is list:
        return text
    try:
        return yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        return text


# ----------------------------------------------------------------------------- cross-key checks
@functools.lru_cache(maxsize=None)
def _base_default(key: str):
    """``key``'s value in the shipped base config (`default_config_path`), coerced."""
    value, where = _load_chain(default_config_path())[key]
    return coerce(key, value, where)


def _check_all(cfg: dict, where: dict):
    import recloss

    def fail(key, msg):
        raise ConfigError(f"config key {key!r} ({where.get(key, '?')}) {msg}")

    strategies = recloss.available_strategies()
    if cfg["loss"] not in strategies:
        fail("loss", f"names no loss strategy: got {cfg['loss']!r}, available are {list(strategies)}"
             + _suggest(cfg["loss"], strategies))
    try:
        options = loss_options(cfg)
        check_strategy_options(cfg["loss"], {key: cfg[key] for key in LOSS_OPTION_KEYS if key in SCHEMA})
    except LossOptionError as err:
        if err.key is not None:
            fail(err.key, f"is invalid: {err.reason}")
        raise ConfigError(f"loss options are invalid: {err.reason}") from err
    try:
        strategy = recloss.get_strategy(cfg["loss"], options)
    except (ValueError, TypeError) as err:  # anything else the strategy refuses
        fail("loss", f"cannot be built with this config's loss options: {err}")
    _check_loss_combinations(cfg, strategy, fail, where)
    if cfg["item_optimizer"] != "rowwise_adagrad":
        for key in ("item_learning_rate", "item_adagrad_eps", "item_adagrad_initial_accumulator"):
            default = _base_default(key)
            if cfg[key] != default:
                fail(key, f"is a row-wise AdaGrad setting, but item_optimizer={cfg['item_optimizer']!r}: set "
                          f"item_optimizer=rowwise_adagrad, or leave {key} at {default}")
    if cfg["item_table_dtype"] != "float32" and cfg["item_optimizer"] != "rowwise_adagrad":
        fail("item_table_dtype", f"is {cfg['item_table_dtype']!r}, which needs item_optimizer=rowwise_adagrad "
             f"(AdamW would keep two float32 moments per table entry), got item_optimizer={cfg['item_optimizer']!r}")
    if cfg["emb_dim"] % cfg["num_heads"]:
        fail("num_heads", f"must divide emb_dim={cfg['emb_dim']}, got {cfg['num_heads']}")
    if cfg["global_batch_size"] == 0 and cfg["per_device_batch_size"] == 0:
        fail("per_device_batch_size", "must be >= 1 when global_batch_size is 0")
    for group in ("ici", "dcn"):
        fills = [f"{group}_{a}_parallelism" for a in ("data", "fsdp", "vocab")
                 if cfg[f"{group}_{a}_parallelism"] == -1]
        if len(fills) > 1:
            fail(fills[1], f"is -1 like {fills[0]!r}; at most one {group}_*_parallelism may be -1")
    if cfg["dataset_type"] in ("interactions", "yambda") and not cfg["dataset_path"]:
        fail("dataset_path", f"must name a file or directory when dataset_type={cfg['dataset_type']!r}")
    if cfg["synthetic_min_len"] > cfg["synthetic_max_len"]:
        fail("synthetic_min_len", f"must be <= synthetic_max_len={cfg['synthetic_max_len']}, "
             f"got {cfg['synthetic_min_len']}")
    if cfg["synthetic_num_intents"] > cfg["synthetic_num_items"]:
        fail("synthetic_num_intents", f"must be <= synthetic_num_items={cfg['synthetic_num_items']} (each intent "
             f"is a cluster of items), got {cfg['synthetic_num_intents']}")
    if cfg["synthetic_intents_per_user"] > cfg["synthetic_num_intents"]:
        fail("synthetic_intents_per_user", f"must be <= synthetic_num_intents="
             f"{cfg['synthetic_num_intents']}, got {cfg['synthetic_intents_per_user']}")
    if cfg["vocab_size"] and cfg["vocab_size"] < 2:
        fail("vocab_size", f"must be 0 (from the data) or >= 2 (padding + one item), got {cfg['vocab_size']}")
    ids = cfg["synthetic_num_items"] + 1
    if cfg["dataset_type"] == "synthetic" and cfg["vocab_size"] and cfg["vocab_size"] < ids:
        fail("vocab_size", f"is {cfg['vocab_size']}, but synthetic_num_items={cfg['synthetic_num_items']} makes "
             f"{ids} ids with the padding id; set vocab_size: 0 or >= {ids}")
    known = _known_vocab_size(cfg)
    if known is not None:
        check_vocab(cfg, *known, where=where)
    _check_batch_split(cfg, fail)
    if cfg["compile_topology"] and cfg["vocab_size"] == 0 and cfg["dataset_type"] != "synthetic":
        fail("vocab_size", "must be set (> 0) with compile_topology: ahead-of-time compilation "
             "does not read the dataset")


def _check_loss_combinations(cfg: dict, strategy, fail, where: dict):
    """The loss keys that are not `recloss.LossOptions` fields, against the strategy they go with:
    ``loss_fsdp_gather`` (`recloss.check_fsdp_gather`, the check the loss itself makes at trace time) and
    ``sampled_proposal`` (only a sampled loss draws negatives)."""
    import recloss

    gather = cfg["loss_fsdp_gather"]
    if gather != "auto":
        try:
            recloss.check_fsdp_gather(gather, strategy, key="loss_fsdp_gather")
        except ValueError as err:
            fail("loss_fsdp_gather", f"does not go with loss={cfg['loss']!r} ({where.get('loss', '?')}): {err}")
    proposal, default = cfg["sampled_proposal"], _base_default("sampled_proposal")
    if proposal != default and strategy.objective != "sampled":
        sampled = [n for n in recloss.available_strategies() if recloss.get_strategy(n).objective == "sampled"]
        fail("sampled_proposal", f"is {proposal!r}, but loss={cfg['loss']!r} ({where.get('loss', '?')}, "
             f"{strategy.objective or 'custom'} objective) draws no negatives: sampled_proposal is for the "
             f"sampled losses {sampled}; leave it at {default!r} or use one of them")


def _known_vocab_size(cfg) -> Optional[tuple]:
    """(V, what sets it) when the config alone fixes the vocabulary: ``vocab_size`` > 0, or the synthetic
    set's items and the padding id; None when the data decides (`recloss_plugins.sasrec.train` checks it then)."""
    if cfg["vocab_size"]:
        return cfg["vocab_size"], f"vocab_size={cfg['vocab_size']}"
    if cfg["dataset_type"] == "synthetic":
        return cfg["synthetic_num_items"] + 1, f"synthetic_num_items={cfg['synthetic_num_items']} + the padding id"
    return None


def check_vocab(cfg, vocab_size: int, source: str, *, where: Optional[dict] = None):
    """Raises ConfigError, naming the keys, when the config's loss cannot run on a vocabulary of
    ``vocab_size`` ids (``source`` says what sets it, naming its keys): a sampled loss that draws more
    negatives than there are ids. The rule is the loss's own (`Strategy.draw_negatives`, which raises it
    when the step is traced), traced here on shapes alone: no device work, no backend started."""
    import jax
    import recloss

    strategy = recloss.get_strategy(cfg["loss"], loss_options(cfg, vocab_size=vocab_size))
    if strategy.objective != "sampled":
        return
    try:
        jax.eval_shape(lambda: strategy.draw_negatives(jax.random.key(0), None, vocab_size=vocab_size))
    except ValueError as err:
        at = f" ({where.get('num_negatives', '?')})" if where else ""
        raise ConfigError(f"config key 'num_negatives'{at} is {cfg['num_negatives']}, more than the V={vocab_size} "
                          f"ids there are ({source}) with loss={cfg['loss']!r}: {err}") from None


def _check_batch_split(cfg: dict, fail):
    """``global_batch_size`` against the splits the config alone fixes: the data × fsdp degrees when none
    of them is -1 (with one, `recloss_plugins.sasrec.train` checks the split when the mesh is built, before
    the data is read), and, when recloss-train prepares the log itself, ``prepare_num_shards`` (each step
    takes B/S rows of every shard). Both were found only after the data was loaded (or prepared)."""
    b = cfg["global_batch_size"]
    if not b:
        return
    keys = [f"{group}_{axis}_parallelism" for group in ("ici", "dcn") for axis in ("data", "fsdp")]
    if all(cfg[k] >= 1 for k in keys):
        shards = math.prod(cfg[k] for k in keys)
        if b % shards:
            named = [k for k in keys if cfg[k] > 1]
            product = " x ".join(f"{k}={cfg[k]}" for k in named) + (f" = {shards}" if len(named) > 1 else "")
            fail("global_batch_size", f"is {b}, which does not split over the batch shards (the batch is split "
                 f"over data x fsdp): {product}; use a multiple of {shards}")
    grain = cfg["dataset_type"] != "synthetic" and cfg["data_pipeline"] == "grain"
    if grain and not cfg["prepared_data_path"] and b % cfg["prepare_num_shards"]:
        s = cfg["prepare_num_shards"]
        fail("global_batch_size", f"is {b}, which does not divide over prepare_num_shards={s}: with "
             f"prepared_data_path empty recloss-train prepares the log into {s} shards, and each step takes "
             f"B/{s} rows of every shard; use a multiple of {s}, or a prepare_num_shards that divides {b}")


# ----------------------------------------------------------------------------- entry point
def load_config(argv: Optional[Sequence[str]] = None, *, overrides: Optional[dict] = None):
    """Resolved, validated, locked `ml_collections.ConfigDict`.

    Args:
      argv: ``[config.yml, key=value, ...]``; the YAML path may be omitted
        (configs/base.yml is used).
      overrides: extra {key: value} applied after argv (for tests and tools).
    """
    import ml_collections

    argv = list(argv or [])
    if argv and "=" not in argv[0]:
        path = Path(argv.pop(0))
    else:
        path = default_config_path()
    raw = _load_chain(path)
    missing = [k for k in SCHEMA if k not in raw]
    if missing:
        raise ConfigError(f"config {str(path)!r} does not set {missing}; start it with "
                          f"'{BASE_CONFIG_KEY}: <path to configs/base.yml>' to inherit every default")
    values = {k: v for k, (v, _) in raw.items()}
    where = {k: f"in {src}" for k, (_, src) in raw.items()}
    for arg in argv:
        key, text = parse_override(arg)
        values[key] = _parse_override_value(key, text)
        where[key] = f"from override {arg!r}"
    for key, value in (overrides or {}).items():
        if key not in SCHEMA:
            raise _unknown(key, "from overrides")
        values[key] = value
        where[key] = "from overrides"
    cfg = {key: coerce(key, values[key], where[key]) for key in SCHEMA}
    _check_all(cfg, where)
    out = ml_collections.ConfigDict(cfg)
    out.lock()
    return out


def command_config(prog: str, usage: str, argv: Sequence[str]):
    """(config, None) of a console command's ``[CONFIG.yml] [key=value ...]`` arguments, or (None, exit
    code): 0 after printing ``usage`` for -h / --help / help, 2 after printing the config error."""
    import sys

    argv = list(argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage)
        return None, 0
    try:
        return load_config(argv), None
    except ConfigError as err:
        print(f"{prog}: config error: {err}", file=sys.stderr)
        return None, 2


def dump_config(cfg, path: Optional[os.PathLike] = None) -> str:
    """The resolved config as YAML text (keys in schema order); written to ``path`` if given."""
    plain = {k: (list(cfg[k]) if isinstance(cfg[k], (list, tuple)) else cfg[k]) for k in SCHEMA}
    text = yaml.safe_dump(plain, sort_keys=False, default_flow_style=None)
    if path is not None:
        Path(path).write_text(text)
    return text
