"""The entry points (`bce_loss`) and the explicit table of built-in strategies.

    objective   strategies                              entry point
    bce         dense_bce, cutbce, cutbce_pallas        recloss.bce_loss

The table below is the one place a built-in strategy is named; importing this
module registers it in `recloss.registry`, where `register_strategy` adds a
user's own.
"""

from __future__ import annotations

from recloss import registry
from recloss.assemble import LossOutput
from recloss.bce.strategies import CutBCE, CutBCEPallas, DenseBCE
from recloss.registry import get_strategy

BUILTIN_STRATEGIES = {
    "dense_bce": DenseBCE,
    "cutbce": CutBCE,
    "cutbce_pallas": CutBCEPallas,
}
for _name, _factory in BUILTIN_STRATEGIES.items():
    registry.register_strategy(_name, _factory)


def bce_loss(hidden, table, targets, weights=None, bias=None, *, strategy: str = "cutbce",
             layout=None, **options) -> LossOutput:
    """Full-vocabulary multi-label binary cross-entropy from hidden states.

    Logits are ``x[..., v] = hidden[...] · table[v] + bias[v]`` (never built
    whole by the blocked strategies). Per position with target set T (unique
    valid ids of ``targets``), label y_v = [v ∈ T] and soft label
    y' = y(1−ε) + ε/2:

        ℓ = Σ_v [ y'_v·P(x_v) + (1 − y'_v)·Q(x_v) ]      (÷ V if vocab_reduction='mean')

    with P, Q as in `LossOptions`; defaults give ℓ = mean_v BCE-with-logits,
    Keras ``binary_crossentropy(from_logits=True)``.

    Args:
      hidden: [..., D] float32/bfloat16. table: [V, D]. targets: [..., L] int ids
        (``pad_id`` = padding; ids outside [0, V) are ignored and counted in
        ``metrics['invalid_targets']``). weights: [...] float or None (= 1).
        bias: [V] or None.
      strategy: a registered name, see `available_strategies()`.
      layout: a `recloss.MeshLayout` to run sharded under shard_map, or None.
      **options: `LossOptions` fields.
    Returns:
      LossOutput(loss, metrics): loss is Σ w·ℓ / Σ w ('mean'; 0 when Σ w = 0),
      Σ w·ℓ ('sum') or w·ℓ with hidden's leading shape ('none'), float32.
      Gradients come back in the input dtypes.
    """
    return get_strategy(strategy, **options)(hidden, table, targets, weights, bias, layout=layout)
