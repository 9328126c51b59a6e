"""recloss: exact full-catalogue losses for JAX recommenders, without the [batch, seq, vocab] logits.

    out = recloss.bce_loss(hidden, table, targets, weights, strategy="cutbce")
    out.loss, out.metrics["tp"]
"""

from recloss import _version
from recloss.api import bce_loss, sampled_loss, softmax_loss
from recloss.assemble import LossOutput
from recloss.bias import sampled_bias
from recloss.options import LossOptions
from recloss.sampled import log_q_from_counts
from recloss.softcap import soft_cap
from recloss.registry import available_strategies, get_strategy, register_strategy, unregister_strategy
from recloss.sharding import (FSDP_GATHERS, GatherChoice, MeshLayout, Specs, check_fsdp_gather, choose_fsdp_gather,
                              padded_vocab_size, psum_in_place)
from recloss.strategy import Strategy

__all__ = [
    "FSDP_GATHERS",
    "GatherChoice",
    "LossOptions",
    "LossOutput",
    "MeshLayout",
    "Specs",
    "Strategy",
    "available_strategies",
    "bce_loss",
    "check_fsdp_gather",
    "choose_fsdp_gather",
    "get_strategy",
    "log_q_from_counts",
    "padded_vocab_size",
    "psum_in_place",
    "register_strategy",
    "sampled_bias",
    "sampled_loss",
    "soft_cap",
    "softmax_loss",
    "unregister_strategy",
]

__version__ = _version.version()   # pyproject.toml's, from the package metadata
