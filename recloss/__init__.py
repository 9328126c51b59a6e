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

__all__ = [
    "LossOptions",
    "LossOutput",
    "Strategy",
    "available_strategies",
    "bce_loss",
    "get_strategy",
    "register_strategy",
]

__version__ = "0.1.0"
