"""MaxText-style configuration: YAML (with ``base_config:`` inheritance) + ``key=value`` overrides.

    cfg = load_config(["configs/base.yml", "loss=cutbce_pallas", "steps=100"])
    cfg.loss, cfg.steps

Every key has a declared type and check (`keys.SCHEMA`); unknown keys, bad
types and bad values raise `ConfigError` naming the key before any work runs.
"""

from recloss_plugins.config.keys import SCHEMA, Key, loss_options
from recloss_plugins.config.pyconfig import (
    ConfigError,
    default_config_path,
    dump_config,
    load_config,
    parse_override,
)

__all__ = [
    "SCHEMA",
    "ConfigError",
    "Key",
    "default_config_path",
    "dump_config",
    "load_config",
    "loss_options",
    "parse_override",
]
