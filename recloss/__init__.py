"""recloss: exact full-catalogue binary cross-entropy for JAX recommenders.

    out = recloss.bce_loss(hidden, table, targets, weights, strategy="cutbce")
    out.loss, out.metrics["tp"]
"""

from recloss.options import LossOptions
from recloss.registry import (
    LossOutput,
    Strategy,
    available_strategies,
    bce_loss,
    get_strategy,
    register_strategy,
)
from recloss.sharding import MeshLayout, Specs, padded_vocab_size
import recloss.pallas  # registers cutbce_pallas

__all__ = [
    "LossOptions",
    "LossOutput",
    "MeshLayout",
    "Specs",
    "Strategy",
    "available_strategies",
    "bce_loss",
    "get_strategy",
    "padded_vocab_size",
    "register_strategy",
]

__version__ = "0.1.0"
