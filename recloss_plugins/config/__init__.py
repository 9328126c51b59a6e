"""MaxText-style configuration: YAML (with ``base_config:`` inheritance) + ``key=value`` overrides.

    cfg = load_config(["configs/base.yml", "loss=cutbce_pallas", "steps=100"])
    cfg.loss, cfg.steps

Every key has a declared type and check (`keys.SCHEMA`); unknown keys, bad
types and bad values raise `ConfigError` naming the key before any work runs.
`LOSS_OPTION_KEYS` maps config keys to `recloss.LossOptions` fields for every
plugin (`build_loss_options`); `check_strategy_options` rejects, naming the key,
an option the chosen strategy's objective does not take (``loss=cutce pos_weight=2``). Keys that only
fail together fail at load too, naming each (``loss=dense_bce loss_fsdp_gather=ring``, a sampled loss's
``num_negatives`` beyond a vocabulary the config fixes: `check_vocab`, a ``global_batch_size`` the
data × fsdp degrees or the shards recloss-train prepares do not divide).
"""

from recloss_plugins.config.keys import FSDP_GATHER_VALUES, SCHEMA, Key, loss_options
from recloss_plugins.config.loss_keys import (
    LOSS_OPTION_KEYS,
    OPTION_PREFIX,
    LossKey,
    LossOptionError,
    build_loss_options,
    check_strategy_options,
    option_for,
    option_keys,
)
from recloss_plugins.config.pyconfig import (
    ConfigError,
    check_vocab,
    command_config,
    default_config_path,
    dump_config,
    load_config,
    parse_override,
)

__all__ = [
    "FSDP_GATHER_VALUES",
    "LOSS_OPTION_KEYS",
    "OPTION_PREFIX",
    "SCHEMA",
    "ConfigError",
    "Key",
    "LossKey",
    "LossOptionError",
    "build_loss_options",
    "check_strategy_options",
    "check_vocab",
    "command_config",
    "default_config_path",
    "dump_config",
    "load_config",
    "loss_options",
    "option_for",
    "option_keys",
    "parse_override",
]
