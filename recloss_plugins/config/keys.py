"""The trainer's configuration keys: type and check of each (defaults live in configs/base.yml; the loss
options' keys are read from recloss.LossOptions, `loss_keys.config_specs`).

A key's type is one of ``int``, ``float``, ``bool``, ``str`` or ``list`` (of
str); ``optional=True`` also admits None (``null`` in YAML, ``none`` on the
command line). ``choices`` lists the admitted values; ``check`` is a predicate
with ``expected`` describing it for error messages.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import recloss
from recloss_plugins.config.loss_keys import LOSS_OPTION_KEYS, RENAMED, build_loss_options, config_specs

# Mesh axis names the trainer understands (MaxText's names); `mesh_axes` orders them.
MESH_AXES = ("data", "fsdp", "vocab")
#: ``loss_fsdp_gather``'s values: a `recloss.FSDP_GATHERS` mode, or 'auto' (`recloss.choose_fsdp_gather` picks one
#: from the shapes when the program is built).
FSDP_GATHER_VALUES = recloss.FSDP_GATHERS + ("auto",)


@dataclasses.dataclass(frozen=True)
class Key:
    type: type
    check: Optional[Callable[[Any], bool]] = None
    expected: str = ""
    choices: Optional[Tuple[Any, ...]] = None
    optional: bool = False


def _nonneg_int(expected="an int >= 0"):
    return Key(int, lambda v: v >= 0, expected)


def _pos_int(expected="an int >= 1"):
    return Key(int, lambda v: v >= 1, expected)


def _parallelism():
    return Key(int, lambda v: v == -1 or v >= 1, "-1 (fill with the remaining devices) or an int >= 1")


def _unit(lo_open=False, hi_open=True):
    lo = (lambda v: v > 0) if lo_open else (lambda v: v >= 0)
    hi = (lambda v: v < 1) if hi_open else (lambda v: v <= 1)
    text = f"a float in {'(' if lo_open else '['}0, 1{')' if hi_open else ']'}"
    return Key(float, lambda v: lo(v) and hi(v), text)


# LossOptions fields the trainer sets itself (`loss_options`): not config keys.
FIXED_LOSS_FIELDS = ("reduction", "pad_id", "compute_metrics", "vocab_size")


def _loss_keys():
    """A `Key` for each loss option the trainer's config takes, read from recloss.LossOptions."""
    out = {}
    for key, spec in config_specs(exclude=FIXED_LOSS_FIELDS).items():
        if spec.nonnegative:
            out[key] = _nonneg_int(f"an int >= 0 (0 = {RENAMED[key].zero})")
        else:
            out[key] = Key(spec.type, choices=spec.choices, optional=spec.optional)
    return out


SCHEMA = {
    # run
    "run_name": Key(str),
    "base_output_directory": Key(str, lambda v: v != "", "a non-empty directory path or gs://BUCKET/PREFIX URL"),
    "seed": _nonneg_int(),
    "steps": _nonneg_int(),
    "log_period": _pos_int(),
    "enable_tensorboard": Key(bool),
    "enable_checkpointing": Key(bool),
    "checkpoint_period": _pos_int(),
    "max_checkpoints_to_keep": _nonneg_int("an int >= 0 (0 = keep all)"),
    "eval_interval": _nonneg_int("an int >= 0 (0 = evaluate only at the end)"),
    "eval_top_k": _pos_int(),
    "eval_batch_size": _pos_int(),
    "eval_block_v": _pos_int(),
    "eval_max_users": _nonneg_int("an int >= 0 (0 = every user)"),
    # batch and sequence
    "per_device_batch_size": _nonneg_int(),
    "global_batch_size": _nonneg_int("an int >= 0 (0 = per_device_batch_size x devices)"),
    "max_seq_len": _pos_int(),
    "num_labels": _pos_int(),
    # model
    "vocab_size": _nonneg_int("an int >= 0 (0 = from the data)"),
    "emb_dim": _pos_int(),
    "num_layers": _pos_int(),
    "num_heads": _pos_int(),
    "mlp_dim": _pos_int(),
    "dropout": _unit(),
    "dtype": Key(str, choices=("float32", "bfloat16")),
    "untie_embeddings": Key(bool),
    "use_output_bias": Key(bool),
    # optimizer
    "learning_rate": Key(float, lambda v: v > 0, "a float > 0"),
    "learning_rate_final_fraction": _unit(hi_open=False),
    "warmup_steps": _nonneg_int(),
    "weight_decay": Key(float, lambda v: v >= 0, "a float >= 0"),
    "grad_clip": Key(float, lambda v: v >= 0, "a float >= 0 (0 = no clipping)"),
    "adam_b1": _unit(),
    "adam_b2": _unit(),
    "adam_eps": Key(float, lambda v: v > 0, "a float > 0"),
    "item_optimizer": Key(str, choices=("adamw", "rowwise_adagrad")),
    "item_table_dtype": Key(str, choices=("float32", "bfloat16")),
    "item_learning_rate": Key(float, lambda v: v >= 0, "a float >= 0 (0 = learning_rate)"),
    "item_adagrad_eps": Key(float, lambda v: v > 0, "a float > 0"),
    "item_adagrad_initial_accumulator": Key(float, lambda v: v >= 0, "a float >= 0"),
    # loss
    # The strategy is checked against recloss.available_strategies() at load time, and the option
    # values by recloss.LossOptions; an option the strategy's objective does not take must keep its
    # default (BCE: vocab_reduction, pos_weight, focal_*, loss_threshold; softmax: z_loss, temperature;
    # BCE and softmax: logit_soft_cap; sampled: num_negatives, in_batch_negatives, remove_accidental_hits,
    # gbce_t). The option keys themselves are every LossOptions field the trainer does not fix (`_loss_keys`).
    "loss": Key(str),
    **_loss_keys(),
    "sampled_proposal": Key(str, choices=("auto", "counts", "uniform")),
    "loss_fsdp_gather": Key(str, choices=FSDP_GATHER_VALUES),
    # mesh
    "mesh_axes": Key(list, lambda v: sorted(v) == sorted(MESH_AXES),
                     f"a list holding each of {list(MESH_AXES)} once, in mesh order"),
    "ici_data_parallelism": _parallelism(),
    "ici_fsdp_parallelism": _parallelism(),
    "ici_vocab_parallelism": _parallelism(),
    "dcn_data_parallelism": _parallelism(),
    "dcn_fsdp_parallelism": _parallelism(),
    "dcn_vocab_parallelism": _parallelism(),
    "compile_topology": Key(str),
    "compile_topology_num_slices": _pos_int(),
    "compile_fit_hbm_gib": Key(float, lambda v: v >= 0, "a float >= 0 (0 = off)"),
    # data
    "dataset_type": Key(str, choices=("synthetic", "interactions", "yambda")),
    "dataset_path": Key(str),
    "file_format": Key(str, choices=("auto", "csv", "tsv", "parquet")),
    "user_column": Key(str, lambda v: v != "", "a non-empty column name"),
    "item_column": Key(str, lambda v: v != "", "a non-empty column name"),
    "timestamp_column": Key(str, lambda v: v != "", "a non-empty column name"),
    "min_user_interactions": _nonneg_int(),
    "yambda_event_types": Key(list),
    "yambda_organic_only": Key(bool),
    "yambda_min_played_ratio_pct": Key(float, lambda v: 0 <= v <= 100, "a float in [0, 100]"),
    "data_pipeline": Key(str, choices=("grain", "memory")),
    "prepared_data_path": Key(str),
    "prepared_cache_dir": Key(str),
    "prepared_stage_dir": Key(str),
    "prepare_num_shards": _pos_int(),
    "prepare_num_buckets": _pos_int(),
    "grain_read_threads": _pos_int(),
    "grain_prefetch_buffer": _pos_int(),
    "synthetic_num_users": _pos_int(),
    "synthetic_num_items": Key(int, lambda v: v >= 2, "an int >= 2"),
    "synthetic_min_len": _pos_int(),
    "synthetic_max_len": _pos_int(),
    "synthetic_num_intents": _pos_int(),
    "synthetic_intents_per_user": _pos_int(),
    "synthetic_zipf_exponent": Key(float, lambda v: v >= 0, "a float >= 0"),
    "synthetic_follow_prob": _unit(hi_open=False),
    "synthetic_switch_prob": _unit(hi_open=False),
}

# Id of the padding item: inputs, targets and row 0 of the table.
PAD_ID = 0


def loss_options(cfg, vocab_size: Optional[int] = None) -> recloss.LossOptions:
    """The `recloss.LossOptions` a config asks for: its keys of `LOSS_OPTION_KEYS`, mapped there.

    Fixed by the trainer: reduction='mean' over weighted positions, pad_id=0
    (item 0 is padding), metrics on. ``vocab_size`` is the real V when the
    table has padded rows. Raises `LossOptionError` naming the key of a bad value.
    """
    options = build_loss_options({key: cfg[key] for key in LOSS_OPTION_KEYS if key in SCHEMA})
    return options.replace(reduction="mean", pad_id=PAD_ID, compute_metrics=True, vocab_size=vocab_size)
