"""LossOptions: every knob of the loss, validated in one place."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

_REDUCTIONS = ("mean", "sum", "none")
_VOCAB_REDUCTIONS = ("mean", "sum")


def _fail(name: str, value, expected: str):
    raise ValueError(f"LossOptions.{name}={value!r} is invalid: expected {expected}")


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """Every knob of every strategy, validated in one place.

    BCE (`recloss.bce_loss`): the per-logit loss is ``y'·P(x) + (1 − y')·Q(x)`` with the soft label
    ``y' = y(1 − label_smoothing) + label_smoothing/2`` and

        P(x) = pos_weight · α · (1 − σ(x))^γ · softplus(−x)
        Q(x) = (1 − α) · σ(x)^γ · softplus(x)

    where γ = ``focal_gamma`` and α = ``focal_alpha`` (α-factors are 1 when
    ``focal_alpha`` is None). The position loss sums over the vocabulary and is
    divided by V when ``vocab_reduction='mean'``.

    Softmax (`recloss.softmax_loss`): ``ℓ = Z − Σ_v q_v·x_v + λ·Z²`` with
    x = logits/τ, Z = logsumexp_v x_v and q_v = (1 − ε)·[v ∈ T]/|T| + ε/V.

    Both: with ``logit_soft_cap`` c every logit x = a·e + b is first replaced by
    ``c·tanh(x/c)`` (before the division by τ, the P/Q terms and the metrics threshold), so
    ∂ℓ/∂x picks up the factor 1 − tanh²(x/c); None (the default) leaves the logits as they are.

    Sampled (`recloss.sampled_loss`): ``sampled_softmax`` and ``gbce`` over the targets and
    ``num_negatives`` drawn ids (see there for the formulas).

    Attributes:
      reduction: 'mean' (Σ w·ℓ / Σ w, 0 when Σ w = 0), 'sum' (Σ w·ℓ) or 'none'
        (w·ℓ per position, shape of ``hidden[..., 0]``).
      vocab_reduction: BCE only: 'mean' divides each position's loss by the vocabulary
        size (Keras convention), 'sum' does not.
      pad_id: target id that marks padding (ignored, not counted as invalid).
      label_smoothing: ε in [0, 1): BCE's soft labels y(1 − ε) + ε/2; softmax's target
        distribution (1 − ε) on the targets + ε/V everywhere.
      pos_weight: BCE only: multiplier of the positive term, > 0.
      focal_gamma: BCE only: focal γ ≥ 0 (0 = plain BCE).
      focal_alpha: BCE only: focal α in [0, 1], or None (no α-balancing).
      threshold: BCE only: logit threshold of the TP/FP/FN/TN metrics (x > threshold is
        a positive prediction).
      block_v: blocked strategies: vocabulary block size (None = chosen from the shape).
      block_n: blocked strategies: row block size (None = chosen from the shape).
      compute_metrics: whether to count TP/FP/FN/TN.
      vocab_size: the real vocabulary size; table rows ≥ vocab_size are inert
        (no loss, no metrics, zero gradient). None = every table row.
      interpret: Pallas strategies only: run kernels in interpret mode
        (None = automatically off TPU: the platform of the layout's mesh, else of
        the mesh `jax.set_mesh` set, else the default backend).
      z_loss: softmax only: λ ≥ 0, adds λ·Z² per position (Z = logsumexp of the logits).
      temperature: softmax and sampled: τ > 0, logits are divided by it.
      logit_soft_cap: BCE and softmax: c > 0, each logit x becomes c·tanh(x/c) (Gemma's final
        logit soft cap; MaxText's final_logits_soft_cap), or None (off). Softmax strategies do not
        take it with label_smoothing > 0 (their ε/V·Σ_v x_v is a column sum of uncapped logits).
      num_negatives: sampled only: K ≥ 1 negative ids drawn per call (≤ V, checked at the call).
      in_batch_negatives: sampled_softmax only: the other positions' targets are negatives too.
      remove_accidental_hits: sampled only: a drawn negative equal to one of a position's
        targets is left out of that position's loss.
      gbce_t: gbce only: gSASRec's calibration t in [0, 1].

    Which options a strategy takes depends on its objective: the BCE ones
    (vocab_reduction, pos_weight, focal_*, threshold) and the softmax ones
    (z_loss, temperature) are an error, naming the option and the strategy,
    when set to a non-default value for a strategy of the other objective;
    logit_soft_cap is an error for the sampled strategies.
    """

    reduction: str = dataclasses.field(default="mean", metadata={"choices": _REDUCTIONS})
    vocab_reduction: str = dataclasses.field(default="mean", metadata={"choices": _VOCAB_REDUCTIONS})
    pad_id: int = -1
    label_smoothing: float = 0.0
    pos_weight: float = 1.0
    focal_gamma: float = 0.0
    focal_alpha: Optional[float] = None
    threshold: float = 0.0
    block_v: Optional[int] = None
    block_n: Optional[int] = None
    compute_metrics: bool = True
    vocab_size: Optional[int] = None
    interpret: Optional[bool] = None
    z_loss: float = 0.0
    temperature: float = 1.0
    logit_soft_cap: Optional[float] = None
    num_negatives: int = 128
    in_batch_negatives: bool = False
    remove_accidental_hits: bool = True
    gbce_t: float = 0.75

    def __post_init__(self):
        if self.reduction not in _REDUCTIONS:
            _fail("reduction", self.reduction, f"one of {_REDUCTIONS}")
        if self.vocab_reduction not in _VOCAB_REDUCTIONS:
            _fail("vocab_reduction", self.vocab_reduction, f"one of {_VOCAB_REDUCTIONS}")
        # numpy scalars (from configs, arrays) are accepted and stored as Python numbers.
        for name in ("pad_id", "block_v", "block_n", "vocab_size", "num_negatives"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                object.__setattr__(self, name, int(value))
        for name in ("label_smoothing", "pos_weight", "focal_gamma", "focal_alpha", "threshold", "z_loss",
                     "temperature", "logit_soft_cap", "gbce_t"):
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        if isinstance(self.pad_id, bool) or not isinstance(self.pad_id, int):
            _fail("pad_id", self.pad_id, "an int (typically -1)")
        _check_real("label_smoothing", self.label_smoothing, lambda v: 0.0 <= v < 1.0, "a float in [0, 1)")
        _check_real("pos_weight", self.pos_weight, lambda v: v > 0.0, "a finite float > 0")
        _check_real("focal_gamma", self.focal_gamma, lambda v: v >= 0.0, "a finite float >= 0")
        if self.focal_alpha is not None:
            _check_real("focal_alpha", self.focal_alpha, lambda v: 0.0 <= v <= 1.0, "None or a float in [0, 1]")
        _check_real("threshold", self.threshold, lambda v: True, "a finite float")
        _check_real("z_loss", self.z_loss, lambda v: v >= 0.0, "a finite float >= 0")
        _check_real("temperature", self.temperature, lambda v: v > 0.0, "a finite float > 0")
        if self.logit_soft_cap is not None:
            _check_real("logit_soft_cap", self.logit_soft_cap, lambda v: v > 0.0,
                        "None (no cap) or a finite float > 0")
        _check_real("gbce_t", self.gbce_t, lambda v: 0.0 <= v <= 1.0, "a float in [0, 1]")
        if isinstance(self.num_negatives, bool) or not isinstance(self.num_negatives, int) or self.num_negatives < 1:
            _fail("num_negatives", self.num_negatives, "an int >= 1 (and <= the vocabulary size)")
        for name in ("block_v", "block_n", "vocab_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                _fail(name, value, "None or a positive int")
        for name in ("compute_metrics", "in_batch_negatives", "remove_accidental_hits"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "True or False")
        if self.interpret is not None and not isinstance(self.interpret, bool):
            _fail("interpret", self.interpret, "None, True or False")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def field_docs(cls) -> dict:
        """{field: its description}, as the class docstring's ``Attributes:`` section gives it (one line
        per field, continuation lines joined): what the plugins' config keys say of each option."""
        docs, name = {}, None
        lines = cls.__doc__.split("Attributes:", 1)[1].splitlines()
        for line in lines[1:]:
            if not line.strip():
                if docs:
                    break
                continue
            head, sep, rest = line.strip().partition(": ")
            if sep and line.startswith("      ") and not line.startswith("       ") and head in cls.field_names():
                name = head
                docs[name] = rest.strip()
            elif name is not None:
                docs[name] += " " + line.strip()
        return docs

    def non_default(self) -> tuple[str, ...]:
        """Names of the fields whose value differs from the default."""
        return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default)

    def replace(self, **changes) -> "LossOptions":
        return dataclasses.replace(self, **changes)


def _check_real(name, value, ok, expected):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, value, expected)
    if not math.isfinite(float(value)) or not ok(float(value)):
        _fail(name, value, expected)
